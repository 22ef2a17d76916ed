"""The layouts users bring from verl, TRL and Hugging Face datasets, read without a conversion step.

verl's preprocessed parquet (DAPO-Math-17k's published layout: ``data_source``, ``prompt`` as chat messages,
``reward_model.ground_truth``), TRL's conversational JSONL, a ``datasets`` ``save_to_disk`` folder (written by
the real ``datasets``), a folder of shards; the prompt template, chat-template kwargs, and reward routing by
``data_source``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from sparrow_nemo.cli import main
from sparrow_nemo.config import ConfigError
from sparrow_nemo.grpo.data import PromptDataConfig, PromptDataError, load_prompts
from sparrow_nemo.grpo.prompts import RoutedAnswer, build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.tasks.tokenizer import CharTokenizer

#: a Qwen3-like template: a system turn, the user turns, and with enable_thinking=false an empty think block
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
#: DAPO-Math-17k's instruction, cut short to fit the tiny recipes' 256-token prompts
DAPO_INSTRUCTION = "Solve step by step; end with Answer: $Answer\n\n{q}"


def save_chat_tokenizer(path: Path) -> Path:
    """A character-level HF tokenizer (99 + 3 ids, fits the tiny model's 128) with the template above."""
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    vocab |= {"<think>": len(vocab), "</think>": len(vocab) + 1}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def verl_rows(n: int) -> list[dict]:
    """Rows in DAPO-Math-17k's / verl's layout."""
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "user", "content": DAPO_INSTRUCTION.format(q=f"What is {i} + {i}?")}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"id-{i}"},
        }
        for i in range(n)
    ]


def write_verl_parquet(path: Path, n: int = 8) -> Path:
    pq.write_table(pa.Table.from_pylist(verl_rows(n)), path)
    return path


def write_trl_jsonl(path: Path, n: int = 8) -> Path:
    """TRL's conversational prompt-only format (``prompt`` messages) with a ``solution`` column."""
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Put the final answer in \\boxed{}."},
                {"role": "user", "content": f"What is {i} + {i}?"},
            ],
            "solution": str(2 * i),
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_saved_dataset(path: Path, n: int = 8) -> Path:
    """A ``datasets.Dataset.save_to_disk`` folder (the real library writes it)."""
    import datasets

    datasets.Dataset.from_list(verl_rows(n)).save_to_disk(str(path))
    return path


@pytest.fixture
def tok(tmp_path: Path) -> Path:
    return save_chat_tokenizer(tmp_path / "tok")


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


VERL = PromptDataConfig(prompt_key="prompt", answer_key="reward_model.ground_truth")


def test_verl_parquet_reads_messages_dotted_answer_and_data_source(tmp_path: Path, tok: Path) -> None:
    ds = load_prompts(write_verl_parquet(tmp_path / "dapo.parquet"), _tokenizer(tok), VERL)
    assert len(ds) == 8 and ds.bad_rows == []
    first = ds[3]
    assert first.answer == "6" and first.data_source == "math_dapo"
    assert first.prompt.startswith("<|im_start|>user\nSolve step by step; end with Answer: $Answer")
    assert "What is 3 + 3?" in first.prompt and first.prompt.endswith("<|im_start|>assistant\n")


def test_chat_template_kwargs_and_prompt_template(tmp_path: Path, tok: Path) -> None:
    path = write_verl_parquet(tmp_path / "dapo.parquet", 2)
    config = PromptDataConfig(
        prompt_key="prompt",
        answer_key="reward_model.ground_truth",
        chat_template_kwargs={"enable_thinking": False},
        prompt_template="[{problem}] {not a placeholder}",
        system_prompt="Be brief.",
    )
    ex = load_prompts(path, _tokenizer(tok), config)[1]
    assert ex.prompt.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n[Solve")
    assert "What is 1 + 1?] {not a placeholder}<|im_end|>" in ex.prompt
    assert ex.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    template_file = tmp_path / "t.txt"
    template_file.write_text("Q: {problem}\nA:")
    raw = PromptDataConfig(
        prompt_key="problem", prompt_template=str(template_file), apply_chat_template=False
    )
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"problem": "1+1", "answer": "2"}) + "\n")
    assert load_prompts(rows, CharTokenizer(), raw)[0].prompt == "Q: 1+1\nA:"
    template_file.write_text("no placeholder")
    with pytest.raises(ValueError, match=r"prompt_template.*holding \{problem\}; the file .* has none"):
        PromptDataConfig(prompt_template=str(template_file))


