#!/usr/bin/env bash
# Cluster tier: `pipesgd run -H` over real ssh. Brings up a 4-node emulated lab (scripts/lab)
# with a key-only sshd in every node, runs the launcher inside node 0 with the lab's ssh config,
# and takes the lab down, checking nothing is left. One MODE per ctest test:
#
#   train      4 ranks on lab0..lab3 train the main job (300 steps) from a config that exists only
#              in the launcher's mount namespace (a private tmpfs: the sshd sessions, like other
#              machines, cannot see it), so the job runs only because the launcher ships the
#              config; the final accuracy equals a local `-np 4` run's to 4 decimals; every rank
#              reports transport tcp on eth0 (--transport, --network-interface); --output-dir
#              keeps per-rank files.
#   preflight  a host whose sshd is down, a wrong port, an unknown host and a host without the
#              binary (an extra sshd on node 3 whose mount namespace hides the build directory)
#              fail the preflight together, each named with ssh's message, within the connect
#              timeout, and nothing is started; --ssh-port with a closed port names every host.
#   stop       rank 2's worker killed with SIGKILL mid-training: the launcher exits 137 within
#              10 s naming rank 2 and lab2, and no pipesgd process is left on any node (by the
#              PIDs recorded in each node's namespace); the job token is on no command line;
#              then SIGINT to the launcher mid-training: exit 130, nothing left on any node;
#              then SIGKILL to the launcher: nothing left on any node either.
#
# Needs root and network namespaces; otherwise prints why and exits 77 (ctest: skipped).
# Usage: ssh_launcher_test.sh MODE PIPESGD_BINARY SOURCE_DIR
set -uo pipefail
MODE="$1"; PIPESGD=$(realpath "$2"); SRC="$3"
export LAB_PREFIX="psgdssh$$" LAB_SUBNET="10.91.$(( $$ % 200 ))"
LAB="$SRC/scripts/lab"
CONFIG="$SRC/configs/fashion_mnist_mlp.pbtxt"
SHORT=(--set train.max_steps=300 --set train.epochs=1)

if [[ $(id -u) -ne 0 ]]; then echo "SKIPPED: the cluster tier needs root"; exit 77; fi
if ! ip netns add "${LAB_PREFIX}-probe" 2>/dev/null; then
  echo "SKIPPED: cannot create network namespaces here"; exit 77
fi
ip netns del "${LAB_PREFIX}-probe"
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
if [[ ! -x "$SSHD" ]] || ! command -v ssh >/dev/null; then
  echo "FAIL: sshd or ssh not installed (scripts/install_deps.sh: openssh-server, openssh-client)"
  exit 1
fi
command -v unshare >/dev/null || { echo "FAIL: unshare (util-linux) not installed"; exit 1; }

tmp=$(mktemp -d)
bg_pids=()        # background processes this script started
extra_sshd_pid=""
cleanup() {
  local p
  for p in "${bg_pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  [[ -n "$extra_sshd_pid" ]] && kill -9 "$extra_sshd_pid" 2>/dev/null
  "$LAB" down >/dev/null 2>&1
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
show() { for f in "$@"; do echo "--- $f"; cat "$f"; done; }

alive() {  # alive PID: running (a zombie is not)
  local st; st=$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null) && [[ -n "$st" && "$st" != Z ]]
}
node_pipesgd() {  # node_pipesgd I: PIDs of pipesgd processes in node I's network namespace
  local p
  for p in $(ip netns pids "${LAB_PREFIX}-n$1" 2>/dev/null); do
    [[ "$(cat "/proc/$p/comm" 2>/dev/null)" == pipesgd ]] && alive "$p" && echo "$p"
  done
}
all_pipesgd() { for i in 0 1 2 3; do node_pipesgd "$i"; done; }
has_arg() {  # has_arg PID WORD: WORD is one of the process's arguments
  tr '\0' '\n' < "/proc/$1/cmdline" 2>/dev/null | grep -qxF -- "$2"
}
wait_gone() {  # wait_gone SECONDS PID...: true once none is running
  local deadline=$((SECONDS + $1)) p left; shift
  while true; do
    left=0
    for p in "$@"; do alive "$p" && left=1; done
    [[ $left -eq 0 ]] && return 0
    [[ $SECONDS -ge $deadline ]] && return 1
    sleep 0.1
  done
}
wait_for_line() {  # wait_for_line SECONDS FILE PATTERN
  local deadline=$((SECONDS + $1))
  until grep -qE -- "$3" "$2" 2>/dev/null; do
    [[ $SECONDS -ge $deadline ]] && return 1
    sleep 0.2
  done
}

