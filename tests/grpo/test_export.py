"""``sparrow export``: a trained run's checkpoint as an HF Qwen3 folder that transformers loads, with the
policy's logits; sharded safetensors; bad run folders and steps are one-line errors. ``checkpoint.save_hf``
writes the same folder at the end of the run (``<run_dir>/hf``), replacing an earlier one only when complete."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from policy._helpers import make_hf_checkpoint, single_rank_env

from sparrow_nemo.cli import main
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.model_shapes import PRESETS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two GRPO steps on a tiny random Qwen3 with a chat tokenizer, a checkpoint after each."""
    from grpo.test_data_formats import VERL, save_chat_tokenizer, write_verl_parquet

    from sparrow_nemo.grpo.start import train

    tmp = tmp_path_factory.mktemp("export")
    ckpt = make_hf_checkpoint(PRESETS["tiny"], tmp / "ckpt")
    save_chat_tokenizer(ckpt)
    config = load_config(
        "tiny_cpu_short_smoke",
        [
            "reward.type=math",
            f"data.train_path={write_verl_parquet(tmp / 'd.parquet')}",
            f"data.prompt_key={VERL.prompt_key}",
            f"data.answer_key={VERL.answer_key}",
            f"model.hf_checkpoint={ckpt}",
            "trainer.max_steps=2",
            "grpo.prompts_per_step=4",
            "rollout.max_new_tokens=12",
            "logging.plots=false",
            "checkpoint.every_n_steps=1",
            "checkpoint.keep_last=2",
            "checkpoint.save_hf=true",
        ],
    )
    run_dir = tmp / "run"
    with single_rank_env():
        train(config, run_dir)
    return run_dir


def _with_policy(run_dir: Path, step: int, use):
    """``use(policy, config)`` on the run's policy loaded from its checkpoint of ``step`` (one rank)."""
    from sparrow_nemo.grpo import setup, world
    from sparrow_nemo.grpo.export import find_checkpoint

    config = load_config(run_dir / "config.yaml")
    with single_rank_env():
        world.start_processes()
        policy = setup.build_policy(config, None)
        try:
            policy.load(find_checkpoint(run_dir, None, step))
            return use(policy, config)
        finally:
            policy.close()


def _policy_logprobs(run_dir: Path, step: int, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S-1] logprobs of ``tokens`` under the run's policy at ``step``, from its checkpoint."""
    from sparrow_nemo.policy.packing import concat_outputs, micro_batches

    def logprobs(policy, _config) -> torch.Tensor:
        lengths = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.int64)
        outputs = policy.logprobs(micro_batches(tokens, lengths, {}, tokens.shape[0], None))
        return concat_outputs(outputs).logprobs.float()

    return _with_policy(run_dir, step, logprobs)


