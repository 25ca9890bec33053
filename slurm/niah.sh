#!/usr/bin/env bash
# Long-context evaluation of a Megatron checkpoint on the Megatron engine (tools/niah.py --engine megatron):
# NIAH grids, RULER-style tasks or perplexity by position at lengths no single GPU holds, every task of the job one
# rank.
#   sbatch slurm/niah.sh --megatron checkpoints/cpt_1m --cp 8 --lengths 128K:1M:4 --out runs/niah_1m
#   sbatch --nodes=8 slurm/niah.sh --megatron checkpoints/cpt_4m --tp 8 --cp 8 --lengths 4M --chat --out runs/niah_4m
#   sbatch slurm/niah.sh ppl --megatron checkpoints/cpt_1m --cp 8 --indexed data/cpt --out runs/ppl_1m
#   sbatch slurm/niah.sh ruler --megatron checkpoints/sft_1m --cp 8 --lengths 128K,512K,1M --chat --out runs/ruler_1m
# Arguments are tools/niah.py's (`python tools/niah.py --help`); TP x PP x CP must divide the task count (the
# remaining data-parallel replicas share the prompts or documents). A NIAH grid or RULER run that reaches the time
# limit is requeued and goes on with --resume (slurm/common.sh, eval_main); --resume also works on a resubmitted job.
# Every #SBATCH line below can be overridden on the sbatch command line; slurm/common.sh documents the rest.
#SBATCH --job-name=niah
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --exclusive
#SBATCH --mem=0
#SBATCH --time=04:00:00
#SBATCH --signal=B:USR1@300
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
eval_main "$@"
