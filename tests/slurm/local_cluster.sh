#!/usr/bin/env bash
# A real Slurm cluster on this one host, for the project's tests and CI (Debian, root).
#
#   bash tests/slurm/local_cluster.sh start     # install if needed, configure, start; prints READY
#   bash tests/slurm/local_cluster.sh stop      # stop the daemons this script started
#   bash tests/slurm/local_cluster.sh status
#
# Debian's slurmctld/slurmd/slurm-client (+ slurmdbd and a private MariaDB, so that `sacct` works,
# which submitit needs to see jobs that died without a result) run as plain background processes:
# no systemd, no munge (auth/none), no cgroups. One host poses as NODES nodes (node1..nodeN, one
# slurmd each on its own port; Debian builds Slurm with --enable-multiple-slurmd).
#
# Exit codes: 0 ready; 2 Slurm cannot run here (not root, no apt-get/dpkg, install failed) with
# the reason on stderr, so callers can skip; 1 any other failure (the log tail is printed).
#
# Settings (environment):
#   SLURM_LOCAL_DIR=/tmp/megatron_ext_slurm   state, spool, logs, pid files, database
#   SLURM_LOCAL_NODES=2                       number of nodes
#   SLURM_LOCAL_CPUS=4                        CPUs each node advertises (may exceed the real cores)
#   SLURM_LOCAL_TIMEOUT=60                    seconds allowed for each readiness wait
# Why the less usual settings: `sbatch --wait` polls after 2 s, then doubles the wait while it is below
# MinJobAge/2, up to 32 s (Slurm's default MinJobAge=300: 2, 4, 8, 16, 32, 32 ... s); MinJobAge=4 polls every 2 s; batch_sched_delay=0,sched_min_interval=0 start a
# job in well under a second instead of ~3 s; UnkillableStepTimeout=180 (default 60) because on a
# loaded 2-core host a torch job can take over a minute to die, and Slurm then drains the node
# ("Kill task failed") until someone resumes it; `start` resumes such nodes.
set -euo pipefail

DIR=${SLURM_LOCAL_DIR:-/tmp/megatron_ext_slurm}
NODES=${SLURM_LOCAL_NODES:-2}
CPUS=${SLURM_LOCAL_CPUS:-4}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
DBD_CONF=/etc/slurm/slurmdbd.conf
TAG="# written by megatron_ext tests/slurm/local_cluster.sh"
CTLD_PORT=6817 DBD_PORT=6819 DB_PORT=6820 NODE_PORT0=6821
PACKAGES=(slurmctld slurmd slurm-client slurmdbd mariadb-server)

say() { echo "local_cluster: $*" >&2; }
unsupported() { say "cannot run Slurm here: $*"; exit 2; }
fail() {
  say "error: $1"
  [[ -n ${2:-} && -f $2 ]] && tail -n 25 "$2" >&2
  exit 1
}

# pid_alive PIDFILE: the process named in PIDFILE runs and is not a zombie (PID 1 here may be
# slow to reap, and `kill -0` calls a zombie alive).
pid_alive() {
  local pid state
  [[ -s $1 ]] || return 1
  pid=$(<"$1")
  [[ -r /proc/$pid/stat ]] || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) || return 1
  [[ $state != Z ]]
}

# wait_until DESCRIPTION LOG COMMAND...: retry COMMAND until it succeeds or TIMEOUT passes.
wait_until() {
  local what=$1 log=$2 deadline=$((SECONDS + TIMEOUT))
  shift 2
  until "$@" >/dev/null 2>&1; do
    ((SECONDS < deadline)) || fail "$what not ready after ${TIMEOUT}s" "$log"
    sleep 0.2
  done
}

stop_pidfile() {
  local file=$1 pid i
  pid_alive "$file" || { rm -f "$file"; return 0; }
  pid=$(<"$file")
  kill -TERM "$pid" 2>/dev/null || true
  for ((i = 0; i < 50; i++)); do pid_alive "$file" || break; sleep 0.2; done
  pid_alive "$file" && kill -KILL "$pid" 2>/dev/null
  rm -f "$file"
}

