#!/usr/bin/env bash
# Submit the whole UltraLong run as a chain of Slurm jobs, each starting after the one it needs succeeded
# (--dependency=afterok; with --kill-on-invalid-dep=yes a failed job cancels the ones that need it):
#   convert (HF -> Megatron, tools/convert.py to-megatron) -> CPT stage -> SFT, then after the last training stage
#   NIAH, RULER and the export (to-hf), each on its own: a failed evaluation does not cancel the export
#
#   bash slurm/pipeline.sh [--cpt cpt_1m|cpt_2m|cpt_4m] [--hf DIR] [--export DIR] [--sft-recipe FILE]
#                          [--no-sft] [--niah LENGTHS] [--ruler LENGTHS] [--dry-run] [dotted.key=value ...]
#
#   --cpt      CPT stage script/recipe (default cpt_1m)
#   --hf       HF model folder to convert first into the CPT recipe's checkpoint.init_from, a folder that must
#              not exist yet; its config.json must be the recipe's model (default: no conversion job;
#              checkpoint.init_from must then exist)
#   --export   a new HF folder to write from the last stage's checkpoint (default: no export job)
#   --sft-recipe  SFT recipe (default: the one with the CPT stage's RoPE, recipes/sft.yaml after cpt_1m,
#              recipes/sft_2m.yaml and sft_4m.yaml after cpt_2m and cpt_4m)
#   --niah     evaluate the last stage's checkpoint at these lengths (e.g. 128K:1M:4) with slurm/niah.sh on the
#              Megatron engine, at the CPT recipe's TP x CP (default: no evaluation job);
#              chat prompts after SFT; results in <checkpoint.dir>_niah/
#   --ruler    the same for the RULER-style tasks (tools/niah.py ruler --tasks all), e.g. 128K,512K,1M; results in
#              <checkpoint.dir>_ruler/
#   --dry-run  print the sbatch commands instead of submitting (without checking paths and data)
# Overrides go to the CPT stage only; SFT gets checkpoint.init_from=<the CPT checkpoint.dir>. Both stages' data
# (the recipes' data.prefix: data/cpt, data/sft) is checked before the first job is submitted.
# SBATCH_ARGS (environment) is added to every sbatch call, e.g. "--account=proj --partition=batch"; its GPUs per node
# (--gpus-per-node=[type:]N, --gres=gpu[:type]:N) size the evaluation jobs too (default: cluster.gpus_per_node). With
# 0 there (CPU nodes) the training recipes must set runtime.device=cpu, and the evaluation jobs ask no GPUs and run
# cluster.gpus_per_node tasks per node.
# The jobs run in the project root; --hf, --export and --sft-recipe are taken relative to the folder this is run
# from, the recipes' own paths and overrides relative to the project root. PYTHON selects the python (default: python).
set -euo pipefail
CALLER=$PWD
cd "$(dirname "$0")/.."
# shellcheck source=slurm/common.sh
source slurm/common.sh # log, die; refuses a bash older than 4.4
# from_caller PATH: PATH as the user meant it, from the folder they ran this in (the jobs run in the project root).
from_caller() {
  if [[ -z $1 || $1 == /* || $CALLER -ef . ]]; then printf '%s\n' "$1"; else printf '%s\n' "$CALLER/$1"; fi
}
PYTHON=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

CPT=cpt_1m HF="" EXPORT="" SFT_RECIPE="" SFT=1 DRY=0 NIAH="" RULER=""
OVERRIDES=()
while (($#)); do
  case $1 in
    --cpt | --hf | --export | --sft-recipe | --niah | --ruler)
      (($# >= 2)) || nothing_launched "$1 needs a value (see --help)" ;;&
    --cpt) CPT=$2; shift 2 ;;
    --hf) HF=$(from_caller "$2"); shift 2 ;;
    --export) EXPORT=$(from_caller "$2"); shift 2 ;;
    --sft-recipe) SFT_RECIPE=$(from_caller "$2"); shift 2 ;;
    --no-sft) SFT=0; shift ;;
    --niah) NIAH=$2; shift 2 ;;
    --ruler) RULER=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    -h | --help) sed -n '2,/^set -euo pipefail/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) nothing_launched "unknown option $1 (see --help)" ;; # an override is dotted.key=value
    *) OVERRIDES+=("$1"); shift ;;
  esac
done
[[ -f slurm/$CPT.sh ]] || nothing_launched "--cpt $CPT: no slurm/$CPT.sh (cpt_1m, cpt_2m, cpt_4m)"
command -v "$PYTHON" >/dev/null || nothing_launched "PYTHON=$PYTHON: no such program; run with" \
  "PYTHON=/path/to/venv/bin/python (the environment megatron_ext is installed in)"
# the recipes are read with it below (a python without the dependencies would end in a traceback); found, not
# imported: importing torch and Megatron-Core takes seconds on a login node
"$PYTHON" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("torch", "megatron.core", "yaml")))' 2>/dev/null ||
  nothing_launched "PYTHON=$PYTHON cannot import torch, megatron.core and yaml: run with" \
    "PYTHON=/path/to/venv/bin/python (the environment megatron_ext is installed in)"
if ((SFT)) && [[ -z $SFT_RECIPE ]]; then
  case $CPT in
    cpt_1m) SFT_RECIPE=recipes/sft.yaml ;;
    cpt_2m | cpt_4m) SFT_RECIPE=recipes/sft_${CPT#cpt_}.yaml ;;
    *)
      nothing_launched "--cpt $CPT: no shipped SFT recipe has its RoPE; give --sft-recipe FILE (recipes/sft.yaml" \
        "with that stage's rope block and model.max_position_embeddings), or --no-sft"
      ;;
  esac
fi
read -r -a EXTRA <<<"${SBATCH_ARGS:-}"
# sbatch_gpus_per_node: the GPUs per node SBATCH_ARGS asks for, in the forms sbatch takes (`man sbatch`):
# --gpus-per-node=[type:]N, and a gpu entry gpu[:type][:N] (N 1 where left out) in --gres's comma list; either as
# one word or two; a later one wins (--gpus / -G, the job's GPUs in all, cannot be read as per node). Sets GPN (empty
# where SBATCH_ARGS names none) and GPU_TYPE, or GPN_UNREAD to why one cannot be read (sbatch itself may take it or
# refuse it: only the evaluation jobs' size needs it).
sbatch_gpus_per_node() {
  GPN="" GPU_TYPE="" GPN_UNREAD=""
  local i option value written entry
  local -a entries
  for ((i = 0; i < ${#EXTRA[@]}; i++)); do
    case ${EXTRA[i]} in
      --gpus-per-node=* | --gres=*) option=${EXTRA[i]%%=*} value=${EXTRA[i]#*=} written=${EXTRA[i]} ;;
      --gpus-per-node | --gres | --gpus | -G)
        option=${EXTRA[i]}
        if ((i + 1 == ${#EXTRA[@]})); then GPN_UNREAD="$option has no value"; return 0; fi
        i=$((i + 1))
        value=${EXTRA[i]} written="$option $value"
        ;;
      --gpus=* | -G?*) option=--gpus written=${EXTRA[i]} ;;
      *) continue ;;
    esac
    if [[ $option == --gpus || $option == -G ]]; then
      # the job's GPUs in all: per node it depends on how Slurm spreads them, so a guess could ask too many
      GPN="" GPU_TYPE="" GPN_UNREAD="$written counts the job's GPUs in all, not per node"
      continue
    fi
    if [[ $option == --gpus-per-node ]]; then
      if [[ $value =~ ^(([^:,]+):)?([0-9]+)$ ]]; then
        GPN=$((10#${BASH_REMATCH[3]})) GPU_TYPE=${BASH_REMATCH[2]} GPN_UNREAD=""
      else
        GPN_UNREAD="$written is not [type:]count"
      fi
      continue
    fi
    IFS=, read -r -a entries <<<"$value"
    for entry in "${entries[@]}"; do
      [[ $entry == gpu || $entry == gpu:* ]] || continue # another resource (or none)
      if [[ $entry =~ ^gpu(:([0-9]+))?$ ]]; then
        GPN=$((10#${BASH_REMATCH[2]:-1})) GPU_TYPE="" GPN_UNREAD=""
      elif [[ $entry =~ ^gpu:([^:]+)(:([0-9]+))?$ ]]; then
        GPN=$((10#${BASH_REMATCH[3]:-1})) GPU_TYPE=${BASH_REMATCH[1]} GPN_UNREAD=""
      else
        GPN_UNREAD="$written: its gpu entry is not gpu[:type][:count]"
      fi
    done
  done
}
sbatch_gpus_per_node
if [[ -n $GPN_UNREAD && (-n $NIAH || -n $RULER) ]]; then
  nothing_launched "SBATCH_ARGS='${SBATCH_ARGS:-}': $GPN_UNREAD, which sizes the --niah/--ruler jobs; give GPUs per" \
    "node as --gpus-per-node=[type:]N or --gres=gpu[:type]:N"
fi

# run_python WHAT ARGS...: "$PYTHON" ARGS, its stdout passed on; its stderr held back until it ends. Where it fails
# with its own one `error:` line (a user error) that line is the last word, saying that nothing was launched; a crash
# (a traceback, a killed process) ends with its output and one line naming WHAT. Every call comes before the first
# sbatch.
run_python() {
  local what=$1 err said last rc=0
  shift
  err=$(mktemp) || nothing_launched "mktemp failed (TMPDIR=${TMPDIR:-/tmp})"
  # bash's own notice of a killed process ("line N: PID Killed ...") to /dev/null: the last line says so
  { "$PYTHON" "$@" 2>"$err"; } 2>/dev/null || rc=$?
  said=$(<"$err")
  rm -f -- "$err"
  last=${said##*$'\n'}
  if ((rc == 1)) && [[ $last == "error: "* ]]; then
    [[ $said != *$'\n'* ]] || printf '%s\n' "${said%$'\n'*}" >&2 # warnings before it
    nothing_launched "${last#error: }"
  fi
  [[ -z $said ]] || printf '%s\n' "$said" >&2 # warnings; a crash's traceback
  ((rc != 0)) || return 0
  local how="failed with exit $rc" signal
  if ((rc > 128)) && signal=$(kill -l $((rc - 128)) 2>/dev/null); then how="was killed by SIG$signal (exit $rc)"; fi
  nothing_launched "$what ($PYTHON ${1:-} ${2:-}) $how${said:+; its output is above}"
}

# field RECIPE KEY [overrides...]: a resolved recipe value (validates the recipe too).
field() {
  local recipe=$1 key=$2
  shift 2
  run_python "reading $key from $recipe" -m megatron_ext.launch --recipe "$recipe" --get "$key" "$@"
}

PREV="" N=0 SUBMITTED="" IDS=""
# submit_failed MESSAGE...: end the pipeline with one line: MESSAGE, and that nothing was launched or which jobs were
# (Slurm runs them as submitted).
submit_failed() {
  [[ -n $SUBMITTED ]] || nothing_launched "$*"
  die "$*; submitted before it: $SUBMITTED, which Slurm runs as submitted: scancel$IDS to cancel them"
}
# submit NAME [VAR=value ...] sbatch-args...: submit after the previous job, with VAR=value in sbatch's environment
# (the job inherits it: unlike --export=VAR=value, a value may hold commas); sets PREV to the new job id.
submit() {
  local name=$1 id
  shift
  local -a cmd=()
  while [[ ${1:-} =~ ^[A-Z_]+= ]]; do
    cmd+=("$1")
    shift
  done
  cmd+=(sbatch --parsable "${EXTRA[@]}")
  # kill-on-invalid-dep: Slurm cancels the job if the one before fails (else it waits forever, DependencyNeverSatisfied)
  [[ -n $PREV ]] && cmd+=("--dependency=afterok:$PREV" --kill-on-invalid-dep=yes)
  cmd+=("$@")
  N=$((N + 1))
  if ((DRY)); then
    id="<$name>"
    printf '%s\n' "$(printf '%q ' "${cmd[@]}")"
  else
    local err why rc=0
    err=$(mktemp) || submit_failed "mktemp failed (TMPDIR=${TMPDIR:-/tmp}) before the $name job"
    id=$(env "${cmd[@]}" 2>"$err") || rc=$?
    why=$(<"$err")
    rm -f -- "$err"
    if ((rc != 0)); then
      why=${why//sbatch: error: /}
      why=${why//$'\n'/; }
      submit_failed "sbatch refused the $name job (${why:-exit $rc})"
    fi
    [[ -z $why ]] || printf '%s\n' "$why" >&2 # sbatch's warnings
    id=${id%%;*}
    echo "submitted $name: job $id" >&2
    SUBMITTED+="${SUBMITTED:+, }$name (job $id)" IDS+=" $id"
  fi
  PREV=$id
}

# A one-task job running a python tool.
tool_job() {
  local name=$1
  shift
  local wrap="" word
  # POSIX single quotes: sbatch runs --wrap under /bin/sh, which reads bash's printf %q forms ($'...') literally
  for word in "$PYTHON" "$@"; do wrap+="'${word//\'/\'\\\'\'}' "; done
  # an 8B conversion holds the model (16 GB in bf16) and more: not the site's default memory
  submit "$name" --job-name="$name" --nodes=1 --ntasks=1 --cpus-per-task=8 --mem=64G --time=04:00:00 \
    --output="slurm-%x-%j.out" --wrap="$wrap"
}

need_convert_tool() {
  [[ -f tools/convert.py ]] && return 0
  ((!DRY)) || { echo "warning: $1 needs tools/convert.py, which is missing" >&2; return 0; }
  nothing_launched "$1 needs tools/convert.py, which is missing"
}

# Resolve (and so validate) every recipe before the first submission.
CPT_RECIPE=recipes/$CPT.yaml
CPT_DIR=$(field "$CPT_RECIPE" checkpoint.dir "${OVERRIDES[@]}")
[[ -n $HF ]] && INIT=$(field "$CPT_RECIPE" checkpoint.init_from "${OVERRIDES[@]}")
LAST_DIR=$CPT_DIR
LAST_RECIPE=("$CPT_RECIPE" "${OVERRIDES[@]}")
if ((SFT)); then
  LAST_RECIPE=("$SFT_RECIPE" "checkpoint.init_from=$CPT_DIR")
  LAST_DIR=$(field "${LAST_RECIPE[@]:0:1}" checkpoint.dir "${LAST_RECIPE[@]:1}")
fi
# No GPUs (CPU nodes): a training job runs only with runtime.device=cpu; its recipe check would refuse cuda after the
# queue wait (and after the jobs before it).
if [[ $GPN == 0 ]]; then
  need_cpu() { # RECIPE JOB FIX [overrides...]
    local device
    device=$(field "$1" runtime.device "${@:4}")
    [[ $device == cpu ]] || nothing_launched "SBATCH_ARGS='${SBATCH_ARGS:-}' asks for no GPUs, but $1 has" \
      "runtime.device = $device (the $2 job would stop at its recipe check); $3, or GPUs per node (--gpus-per-node=N)"
  }
  need_cpu "$CPT_RECIPE" "$CPT" "give the override runtime.device=cpu" "${OVERRIDES[@]}"
  if ((SFT)); then
    need_cpu "$SFT_RECIPE" sft "give --sft-recipe with runtime.device: cpu or --no-sft" "${LAST_RECIPE[@]:1}"
  fi
fi
# The stages' data, before anything is submitted (not on --dry-run): a job would find it missing only after its
# queue wait and the jobs before it.
if ((!DRY)); then
  # the convert and export jobs would find these only after their queue wait (export: after the whole training)
  if [[ -n $HF && ! -f $HF/config.json ]]; then
    nothing_launched "--hf $HF: no config.json there; give the Hugging Face model folder to convert"
  fi
  if [[ -n $HF && -z $INIT ]]; then
    nothing_launched "--hf: the CPT recipe sets no checkpoint.init_from, the folder the convert job writes; give" \
      "checkpoint.init_from=NEW_FOLDER"
  fi
  if [[ -n $HF && -e $INIT ]]; then
    nothing_launched "--hf: the CPT recipe's checkpoint.init_from $INIT exists, and the convert job writes it; leave" \
      "out --hf to start from it, or give checkpoint.init_from=NEW_FOLDER"
  fi
  if [[ -n $EXPORT && -e $EXPORT ]]; then
    nothing_launched "--export $EXPORT: exists, and the export job does not overwrite; give a new folder"
  fi
  # the evaluation jobs refuse an --out holding an earlier run's results (they would find it after the training)
  refuse_earlier_results() { # NAME LENGTHS RESULTS_FILE
    if [[ -n $2 && -e ${LAST_DIR%/}_$1/$3 ]]; then
      nothing_launched "--$1: ${LAST_DIR%/}_$1 holds an earlier evaluation's $3, which the $1 job does not" \
        "overwrite; move or remove that folder first"
    fi
  }
  refuse_earlier_results niah "$NIAH" results.json
  refuse_earlier_results ruler "$RULER" ruler.json
  run_python "checking the CPT stage's data" -m megatron_ext.launch --recipe "$CPT_RECIPE" "${OVERRIDES[@]}" \
    --check-data
  if [[ -n $HF ]]; then
    run_python "checking --hf $HF" -m megatron_ext.launch --recipe "$CPT_RECIPE" "${OVERRIDES[@]}" --check-hf "$HF"
  fi
  if ((SFT)); then
    run_python "checking the SFT stage's data" -m megatron_ext.launch --recipe "${LAST_RECIPE[@]}" --check-data
  fi
fi
# lengths: a list, within the last stage's model.max_position_embeddings
if [[ -n $NIAH ]]; then
  run_python "checking --niah $NIAH" -m megatron_ext.launch_eval --niah "$NIAH" "${LAST_RECIPE[@]}"
fi
if [[ -n $RULER ]]; then
  run_python "checking --ruler $RULER" -m megatron_ext.launch_eval --ruler "$RULER" "${LAST_RECIPE[@]}"
fi
if [[ -n $NIAH || -n $RULER ]]; then
  # The CPT layout holds the longest sequences; evaluation passes need less memory than its training steps.
  TP=$(field "$CPT_RECIPE" parallel.tensor "${OVERRIDES[@]}")
  CP=$(field "$CPT_RECIPE" parallel.context "${OVERRIDES[@]}")
  # Tasks per node: SBATCH_ARGS' GPUs per node where given (they size the training jobs too), else the recipe's
  # processes per node, which on CPU nodes (no GPUs) it is anyway.
  SLOTS=$GPN
  [[ -n $SLOTS && $SLOTS != 0 ]] || SLOTS=$(field "$CPT_RECIPE" cluster.gpus_per_node "${OVERRIDES[@]}")
  # As many tasks per node as divides TP x CP (the job has exactly that many tasks), whole TP groups where that
  # can be (megatron_ext/launch_eval.py tasks_per_node)
  RANKS=$((TP * CP)) PER_NODE=0
  for ((n = (RANKS < SLOTS ? RANKS : SLOTS); n >= 1; n--)); do
    ((RANKS % n == 0)) || continue
    ((PER_NODE)) || PER_NODE=$n
    if ((n % TP == 0)); then PER_NODE=$n; break; fi
  done
  EVAL_GPUS=${GPU_TYPE:+$GPU_TYPE:}$PER_NODE # the GPU type SBATCH_ARGS named kept
  [[ $GPN != 0 ]] || EVAL_GPUS=0
fi
[[ -z $HF ]] || need_convert_tool --hf
[[ -z $EXPORT ]] || need_convert_tool --export

if [[ -n $HF ]]; then
  tool_job convert tools/convert.py to-megatron --hf "$HF" --out "$INIT"
fi
# RECIPE: the one checked above, not one exported in the submitting shell (the job would run that)
submit "$CPT" "RECIPE=$CPT_RECIPE" "slurm/$CPT.sh" "${OVERRIDES[@]}"
((SFT)) && submit sft "RECIPE=$SFT_RECIPE" --export=ALL slurm/sft.sh "checkpoint.init_from=$CPT_DIR"
# eval_job NAME COMMAND [tools/niah.py arguments]: slurm/niah.sh [COMMAND] on the last stage's checkpoint at the CPT
# layout, results in <checkpoint.dir>_NAME/, chat prompts after SFT.
eval_job() {
  local name=$1 command=$2
  shift 2
  local -a args=(${command:+"$command"} --megatron "$LAST_DIR" --tp "$TP" --cp "$CP" "$@" --out "${LAST_DIR%/}_$name"
    --no-progress)
  ((SFT)) && args+=(--chat)
  submit "$name" --job-name="$name" "--nodes=$(((RANKS + PER_NODE - 1) / PER_NODE))" "--ntasks-per-node=$PER_NODE" \
    "--gpus-per-node=$EVAL_GPUS" slurm/niah.sh "${args[@]}"
}
TRAINED=$PREV # the evaluations and the export need the last training stage only
if [[ -n $NIAH || -n $RULER ]]; then
  [[ -n $NIAH ]] && PREV=$TRAINED && eval_job niah "" --lengths "$NIAH" --depths 0:100:10
  [[ -n $RULER ]] && PREV=$TRAINED && eval_job ruler ruler --lengths "$RULER" --tasks all
fi
if [[ -n $EXPORT ]]; then
  PREV=$TRAINED
  tool_job export tools/convert.py to-hf --megatron "$LAST_DIR" --out "$EXPORT"
fi
echo "pipeline: $N job(s), the last training stage $TRAINED" >&2
