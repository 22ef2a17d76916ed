"""``policy.offload_during_rollout`` in the trainer (smoke recipe, one process): from the rollout to the update
the policy holds only its weights on its device, and the run is the same as one without the offload."""

from __future__ import annotations

import pytest
from policy._helpers import single_rank_env

from sparrow_nemo.callbacks import Callback
from sparrow_nemo.grpo.recipe import load_config
from sparrow_nemo.grpo.trainer import GrpoTrainer
from sparrow_nemo.run_io.metrics import read_metrics

pytestmark = pytest.mark.slow

FAST = [
    "warmstart.enabled=false",
    "grpo.prompts_per_step=2",
    "grpo.samples_per_prompt=4",
    "rollout.max_new_tokens=12",
    "evaluation.num_prompts=1",
    "logging.plots=false",
    "trainer.max_steps=2",
    "checkpoint.enabled=false",
    "callbacks=[{_target_: test_offload_in_trainer.DeviceBytes}]",
]
COMPARED = ("reward/mean", "response_length/mean", "train/grad_norm", "train/loss", "acceptance/mean")


class DeviceBytes(Callback):
    """The policy's device bytes at the end of each rollout phase (after the logprobs, before the update)."""

    def __init__(self) -> None:
        self.seen: list[dict[str, int]] = []

    def on_rollout_end(self, trainer, report):
        self.seen.append(trainer.policy.device_bytes())


def _run(tmp_path, offload: bool) -> tuple[list[dict[str, int]], list[dict]]:
    config = load_config(
        "tiny_cpu_short_smoke", [*FAST, f"policy.offload_during_rollout={str(offload).lower()}"]
    )
    with single_rank_env():
        trainer = GrpoTrainer(config, tmp_path / str(offload))
        try:
            trainer.fit()
        finally:
            trainer.policy.close()
    rows = [r for r in read_metrics(tmp_path / str(offload) / "metrics.jsonl") if r["step"] >= 0]
    return trainer.callbacks.callbacks[0].seen, rows


def test_the_rollout_runs_next_to_the_weights_only(tmp_path) -> None:
    kept, plain = _run(tmp_path, offload=False)
    released, cycled = _run(tmp_path, offload=True)
    # step 1's rollout follows step 0's update: without the offload, its gradients and Adam state are there
    assert kept[1]["gradients"] > 0 and kept[1]["optimizer"] >= 2 * kept[1]["weights"]
    for step in (0, 1):
        assert released[step] == {"weights": kept[step]["weights"], "gradients": 0, "optimizer": 0}
    assert [r["step"] for r in cycled] == [r["step"] for r in plain] == [0, 1]
    for a, b in zip(plain, cycled, strict=True):
        for key in COMPARED:
            assert b[key] == a[key], (a["step"], key)