"$LAB" up 4 >/dev/null || fail "lab up"
"$LAB" sshd >/dev/null || fail "lab sshd"
CFG=$("$LAB" ssh-config) || fail "lab ssh-config"
SSH_DIR=$(dirname "$CFG")
addr() { "$LAB" addr "$1"; }
# The BLAS environment must be the same on every rank for bit-identical results: sshd gives
# sessions a fresh environment, so forward this shell's OPENBLAS_* settings with -x.
FORWARD=()
for v in $(compgen -e | grep '^OPENBLAS_' || true); do FORWARD+=(-x "$v"); done

mode_train() {
  "$PIPESGD" run -np 4 "$CONFIG" "${SHORT[@]}" > "$tmp/local.out" 2> "$tmp/local.err" \
    || { show "$tmp/local.err"; fail "local run"; }
  local want; want=$(grep -oE "final test accuracy: [0-9.]+" "$tmp/local.out" | awk '{print $4}')
  [[ -n "$want" ]] || { show "$tmp/local.out"; fail "no final accuracy from the local run"; }

  # The config lives on a tmpfs mounted only in the launcher's mount namespace: in the root
  # namespace (where the nodes' sshd and their sessions live) the directory stays empty.
  local hidden="$tmp/launcher-only"
  mkdir -p "$hidden"
  local start=$SECONDS
  # shellcheck disable=SC2016  # expanded by the inner bash
  "$LAB" exec 0 unshare -m --propagation private bash -c '
      hidden="$1"; config="$2"; shift 2
      mount -t tmpfs -o size=1m pipesgd-test "$hidden" && cp "$config" "$hidden/job.pbtxt" || exit 99
      exec "$@"' _ "$hidden" "$CONFIG" \
    "$PIPESGD" run -np 4 -H lab0:1,lab1:1,lab2:1,lab3:1 -F "$CFG" "${FORWARD[@]}" \
      --transport tcp --network-interface eth0 --output-dir "$tmp/ranks" \
      "$hidden/job.pbtxt" "${SHORT[@]}" > "$tmp/ssh.out" 2> "$tmp/ssh.err"
  local rc=$?
  echo "launcher over ssh: exit $rc in $((SECONDS - start)) s; its output:"
  grep -vE "step [0-9]+/300" "$tmp/ssh.out" "$tmp/ssh.err" | sed 's/^[^:]*://'
  [[ $rc -eq 0 ]] || fail "the run over ssh exited $rc"
  [[ -e "$hidden/job.pbtxt" ]] && fail "the config is visible outside the launcher's mount namespace"
  grep -qE "^\[rank 0\] config /tmp/pipesgd-rank0-[A-Za-z0-9]{6}/job.pbtxt \(" "$tmp/ssh.out" \
    || fail "rank 0 did not read the shipped copy of the config"
  local got; got=$(grep -oE "final test accuracy: [0-9.]+" "$tmp/ssh.out" | awk '{print $4}')
  [[ "$got" == "$want" ]] || fail "final accuracy over ssh $got, local run $want"
  for i in 0 1 2 3; do
    grep -qxF "[rank $i] rank $i on lab$i: transport tcp, interface eth0, address $(addr "$i") (comm.network_interface = eth0)" "$tmp/ssh.out" \
      || fail "rank $i did not report transport tcp on eth0 at $(addr "$i")"
    grep -qF "rank $i on lab$i: transport tcp, interface eth0" "$tmp/ranks/rank.$i/stdout" \
      || fail "--output-dir: $tmp/ranks/rank.$i/stdout lacks rank $i's lines"
  done
  grep -qF "pipesgd run: starting 4 ranks over ssh (rank:host 0:lab0 1:lab1 2:lab2 3:lab3); rendezvous $(addr 0):" "$tmp/ssh.out" \
    || fail "the launcher did not name the placement and rank 0's address"
  echo "ok: 4 ranks over ssh from node 0 (config only in the launcher's mount namespace): accuracy $got = local -np 4 ($want)"
}

