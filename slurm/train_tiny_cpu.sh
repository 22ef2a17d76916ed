#!/usr/bin/env bash
# The embedded tiny CPU recipe through the cluster launcher: 2 tasks (gloo), tensor parallel 2, no GPU,
# no container. A smoke test of the Slurm path on any machine with Slurm (tests/slurm/ runs it).
#
#   sbatch slurm/train_tiny_cpu.sh                                  # from the repository root
#   RECIPE=tiny_cpu_short_smoke sbatch slurm/train_tiny_cpu.sh trainer.max_steps=4
#
# Needs ./install.sh (the tasks run .venv/bin/python). Output: runs/<recipe>[-<SPARROW_TAG>]/ (metrics.jsonl,
# checkpoints/, logs/job<J>_attempt<N>_rank<R>.log); the launcher's own messages in slurm-<job name>-<job id>.out.
#SBATCH --job-name=sparrow-tiny-cpu
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --cpus-per-task=1
#SBATCH --time=00:30:00
#SBATCH --signal=B:USR1@60
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
export RECIPE=${RECIPE:-tiny_cpu}
export SPARROW_IMAGE=""
exec bash "${SPARROW_ROOT:-${SLURM_SUBMIT_DIR:-.}}/slurm/launch.sh" policy.tensor_model_parallel_size=2 "$@"