def test_trl_conversational_jsonl(tmp_path: Path, tok: Path) -> None:
    path = write_trl_jsonl(tmp_path / "trl.jsonl")
    config = PromptDataConfig(
        prompt_key="prompt", answer_key="solution", system_prompt="ignored: one is there"
    )
    ex = load_prompts(path, _tokenizer(tok), config)[2]
    assert ex.answer == "4" and ex.data_source is None
    assert ex.prompt == (
        "<|im_start|>system\nPut the final answer in \\boxed{}.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_save_to_disk_folder_and_folder_of_shards(tmp_path: Path, tok: Path) -> None:
    saved = write_saved_dataset(tmp_path / "saved")
    from_arrow = load_prompts(saved, _tokenizer(tok), VERL)
    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    rows = verl_rows(8)
    pq.write_table(pa.Table.from_pylist(rows[:5]), shards / "train-00000-of-00002.parquet")
    (shards / "train-00001-of-00002.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[5:]))
    (tmp_path / "shards" / ".cache").mkdir()  # huggingface-cli's own folder: skipped
    (tmp_path / "shards" / ".cache" / "x.jsonl").write_text("{oops\n")
    from_shards = load_prompts(tmp_path / "shards", _tokenizer(tok), VERL)
    assert [e.prompt_ids for e in from_arrow] == [e.prompt_ids for e in from_shards]
    assert from_shards[5].source.endswith("train-00001-of-00002.jsonl:1")
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(
        PromptDataError, match=r"dict: a DatasetDict folder; give one split's folder \(train\)"
    ):
        load_prompts(tmp_path / "dict", _tokenizer(tok), VERL)
    assert len(load_prompts(tmp_path / "dict" / "train", _tokenizer(tok), VERL)) == 8


def test_rewards_route_by_data_source(tmp_path: Path, tok: Path) -> None:
    rows = verl_rows(4)
    rows[1]["data_source"] = "chain_rows"
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(
        "tiny_cpu_short_smoke",
        [
            "reward.type=math",
            f"data.train_path={path}",
            "data.prompt_key=prompt",
            "data.answer_key=reward_model.ground_truth",
            f"model.hf_checkpoint={tok}",
            "++reward.by_data_source.chain_rows=chain_exact",
        ],
    )
    source = build_prompt_source(config)
    answers = {item.answer.value: item.answer for item in source.peek(4)}
    assert answers["2"] == RoutedAnswer("chain_exact", "2") and answers["4"] == RoutedAnswer("math", "4")
    assert source.reward_fn("Answer: 4", answers["4"]) == 1.0  # math reads DAPO's Answer: line
    assert source.reward_fn("Answer: 2", answers["2"]) == 0.0  # the exact-match reward does not
    assert source.reward_fn("2", answers["2"]) == 1.0
    with pytest.raises(
        ConfigError, match=r"reward.by_data_source.x=nope .* expected a file-data reward name"
    ):
        load_config("tiny_cpu_short_smoke", ["++reward.by_data_source.x=nope"])


def test_data_check_prints_rows_as_the_model_sees_them(tmp_path: Path, tok: Path, capsys) -> None:
    rows = [*verl_rows(4), {"prompt": [], "reward_model": {"ground_truth": "1"}}]
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "data", "check", "--config", "tiny_cpu_short_smoke", "--rows", "1", "reward.type=math",
        f"data.train_path={path}", "data.prompt_key=prompt", "data.answer_key=reward_model.ground_truth",
        f"model.hf_checkpoint={tok}", "control.calibrate=false",
    ]  # fmt: skip
    assert main(args) == 1  # 1 of 5 bad > max_bad_fraction 0.01
    out = capsys.readouterr().out
    expected_text = _tokenizer(tok).apply_chat_template(
        rows[0]["prompt"], tokenize=False, add_generation_prompt=True
    )
    tokens = len(_tokenizer(tok).encode(expected_text, add_special_tokens=False))
    assert "columns: prompt 'prompt', answer 'reward_model.ground_truth', data source 'data_source'" in out
    assert (
        f"--- row {path}:1 ({tokens} tokens, data_source=math_dapo) ---\n{expected_text}\n--- answer: '0'"
        in out
    )
    assert f"{path}:2" not in out.split("bad row")[0]  # --rows 1
    assert "data.train_path: 4 usable and 1 bad of 5 rows" in out
    assert f"bad row {path}:5: field 'prompt' must be a non-empty string or chat messages, got list" in out
    assert main([*args, "data.max_bad_fraction=0.5"]) == 0


@pytest.fixture(autouse=True)
def _chain_exact():
    """An exact-match reward registered for the routing test."""
    from sparrow_nemo.rewards.registry import _REGISTERED, register_reward

    register_reward("chain_exact")(lambda completion, gold: float(completion.strip() == gold))
    yield
    _REGISTERED.pop("chain_exact", None)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["verl_parquet", "trl_jsonl", "save_to_disk"])
def test_each_layout_trains_the_smoke_recipe(tmp_path: Path, layout: str) -> None:
    """Two GRPO steps of the smoke recipe on a tiny random Qwen3 whose tokenizer has a chat template."""
    from policy._helpers import make_hf_checkpoint, single_rank_env

    from sparrow_nemo.grpo.start import train
    from sparrow_nemo.model_shapes import PRESETS
    from sparrow_nemo.run_io.metrics import read_metrics

    ckpt = make_hf_checkpoint(PRESETS["tiny"], tmp_path / "ckpt")
    save_chat_tokenizer(ckpt)
    data, keys = {
        "verl_parquet": (write_verl_parquet(tmp_path / "d.parquet"), VERL),
        "trl_jsonl": (
            write_trl_jsonl(tmp_path / "d.jsonl"),
            PromptDataConfig(prompt_key="prompt", answer_key="solution"),
        ),
        "save_to_disk": (write_saved_dataset(tmp_path / "saved"), VERL),
    }[layout]
    config = load_config(
        "tiny_cpu_short_smoke",
        [
            "reward.type=math",
            f"data.train_path={data}",
            f"data.prompt_key={keys.prompt_key}",
            f"data.answer_key={keys.answer_key}",
            f"model.hf_checkpoint={ckpt}",
            "trainer.max_steps=2",
            "grpo.prompts_per_step=4",
            "rollout.max_new_tokens=12",
            "logging.plots=false",
        ],
    )
    run_dir = tmp_path / "run"
    with single_rank_env():
        train(config, run_dir)
    rows = [row for row in read_metrics(run_dir / "metrics.jsonl") if row["step"] >= 0]
    assert [row["step"] for row in rows] == [0, 1]
    assert all(row["rollout/tokens"] > 0 and row["reward/mean"] is not None for row in rows)
    assert all(row["rollout_corr/k3_kl"] >= 0 and row["rollout_corr/ratio_p50"] > 0 for row in rows)
