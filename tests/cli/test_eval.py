"""``sparrow eval``: the unbiased pass@k estimator against hand values and brute force, the summary
averages, and the command end to end on a tiny random Qwen3 with the real AIME24 prompts.
"""

from __future__ import annotations

import itertools
import json
from math import comb
from pathlib import Path

import pytest
import torch

from sparrow_nemo import cli
from sparrow_nemo.evaluation import PromptResult, default_ks, pass_at_k, summarize
from sparrow_nemo.evaluation.runner import score_samples
from sparrow_nemo.hf_qwen3 import hf_config_dict
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.rollout.engine import RolloutBatch, RolloutSample


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 1, 0.4),  # pass@1 = c/n
        (16, 0, 8, 0.0),
        (16, 16, 1, 1.0),
        (4, 1, 4, 1.0),  # n - c < k: every draw of 4 includes the correct one
        (10, 3, 3, 1 - 35 / 120),  # 1 - C(7,3)/C(10,3)
    ],
)
def test_pass_at_k_hand_values(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_equals_brute_force_over_all_draws() -> None:
    for n in range(1, 8):
        for c in range(n + 1):
            samples = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                draws = list(itertools.combinations(samples, k))
                brute = sum(any(d) for d in draws) / len(draws)
                assert len(draws) == comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12), (n, c, k)


