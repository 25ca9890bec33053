#!/usr/bin/env bash
# UltraLong CPT to 4M tokens (recipes/cpt_4m.yaml): 256 H100, TP 8 x CP 16; the paper reports ~13 h (perf.md),
# tools/plan.py predicts 17.7 h at 35% MFU (424 s steps): past the 16 h limit the run requeues once and goes on.
# The time-limit warning comes 20 minutes ahead (10 in the other stages): one step, then the save, must fit.
#   sbatch slurm/cpt_4m.sh [dotted.key=value ...]       (relative paths: from the submit folder)
# Every #SBATCH line below can be overridden on the sbatch command line; RECIPE=FILE picks another
# recipe. The recipe sets the model and the parallel layout; slurm/common.sh documents the rest.
#SBATCH --job-name=cpt_4m
#SBATCH --nodes=32
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=16:00:00
#SBATCH --signal=B:USR1@1200
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

# sbatch runs a spool copy of this file: find the project from MEGATRON_EXT_ROOT, else the path this script was
# submitted by (Slurm keeps it: `sbatch /path/to/project/slurm/X.sh` from another checkout runs this one's code),
# else the submit folder.
root=${MEGATRON_EXT_ROOT:-$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null |
  sed -n 's|^ *Command=\(/.*\)/slurm/[^/]*\.sh.*|\1|p')}
[[ -f $root/slurm/common.sh ]] || root=${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}
[[ -f $root/slurm/common.sh ]] || {
  echo "error: slurm/common.sh not found; set MEGATRON_EXT_ROOT=<project folder>; nothing launched" >&2
  exit 1
}
# shellcheck source=slurm/common.sh
source "$root/slurm/common.sh"
stage_main cpt_4m "$@"
