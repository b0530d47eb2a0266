#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for the tests of `quantdyn sweep/grid --slurm`
# (tests/test_slurm.py; docs/scale-out.md). Debian's slurm-wlm (slurmctld + slurmd) and munge.
#
#   tools/slurm_cluster.sh install   apt-get install slurm-wlm munge (root; skipped when they are there)
#   tools/slurm_cluster.sh start     install if needed, write the configuration, start munged, slurmctld and
#                                    slurmd, wait until the node takes jobs; prints `export SLURM_CONF=...`
#   tools/slurm_cluster.sh status    sinfo of the running cluster (exit 1 when it does not answer)
#   tools/slurm_cluster.sh stop      stop the daemons this script started (by their pid files)
#
# Everything lives under $QUANTDYN_SLURM_DIR (default /tmp/quantdyn-slurm): slurm.conf, the munge key and
# socket, state, spool, logs and pid files; nothing under /etc is written. slurmctld listens on
# $QUANTDYN_SLURM_PORT (default 6817), slurmd on the next port: two clusters on one machine (two test
# sessions) need two directories and two ports. Clients find the cluster through
# SLURM_CONF=$QUANTDYN_SLURM_DIR/slurm.conf. The node is this machine ("localhost") with its CPUs as slots,
# a short MinJobAge and cred_expire (a requeued job starts again within seconds, not two minutes),
# JobRequeue=1, no cgroups (proctrack/linuxproc, task/none: containers rarely delegate cgroups). The daemons
# and the jobs run as root (SlurmUser=root): this is a test cluster on a CI machine, not a shared one.
# Partitions: `debug` (the default) and `restricted` (AllowAccounts=quantdyn-ci with EnforcePartLimits=ALL:
# without an accounting database no account is known, so every job there is refused at submission, which
# the bad-input tests use).
set -euo pipefail

DIR=${QUANTDYN_SLURM_DIR:-/tmp/quantdyn-slurm}
CTL_PORT=${QUANTDYN_SLURM_PORT:-6817}
CONF=$DIR/slurm.conf

die() { echo "slurm_cluster: $*" >&2; exit 1; }

install_packages() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || die "slurm-wlm and munge are not installed and there is no apt-get"
  # the packages' service starts are refused in a container (policy-rc.d) or fail without systemd: harmless
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
           --no-install-recommends slurm-wlm munge >/dev/null; } \
    || die "apt-get install slurm-wlm munge failed"
}

answers() { [ -f "$CONF" ] && SLURM_CONF=$CONF timeout 10 sinfo -h -o %T >/dev/null 2>&1; }

write_config() {
  local cpus mem
  cpus=$(nproc)
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))  # MiB: half of this machine for jobs
  mkdir -p "$DIR"/{munge,state,spool,logs}
  chmod 755 "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    head -c 1024 /dev/urandom > "$DIR/munge/munge.key"
    chmod 400 "$DIR/munge/munge.key"
  fi
  cat > "$CONF" <<EOF
# written by tools/slurm_cluster.sh: a one-node test cluster on this machine
ClusterName=quantdyn
SlurmctldHost=localhost
SlurmctldPort=$CTL_PORT
SlurmdPort=$((CTL_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2,cred_expire=5
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/logs/slurmctld.log
SlurmdLogFile=$DIR/logs/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
MinJobAge=10
KillWait=10
JobRequeue=1
EnforcePartLimits=ALL
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
PartitionName=restricted Nodes=localhost AllowAccounts=quantdyn-ci MaxTime=INFINITE State=UP
EOF
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
  if answers; then
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  install_packages
  write_config
  if ! pid_alive "$DIR/munge/munged.pid"; then
    munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
      --pid-file="$DIR/munge/munged.pid" --seed-file="$DIR/munge/munged.seed" \
      --log-file="$DIR/logs/munged.log" || die "munged did not start (see $DIR/logs/munged.log)"
  fi
  export SLURM_CONF=$CONF
  pid_alive "$DIR/slurmctld.pid" || slurmctld -i || die "slurmctld did not start (see $DIR/logs/slurmctld.log)"
  pid_alive "$DIR/slurmd.pid" || slurmd -N localhost || die "slurmd did not start (see $DIR/logs/slurmd.log)"
  local i state
  for i in $(seq 1 60); do
    state=$(sinfo -h -n localhost -o %T 2>/dev/null || true)
    case "$state" in
      idle*|mixed*|alloc*) echo "export SLURM_CONF=$CONF"; return 0 ;;
      down*|drain*) scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
    esac
    sleep 0.5
  done
  die "the node did not come up within 30 s (state '${state:-none}'; see $DIR/logs/)"
}

stop() {
  local f pid
  if answers; then  # end this cluster's jobs first: a job step outlives a killed slurmd
    SLURM_CONF=$CONF scancel --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 1 60); do [ -z "$(SLURM_CONF=$CONF squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.5; done
  fi
  for f in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    if pid_alive "$f"; then
      pid=$(cat "$f")
      kill "$pid"
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    fi
  done
}

case "${1:-}" in
  install) install_packages ;;
  start) start ;;
  stop) stop ;;
  status) SLURM_CONF=$CONF sinfo || exit 1 ;;
  *) echo "usage: $0 install|start|status|stop" >&2; exit 2 ;;
esac
