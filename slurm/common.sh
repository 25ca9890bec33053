# shellcheck shell=bash
# Shared body of the stage scripts (slurm/cpt_1m.sh, cpt_2m.sh, cpt_4m.sh, sft.sh) and of the evaluation
# script (slurm/niah.sh, `eval_main` at the end); sourced, not run.
#
# One stage = one training run of one recipe. The recipe is the single source of truth for the
# model and the parallel layout; this file only launches it:
#   1. logs the job (git SHA, recipe, overrides, nodes, restart count),
#   2. validates the recipe for this job's size before any worker starts (`megatron_ext.launch
#      --check`: unknown keys, TP x PP x CP not dividing the task count, missing data, GPUs),
#   3. starts one task per GPU with srun (rank/world/rendezvous come from Slurm's env; the
#      trainer reads SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_NODELIST or SLURM_JOB_NODELIST,
#      SLURM_JOB_ID and SLURM_STEP_ID),
#   4. on the warning signal (--signal=B:USR1@T reaches this shell) forwards USR1 to the tasks;
#      the trainer saves a checkpoint and exits with EXIT_REQUEUE, and this script then runs
#      `scontrol requeue`. The requeued job resumes from the latest checkpoint by itself.
#   5. on USR2 (`scancel --batch --signal=USR2 JOBID`: stop the run now, with a save) does the same
#      without the requeue; submitting the job again goes on from that checkpoint.
#
# Environment (all optional):
#   RECIPE            recipe file (default: the stage's recipes/<stage>.yaml)
#   PYTHON            python with megatron_ext's dependencies (default: python)
#   CONTAINER_IMAGE   run the tasks in this container via pyxis (srun --container-image)
#   CONTAINER_MOUNTS  extra pyxis mounts, SRC:DST[,SRC:DST...]; the project folder is always mounted
#   MAX_REQUEUES      stop requeueing after this many restarts (default 50)
#   SRUN_WAIT         seconds the other tasks may run after one ended, then srun ends them (120)
#   TASK_PREFIX       words run before python in each training task (split at spaces), e.g. with the recipe's
#                     profile.tool=nsys: "nsys profile --capture-range=cudaProfilerApi --capture-range-end=stop
#                     -o prof/rank%q{SLURM_PROCID}"
#   NCCL_*, CUDA_DEVICE_MAX_CONNECTIONS, TORCH_NCCL_*  see nccl_defaults below; any value set
#                     in the submitting shell wins (sbatch exports the environment)

EXIT_REQUEUE=3  # megatron_ext.train.EXIT_REQUEUE
EXIT_DIVERGED=4 # megatron_ext.train.EXIT_DIVERGED: NaN/Inf loss, nothing saved, not requeued
PROJECT_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

log() { printf '[%s] %s\n' "$(date -u +%FT%TZ)" "$*"; }
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

# bash_at_least_4_4 MAJOR MINOR: that bash version is 4.4 or newer. Before 4.4 (EL7's 4.2) an
# empty array under `set -u` is an error ("args[@]: unbound variable", e.g. a stage submitted without overrides),
# which these scripts would hit halfway through a job: they stop at once instead.
bash_at_least_4_4() {
  local major=$1 minor=$2
  ((major > 4 || (major == 4 && minor >= 4)))
}
bash_at_least_4_4 "${BASH_VERSINFO[0]}" "${BASH_VERSINFO[1]}" || die "slurm/*.sh need bash >= 4.4, this is bash $BASH_VERSION; put a newer bash first in PATH" \
  "(a module, or conda install bash) before sbatch or bash slurm/pipeline.sh; nothing launched"

