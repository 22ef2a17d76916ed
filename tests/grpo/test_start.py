"""Where a run starts: the warm-start is a step of ``train`` (``sparrow train``), not of the trainer's constructor.

- ``GrpoTrainer(config)`` builds and does not train: on a recipe with ``warmstart.enabled`` and an empty warm-start
  cache it writes nothing there and its policy starts from random weights;
- ``start_checkpoint`` is ``model.hf_checkpoint`` when set and None when the warm-start is off (no work either way).
"""

from __future__ import annotations

from pathlib import Path

from policy._helpers import single_rank_env

from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.start import start_checkpoint
from sparrow_nemo.grpo.trainer import GrpoTrainer

QUICK = [
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "rollout.max_new_tokens=12",
    "logging.plots=false",
    "logging.tensorboard=false",
]


def test_the_trainer_builds_without_warm_starting(tmp_path: Path) -> None:
    cache = tmp_path / "ws"
    config = load_config("tiny_cpu_short_smoke", [*QUICK, f"warmstart.cache_dir={cache}"])
    assert config.warmstart.enabled and config.model.hf_checkpoint is None
    with single_rank_env():
        trainer = GrpoTrainer(config, tmp_path / "run")
        try:
            assert trainer.state.warm_start_dir is None  # random init: nothing was trained or copied
            assert trainer.state.step == 0
        finally:
            trainer.policy.close()
    assert not cache.exists() or not any(cache.iterdir())


def test_start_checkpoint_does_no_work_without_a_warm_start(tmp_path: Path) -> None:
    cache = tmp_path / "ws"
    off = load_config("tiny_cpu_short_smoke", ["warmstart.enabled=false", f"warmstart.cache_dir={cache}"])
    assert start_checkpoint(off, show_progress=False) is None
    given = load_config(
        "tiny_cpu_short_smoke", [f"model.hf_checkpoint={tmp_path}", f"warmstart.cache_dir={cache}"]
    )
    assert start_checkpoint(given, show_progress=False) == str(tmp_path)
    assert not cache.exists()