def test_pass_at_k_errors_and_default_ks() -> None:
    with pytest.raises(ValueError, match="k=5 must be in \\[1, n=4\\]"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c=5 must be in \\[0, n=4\\]"):
        pass_at_k(4, 5, 1)
    assert default_ks(16) == [1, 2, 4, 8, 16] and default_ks(1) == [1] and default_ks(6) == [1, 2, 4, 6]


def _sample(response: list[int]) -> RolloutSample:
    n = len(response)
    return RolloutSample(
        prompt_ids=torch.tensor([1, 2]),
        response_ids=torch.tensor(response),
        logprobs=torch.zeros(n),
        top_ids=torch.zeros(n, 1, dtype=torch.long),
        top_logprobs=torch.zeros(n, 1),
        cached_len=torch.arange(2, 2 + n),
        kv_budget=torch.zeros(n, dtype=torch.long),
        finish_reason="length",
    )


def test_score_samples_groups_prompt_major_and_counts_reward_one_as_correct() -> None:
    # 2 prompts x n=3; the reward is 1 when the response's first token equals the answer, else 0.5
    responses = [[7, 0], [3], [7], [4, 4, 4], [9], [4]]
    batch = RolloutBatch([_sample(r) for r in responses], "dense", prefill_s=0.5, decode_s=0.5)
    results = score_samples(
        batch, [7, 4], lambda ids, answer: 1.0 if ids[0] == answer else 0.5, n=3, ks=[1, 3]
    )
    assert [r.rewards for r in results] == [[1.0, 0.5, 1.0], [1.0, 0.5, 1.0]]
    assert [r.correct for r in results] == [2, 2] and [r.index for r in results] == [0, 1]
    assert results[1].response_tokens == [3, 1, 1] and results[0].pass_at == {1: 2 / 3, 3: 1.0}
    with pytest.raises(ValueError, match="6 samples for 3 prompts x n=3"):
        score_samples(batch, [7, 4, 1], lambda ids, answer: 1.0, n=3, ks=[1])


def test_a_reward_that_raises_on_one_response_scores_it_zero(caplog: pytest.LogCaptureFixture) -> None:
    """An evaluation meets any completion a model writes: a reward that raises on one is that sample's 0."""
    batch = RolloutBatch([_sample(r) for r in ([7], [3], [9])], "dense", prefill_s=0.5, decode_s=0.5)

    def reward(ids: list[int], answer: int) -> float:
        if ids[0] == 3:
            raise KeyError("values")
        return 1.0 if ids[0] == answer else 0.0

    (result,) = score_samples(batch, [7], reward, n=3, ks=[1])
    assert result.rewards == [1.0, 0.0, 0.0] and result.correct == 1
    assert "reward raised KeyError" in caplog.text


def test_summary_averages_over_prompts() -> None:
    def result(i: int, rewards: list[float]) -> PromptResult:
        c = sum(r >= 1 for r in rewards)
        return PromptResult(
            i, "a", rewards, c, [10] * 4, ["length"] * 4, {1: pass_at_k(4, c, 1), 2: pass_at_k(4, c, 2)}
        )

    s = summarize([result(0, [1, 0, 0, 0.5]), result(1, [1, 1, 1, 1])], n=4, tokens_per_s=5.0, schedule="x")
    assert s.mean_at_n == pytest.approx((0.25 + 1.0) / 2)
    assert s.pass_at[1] == pytest.approx(s.mean_at_n)  # pass@1 is mean@n
    assert s.pass_at[2] == pytest.approx((0.5 + 1.0) / 2)  # 1 - C(3,2)/C(4,2) = 0.5
    assert s.reward_mean == pytest.approx((1.5 / 4 + 1.0) / 2)
    d = s.to_dict()
    assert d["mean@4"] == s.mean_at_n and d["pass@2"] == s.pass_at[2] and d["schedule"] == "x"


def _tiny_checkpoint(path: Path) -> Path:
    """A random transformers Qwen3 of the 'tiny' preset plus a character-level tokenizer, saved offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    shape = PRESETS["tiny"]
    chars = [chr(i) for i in range(32, 127)] + ["\n"]
    vocab = {"<unk>": 0, "<s>": 1, "<|im_end|>": 2} | {ch: i + 3 for i, ch in enumerate(chars)}
    assert len(vocab) <= shape.vocab_size and vocab["<|im_end|>"] == shape.eos_token_id
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|im_end|>").save_pretrained(
        path
    )
    config = Qwen3Config(**hf_config_dict(shape))
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).float().save_pretrained(path)
    return path


def test_eval_command_on_aime24(
    tmp_path: Path, shared_data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = _tiny_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "res" / "aime.jsonl"
    argv = [
        "eval",
        "--config",
        "tiny_cpu",
        "--data",
        str(shared_data / "aime24.jsonl"),
        "--n",
        "4",
        "--max-prompts",
        "2",
        "--out",
        str(out),
        f"model.hf_checkpoint={ckpt}",
        "reward.type=math",
        "control.calibrate=false",
        "rollout.max_new_tokens=6",
        "data.max_prompt_tokens=2048",
    ]
    assert cli.main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    first_answers = [
        json.loads(line)["answer"] for line in (shared_data / "aime24.jsonl").read_text().splitlines()[:2]
    ]
    assert [r["answer"] for r in rows] == first_answers and [r["index"] for r in rows] == [0, 1]
    for r in rows:
        assert len(r["rewards"]) == len(r["responses"]) == 4
        assert all(0 < t <= 6 for t in r["response_tokens"])
        assert r["correct"] == sum(x >= 1 for x in r["rewards"])  # random weights: 0, but not assumed
        assert r["pass_at"] == {str(k): pytest.approx(pass_at_k(4, r["correct"], k)) for k in (1, 2, 4)}
    summary = json.loads((out.parent / "aime_summary.json").read_text())
    assert summary["prompts"] == 2 and summary["n"] == 4
    assert summary["mean@4"] == pytest.approx(sum(r["correct"] / 4 for r in rows) / 2)
    assert summary["pass@4"] == pytest.approx(sum(r["pass_at"]["4"] for r in rows) / 2)
    assert summary["schedule"] == "explicit"
    printed = capsys.readouterr().out
    assert "mean@4" in printed and "pass@2" in printed and str(out) in printed


def test_eval_command_errors(capsys: pytest.CaptureFixture[str], shared_data: Path) -> None:
    assert cli.main(["eval", "--n", "4", "--k", "8"]) == 2
    assert "--k values must be in [1, --n=4], got [8]" in capsys.readouterr().err
    assert cli.main(["eval", "--data", str(shared_data / "aime24.jsonl")]) == 2
    assert "needs a file reward (reward.type=math, code, ...)" in capsys.readouterr().err
