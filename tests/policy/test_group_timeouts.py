"""Every process group megatron makes bounds its collectives by ``trainer.dist_timeout_minutes``.

``world.start_processes`` gives the default group the recipe's timeout; ``initialize_parallel`` passes it to
megatron's ``initialize_model_parallel`` (whose own default is 30 minutes). Read back from each group's backend
options, gloo groups included (one rank: megatron still makes every group, each of one rank).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from policy._helpers import single_rank_env
from sparrow_nemo.grpo import world
from sparrow_nemo.model_shapes import PRESETS
from sparrow_nemo.policy.parallel import ParallelLayout, destroy_parallel, initialize_parallel


def _group_timeouts() -> dict[str, datetime.timedelta]:
    """``{group description: collective timeout}`` of every process group alive in this process."""
    c10d = dist.distributed_c10d
    out = {}
    for group in list(c10d._world.pg_map):
        backend = group._get_backend(torch.device("cpu"))
        out[f"{c10d._get_pg_config(group)['pg_desc']}#{group.group_name}"] = backend.options._timeout
    return out


def test_every_megatron_group_gets_the_recipe_timeout() -> None:
    with single_rank_env():
        world.start_processes(7.0)  # trainer.dist_timeout_minutes=7, not megatron's 30 nor torch's 30
        try:
            initialize_parallel(ParallelLayout(), PRESETS["tiny-test"])
            timeouts = _group_timeouts()
        finally:
            destroy_parallel()
    names = {name.split("#")[0] for name in timeouts}
    expected = {
        "default_pg",
        "TENSOR_MODEL_PARALLEL_GROUP",
        "DATA_PARALLEL_GROUP",
        "DATA_PARALLEL_GROUP_GLOO",
    }
    assert expected <= names, sorted(names)
    assert any("GLOO" in name for name in names)
    wrong = {name: t for name, t in timeouts.items() if t != datetime.timedelta(minutes=7)}
    assert not wrong, f"groups without the recipe's 7-minute timeout: {wrong}"
