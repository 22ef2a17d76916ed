"""Prompt sources from the recipe, and the warm-start cache key."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.warmstart import cache_key, cache_root, warm_start_dir
from sparrow_nemo.tasks.chain import ChainTask, ChainTaskConfig, solve


def test_synthetic_source_streams_task_problems_and_rewards_them() -> None:
    config = load_config("tiny_cpu_short", ["task.num_nodes=[3, 5]", "task.num_hops=[1, 2]", "task.seed=7"])
    source = build_prompt_source(config)
    task = ChainTask(ChainTaskConfig(num_nodes=(3, 5), num_hops=(1, 2), seed=7))
    first, second = source.next_batch(2), source.next_batch(1)
    assert source.cursor == 3
    for item, problem in zip([*first, *second], task.problems(3)):
        assert source.tokenizer.decode(item.prompt_ids) == problem.prompt
        assert item.prompt_ids[0] == source.tokenizer.bos_token_id
        assert item.answer == solve(problem.prompt)
        good = source.tokenizer.encode(problem.trace)
        assert source.reward(good, item.answer) == 1.0
        assert source.reward(source.tokenizer.encode("A:zz"), item.answer) == 0.0
    held_out = {tuple(i.prompt_ids) for i in source.eval_batch(20)}
    assert not held_out & {tuple(i.prompt_ids) for i in source.peek(200)}
    prompt, solution = next(source.warm_start_pairs(0))
    assert source.reward(source.tokenizer.encode(solution), solve(prompt)) == 1.0


def test_file_source_needs_the_model_tokenizer(tmp_path: Path) -> None:
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    config = load_config(
        "tiny_cpu_short", [f"data.train_path={rows}", "reward.type=math", "control.calibrate=false"]
    )
    with pytest.raises(ValueError, match=r"model\.hf_checkpoint"):
        build_prompt_source(config)


def test_warm_start_cache_key_tracks_what_changes_the_result(tmp_path: Path) -> None:
    base = load_config("tiny_cpu_short", [f"warmstart.cache_dir={tmp_path}"])
    key = cache_key(base, "CharTokenizer")
    assert len(key) == 16 and key == cache_key(
        load_config("tiny_cpu_short", [f"warmstart.cache_dir={tmp_path}"]), "CharTokenizer"
    )
    for change in (
        ["warmstart.steps=7"],
        ["warmstart.lr=0.1"],
        ["task.num_hops=[1, 3]"],
        ["task.seed=4"],
        ["policy.optimizer.weight_decay=0.1"],
        ["policy.micro_batch_size=2"],
        ["model.preset=tiny-test", "rollout.max_new_tokens=512"],
    ):
        assert cache_key(load_config("tiny_cpu_short", change), "CharTokenizer") != key, change
    for same in (
        ["warmstart.cache_dir=/elsewhere"],
        ["trainer.max_steps=3"],
        ["grpo.loss.clip_high=0.3"],
        ["trainer.cpu_threads=2"],  # a CPU warm-start always runs on one thread
        ["policy.optimizer.lr=0.5"],  # the warm-start has its own warmstart.lr
    ):
        assert cache_key(load_config("tiny_cpu_short", same), "CharTokenizer") == key, same
    # the warm-start's own sizes replace the task's in the key: RL sizes do not matter once they are set
    pinned = ["warmstart.num_hops=[1, 2]", "warmstart.num_nodes=[2, 4]"]
    assert cache_key(load_config("tiny_cpu_short", pinned), "CharTokenizer") == cache_key(
        load_config("tiny_cpu_short", [*pinned, "task.num_hops=[1, 3]", "task.num_nodes=[3, 6]"]),
        "CharTokenizer",
    )
    assert cache_key(load_config("tiny_cpu_short", ["warmstart.num_hops=[1, 1]"]), "CharTokenizer") != key
    assert cache_key(load_config("tiny_cpu_short", ["warmstart.ramp_steps=100"]), "CharTokenizer") != key
    source = build_prompt_source(base)
    assert warm_start_dir(base, source) == tmp_path / key
    assert cache_root(base) == tmp_path


def test_a_shipped_warm_start_is_hash_checked_and_used_instead_of_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sparrow_nemo.grpo import warmstart
    from sparrow_nemo.grpo.world import one_rank_world

    small = ["model.preset=tiny-test", "rollout.max_new_tokens=64", "warmstart.steps=2"]
    made = load_config("tiny_cpu_short", [*small, f"warmstart.cache_dir={tmp_path / 'made'}"])
    with one_rank_world():
        folder = warmstart.ensure_warm_start(made, build_prompt_source(made), show_progress=False)
    shipped_root = tmp_path / "shipped"
    shutil.copytree(folder, shipped_root / folder.name)
    digests = {p.name: warmstart.file_sha256(p) for p in folder.iterdir()}
    (shipped_root / folder.name / warmstart.MANIFEST).write_text(
        json.dumps({"key": folder.name, "sha256": digests})
    )
    monkeypatch.setattr(warmstart, "SHIPPED_ROOT", shipped_root)

    def no_training(*args, **kwargs):
        raise AssertionError("trained although a shipped checkpoint has the key")

    monkeypatch.setattr(warmstart, "_train_and_cache", no_training)
    fresh = load_config("tiny_cpu_short", [*small, f"warmstart.cache_dir={tmp_path / 'fresh'}"])
    with one_rank_world():
        got = warmstart.ensure_warm_start(fresh, build_prompt_source(fresh), show_progress=False)
    assert got == tmp_path / "fresh" / folder.name
    assert (got / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()

    damaged = shipped_root / folder.name / "model.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte
    damaged.write_bytes(bytes(data))
    other = load_config("tiny_cpu_short", [*small, f"warmstart.cache_dir={tmp_path / 'other'}"])
    with (
        one_rank_world(),
        pytest.raises(ValueError, match=r"model\.safetensors: sha256 .* the manifest says"),
    ):
        warmstart.ensure_warm_start(other, build_prompt_source(other), show_progress=False)
