#!/usr/bin/env bash
# Cluster tier: brings up a 4-node emulated lab (scripts/lab) with 1gbit links, runs a 4-rank
# AllReduce with exact results across the namespaces (one rank per node), then a short width-2
# training job across them; caps the nodes' CPU (`lab cpu`) and checks a process started on a
# node lands in its cgroup and is held to its share; starts a key-only sshd on every node
# (`lab sshd`) and runs commands over ssh from node 0 on node 3; takes the lab down, and checks
# that nothing it made is left (namespaces, route, cgroups, sshd processes, state).
# Needs root and network namespaces; otherwise prints why and exits 77 (ctest: skipped).
# sshd (openssh-server) is listed in scripts/install_deps.sh, so a missing sshd is a failure.
# Usage: lab_test.sh PIPESGD_BINARY ALLREDUCE_CHECK_BINARY SOURCE_DIR
set -uo pipefail
PIPESGD="$1"; CHECK="$2"; SRC="$3"
export LAB_PREFIX="psgdci$$" LAB_SUBNET="10.79.$(( $$ % 200 ))"
LAB="$SRC/scripts/lab"

if [[ $(id -u) -ne 0 ]]; then echo "SKIPPED: the cluster tier needs root"; exit 77; fi
if ! ip netns add "${LAB_PREFIX}-probe" 2>/dev/null; then
  echo "SKIPPED: cannot create network namespaces here"; exit 77
fi
ip netns del "${LAB_PREFIX}-probe"
SSHD=$(command -v sshd || echo /usr/sbin/sshd)
if [[ ! -x "$SSHD" ]] || ! command -v ssh >/dev/null; then
  echo "FAIL: sshd or ssh not installed; scripts/install_deps.sh lists openssh-server and"
  echo "      openssh-client: run it (or apt-get install openssh-server openssh-client)"
  exit 1
fi

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null; done
  for i in 0 1 2 3; do rm -rf "/etc/netns/${LAB_PREFIX}-n$i"; done
  "$LAB" down >/dev/null 2>&1
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

"$LAB" up 4 || fail "lab up"
"$LAB" shape 1gbit || fail "lab shape"
master=$("$LAB" addr 0)

# A shaped link banks no idle time, as a real one (tbf's burst, scripts/lab): 2 MB sent after
# 0.5 s idle, three times, take a median of at least 90% of 2 MB at 1 Gbit/s (16 ms). With the
# 10 ms burst it had: 14.72, 12.65, 10.24 ms (and a width-1 step's compute was free on the lab);
# with 1 ms: 21.34, 20.78, 18.20.
"$LAB" exec 0 timeout 30 python3 -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 29590)); s.listen(1); c, _ = s.accept()
for _ in range(3):
    left = 2_000_000
    while left > 0: left -= len(c.recv(min(left, 1 << 16)))
    c.sendall(b"k")' "$master" &