def _hf_logprobs(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    """[B, S-1] logprobs of ``tokens`` under the HF checkpoint ``folder`` loaded by transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]


def test_export_round_trips_through_transformers_with_the_policys_logits(trained_run: Path, tmp_path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    with single_rank_env():
        assert main(["export", "--run-dir", str(trained_run), "--out", str(out)]) == 0
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokens = torch.tensor([tokenizer.encode("What is 3 + 3? Answer: 6")] * 2)
    tokens[1, 5] = 40
    with torch.no_grad():
        logits = model(tokens).logits.float()
    hf = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    policy = _policy_logprobs(trained_run, 2, tokens)
    torch.testing.assert_close(hf, policy, atol=1e-4, rtol=1e-4)
    start = make_hf_checkpoint(PRESETS["tiny"], tmp_path / "start")  # the trained weights, not the start's
    untrained = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    with torch.no_grad():
        assert not torch.equal(untrained(tokens).logits, logits)


def test_save_hf_writes_the_final_policy_at_the_end_of_the_run(trained_run: Path, tmp_path) -> None:
    """``checkpoint.save_hf``: ``<run_dir>/hf`` holds what ``sparrow export`` writes of the last step (every
    tensor equal), transformers loads it with the final policy's logits; a second save into a run folder that
    has one replaces it whole, leaving no staging folder."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from sparrow_nemo.grpo.export import save_run_hf

    saved = trained_run / "hf"
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in saved.iterdir()
    }
    exported = tmp_path / "export"
    with single_rank_env():
        assert main(["export", "--run-dir", str(trained_run), "--out", str(exported)]) == 0
    want = load_file(str(exported / "model.safetensors"))
    got = load_file(str(saved / "model.safetensors"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    tokens = torch.tensor([AutoTokenizer.from_pretrained(saved).encode("What is 3 + 3? Answer: 6")])
    torch.testing.assert_close(
        _hf_logprobs(saved, tokens), _policy_logprobs(trained_run, 2, tokens), atol=1e-4, rtol=1e-4
    )
    run_dir = tmp_path / "run"
    shutil.copytree(saved, run_dir / "hf")  # an earlier attempt's folder (step 2), replaced by step 1's
    _with_policy(trained_run, 1, lambda policy, config: save_run_hf(policy, config, run_dir))
    assert sorted(p.name for p in run_dir.iterdir()) == ["hf"]
    step1 = load_file(str(run_dir / "hf" / "model.safetensors"))
    assert any(not torch.equal(step1[n], want[n]) for n in want)
    torch.testing.assert_close(
        _hf_logprobs(run_dir / "hf", tokens), _policy_logprobs(trained_run, 1, tokens), atol=1e-4, rtol=1e-4
    )


def test_export_of_a_step_sharded_and_bad_requests(trained_run: Path, tmp_path, capsys) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sparrow_nemo.grpo.export import write_hf_folder

    step1 = tmp_path / "step1"
    with single_rank_env():
        assert main(["export", "--run-dir", str(trained_run), "--step", "1", "--out", str(step1)]) == 0
    state = load_file(str(step1 / "model.safetensors"))
    config = load_config(trained_run / "config.yaml")
    sharded = write_hf_folder(state, config, tmp_path / "sharded", max_shard_bytes=200_000)
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(sharded, dtype=torch.float32).state_dict()
    for name, tensor in state.items():
        assert torch.equal(reloaded[name], tensor), name
    capsys.readouterr()
    assert main(["export", "--run-dir", str(trained_run), "--step", "7", "--out", str(tmp_path / "x")]) == 2
    assert "no complete checkpoint of step 7 (steps: [1, 2])" in capsys.readouterr().err
    assert main(["export", "--run-dir", str(tmp_path), "--out", str(tmp_path / "y")]) == 2
    assert "not a run folder (no config.yaml)" in capsys.readouterr().err
    assert main(["export", "--run-dir", str(trained_run), "--out", str(step1)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_distill_adapter_in_peft_format_applies_to_the_exported_model(tmp_path) -> None:
    """A DistillSparse adapter state exported with the weights: PEFT's LoraModel on the exported folder gives
    the logits of the weights merged by hand (W + scaling * B @ A)."""
    pytest.importorskip("peft")
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from sparrow_nemo.grpo.export import write_hf_folder
    from sparrow_nemo.hf_qwen3 import linear_in_out

    shape = PRESETS["tiny"]
    base = make_hf_checkpoint(shape, tmp_path / "base")
    state = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    weights = {
        name: (torch.randn(4, fan_in, generator=g) * 0.1, torch.randn(fan_out, 4, generator=g) * 0.1)
        for name, (fan_in, fan_out) in linear_in_out(shape).items()
        if name.endswith(("q_proj", "down_proj"))
    }
    config = load_config("tiny_cpu_short_smoke")
    out = write_hf_folder(state, config, tmp_path / "hf", adapter={"weights": weights, "scaling": 0.5})
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), out / "distill_lora"
    )
    merged = dict(state)
    for name, (a, b) in weights.items():
        merged[f"{name}.weight"] = state[f"{name}.weight"] + 0.5 * b @ a
    reference = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    reference.load_state_dict(merged, strict=False)
    tokens = torch.tensor([[5, 9, 17, 33, 2, 64, 100]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, atol=1e-5, rtol=1e-5)
        plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(tokens).logits
    assert not torch.allclose(plain, reference(tokens).logits, atol=1e-3)  # the adapter changes the logits
