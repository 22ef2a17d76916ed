"""Each GPU wrapper's time-limit warning (``#SBATCH --signal=B:USR1@<lead>``) leaves time to stop and save.

After USR1 the job must, before the limit: stop (within 8 decode steps of a rollout, or at the current phase's
end), refit the engine, write a checkpoint and exit; Slurm sends the warning up to 30 s early or late on a
busy controller. Priced conservatively: 120 s for the stop, the refit, the exit and Slurm's timing, plus twice
the time to write the checkpoint at 1 GB/s from one node. The checkpoint holds 14 bytes per parameter (bf16
weights, fp32 master weights and the two Adam moments); a gathered checkpoint writes all of it from node 0.
"""

from __future__ import annotations

import re

import pytest

from sparrow_nemo.grpo.recipe import load_config

from .conftest import REPO_ROOT

WRAPPERS = sorted((REPO_ROOT / "slurm").glob("train_qwen3_*.sh"))
#: seconds for the stop, the refit, the exit and Slurm's signal timing
FIXED_S = 120.0
#: bytes per second one node writes to the cluster file system (a conservative parallel-FS client rate)
WRITE_BYTES_PER_S = 1e9
#: checkpoint bytes per model parameter: bf16 weights + fp32 master weights + Adam's two fp32 moments
CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 4 + 4


def test_there_are_gpu_wrappers() -> None:
    assert {p.name for p in WRAPPERS} >= {"train_qwen3_14b.sh", "train_qwen3_8b.sh", "train_qwen3_1p7b.sh"}


@pytest.mark.parametrize("wrapper", WRAPPERS, ids=lambda p: p.name)
def test_the_warning_lead_covers_a_checkpoint_write(wrapper) -> None:
    text = wrapper.read_text()
    lead = int(re.search(r"^#SBATCH --signal=B:USR1@(\d+)$", text, re.M).group(1))
    recipe = re.search(r"RECIPE=\$\{RECIPE:-(\w+)\}", text).group(1)
    params = load_config(recipe).model.shape().num_parameters()
    needed = FIXED_S + 2 * params * CHECKPOINT_BYTES_PER_PARAM / WRITE_BYTES_PER_S
    assert lead >= needed, (
        f"{wrapper.name}: USR1@{lead} s is less than the {needed:.0f} s a stop and save of {recipe} take"
    )
    assert re.search(rf"USR1 {lead // 60} minutes before it", text), (
        f"{wrapper.name}: its comment names another lead"
    )
    assert (
        "#SBATCH --requeue" in text and "#SBATCH --mem=0" in text
    )  # the node's memory, not Slurm's default share
    assert load_config(recipe).checkpoint.every_n_minutes > 0  # the Qwen3 recipes also save by the clock