install_packages() {
  local missing=() p policy_made=0 t0=$SECONDS
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  command -v apt-get >/dev/null || unsupported "Slurm is not installed and there is no apt-get"
  say "installing ${missing[*]} with apt-get"
  # Keep package scripts from starting system services (MariaDB on 3306, slurmd via init.d).
  if [[ ! -e /usr/sbin/policy-rc.d ]]; then
    printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod 755 /usr/sbin/policy-rc.d && policy_made=1
  fi
  local apt=(apt-get install -y -q --no-install-recommends "${missing[@]}")
  if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >"$DIR/log/apt.log" 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$DIR/log/apt.log" 2>&1 || true
    if ! DEBIAN_FRONTEND=noninteractive "${apt[@]}" >>"$DIR/log/apt.log" 2>&1; then
      ((policy_made)) && rm -f /usr/sbin/policy-rc.d
      tail -n 5 "$DIR/log/apt.log" >&2
      unsupported "apt-get install ${missing[*]} failed (log: $DIR/log/apt.log)"
    fi
  fi
  ((policy_made)) && rm -f /usr/sbin/policy-rc.d
  say "installed in $((SECONDS - t0)) s"
}

# The shellcheck linter for tests/slurm/test_shell.py (the batch scripts' quoting): best effort, as its tests skip
# without it; a failed install is only said, never the cluster's failure.
install_shellcheck() {
  command -v shellcheck >/dev/null && return 0
  local apt=(apt-get install -y -q --no-install-recommends shellcheck) t0=$SECONDS
  if DEBIAN_FRONTEND=noninteractive "${apt[@]}" >>"$DIR/log/apt.log" 2>&1 \
    || { DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$DIR/log/apt.log" 2>&1 \
         && DEBIAN_FRONTEND=noninteractive "${apt[@]}" >>"$DIR/log/apt.log" 2>&1; }; then
    say "installed shellcheck in $((SECONDS - t0)) s"
  else
    say "shellcheck not installed (log: $DIR/log/apt.log): tests/slurm/test_shell.py's shellcheck tests skip"
  fi
}

write_configs() {
  local host mem cpus_line
  host=$(hostname -s)
  mem=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
  cpus_line="CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$mem"
  mkdir -p /etc/slurm "$DIR"/{state,spool,log,run,etc}
  cat >"$DIR/etc/slurm.conf" <<EOF
$TAG
ClusterName=megatronext
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
MinJobAge=4
KillWait=5
UnkillableStepTimeout=180
ReturnToService=2
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=node[1-$NODES] NodeHostname=$host NodeAddr=127.0.0.1 Port=[$NODE_PORT0-$((NODE_PORT0 + NODES - 1))] $cpus_line
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
  cat >"$DIR/etc/slurmdbd.conf" <<EOF
$TAG
AuthType=auth/none
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=megatron_ext
StorageLoc=slurm_acct_db
EOF
  # Every client (sbatch, srun inside jobs, submitit's sacct) reads /etc/slurm. A file this script
  # did not write is kept aside. Returns 0 when the installed configuration changed.
  local changed=1 f
  for f in slurm.conf slurmdbd.conf; do
    if [[ -f /etc/slurm/$f ]] && ! grep -qF "$TAG" "/etc/slurm/$f"; then
      mv "/etc/slurm/$f" "/etc/slurm/$f.orig.$(date +%s)"
    fi
    if ! cmp -s "$DIR/etc/$f" "/etc/slurm/$f"; then
      cp "$DIR/etc/$f" "/etc/slurm/$f.tmp" && mv "/etc/slurm/$f.tmp" "/etc/slurm/$f"
      changed=0
    fi
  done
  chmod 600 "$DBD_CONF"
  return "$changed"
}

add_hosts_line() {
  local names="" i
  for ((i = 1; i <= NODES; i++)); do
    getent hosts "node$i" >/dev/null || names+=" node$i"
  done
  [[ -z $names ]] && return 0
  # Rewritten in place (not replaced), so a bind-mounted /etc/hosts works too.
  local tmp
  tmp=$(grep -v "# megatron_ext local_cluster" /etc/hosts || true)
  printf '%s\n127.0.0.1%s # megatron_ext local_cluster\n' "$tmp" "$names" >/etc/hosts
}

start_mariadb() {
  local sock=$DIR/run/mysqld.sock
  if ! pid_alive "$DIR/run/mysqld.pid"; then
    if [[ ! -d $DIR/mysql/mysql ]]; then
      mariadb-install-db --no-defaults --user=root --datadir="$DIR/mysql" --skip-test-db \
        --auth-root-authentication-method=socket >"$DIR/log/mariadb-install.log" 2>&1 ||
        fail "mariadb-install-db failed" "$DIR/log/mariadb-install.log"
    fi
    # 9>&-: the daemons must not inherit the lock, or the next caller waits for them forever.
    setsid mariadbd --no-defaults --user=root --datadir="$DIR/mysql" --socket="$sock" \
      --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/run/mysqld.pid" \
      --log-error="$DIR/log/mariadb.log" --innodb-buffer-pool-size=1024M \
      </dev/null >/dev/null 2>&1 9>&- &
  fi
  wait_until MariaDB "$DIR/log/mariadb.log" mariadb --no-defaults -S "$sock" -u root -e "SELECT 1"
  mariadb --no-defaults -S "$sock" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'megatron_ext';
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'megatron_ext';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
    fail "could not create the slurm database user" "$DIR/log/mariadb.log"
}

# resume_drained_nodes: a node drained by an earlier run (a "Kill task failed" under load) takes no
# jobs until resumed; ReturnToService=2 brings back only DOWN nodes (on their next registration).
resume_drained_nodes() {
  local nodes
  nodes=$(sinfo -h -N -t drain -o "%N" 2>/dev/null | sort -u | paste -sd, -)
  [[ -n $nodes ]] || return 0
  say "resuming $nodes (drained: $(sinfo -h -R -o '%E' 2>/dev/null | sort -u | paste -sd';' -))"
  scontrol update nodename="$nodes" state=resume 2>/dev/null || true
}

node_states_idle() {
  local out
  out=$(sinfo -h -N -o "%N %t") || return 1
  [[ $(grep -c . <<<"$out") -eq $NODES ]] && ! grep -vqE " (idle|alloc|mix)$" <<<"$out"
}

start() {
  [[ $(id -u) -eq 0 ]] || unsupported "not root (the daemons, /etc/slurm and /etc/hosts need root)"
  command -v dpkg-query >/dev/null || unsupported "not a Debian system (no dpkg-query)"
  mkdir -p "$DIR"/{state,spool,log,run,etc}
  exec 9>"$DIR/lock"
  flock 9
  local t0=$SECONDS i restarted=0
  install_packages
  command -v apt-get >/dev/null && install_shellcheck
  if write_configs; then
    say "configuration changed: restarting the Slurm daemons"
    stop_slurm
  fi
  add_hosts_line
  start_mariadb
  if ! pid_alive "$DIR/run/slurmdbd.pid"; then
    slurmdbd 9>&- || fail "slurmdbd did not start" "$DIR/log/slurmdbd.log"
    restarted=1
  fi
  wait_until slurmdbd "$DIR/log/slurmdbd.log" sacctmgr -n list cluster
  if ! pid_alive "$DIR/run/slurmctld.pid"; then
    slurmctld 9>&- || fail "slurmctld did not start" "$DIR/log/slurmctld.log"
    restarted=1
  fi
  wait_until slurmctld "$DIR/log/slurmctld.log" scontrol ping
  for ((i = 1; i <= NODES; i++)); do
    if ! pid_alive "$DIR/run/slurmd-node$i.pid"; then
      slurmd -N "node$i" 9>&- || fail "slurmd node$i did not start" "$DIR/log/slurmd-node$i.log"
      restarted=1
    fi
  done
  wait_until "node registration" "$DIR/log/slurmctld.log" sinfo -h -N
  resume_drained_nodes
  wait_until "nodes" "$DIR/log/slurmctld.log" node_states_idle
  if ((restarted)); then
    local out
    out=$(timeout "$TIMEOUT" srun -N "$NODES" --ntasks-per-node=1 printenv SLURMD_NODENAME 2>&1) ||
      fail "srun smoke test failed: $out" "$DIR/log/slurmctld.log"
    [[ $(sort <<<"$out" | tr '\n' ' ') == "$(seq -f 'node%g' 1 "$NODES" | sort | tr '\n' ' ')" ]] ||
      fail "srun smoke test printed: $out"
  fi
  echo "local_cluster: READY nodes=$NODES cpus_per_node=$CPUS dir=$DIR in $((SECONDS - t0)) s"
}

stop_slurm() {
  local f
  scancel --full --quiet --state=RUNNING,PENDING "--user=$(id -un)" 2>/dev/null || true
  for f in "$DIR"/run/slurmd-*.pid; do [[ -e $f ]] && stop_pidfile "$f"; done
  stop_pidfile "$DIR/run/slurmctld.pid"
}

stop() {
  stop_slurm
  stop_pidfile "$DIR/run/slurmdbd.pid"
  stop_pidfile "$DIR/run/mysqld.pid"
  say "stopped"
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  status)
    for f in "$DIR"/run/*.pid; do
      [[ -e $f ]] || continue
      if pid_alive "$f"; then echo "$(basename "$f" .pid): running"; else echo "$(basename "$f" .pid): dead"; fi
    done ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 64 ;;
esac