mode_preflight() {
  # lab1: sshd stopped.
  local pid1; pid1=$(cat "$SSH_DIR/n1.pid")
  kill "$pid1"; wait_gone 5 "$pid1" || fail "lab1's sshd did not stop"
  # nobinary: a second sshd on node 3, port 2200, in a mount namespace where the directory of
  # the pipesgd binary is an empty tmpfs: that "machine" has no pipesgd.
  local bindir; bindir=$(dirname "$PIPESGD")
  sed -e 's/^Port 22$/Port 2200/' -e "s#^PidFile .*#PidFile $tmp/nobinary.pid#" \
    "$SSH_DIR/n3.sshd_config" > "$tmp/nobinary.sshd_config"
  "$LAB" exec 3 unshare -m --propagation private sh -c \
    'mount -t tmpfs -o size=1m nobinary "$1" && exec "$2" -f "$3" -E "$4"' _ \
    "$bindir" "$SSHD" "$tmp/nobinary.sshd_config" "$tmp/nobinary.log" \
    || fail "could not start the extra sshd"
  for _ in $(seq 50); do [[ -s "$tmp/nobinary.pid" ]] && break; sleep 0.1; done
  extra_sshd_pid=$(cat "$tmp/nobinary.pid" 2>/dev/null) || fail "extra sshd did not start"
  # Client config: the lab's, plus two aliases (a wrong port, and the host without the binary).
  local hostkey; hostkey=$(awk '{print $1, $2}' "$SSH_DIR/host_ed25519_key.pub")
  cp "$SSH_DIR/known_hosts" "$tmp/known_hosts"
  echo "[$(addr 3)]:2200 $hostkey" >> "$tmp/known_hosts"
  {
    for alias in "wrongport $(addr 2) 2222" "nobinary $(addr 3) 2200"; do
      read -r name host port <<< "$alias"
      printf 'Host %s\n  HostName %s\n  Port %s\n  User root\n  IdentityFile %s\n  IdentitiesOnly yes\n' \
        "$name" "$host" "$port" "$SSH_DIR/client_ed25519_key"
      printf '  UserKnownHostsFile %s\n  GlobalKnownHostsFile /dev/null\n  StrictHostKeyChecking yes\n  LogLevel ERROR\n\n' \
        "$tmp/known_hosts"
    done
    cat "$CFG"
  } > "$tmp/ssh_config"

  local timeout=8 start=$SECONDS rc
  "$LAB" exec 0 "$PIPESGD" run -H lab0,lab1,wrongport,nohost.invalid,nobinary -F "$tmp/ssh_config" \
    --ssh-connect-timeout "$timeout" "$CONFIG" > "$tmp/pre.out" 2> "$tmp/pre.err"
  rc=$?
  local took=$((SECONDS - start))
  echo "launcher with four bad hosts: exit $rc in $took s; its output:"; cat "$tmp/pre.out" "$tmp/pre.err"
  [[ $rc -eq 1 ]] || fail "exit $rc, expected 1"
  [[ $took -lt $timeout ]] || fail "took $took s, more than the connect timeout ($timeout s)"
  grep -qxF "error: preflight failed on 4 of 5 host(s); nothing was started:" "$tmp/pre.err" || fail "no summary line"
  grep -qxF "  lab1: ssh failed: ssh: connect to host $(addr 1) port 22: Connection refused" "$tmp/pre.err" || fail "lab1 (sshd down) not named"
  grep -qxF "  wrongport: ssh failed: ssh: connect to host $(addr 2) port 2222: Connection refused" "$tmp/pre.err" || fail "wrong port not named"
  grep -qE "^  nohost\.invalid: ssh failed: ssh: Could not resolve hostname nohost\.invalid: " "$tmp/pre.err" || fail "unknown host not named"
  grep -qE "^  nobinary: no pipesgd binary at ${PIPESGD//./\\.} there \(.+\); install it at the same path, or pass --remote-binary PATH$" "$tmp/pre.err" \
    || fail "missing binary not named"
  grep -q "lab0:" "$tmp/pre.err" && fail "lab0 (fine) reported as failing"
  grep -qE "\[rank|starting" "$tmp/pre.out" "$tmp/pre.err" && fail "something was started"

  "$LAB" exec 0 "$PIPESGD" run -H lab0,lab2 -F "$CFG" --ssh-port 2222 "$CONFIG" > "$tmp/port.out" 2> "$tmp/port.err"
  rc=$?
  cat "$tmp/port.err"
  [[ $rc -eq 1 ]] || fail "--ssh-port 2222: exit $rc, expected 1"
  for i in 0 2; do
    grep -qxF "  lab$i: ssh failed: ssh: connect to host $(addr "$i") port 2222: Connection refused" "$tmp/port.err" \
      || fail "--ssh-port 2222: lab$i not named"
  done
  echo "ok: preflight names sshd down, wrong port, unknown host, missing binary (in $took s) and starts nothing"

  # A remote binary that hangs (and has a child): the launcher gives up after the connect
  # timeout plus its slack, and nothing it started may stay behind on any host (no tty there,
  # so no SIGHUP: the remote watcher kills the probe's process group when the session ends).
  printf '#!/bin/sh\nsleep 987654 &\nwait\n' > "$tmp/hang_pipesgd"
  chmod +x "$tmp/hang_pipesgd"
  start=$SECONDS
  "$LAB" exec 0 "$PIPESGD" run -H lab2,lab3 -F "$CFG" --ssh-connect-timeout 2 \
    --remote-binary "$tmp/hang_pipesgd" "$CONFIG" > "$tmp/hang.out" 2> "$tmp/hang.err"
  rc=$?
  took=$((SECONDS - start))
  cat "$tmp/hang.err"
  [[ $rc -eq 1 ]] || fail "hanging remote binary: exit $rc, expected 1"
  for i in 2 3; do
    grep -qF "  lab$i: no answer within 12 s" "$tmp/hang.err" || fail "hanging remote binary: lab$i not named"
  done
  local left="" p
  for _ in $(seq 50); do
    left=""
    for i in 0 1 2 3; do
      for p in $(ip netns pids "${LAB_PREFIX}-n$i" 2>/dev/null); do
        tr '\0' ' ' < "/proc/$p/cmdline" 2>/dev/null | grep -qE "hang_pipesgd|sleep 987654" && alive "$p" && left+=" $p"
      done
    done
    # The sessions' processes live in the root namespace (sshd's): look there too.
    for p in $(pgrep -f "sleep 987654|$tmp/hang_pipesgd"); do alive "$p" && left+=" $p"; done
    [[ -z "$left" ]] && break
    sleep 0.1
  done
  if [[ -n "$left" ]]; then
    ps -o pid,ppid,args -p $left
    kill -9 $left 2>/dev/null
    fail "hanging remote binary: processes left after the preflight gave up:$left"
  fi
  echo "ok: a hanging remote binary is named on every host after $took s, and nothing is left running there"
}

