"""The warm-start cache key determines the cached weights.

Two warm-starts with the same key give byte-identical checkpoints whatever the caller's torch thread count
and global RNG state (measured before the fix: 1 and 2 intra-op threads gave different weights under one
key), and every recipe input that changes the weights changes the key, as does the training code. A
multi-rank run starts from its own layout's warm-start only when no single-rank one is cached (then every
layout starts from that one).
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch

from sparrow_nemo.grpo import warmstart
from sparrow_nemo.grpo.prompts import build_prompt_source
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.warmstart import (
    SINGLE_RANK,
    cache_key,
    cached_warm_start,
    ensure_warm_start,
    warm_start_dir,
)
from sparrow_nemo.grpo.world import one_rank_world

SHORT = ["warmstart.steps=6", "warmstart.batch_size=4"]


def _warm_start(cache: Path, threads: int, disturb: bool) -> tuple[Path, str]:
    config = load_config("tiny_cpu_smoke", [*SHORT, f"warmstart.cache_dir={cache}"])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if disturb:  # global RNGs touched by whatever ran before in the process
            torch.rand(1000)
            random.random()
        with one_rank_world():
            path = ensure_warm_start(config, build_prompt_source(config), show_progress=False)
    finally:
        torch.set_num_threads(before)
    return path, hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_same_key_same_bytes_under_other_thread_counts_and_rng_state(tmp_path: Path) -> None:
    one, digest_one = _warm_start(tmp_path / "a", threads=1, disturb=False)
    two, digest_two = _warm_start(tmp_path / "b", threads=2, disturb=True)
    assert one.name == two.name  # the same cache key ...
    assert digest_one == digest_two  # ... and the same weights, to the byte
    assert torch.get_num_threads() == 1  # the caller's thread count is restored (conftest sets 1)


def test_every_input_of_the_weights_is_in_the_key(tmp_path: Path, monkeypatch) -> None:
    base = [f"warmstart.cache_dir={tmp_path}"]
    key = cache_key(load_config("tiny_cpu_smoke", base), "CharTokenizer")
    for change in (
        ["policy.optimizer.betas=[0.8, 0.99]"],
        ["policy.optimizer.eps=1e-6"],
        ["policy.optimizer.weight_decay=0.1"],
        ["policy.optimizer.grad_clip=0.5"],
        ["policy.micro_batch_size=2"],
        ["policy.tensor_model_parallel_size=2"],
        ["trainer.device=cpu", "model.dtype=bf16", "policy.precision=bf16"],
        ["trainer.seed=1"],
    ):
        assert cache_key(load_config("tiny_cpu_smoke", [*base, *change]), "CharTokenizer") != key, change
    # the code that trains is an input: another digest of its sources, another key
    monkeypatch.setattr(warmstart, "source_digest", lambda: "edited")
    assert cache_key(load_config("tiny_cpu_smoke", base), "CharTokenizer") != key
    monkeypatch.undo()
    # what does not change the weights does not change the key (the RL learning rate, the cache folder)
    for same in (["policy.optimizer.lr=0.5"], ["warmstart.cache_dir=/elsewhere"], ["trainer.cpu_threads=4"]):
        assert cache_key(load_config("tiny_cpu_smoke", [*base, *same]), "CharTokenizer") == key, same


def test_every_layout_starts_from_the_single_rank_warm_start_when_it_is_cached(
    tmp_path: Path, monkeypatch
) -> None:
    config = load_config(
        "tiny_cpu_smoke", [f"warmstart.cache_dir={tmp_path}", "policy.tensor_model_parallel_size=2"]
    )
    source = build_prompt_source(config)
    single = warm_start_dir(config, source, SINGLE_RANK)
    monkeypatch.setenv("WORLD_SIZE", "2")
    own = warm_start_dir(config, source)
    assert own != single  # trained on 2 ranks the weights differ: another key
    assert cached_warm_start(config, source) is None
    own.mkdir()
    (own / "config.json").write_text("{}")
    assert cached_warm_start(config, source) == own  # what this layout trained, without a single-rank one
    single.mkdir()
    (single / "config.json").write_text("{}")
    assert cached_warm_start(config, source) == single  # the reference: every layout starts from it
