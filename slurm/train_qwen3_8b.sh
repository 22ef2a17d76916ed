#!/usr/bin/env bash
# Qwen3-8B math GRPO with sparse rollout on 2 nodes x 8 GPUs (80 GB H100/H200): recipes/qwen3_8b_math.yaml through slurm/launch.sh.
#
#   sbatch slurm/train_qwen3_8b.sh                                   # from the repository root
#   sbatch slurm/train_qwen3_8b.sh trainer.max_steps=500 sparsity.threshold=0.88      # recipe overrides
#   sbatch -p <partition> -A <account> --time=08:00:00 slurm/train_qwen3_8b.sh        # cluster options
#   RECIPE=qwen3_8b_math_distill sbatch slurm/train_qwen3_8b.sh      # DistillSparse variant
#
# Container (pyxis/enroot): SPARROW_IMAGE, default ./sparrow_nemo.sqsh built from docker/Dockerfile
# (docker build -f docker/Dockerfile -t sparrow-nemo . && enroot import -o sparrow_nemo.sqsh dockerd://sparrow-nemo);
# SPARROW_IMAGE= (empty) runs .venv/bin/python on the nodes instead. The repository is mounted at
# /workspace/sparrow_nemo (recipe paths such as checkpoints/ and data/ are relative to it); add data and
# model folders with SPARROW_MOUNTS=/lustre/ckpt:/workspace/sparrow_nemo/checkpoints,...
# Output: runs/<recipe>[-<SPARROW_TAG>]/ (the run name: a requeued or resubmitted job resumes that run; a new
# run takes a new tag, SPARROW_TAG=try2), per-job, per-rank logs in its logs/ folder.
# Time limit: USR1 10 minutes before it (the rollout stops within a few decode steps; the lead covers a
# checkpoint's write, tests/slurm/test_signal_lead.py) -> checkpoint -> requeue -> the job resumes by itself.
#SBATCH --job-name=sparrow-qwen3-8b
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
export RECIPE=${RECIPE:-qwen3_8b_math}
export SPARROW_IMAGE=${SPARROW_IMAGE-sparrow_nemo.sqsh}
exec bash "${SPARROW_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh" "$@"