# Starts a long job over ssh in the background; sets LAUNCHER (its PID) and RECORDED (every
# pipesgd PID on the nodes once all 4 ranks train).
start_long_job() {
  "$LAB" exec 0 "$PIPESGD" run -np 4 -H lab0,lab1,lab2,lab3 -F "$CFG" "$CONFIG" \
    --set train.epochs=100 > "$tmp/$1.out" 2> "$tmp/$1.err" &
  LAUNCHER=$!
  bg_pids+=("$LAUNCHER")
  wait_for_line 90 "$tmp/$1.out" "^\[rank 0\] epoch 1/100 step " \
    || { show "$tmp/$1.out" "$tmp/$1.err"; fail "$1: training did not start"; }
  has_arg "$LAUNCHER" run || fail "PID $LAUNCHER is not the launcher"
  RECORDED=($(all_pipesgd))
  # The launcher, and a remote-rank wrapper and a worker per rank.
  [[ ${#RECORDED[@]} -eq 9 ]] || { ps -o pid,args -p "${RECORDED[@]}"; fail "$1: ${#RECORDED[@]} pipesgd processes on the nodes, expected 9"; }
}

check_nothing_left() {  # check_nothing_left WHAT
  wait_gone 5 "${RECORDED[@]}" \
    || { ps -o pid,args -p "${RECORDED[@]}"; fail "$1: pipesgd processes left: $(for p in "${RECORDED[@]}"; do alive "$p" && echo "$p"; done)"; }
  local left; left=$(all_pipesgd)
  [[ -z "$left" ]] || { ps -o pid,args -p $left; fail "$1: pipesgd processes on the nodes: $left"; }
}

wait_exit() {  # wait_exit PID SECONDS: sets RC and TOOK (seconds, 0.1 s resolution)
  local t0=$EPOCHREALTIME
  local deadline=$((SECONDS + $2))
  while alive "$1" && [[ $SECONDS -lt $deadline ]]; do sleep 0.05; done
  alive "$1" && fail "the launcher did not exit within $2 s"
  { wait "$1"; } 2>/dev/null; RC=$?
  TOOK=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
}

mode_stop() {
  start_long_job kill
  local worker="" p
  for p in $(node_pipesgd 2); do has_arg "$p" worker && worker=$p; done
  [[ -n "$worker" ]] || fail "no worker on node 2"
  tr '\0' '\n' < "/proc/$worker/environ" | grep -qx "RANK=2" || fail "node 2's worker is not rank 2"
  # The job token reached the worker, and no command line on the machine shows it.
  local token; token=$(tr '\0' '\n' < "/proc/$worker/environ" | sed -n 's/^PIPESGD_JOB_TOKEN=//p')
  [[ ${#token} -eq 32 ]] || fail "rank 2 has no 32-digit job token"
  for p in /proc/[0-9]*; do
    grep -qaF "$token" "$p/cmdline" 2>/dev/null && fail "the job token is on the command line of $(tr '\0' ' ' < "$p/cmdline")"
  done
  kill -9 "$worker"
  wait_exit "$LAUNCHER" 10
  echo "launcher after kill -9 of rank 2's worker (pid $worker): exit $RC in $TOOK s; its last lines:"
  tail -n 12 "$tmp/kill.err"
  [[ $RC -eq 137 ]] || fail "exit $RC, expected 137 (rank 2's status)"
  grep -qxF "error: pipesgd run: failed: rank 2 on lab2 exited with status 137: its worker was killed by signal 9 (Killed)" "$tmp/kill.err" \
    || fail "the launcher did not name rank 2 on lab2"
  check_nothing_left "after killing rank 2"
  echo "ok: rank 2 killed: launcher exit 137 in $TOOK s naming rank 2 on lab2; nothing left on any node"

  start_long_job sigint
  kill -INT "$LAUNCHER"
  wait_exit "$LAUNCHER" 15
  echo "launcher after SIGINT: exit $RC in $TOOK s; its last lines:"
  tail -n 3 "$tmp/sigint.err"
  [[ $RC -eq 130 ]] || fail "exit $RC after SIGINT, expected 130"
  check_nothing_left "after SIGINT"
  echo "ok: SIGINT to the launcher: exit 130 in $TOOK s; nothing left on any node"

  # A launcher that cannot clean up (SIGKILL): its ssh clients die with it (PR_SET_PDEATHSIG),
  # each remote wrapper sees its session end and stops its worker.
  start_long_job sigkill
  kill -KILL "$LAUNCHER"
  wait_exit "$LAUNCHER" 5
  check_nothing_left "after SIGKILL to the launcher"
  echo "ok: SIGKILL to the launcher: nothing left on any node"
}

case "$MODE" in
  train) mode_train ;;
  preflight) mode_preflight ;;
  stop) mode_stop ;;
  *) fail "unknown mode '$MODE' (train, preflight, stop)" ;;
esac

[[ -n "$extra_sshd_pid" ]] && { kill "$extra_sshd_pid" 2>/dev/null; wait_gone 5 "$extra_sshd_pid"; extra_sshd_pid=""; }
"$LAB" down >/dev/null 2>&1 || fail "lab down"
[[ -z "$(ip netns list | grep "^${LAB_PREFIX}")" ]] || fail "namespaces left behind"
echo "ok: lab down"
