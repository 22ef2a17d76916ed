#!/usr/bin/env bash
# One training task of a Slurm job step (started by slurm/launch.sh through srun, one per GPU/CPU task):
# maps Slurm's task identity to the torch.distributed env:// variables, then runs the given command.
#   RANK = SLURM_PROCID, WORLD_SIZE = SLURM_NTASKS, LOCAL_RANK = SLURM_LOCALID,
#   LOCAL_WORLD_SIZE = SLURM_NTASKS_PER_NODE (or the tasks on this node)
# MASTER_ADDR / MASTER_PORT are exported by the launcher and inherited through srun.
set -euo pipefail
: "${MASTER_ADDR:?MASTER_ADDR is not set: run through slurm/launch.sh}"
: "${MASTER_PORT:?MASTER_PORT is not set: run through slurm/launch.sh}"
export RANK=${SLURM_PROCID:?not a Slurm task (no SLURM_PROCID)}
export WORLD_SIZE=${SLURM_NTASKS:?not a Slurm task (no SLURM_NTASKS)}
export LOCAL_RANK=${SLURM_LOCALID:?not a Slurm task (no SLURM_LOCALID)}
export LOCAL_WORLD_SIZE=${SLURM_NTASKS_PER_NODE:-${SLURM_STEP_TASKS_PER_NODE%%(*}}
exec "$@"
