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

import pytest
import torch

from sparrow_nemo.config.compose import recipes_dir
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
    config = load_config("tiny_cpu_short_smoke", [*SHORT, f"warmstart.cache_dir={cache}"])
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
    key = cache_key(load_config("tiny_cpu_short_smoke", base), "CharTokenizer")
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
        assert cache_key(load_config("tiny_cpu_short_smoke", [*base, *change]), "CharTokenizer") != key, (
            change
        )
    # the code that trains is an input: another digest of its sources, another key
    monkeypatch.setattr(warmstart, "source_digest", lambda: "edited")
    assert cache_key(load_config("tiny_cpu_short_smoke", base), "CharTokenizer") != key
    monkeypatch.undo()
    # what does not change the weights does not change the key (the RL learning rate, the cache folder)
    for same in (["policy.optimizer.lr=0.5"], ["warmstart.cache_dir=/elsewhere"], ["trainer.cpu_threads=4"]):
        assert cache_key(load_config("tiny_cpu_short_smoke", [*base, *same]), "CharTokenizer") == key, same


def test_every_layout_starts_from_the_single_rank_warm_start_when_it_is_cached(
    tmp_path: Path, monkeypatch
) -> None:
    config = load_config(
        "tiny_cpu_short_smoke", [f"warmstart.cache_dir={tmp_path}", "policy.tensor_model_parallel_size=2"]
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


def _staged_recipes(folder: Path, stage_steps: int) -> Path:
    """A two-stage warm-start: ``stage.yaml`` (the short task, ``stage_steps`` steps) and ``next.yaml``, which
    continues it (warmstart.init_from) for 2 steps at a learning rate too small to move far."""
    folder.mkdir(exist_ok=True)
    base = recipes_dir() / "tiny_cpu_short_smoke.yaml"
    (folder / "stage.yaml").write_text(
        f"defaults: [{base}]\nname: stage\nwarmstart: {{steps: {stage_steps}, batch_size: 4}}\n"
    )
    (folder / "next.yaml").write_text(
        f"defaults: [{base}]\nname: next\n"
        f"warmstart: {{init_from: {folder / 'stage.yaml'}, steps: 2, batch_size: 4, lr: 1.0e-9}}\n"
    )
    return folder / "next.yaml"


def test_a_staged_warm_start_trains_its_stage_first_and_starts_from_it(tmp_path: Path) -> None:
    """warmstart.init_from: the stage's checkpoint is made (and cached) first and these steps start from its
    weights; the stage's key is part of this one's, and a stage that is itself staged is refused."""
    from safetensors.torch import load_file

    recipe = _staged_recipes(tmp_path, stage_steps=6)
    config = load_config(recipe, [f"warmstart.cache_dir={tmp_path / 'cache'}"])
    with one_rank_world():
        staged = ensure_warm_start(config, build_prompt_source(config), show_progress=False)
    stage = load_config(tmp_path / "stage.yaml", [f"warmstart.cache_dir={tmp_path / 'cache'}"])
    stage_dir = warm_start_dir(stage, build_prompt_source(stage))
    assert (stage_dir / "config.json").is_file() and staged != stage_dir
    before, after = load_file(stage_dir / "model.safetensors"), load_file(staged / "model.safetensors")
    moved = max(float((after[k] - before[k]).abs().max()) for k in before)
    assert 0 < moved < 1e-6  # 2 steps at lr 1e-9 from the stage's weights, not from a random init
    longer_stage = load_config(_staged_recipes(tmp_path / "other", stage_steps=7))
    assert cache_key(longer_stage, "CharTokenizer") != cache_key(load_config(recipe), "CharTokenizer")
    (tmp_path / "stage.yaml").write_text(
        f"defaults: [{recipes_dir() / 'tiny_cpu_short_smoke.yaml'}]\nname: stage\nwarmstart: {{init_from: {recipe}}}\n"
    )
    with pytest.raises(ValueError, match="one stage deep only"):
        cache_key(load_config(recipe), "CharTokenizer")


def test_the_code_digest_ignores_docstrings_and_comments_but_not_code() -> None:
    """Documentation edits keep the warm-start key (and the shipped checkpoints valid); code edits change it."""
    a = '"""Module doc."""\n\ndef f(x):\n    """What f does."""\n    return x + 1  # a comment\n'
    b = '"""Another doc."""\n\ndef f(x):\n    # another comment\n    return x + 1\n'
    c = '"""Module doc."""\n\ndef f(x):\n    """What f does."""\n    return x + 2\n'
    assert warmstart._code(a) == warmstart._code(b) != warmstart._code(c)
    assert warmstart._code('def g():\n    """Only a docstring."""\n') == warmstart._code(
        "def g():\n    pass\n"
    )
    assert set(warmstart.PLANNING_ONLY) <= {
        f"policy/{p.name}" for p in (Path(warmstart.__file__).parents[1] / "policy").glob("*.py")
    }