# NCCL / InfiniBand defaults for multi-node H100 jobs; every one can be overridden by exporting it
# before sbatch. Interface and HCA names are cluster-specific and left to NCCL's detection unless
# the user sets NCCL_SOCKET_IFNAME / NCCL_IB_HCA.
nccl_defaults() {
  # Megatron: one hardware queue keeps TP/CP communication kernels in launch order.
  export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
  export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
  # IB retry timeout 4.096us * 2^22 ~ 17 s: rides out short fabric hiccups on large jobs.
  export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-22}
  # Fail a stuck collective instead of hanging the whole allocation until the time limit.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
}

# Sets the array LAUNCH: the srun command line for N tasks (default: the whole allocation).
build_launcher() {
  # Not --kill-on-bad-exit: a rank that returns EXIT_REQUEUE first would get the others killed
  # while they finish, and srun would report their signal instead of EXIT_REQUEUE. --wait bounds
  # how long the others may run on after any task ended (a crashed rank does not hang the job).
  # --export=ALL: under sbatch --export=NONE srun would inherit SLURM_EXPORT_ENV=NONE and drop what this script
  # exports (PYTHONPATH, NCCL_*, OMP_NUM_THREADS).
  LAUNCH=(srun --kill-on-bad-exit=0 "--wait=${SRUN_WAIT:-120}" --export=ALL --unbuffered)
  # Since Slurm 22.05 srun does not inherit --cpus-per-task from the job.
  [[ -n ${SLURM_CPUS_PER_TASK:-} ]] && LAUNCH+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
  if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    local mounts="$PROJECT_ROOT:$PROJECT_ROOT"
    # the tasks run in the submit folder (relative recipe paths are read from there): mounted too when outside
    [[ $PWD == "$PROJECT_ROOT" || $PWD == "$PROJECT_ROOT"/* ]] || mounts+=",$PWD:$PWD"
    [[ -n ${CONTAINER_MOUNTS:-} ]] && mounts+=",$CONTAINER_MOUNTS"
    LAUNCH+=("--container-image=$CONTAINER_IMAGE" "--container-mounts=$mounts"
      "--container-workdir=$PWD")
  fi
}

# log_job WHAT [ARGS...]: the job's first lines. WHAT is `overrides` (a stage: $RECIPE, then ARGS, its overrides) or
# `tools/niah.py arguments` (an evaluation: ARGS; a RECIPE the submitting shell exported is not what it runs).
log_job() {
  local what=$1 sha
  shift
  sha=$(git -C "$PROJECT_ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  if [[ $sha != unknown ]] && ! git -C "$PROJECT_ROOT" diff --quiet HEAD -- 2>/dev/null; then
    sha+="-dirty"
  fi
  log "job ${SLURM_JOB_ID:-none} (${SLURM_JOB_NAME:-}) restart ${SLURM_RESTART_COUNT:-0}"
  log "git $sha in $PROJECT_ROOT"
  local paths="in the recipe"
  [[ $what == overrides ]] || paths="in the arguments"
  [[ . -ef $PROJECT_ROOT ]] || log "working directory $PWD: relative paths $paths are taken from here"
  [[ $what != overrides ]] || log "recipe $RECIPE"
  log "$what: ${*:-(none)}"
  log "nodes ${SLURM_JOB_NODELIST:-?} (${SLURM_JOB_NUM_NODES:-?}), tasks ${SLURM_NTASKS:-?}," \
    "gpus/node ${SLURM_GPUS_ON_NODE:-0}, python $PYTHON${CONTAINER_IMAGE:+, container $CONTAINER_IMAGE}"
  [[ -z ${TASK_PREFIX:-} ]] || log "task prefix: $TASK_PREFIX"
}

# nothing_launched MESSAGE...: end the job with one line, MESSAGE and that nothing was launched (a full stop at its
# end dropped). The preflight's errors read like the ones a started trainer prints in each task: this tells them apart.
nothing_launched() {
  local message="$*"
  die "${message%.}; nothing launched"
}

# check_python_found: end the job with one line when PYTHON is no program on this host (srun would say so once per
# task, then once more itself).
check_python_found() {
  command -v "$PYTHON" >/dev/null ||
    nothing_launched "PYTHON=$PYTHON: no such program; export PYTHON=/path/to/venv/bin/python before sbatch"
}

# check_python: end the job with one line when PYTHON is not a python with megatron_ext's dependencies (the
# default `python` of a compute node often is the system one): what made the check above fail with a traceback.
check_python() {
  check_python_found
  # found, not imported (~8 s of CPU); launch --check looks for them the same way
  "$PYTHON" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ("torch", "megatron.core", "yaml")))' 2>/dev/null ||
    nothing_launched "PYTHON=$PYTHON cannot import torch, megatron.core and yaml; export PYTHON=/path/to/venv/bin/python" \
      "(the environment megatron_ext is installed in) before sbatch"
}

# srun's own lines on a task that ended badly ("srun: error: node1: task 0: Exited with exit code 1", and the step's
# ending): where the check said why, they repeat it.
SRUN_TASK_END='^srun: (error: [^ ]+: tasks? [0-9,-]+: |(launch/slurm: )?_step_signal: Terminating )'

# Fail before any worker starts: the recipe, overrides, data and checkpoint paths must be good
# for this many tasks.
preflight() {
  local per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}
  per_node=${per_node%%[(,]*} # "8(x32)" -> 8
  local -a check=("$PYTHON" -m megatron_ext.launch --check --recipe "$RECIPE"
    --world-size "$SLURM_NTASKS" --tasks-per-node "$per_node"
    --gpus-per-node "${SLURM_GPUS_ON_NODE:-0}" --claim)
  if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    local help # captured first: `srun --help | grep -q` can fail under pipefail (SIGPIPE)
    help=$(srun --help 2>&1 || true)
    [[ $help == *--container-image* ]] ||
      nothing_launched "CONTAINER_IMAGE is set but srun has no --container-image (pyxis is not installed); unset it" \
        "or install pyxis"
  fi
  # The check's stderr is held back until it ends: where it failed, one line says why (its own, or check_python's).
  local err said last rc=0
  err=$(mktemp) || nothing_launched "mktemp failed (TMPDIR=${TMPDIR:-/tmp})"
  if [[ -n ${CONTAINER_IMAGE:-} ]]; then
    container_check "$@" 2>"$err" || rc=$?
  else
    # bash's own notice of a killed check ("common.sh: line N: PID Killed ...") to /dev/null: the line below says so
    { "${check[@]}" "$@" 2>"$err"; } 2>/dev/null || rc=$?
  fi
  said=$(<"$err")
  rm -f -- "$err"
  if ((rc == 0)); then
    [[ -z $said ]] || printf '%s\n' "$said" >&2 # warnings
    return 0
  fi
  # the python itself (no such program, no torch): that line, not the traceback or 'No such file' it caused
  [[ -n ${CONTAINER_IMAGE:-} ]] || check_python
  local told line
  told=$(grep -Ev "$SRUN_TASK_END" <<<"$said" || true)
  # PYTHON not in the image: slurmstepd's "slurmstepd[-NODE]: error: execve(): PYTHON: WHY" and srun's line
  while IFS= read -r line; do
    if [[ -n ${CONTAINER_IMAGE:-} && $line == slurmstepd*": error: execve(): $PYTHON: "* ]]; then
      nothing_launched "PYTHON=$PYTHON cannot be run in the container CONTAINER_IMAGE=$CONTAINER_IMAGE" \
        "(${line#*": error: execve(): $PYTHON: "}); export PYTHON=/path/to/python of the image's environment with" \
        "megatron_ext's dependencies before sbatch"
    fi
  done <<<"$told"
  last=${told##*$'\n'}
  if ((rc == 1)) && [[ $last == "error: "* ]]; then # the check's (or container_check's) own one line
    [[ $told != *$'\n'* ]] || printf '%s\n' "${told%$'\n'*}" >&2
    nothing_launched "${last#error: }"
  fi
  if ((rc == 2)) && [[ $last =~ ^python\ -m\ megatron_ext\.launch:\ error:\ (.*)$ ]]; then # argparse; its usage dropped
    nothing_launched "${BASH_REMATCH[1]} (give the script recipe overrides, dotted.key=value)"
  fi
  # a crash (a traceback, a killed process): what it and srun printed, then one line that nothing was launched
  [[ -z $said ]] || printf '%s\n' "$said" >&2
  local how="failed with exit $rc" signal
  if ((rc > 128)) && signal=$(kill -l $((rc - 128)) 2>/dev/null); then how="was killed by SIG$signal (exit $rc)"; fi
  nothing_launched "the recipe check ($PYTHON -m megatron_ext.launch --check) $how${said:+; its output is above}"
}

# host_job_state ID: the state squeue on this (batch) host gives for job ID, as `launch --owner-state ID=STATE` takes
# it: RUNNING, PENDING, COMPLETED...; nothing where Slurm no longer lists the job (it has ended); `UNKNOWN (why)`
# where squeue cannot say (megatron_ext.slurm_jobs.job_state does the same where squeue is at hand).
host_job_state() {
  local out err why rc=0
  err=$(mktemp)
  out=$(timeout 60 squeue -h -j "$1" -o %T 2>"$err") || rc=$?
  why=$(tr -s '[:space:]' ' ' <"$err")
  rm -f -- "$err"
  why=${why% }
  if ((rc == 0)); then
    printf '%s' "${out%%$'\n'*}"
  elif [[ ${why,,} == *"invalid job id"* ]]; then
    : # Slurm has forgotten the job: ended
  elif ((rc == 124)); then
    printf 'UNKNOWN (squeue on the batch host did not answer in 60 s)'
  else
    printf 'UNKNOWN (squeue on the batch host: %s)' "${why:-exit $rc}"
  fi
}

# container_check [overrides]: the preflight's check (its array `check`) as one task in the container. Slurm's
# commands are rarely in the image, so there the check cannot learn whether the job that last wrote checkpoint.dir
# (its .slurm_job) has ended: with --host-squeue it then ends with EXIT_ASK_HOST (5) and a last line
# `claim-owner-unknown: ID`, this shell asks squeue here, and the check runs again with --owner-state ID=STATE (an
# ended job's claim is taken over, a live one refused, an unknown one refused as before). Bounded: the claim may
# change hands between two runs.
container_check() {
  local -a told=()
  local out rc last owner state round
  for round in 1 2 3; do
    rc=0
    out=$("${LAUNCH[@]}" --nodes=1 --ntasks=1 "${check[@]}" --host-squeue "${told[@]}" "$@") || rc=$?
    last=${out##*$'\n'}
    if ((rc != 5)) || [[ ! $last =~ ^claim-owner-unknown:\ ([0-9]+)$ ]]; then
      [[ -z $out ]] || printf '%s\n' "$out"
      return "$rc"
    fi
    owner=${BASH_REMATCH[1]}
    state=$(host_job_state "$owner")
    log "checkpoint.dir was last claimed by Slurm job $owner, which squeue cannot be asked about in the container;" \
      "on the batch host it is ${state:-no longer listed (ended)}"
    told+=(--owner-state "$owner=$state")
  done
  printf '%s\n' "${out%$'\n'*}"
  echo "error: the claim of checkpoint.dir changed hands $round times while this job checked it; submit again" >&2
  return 1
}

# A MASTER_ADDR exported in the submitting shell (sbatch passes the environment on; torchrun habits, or one left
# from an earlier interactive job) wins over the job's first node in megatron_ext.runtime. Rank 0 (on the job's
# first node) listens for the rendezvous; any other address leaves every rank waiting on a host where nobody
# listens until the process-group timeout (runtime.timeout_minutes, 30): stop now instead. Accepted: loopback on
# one node, and the first node by its name, a name it starts (gpu004-ib0, gpu004.cluster) or one of its addresses.
# RANK, WORLD_SIZE, ... from a submitting shell that itself ran under torchrun or submitit would win over Slurm's
# too (torchrun inside a job), and every task would be the same rank: a silent hang. The tasks here are srun's.
check_rendezvous() {
  local v leaked=()
  for v in RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK; do
    if [[ -n ${!v+x} ]]; then leaked+=("$v"); unset "$v"; fi
  done
  ((${#leaked[@]} == 0)) || echo "note: unset ${leaked[*]} from the submitting shell; each task's rank comes from Slurm" >&2
  [[ -n ${MASTER_ADDR:-} ]] || return 0
  if [[ $MASTER_ADDR =~ ^(localhost|127\.|::1$) ]]; then
    ((${SLURM_JOB_NUM_NODES:-1} == 1)) ||
      nothing_launched "MASTER_ADDR=$MASTER_ADDR (from the submitting shell) on a ${SLURM_JOB_NUM_NODES}-node job:" \
        "the other nodes cannot reach it; unset MASTER_ADDR before sbatch (the job's first node is used)"
    return 0
  fi
  local first
  first=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | head -n 1) || true
  [[ -n $first ]] || return 0 # cannot tell
  case $MASTER_ADDR in "$first" | "$first".* | "$first"-*) return 0 ;; esac
  if getent ahosts "$first" 2>/dev/null | awk '{print $1}' | grep -qxF -- "$MASTER_ADDR"; then return 0; fi
  nothing_launched "MASTER_ADDR=$MASTER_ADDR (from the submitting shell) is not this job's first node $first, where" \
    "rank 0 listens for the other ranks; unset MASTER_ADDR before sbatch (the first node is used)"
}

# wait_step PID: wait for the srun step PID; its exit status in STEP_RC. `wait` returns early (> 128) when a
# trap ran: while srun still runs, wait again; when srun ended during the trap, that status is the signal's, and
# a second `wait` gives srun's own (bash 5.2 keeps it; 127 where a shell has forgotten the pid: keep the first).
wait_step() {
  while :; do
    STEP_RC=0
    wait "$1" || STEP_RC=$?
    if ((STEP_RC > 128)); then
      if kill -0 "$1" 2>/dev/null; then continue; fi
      local again=0
      wait "$1" 2>/dev/null || again=$?
      ((again == 127)) || STEP_RC=$again
    fi
    return 0
  done
}

# requeue_job PREFIX SUFFIX: `scontrol requeue` this job (up to MAX_REQUEUES restarts), logging
# "PREFIXrequeueing job ID (restart N)SUFFIX", and end the batch shell.
requeue_job() {
  local restarts=${SLURM_RESTART_COUNT:-0}
  ((restarts < ${MAX_REQUEUES:-50})) || die "not requeueing: $restarts restarts (MAX_REQUEUES)"
  log "${1}requeueing job $SLURM_JOB_ID (restart $((restarts + 1)))${2}"
  local why=""
  # scontrol's own error held back: one line says what failed and what to do
  if ! why=$(scontrol requeue "$SLURM_JOB_ID" 2>&1 >/dev/null); then
    why=${why//$'\n'/ }
    die "scontrol requeue $SLURM_JOB_ID failed (${why:-no message}): not requeued; submit the job again to go on" \
      "from where this one stopped"
  fi
  exit 0
}

# note_signal SIGNAL: remember the signal for after the tasks end; a USR2 stop stays one (a time-limit USR1 that
# comes while the tasks save must not turn it into a requeue).
note_signal() {
  [[ ${SIGNALLED:-} == USR2 ]] || SIGNALLED=$1
  SIGNAL_AT=$SECONDS
}

# on_signal SIGNAL: ask the tasks to save and exit (TERM and USR1 as they came; USR2, the stop without a requeue,
# as USR1).
on_signal() {
  note_signal "$1"
  local task_signal=$1 note=""
  if [[ $1 == USR2 ]]; then task_signal=USR1 note=" (stop requested: the job will not be requeued)"; fi
  log "received $1: asking the tasks to save a checkpoint and exit$note"
  scancel --signal="$task_signal" "$SLURM_JOB_ID" || log "scancel --signal=$task_signal failed"
}

# slurm_seconds TIME: squeue's time ([D-]H:MM:SS or M:SS) in seconds; nothing for UNLIMITED or anything else.
slurm_seconds() {
  [[ $1 =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]] || return 0
  echo $(((10#${BASH_REMATCH[2]:-0} * 24 + 10#${BASH_REMATCH[4]:-0}) * 3600 + 10#${BASH_REMATCH[5]} * 60 + 10#${BASH_REMATCH[6]}))
}

# cancelled_by_user: the TERM this job got came from scancel, not from its time limit or a preemption (Slurm
# says which). Unknown counts as cancelled: a job its user cancelled must not come back by itself.
cancelled_by_user() {
  local reason state
  reason=$(squeue -h -j "$SLURM_JOB_ID" -o %r 2>/dev/null || true)
  [[ $reason == TimeLimit || $reason == Preempt* ]] && return 1
  state=$(sacct -X -n -P -j "$SLURM_JOB_ID" -o State 2>/dev/null || true)
  [[ $state == TIMEOUT* || $state == PREEMPTED* ]] && return 1
  return 0
}

# chain_cancelled: where pending jobs wait for this one to succeed (`--dependency=afterok`, as slurm/pipeline.sh and
# `launch --stages` chain the stages), a line saying that Slurm cancels them when this job ends without success
# (--kill-on-invalid-dep), so that a stop or a cancel is not mistaken for the end of one stage alone; nothing where
# none waits or squeue cannot say.
chain_cancelled() {
  local id dependency waiting=()
  while read -r id dependency; do
    [[ ,$dependency, =~ [,?]afterok:([0-9_]+:)*${SLURM_JOB_ID}[:\(,] ]] && waiting+=("$id")
  done < <(timeout 30 squeue -h -t PENDING -o '%i %E' 2>/dev/null || true)
  ((${#waiting[@]})) || return 0
  log "job(s) ${waiting[*]} wait for this one to succeed (afterok) and are cancelled by Slurm: once this stage is" \
    "done, submit the later stages again (slurm/pipeline.sh or launch --stages with the stages left)"
}

# warned_at_start: the USR1 came in the first half of the job's time limit. When that USR1 is the time-limit
# warning (--signal=B:USR1@S with S too close to --time) every requeued run gets it as early: requeueing loops.
warned_at_start() {
  local limit
  limit=$(slurm_seconds "$(squeue -h -j "$SLURM_JOB_ID" -o %l 2>/dev/null || true)")
  [[ -n $limit ]] && ((2 * ${SIGNAL_AT:-0} < limit))
}

# run_finished [overrides]: the checkpoint of $RECIPE is at train.steps (the preflight's own report), so a USR1 that
# killed the tasks (exit 138) came while they were exiting after the last save, not before training.
# With CONTAINER_IMAGE it asks in the container, as the preflight does (the batch host's python may lack torch).
run_finished() {
  local out
  local -a check=("$PYTHON" -m megatron_ext.launch --check --recipe "$RECIPE" --world-size "$SLURM_NTASKS" "$@")
  [[ -z ${CONTAINER_IMAGE:-} ]] || check=("${LAUNCH[@]}" --nodes=1 --ntasks=1 "${check[@]}")
  out=$("${check[@]}" 2>/dev/null) || return 1
  [[ $out == *"checkpoint: nothing to train"* ]]
}

# help_if_asked ARGS...: an -h or --help among the script's arguments prints its header and ends it: not the help of
# the python it runs (on every task of a job that then does nothing), and outside a job too.
help_if_asked() {
  local arg
  for arg in "$@"; do
    if [[ $arg == -h || $arg == --help ]]; then sed -n '2,/^#SBATCH/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
  done
}

# stage_main STAGE [dotted.key=value ...]: run recipes/STAGE.yaml (or $RECIPE) with the overrides.
stage_main() {
  set -euo pipefail
  RECIPE=${RECIPE:-$PROJECT_ROOT/recipes/$1.yaml}
  shift
  help_if_asked "$@"
  PYTHON=${PYTHON:-python}
  [[ -n ${SLURM_JOB_ID:-} ]] || nothing_launched "run this with sbatch (no SLURM_JOB_ID), e.g. sbatch $0"
  [[ -f $RECIPE ]] || nothing_launched "recipe $RECIPE not found; set RECIPE=path/to/recipe.yaml"
  export PYTHONPATH="$PROJECT_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  nccl_defaults
  build_launcher
  log_job overrides "$@"
  # Trapped from here on: an early warning signal must not kill this shell (bash's default).
  trap 'note_signal USR1' USR1
  trap 'note_signal TERM' TERM
  trap 'note_signal USR2' USR2
  check_rendezvous
  preflight "$@"
  if [[ ${SIGNALLED:-} == USR2 ]]; then
    log "received USR2 (stop) before training started: nothing to save; not requeued"
    chain_cancelled
    exit "$EXIT_REQUEUE"
  fi

  local -a prefix=()
  read -ra prefix <<<"${TASK_PREFIX:-}"
  "${LAUNCH[@]}" "${prefix[@]}" "$PYTHON" -m megatron_ext.train --recipe "$RECIPE" "$@" &
  local pid=$! rc
  trap 'on_signal USR1' USR1
  trap 'on_signal TERM' TERM
  trap 'on_signal USR2' USR2
  # A signal that came during the preflight goes to the tasks now.
  [[ -n ${SIGNALLED:-} ]] && on_signal "$SIGNALLED"
  wait_step "$pid"
  rc=$STEP_RC
  trap - USR1 TERM USR2
  log "training exited with $rc"
  if ((rc == EXIT_DIVERGED)); then
    log "training diverged (the error line above names the step); not requeued: the newest checkpoint is from before"
  fi
  if [[ ${SIGNALLED:-} == USR2 ]]; then
    ((rc == EXIT_REQUEUE)) && log "stopped on request (USR2): checkpoint saved; not requeued; submitting the same" \
      "job again resumes from it"
    ((rc == EXIT_REQUEUE)) || log "stopped on request (USR2): not requeued (exit $rc)"
    ((rc == 0)) || chain_cancelled
    exit "$rc"
  fi
  if ((rc == EXIT_REQUEUE)) && [[ ${SIGNALLED:-} == TERM ]] && cancelled_by_user; then
    log "job cancelled (scancel): not requeued; submitting the same job again resumes from the checkpoint"
    chain_cancelled
    exit "$rc"
  fi
  ((rc == EXIT_REQUEUE)) && requeue_job "checkpoint saved; " ""
  # 128 + 10: the tasks got USR1 before the trainer's handler was installed (still starting up), so nothing
  # was saved; a requeued run resumes from the previous checkpoint, unless it would be warned as early.
  if [[ ${SIGNALLED:-} == USR1 && $rc -eq 138 ]]; then
    if run_finished "$@"; then
      log "the run had reached train.steps: USR1 came while the tasks were exiting; done"
      exit 0
    fi
    warned_at_start && die "USR1 came ${SIGNAL_AT}s into the job, before training started, and a requeued job" \
      "would get it as early (if it is the time-limit warning, --signal=B:USR1@S comes S seconds before" \
      "--time): not requeued; submit again with a longer --time"
    requeue_job "nothing saved (USR1 came before training started); " ", resuming from the previous checkpoint"
  fi
  exit "$rc"
}

# eval_main [tools/niah.py arguments]: NIAH (or `ruler ...`, `ppl ...`, `generate ...`) of a Megatron checkpoint
# with --engine megatron on every task of the job. Each task reads its rank from Slurm's env; rank 0 writes the
# results and the log. A NIAH grid or RULER run saves its results after each length (and task) and every minute;
# on the warning signal (USR1) before the time limit this script stops the tasks and requeues the job, and the
# requeued job adds --resume, so it runs only the cells its results lack. ppl and generate run to the end.
stop_evaluation() {
  SIGNALLED=USR1 SIGNAL_AT=$SECONDS
  log "received USR1: stopping the evaluation (its results file keeps what is done)"
  scancel --signal=TERM "$SLURM_JOB_ID" || log "scancel --signal=TERM failed"
}

# results_stamp ARGS...: a checksum of the results file in tools/niah.py's --out folder (results.json; ruler.json
# for `ruler`, megatron_ext/launch_eval.py EVALUATIONS), or nothing.
results_stamp() {
  local out="" prev="" file=results.json
  [[ ${1:-} == ruler ]] && file=ruler.json
  for a in "$@"; do
    [[ $prev == --out ]] && out=$a
    [[ $a == --out=* ]] && out=${a#--out=}
    prev=$a
  done
  if [[ -n $out ]]; then cksum 2>/dev/null <"$out/$file" || true; fi
}

eval_main() {
  set -euo pipefail
  help_if_asked "$@"
  PYTHON=${PYTHON:-python}
  [[ -n ${SLURM_JOB_ID:-} ]] ||
    nothing_launched "run this with sbatch (no SLURM_JOB_ID), e.g. sbatch $0 --megatron CKPT --cp 8 --out DIR"
  (($# > 0)) || nothing_launched "give tools/niah.py arguments, e.g. sbatch $0 --megatron checkpoints/cpt_1m --cp 8" \
    "--lengths 1M --out runs/niah_1m"
  # in the container only srun can tell; here, one line instead of one from every task and one from srun
  [[ -n ${CONTAINER_IMAGE:-} ]] || check_python_found
  export PYTHONPATH="$PROJECT_ROOT${PYTHONPATH:+:$PYTHONPATH}"
  nccl_defaults
  build_launcher
  local args=("$@") grid=1
  [[ $1 == ppl || $1 == generate ]] && grid=0
  if ((grid)) && ((${SLURM_RESTART_COUNT:-0} > 0)) && [[ " $* " != *" --resume "* ]]; then
    args+=(--resume)
  fi
  log_job "tools/niah.py arguments" "${args[@]}"
  check_rendezvous
  local saved_before
  saved_before=$(results_stamp "${args[@]}")
  trap 'SIGNALLED=USR1' USR1 # bash's default for USR1 would end this shell
  "${LAUNCH[@]}" "$PYTHON" "$PROJECT_ROOT/tools/niah.py" "${args[@]}" --engine megatron &
  local pid=$! rc
  if ((grid)); then
    trap stop_evaluation USR1
    [[ -n ${SIGNALLED:-} ]] && stop_evaluation # the signal came while srun was starting
  fi
  wait_step "$pid"
  rc=$STEP_RC
  trap - USR1
  log "evaluation exited with $rc"
  if ((grid)) && [[ ${SIGNALLED:-} == USR1 ]] && ((rc != 0)); then
    # Warned as it started and nothing saved: a requeued job would be warned as early, again and again.
    if warned_at_start && [[ $(results_stamp "${args[@]}") == "$saved_before" ]]; then
      die "USR1 came ${SIGNAL_AT}s into the job and no results were saved since it started; a requeued job would" \
        "be warned as early (--signal=B:USR1@S comes S seconds before --time): not requeued; submit again with a" \
        "longer --time (and --resume)"
    fi
    requeue_job "" "; it goes on with --resume"
  fi
  exit "$rc"
}