pids+=($!)
sleep 0.5
idle_ms=$("$LAB" exec 1 timeout 30 python3 -c '
import socket, statistics, sys, time
c = socket.create_connection((sys.argv[1], 29590)); ms = []
for _ in range(3):
    time.sleep(0.5)
    t0 = time.perf_counter(); c.sendall(b"x" * 2_000_000); c.recv(1)
    ms.append((time.perf_counter() - t0) * 1e3)
print("%.2f" % statistics.median(ms))' "$master") || fail "the idle-link send"
wait "${pids[@]}"; pids=()
awk -v t="$idle_ms" 'BEGIN { exit !(t >= 14.4) }' ||
  fail "2 MB after an idle 0.5 s took $idle_ms ms (median of 3) at 1gbit: expected >= 14.4 (90% of 16)"
echo "ok: a shaped link banks no idle time (2 MB after idle: median $idle_ms ms at 1gbit)"

# Ranks run inside the nodes; the root namespace never connects to a lab address.
run_ranks() {  # run_ranks TIMEOUT CMD... (RANK etc. set per node)
  local timeout="$1"; shift
  pids=()
  for i in 0 1 2 3; do
    RANK=$i WORLD_SIZE=4 MASTER_ADDR=${RANKS_MASTER:-$master} MASTER_PORT=${RANKS_PORT:-29500} \
      OPENBLAS_NUM_THREADS=1 \
      timeout "$timeout" "$LAB" exec "$i" "$@" > "$tmp/out$i" 2> "$tmp/err$i" &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  pids=()
  return $rc
}
tmp=$(mktemp -d)

run_ranks 120 "$CHECK" || { cat "$tmp"/err*; fail "AllReduce across the lab"; }
for i in 0 1 2 3; do
  grep -q "rank $i ok: 4 ranks" "$tmp/out$i" || { cat "$tmp/out$i" "$tmp/err$i"; fail "rank $i"; }
done
echo "ok: exact AllReduce across 4 namespace nodes at 1gbit"

run_ranks 300 "$PIPESGD" worker "$SRC/configs/fashion_mnist_mlp.pbtxt" --set train.max_steps=300 \
  --set train.epochs=1 || { cat "$tmp"/err*; fail "training across the lab"; }
acc=$(grep -oE "final test accuracy: [0-9.]+" "$tmp/out0" | awk '{print $4}')
[[ -n "$acc" ]] || fail "no final accuracy"
awk -v a="$acc" 'BEGIN { exit !(a >= 0.75) }' || fail "accuracy $acc after 300 steps, expected >= 0.75"
echo "ok: width-2 training across the lab, accuracy $acc after 300 steps"

# The loopback trap (Debian's `127.0.1.1 hostname` line): MASTER_ADDR names rank 0's host, which
# resolves to loopback there and to its real address elsewhere. `ip netns exec` bind-mounts
# /etc/netns/NODE/hosts over /etc/hosts, so each node gets its own view, as real hosts do.
for i in 0 1 2 3; do
  mkdir -p "/etc/netns/${LAB_PREFIX}-n$i"
  if [[ $i == 0 ]]; then line="127.0.1.1 labmaster"; else line="$master labmaster"; fi
  printf '127.0.0.1 localhost\n%s\n' "$line" > "/etc/netns/${LAB_PREFIX}-n$i/hosts"
done
loopback_ranks() {  # loopback_ranks EXTRA_ARGS...: the 4 ranks with MASTER_ADDR=labmaster
  RANKS_MASTER=labmaster RANKS_PORT=29501 run_ranks 120 "$PIPESGD" worker \
    "$SRC/configs/fashion_mnist_mlp.pbtxt" --set train.max_steps=20 --set train.epochs=1 \
    --set data.test_limit=1000 --set comm.start_timeout_s=30 "$@"
}
t0=${EPOCHREALTIME/./}
loopback_ranks && fail "a multi-host job with rank 0 on loopback did not fail"
took=$(awk -v us=$(( ${EPOCHREALTIME/./} - t0 )) 'BEGIN { printf "%.2f", us / 1e6 }')
# Start-up (reading the data) included; rank 0 answers the others at once and keeps its port
# open 1 s more for late arrivals.
awk -v t="$took" 'BEGIN { exit !(t <= 5) }' || fail "the loopback case took ${took} s to fail (comm.start_timeout_s = 30)"
for i in 0 1 2 3; do
  grep -q "rank 0 would use loopback address 127.0.0.1 for its data connections, but the job spans hosts" "$tmp/err$i" \
    && grep -q "MASTER_ADDR=labmaster resolves to 127.0.1.1 on rank 0's host" "$tmp/err$i" \
    && grep -q "Set comm.network_interface (or PIPESGD_SOCKET_IFNAME)" "$tmp/err$i" \
    || { cat "$tmp/err$i"; fail "rank $i does not explain the loopback trap"; }
done
echo "ok: MASTER_ADDR resolving to loopback on rank 0's host fails on every rank in ${took} s, naming loopback and the fix"
grep -h "^error" "$tmp/err1"
loopback_ranks --set comm.network_interface=eth0 || { cat "$tmp"/err*; fail "the loopback case with comm.network_interface=eth0"; }
grep -q "final test accuracy" "$tmp/out0" || { cat "$tmp/out0"; fail "no final accuracy with comm.network_interface=eth0"; }
echo "ok: the same job with comm.network_interface=eth0 listens and advertises on eth0, and trains"
for i in 0 1 2 3; do rm -rf "/etc/netns/${LAB_PREFIX}-n$i"; done

# CPU caps: cgroup v1 cpu quota per node.
CG="/sys/fs/cgroup/cpu/${LAB_PREFIX}"
out=$("$LAB" cpu 0.5 0.5 2>&1) && fail "lab cpu accepted 2 shares for 4 nodes"
grep -q "2 shares given for 4 nodes" <<< "$out" || fail "lab cpu with 2 shares for 4 nodes: unclear error: $out"
out=$("$LAB" cpu 0.5x 2>&1) && fail "lab cpu accepted 0.5x"
grep -q "'0.5x'" <<< "$out" || fail "lab cpu 0.5x: error does not name the bad value: $out"
"$LAB" cpu 1 0.5 2 0.25 >/dev/null || fail "lab cpu 1 0.5 2 0.25"
[[ "$(cat "$CG/n3/cpu.cfs_quota_us")" == 25000 ]] || fail "node 3 quota $(cat "$CG/n3/cpu.cfs_quota_us"), expected 25000"
"$LAB" cpu 0.5 || fail "lab cpu 0.5"
for i in 0 1 2 3; do
  [[ "$(cat "$CG/n$i/cpu.cfs_quota_us")" == 50000 && "$(cat "$CG/n$i/cpu.cfs_period_us")" == 100000 ]] \
    || fail "node $i: quota $(cat "$CG/n$i/cpu.cfs_quota_us") period $(cat "$CG/n$i/cpu.cfs_period_us"), expected 50000/100000"
done
"$LAB" exec 1 cat /proc/self/cgroup > "$tmp/cgroup" || fail "lab exec 1 cat /proc/self/cgroup"
grep -qE "^[0-9]+:([^:]*,)?cpu(,[^:]*)?:/${LAB_PREFIX}/n1$" "$tmp/cgroup" \
  || { cat "$tmp/cgroup"; fail "a process started with 'lab exec 1' is not in ${LAB_PREFIX}/n1's cpu cgroup"; }
out=$("$LAB" status) || fail "lab status"
grep -q "${LAB_PREFIX}-n1 .* cpu 0.5 " <<< "$out" || { echo "$out"; fail "lab status does not show cpu 0.5"; }
# A busy loop of 1.5 s wall on a node capped at 0.5 CPU gets at most about 0.75 s of CPU.
# shellcheck disable=SC2016  # expanded by the inner bash
"$LAB" exec 1 bash -c 'e=$(( ${EPOCHREALTIME/./} + 1500000 )); while (( ${EPOCHREALTIME/./} < e )); do :; done; times' \
  > "$tmp/times" || fail "busy loop on node 1"
cpu_s=$(head -1 "$tmp/times" | awk '{ split($1, u, /[ms]/); split($2, s, /[ms]/); print u[1] * 60 + u[2] + s[1] * 60 + s[2] }')
awk -v c="$cpu_s" 'BEGIN { exit !(c <= 1.0) }' || fail "a 1.5 s busy loop on a 0.5-CPU node used ${cpu_s} s of CPU"
echo "ok: lab cpu 0.5: exec lands in the node's cgroup, quota 50000/100000, busy loop held to ${cpu_s} s CPU in 1.5 s"
# A worker started without OMP_NUM_THREADS and OPENBLAS_NUM_THREADS (srun, a container with a
# CPU limit) runs one thread each on the 0.5-CPU node, where the libraries would count the
# machine's CPUs, and says so.
if (( $(nproc) >= 2 )); then
  "$LAB" exec 1 env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS -u GOTO_NUM_THREADS RANK=0 \
    WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29511 timeout 120 "$PIPESGD" worker \
    "$SRC/configs/fashion_mnist_cnn.pbtxt" --set train.max_steps=3 --set data.test_limit=100 \
    --set train.progress_per_epoch=0 > "$tmp/quota.log" 2>&1 \
    || { tail -n 20 "$tmp/quota.log"; fail "a one-rank CNN job on the 0.5-CPU node"; }
  grep -qE "OPENBLAS_NUM_THREADS is unset and OpenBLAS's matrix products would run [0-9]+ threads in this process, over its CPU quota of 0.50 CPU .*: they run 1 " "$tmp/quota.log" \
    || { cat "$tmp/quota.log"; fail "OpenBLAS's threads not fitted to the node's 0.5 CPU"; }
  if grep -q "convolutions and pooling on onednn" "$tmp/quota.log"; then
    grep -qE "OMP_NUM_THREADS is unset and oneDNN's convolutions would run [0-9]+ OpenMP threads .*: they run 1 " "$tmp/quota.log" \
      && grep -q "OpenMP, 1 thread(s)" "$tmp/quota.log" \
      || { cat "$tmp/quota.log"; fail "oneDNN's threads not fitted to the node's 0.5 CPU"; }
  fi
  echo "ok: a worker on the 0.5-CPU node with the thread variables unset runs 1 thread per library"
  # `pipesgd info` there says what such a worker runs.
  "$LAB" exec 1 env -u OMP_NUM_THREADS -u OPENBLAS_NUM_THREADS -u GOTO_NUM_THREADS \
    "$PIPESGD" info > "$tmp/info.log" 2>&1 || { cat "$tmp/info.log"; fail "pipesgd info on node 1"; }
  grep -qE "^threads: CPU quota 0.50 CPU .*OpenBLAS's matrix products: threads 1, fitted \(OPENBLAS_NUM_THREADS is unset" \
    "$tmp/info.log" || { cat "$tmp/info.log"; fail "pipesgd info on the 0.5-CPU node: no fitted thread counts"; }
  echo "ok: pipesgd info on the 0.5-CPU node names the quota and the fitted counts"
fi
"$LAB" cpu none >/dev/null || fail "lab cpu none"
[[ "$(cat "$CG/n1/cpu.cfs_quota_us")" == -1 ]] || fail "lab cpu none left quota $(cat "$CG/n1/cpu.cfs_quota_us")"

# Key-only sshd on every node; ssh only from inside a node.
"$LAB" sshd || fail "lab sshd"
cfg=$("$LAB" ssh-config) || fail "lab ssh-config"
ssh_dir=$(dirname "$cfg")
sshd_pids=()
for i in 0 1 2 3; do
  [[ -s "$ssh_dir/n$i.pid" ]] || fail "no sshd pid file for node $i"
  sshd_pids+=("$(cat "$ssh_dir/n$i.pid")")
done
"$LAB" exec 0 ssh -F "$cfg" lab3 cat /etc/hostname > "$tmp/ssh_out" 2> "$tmp/ssh_err" \
  || { cat "$tmp/ssh_err"; fail "ssh from node 0 to lab3"; }
[[ -s "$tmp/ssh_out" ]] || fail "ssh lab3 cat /etc/hostname printed nothing"
addr3=$("$LAB" addr 3)
"$LAB" exec 0 ssh -F "$cfg" lab3 ip -4 -o addr show dev eth0 > "$tmp/ssh_out" 2> "$tmp/ssh_err" \
  || { cat "$tmp/ssh_err"; fail "ssh lab3 ip addr"; }
grep -qF " ${addr3}/24 " "$tmp/ssh_out" || { cat "$tmp/ssh_out"; fail "ssh lab3 does not run on node 3 (${addr3})"; }
"$LAB" exec 2 ssh -F "$cfg" "$("$LAB" addr 0)" cat /proc/self/cgroup > "$tmp/ssh_out" 2> "$tmp/ssh_err" \
  || { cat "$tmp/ssh_err"; fail "ssh from node 2 to node 0 by address"; }
grep -qE ":/${LAB_PREFIX}/n0$" "$tmp/ssh_out" || { cat "$tmp/ssh_out"; fail "a command run over ssh on node 0 is not in node 0's cgroup"; }
# Only the lab's client key gets in.
ssh-keygen -q -t ed25519 -N "" -f "$tmp/other_key" || fail "ssh-keygen"
sed "s#IdentityFile .*#IdentityFile $tmp/other_key#" "$cfg" > "$tmp/other_config"
if "$LAB" exec 0 ssh -F "$tmp/other_config" lab3 true 2>/dev/null; then fail "sshd accepted a key that is not the lab's"; fi
echo "ok: lab sshd: key-only ssh from node 0 to lab3 runs on ${addr3}; other keys refused"

"$LAB" down >/dev/null || fail "lab down"
trap - EXIT
left=$(ip netns list | grep -c "^${LAB_PREFIX}" || true)
[[ "$left" -eq 0 ]] || fail "$left namespaces left behind"
grep -q "${LAB_SUBNET}.0/24" <<< "$(ip route)" && fail "blackhole route left behind"
for p in "${sshd_pids[@]}"; do
  # A zombie waiting for init to reap it is not running.
  st=$(awk '{print $3}' "/proc/$p/stat" 2>/dev/null || true)
  [[ -z "$st" || "$st" == Z ]] || fail "sshd pid $p still running after down"
done
[[ -e "$CG" ]] && fail "cgroup $CG left behind"
ls -d /etc/netns/"${LAB_PREFIX}"-* >/dev/null 2>&1 && fail "/etc/netns entries left behind"
[[ -e "/run/pipesgd-lab/${LAB_PREFIX}" || -e "/run/pipesgd-lab/${LAB_PREFIX}.subnet" ]] && fail "lab state left behind"
rm -rf "$tmp"
echo "ok: lab down, nothing left behind (namespaces, route, sshd, cgroups, state)"
