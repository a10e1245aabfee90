#!/usr/bin/env bash
# Cluster tier: the lab's own launchers start pipesgd with no wrapper script
# (transport/launch_env.h). A 4-node emulated lab (scripts/lab); one MODE per ctest test:
#
#   slurm    Debian's Slurm for real: munged, slurmctld on node 0 and a slurmd per node (each
#            in its node's network namespace with its own hostname lab0..lab3, which a private
#            /etc/hosts resolves). `srun -N4 -n4 pipesgd worker` and `sbatch --wait
#            docs/examples/pipesgd.sbatch` each train the main job (200 steps) across the four
#            nodes; final test loss and accuracy equal a local `pipesgd run -np 4` to the bit;
#            every rank runs on its own node.
#   mpirun   Open MPI's mpirun from node 0 (`--host` the four nodes, started through
#            bench/peers/netns_rsh instead of ssh) runs `pipesgd worker` with no MASTER_ADDR:
#            rank 0 listens at mpirun's host; bits equal the local run's.
#   program  `pipesgd run -H lab0..lab3 -- allreduce_check` over the lab's sshd: a program that
#            is not pipesgd gets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and the job token,
#            and its exact AllReduce passes on every node.
#   api      docs/examples/train_least_squares on lab0 and lab1, given only the master's
#            HOST:PORT, its rank and the world size on the command line (ConnectOptions set by
#            hand, bind_host left at its default): both ranks converge, with the same weights.
#   torch_srun, torch_mpirun  the PyTorch example on the pipesgd backend under srun / mpirun
#            across the four nodes (registered with the torch tier; PIPESGD_PYTHONPATH is the
#            build's python/): bits equal the same script under a local `pipesgd run -np 4 --`.
#
# Nothing is left behind: daemons are stopped by their PIDs, every process in the lab's
# namespaces is ended, the lab is taken down.
# Needs root and network namespaces; otherwise prints why and exits 77 (ctest: skipped).
# Usage: launchers_test.sh MODE PIPESGD_BINARY ALLREDUCE_CHECK_BINARY SOURCE_DIR [EXAMPLE_BINARY]
set -uo pipefail
MODE="$1"; PIPESGD=$(realpath "$2"); CHECK=$(realpath "$3"); SRC=$(realpath "$4")
EXAMPLE=$(realpath "${5:-/nonexistent}" 2>/dev/null || true)
export PIPESGD  # docs/examples/pipesgd.sbatch runs it

if [[ $(id -u) -ne 0 ]]; then echo "SKIPPED: the cluster tier needs root"; exit 77; fi
# Slurm's node names must resolve on every node: a private /etc/hosts, in a mount namespace of
# this test's own (the machine's file is not touched).
if [[ -z "${PIPESGD_LAUNCHERS_TEST_NS:-}" ]]; then
  command -v unshare > /dev/null || { echo "FAIL: unshare (util-linux) not installed"; exit 1; }
  PIPESGD_LAUNCHERS_TEST_NS=1 exec unshare -m --propagation private "$0" "$@"
fi
export LAB_PREFIX="psgdla$$" LAB_SUBNET="10.92.$(( $$ % 200 ))"
LAB="$SRC/scripts/lab"
CONFIG="$SRC/configs/fashion_mnist_mlp.pbtxt"
SHORT=(--set train.max_steps=200 --set train.epochs=1)
if ! ip netns add "${LAB_PREFIX}-probe" 2>/dev/null; then
  echo "SKIPPED: cannot create network namespaces here"; exit 77
fi
ip netns del "${LAB_PREFIX}-probe"

tmp=$(mktemp -d)
daemon_pidfiles=()  # of the daemons this script started
cleanup() {
  local f p i
  for f in "${daemon_pidfiles[@]}"; do
    [[ -f "$f" ]] && kill -9 "$(cat "$f")" 2>/dev/null
  done
  # Whatever still runs in the lab's namespaces was started by this test (slurmstepd, orted).
  for i in 0 1 2 3; do
    for p in $(ip netns pids "${LAB_PREFIX}-n$i" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
  done
  "$LAB" down > /dev/null 2>&1
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }
show() { for f in "$@"; do echo "--- $f"; cat "$f"; done; }
need() { command -v "$1" > /dev/null || fail "$1 not installed ($2; scripts/install_deps.sh)"; }

"$LAB" up 4 > /dev/null || fail "lab up"
addr() { "$LAB" addr "$1"; }
node_ns() { echo "/run/netns/${LAB_PREFIX}-n$1"; }
# On node I with hostname labI: the network namespace only (nsenter, unlike `ip netns exec`,
# keeps /sys and its cgroup mounts, which slurmd needs) and a UTS namespace for the name.
on_node() {
  local i=$1; shift
  nsenter --net="$(node_ns "$i")" unshare -u sh -c 'hostname "$0"; exec "$@"' "lab$i" "$@"
}

# The reference: the same job from `pipesgd run -np 4` on this machine.
reference() {
  "$PIPESGD" run -np 4 "$CONFIG" "${SHORT[@]}" --out "$tmp/local" > "$tmp/local.out" 2>&1 \
    || { show "$tmp/local.out"; fail "local run"; }
}
# same_bits DIR WHAT: DIR/summary.json has the local run's final test loss and accuracy exactly.
same_bits() {
  python3 - "$tmp/local/summary.json" "$1/summary.json" "$2" << 'PY' || exit 1
import json, sys
want, got = (json.load(open(p)) for p in sys.argv[1:3])
keys = ("final_test_loss", "final_test_accuracy", "steps")
if any(want[k] != got[k] for k in keys):
    print("FAIL: %s: %s, local -np 4: %s" % (sys.argv[3], [got[k] for k in keys], [want[k] for k in keys]))
    sys.exit(1)
print("ok: %s: final test loss %r, accuracy %r after %d steps = local -np 4, to the bit"
      % (sys.argv[3], got["final_test_loss"], got["final_test_accuracy"], got["steps"]))
PY
}
# Every rank ran on its own node: "rank I on HOST: transport tcp, interface eth0, address A".
on_their_nodes() {
  local i
  for i in 0 1 2 3; do
    grep -qE "rank $i on [^:]+: transport tcp, interface eth0, address $(addr "$i")\$" "$1" \
      || { show "$1"; fail "$2: rank $i did not run on node $i ($(addr "$i"))"; }
  done
}

# Slurm for real across the lab: munged, slurmctld on lab0, a slurmd per node; SLURM_CONF set.
slurm_up() {
  need slurmctld "Debian slurmctld"; need slurmd "Debian slurmd"; need srun "Debian slurm-client"
  need munged "Debian munge"
  local d="$tmp/slurm" i
  mkdir -p "$d/state" "$d/spool" && chmod 700 "$d"
  { cat /etc/hosts; for i in 0 1 2 3; do echo "$(addr "$i") lab$i"; done; } > "$d/hosts"
  mount --bind "$d/hosts" /etc/hosts || fail "bind-mount the lab's /etc/hosts"
  head -c 1024 /dev/urandom > "$d/munge.key" && chmod 400 "$d/munge.key"
  # --force: munged refuses root and group-writable parents otherwise.
  munged --force --key-file="$d/munge.key" --socket="$d/munge.sock" --pid-file="$d/munged.pid" \
    --log-file="$d/munged.log" --seed-file="$d/munge.seed" || fail "munged did not start"
  daemon_pidfiles+=("$d/munged.pid")
  cat > "$d/slurm.conf" << CONF
ClusterName=pipesgdlab
SlurmctldHost=lab0($(addr 0))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$d/munge.sock
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$d/state
SlurmdSpoolDir=$d/spool/%n
SlurmctldPidFile=$d/slurmctld.pid
SlurmdPidFile=$d/slurmd.%n.pid
SlurmctldLogFile=$d/slurmctld.log
SlurmdLogFile=$d/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/linear
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
NodeName=lab[0-3] NodeAddr=${LAB_SUBNET}.[1-4] CPUs=1 State=UNKNOWN
PartitionName=lab Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
  export SLURM_CONF="$d/slurm.conf"
  on_node 0 slurmctld -i -f "$SLURM_CONF" || fail "slurmctld did not start"
  daemon_pidfiles+=("$d/slurmctld.pid")
  for i in 0 1 2 3; do
    mkdir -p "$d/spool/lab$i"
    on_node "$i" slurmd -N "lab$i" -f "$SLURM_CONF" || { show "$d/slurmd.lab$i.log"; fail "slurmd lab$i"; }
    daemon_pidfiles+=("$d/slurmd.lab$i.pid")
  done
  local deadline=$((SECONDS + 30))
  until [[ $(on_node 0 sinfo -h -t idle -o %D 2> /dev/null) == 4 ]]; do
    [[ $SECONDS -ge $deadline ]] && { show "$d/slurmctld.log"; fail "4 idle Slurm nodes within 30 s"; }
    sleep 0.5
  done
  echo "ok: Slurm up: slurmctld on lab0, slurmd on lab0..lab3, 4 nodes idle"
}

mode_slurm() {
  reference
  slurm_up
  # srun passes this environment to every task; pipesgd run would set these two itself.
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
    on_node 0 timeout 120 srun -N4 -n4 --kill-on-bad-exit=1 "$PIPESGD" worker "$CONFIG" \
    "${SHORT[@]}" --out "$tmp/srun" > "$tmp/srun.out" 2>&1 || { show "$tmp/srun.out"; fail "srun"; }
  grep -q "rank 0 of 4 from Slurm's environment; rendezvous lab0:" "$tmp/srun.out" \
    || { show "$tmp/srun.out"; fail "srun: rank 0 did not take its place from Slurm"; }
  on_their_nodes "$tmp/srun.out" srun
  same_bits "$tmp/srun" "srun -N4 -n4 pipesgd worker"

  # The documented batch script, as a user submits it (its output file is in the cwd).
  (cd "$tmp" && on_node 0 timeout 180 sbatch --wait --quiet \
     "$SRC/docs/examples/pipesgd.sbatch" "$CONFIG" "${SHORT[@]}" --out "$tmp/sbatch") \
    || { show "$tmp"/pipesgd-*.out; fail "sbatch docs/examples/pipesgd.sbatch"; }
  on_their_nodes "$(ls "$tmp"/pipesgd-*.out)" sbatch
  same_bits "$tmp/sbatch" "sbatch docs/examples/pipesgd.sbatch"
}

# lab_mpirun OUTPUT ARGS...: Open MPI's mpirun from lab0, one rank per node, ARGS after its own.
lab_mpirun() {
  local out="$1"; shift
  need mpirun "Debian openmpi-bin"
  # As with ssh, mpirun starts remote ranks with a fresh environment: -x what must match.
  # Every orted started by mpirun itself and reporting to it directly: one run in the first
  # eight here failed in ORTE's routing tree ("set the MCA param routed=direct").
  "$LAB" exec 0 env LAB_PREFIX="$LAB_PREFIX" LAB_SUBNET="$LAB_SUBNET" timeout 180 \
    mpirun --allow-run-as-root -np 4 --host "$(addr 0),$(addr 1),$(addr 2),$(addr 3)" \
      --mca plm_rsh_agent "$SRC/bench/peers/netns_rsh" --mca plm_rsh_no_tree_spawn 1 \
      --mca routed direct -x OPENBLAS_NUM_THREADS=1 -x OMP_NUM_THREADS=1 "$@" \
    > "$out" 2>&1 || { show "$out"; fail "mpirun -np 4 from lab0 ($*)"; }
}

mode_mpirun() {
  need mpirun "Debian openmpi-bin"
  reference
  lab_mpirun "$tmp/mpirun.out" "$PIPESGD" worker "$CONFIG" "${SHORT[@]}" --out "$tmp/mpirun"
  grep -q "rank 0 of 4 from Open MPI's environment; rendezvous $(addr 0):" \
    "$tmp/mpirun.out" || { show "$tmp/mpirun.out"; fail "mpirun: rank 0 did not listen at mpirun's host"; }
  on_their_nodes "$tmp/mpirun.out" mpirun
  same_bits "$tmp/mpirun" "mpirun -np 4 --host (4 nodes) pipesgd worker"
}

mode_program() {
  "$LAB" sshd > /dev/null || fail "lab sshd"
  local cfg; cfg=$("$LAB" ssh-config) || fail "lab ssh-config"
  "$LAB" exec 0 timeout 120 "$PIPESGD" run -H lab0:1,lab1:1,lab2:1,lab3:1 -F "$cfg" \
    -- "$CHECK" > "$tmp/program.out" 2>&1 || { show "$tmp/program.out"; fail "pipesgd run -- allreduce_check"; }
  local i
  for i in 0 1 2 3; do
    grep -q "^\[rank $i\] rank $i ok" "$tmp/program.out" || { show "$tmp/program.out"; fail "rank $i of the program"; }
  done
  grep -q "starting 4 ranks over ssh" "$tmp/program.out" || fail "the launcher did not go over ssh"
  echo "ok: pipesgd run -H lab0..lab3 -- allreduce_check: exact on all 4 nodes"
}

mode_api() {
  [[ -x "$EXAMPLE" ]] || fail "api: no example binary (5th argument)"
  local master pids=() i rc=0
  master="$(addr 0):29613"
  for i in 0 1; do
    "$LAB" exec "$i" timeout 120 "$EXAMPLE" "$master" "$i" 2 > "$tmp/api.$i.out" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do wait "${pids[$i]}" || rc=1; done
  [[ $rc -eq 0 ]] || { show "$tmp/api.0.out" "$tmp/api.1.out"; fail "api: train_least_squares on lab0 and lab1"; }
  local w0 w1
  w0=$(grep -o "w = ([^)]*)" "$tmp/api.0.out"); w1=$(grep -o "w = ([^)]*)" "$tmp/api.1.out")
  [[ -n "$w0" && "$w0" == "$w1" ]] || { show "$tmp/api.0.out" "$tmp/api.1.out"; fail "api: the two ranks' weights differ"; }
  echo "ok: train_least_squares on lab0 and lab1 (rendezvous $master by hand): $w0 on both"
}

# The PyTorch example (examples/torch/train_fashion_mnist.py) on pipesgd's torch.distributed
# backend, with pipesgd's q8 hook, started by a launcher of the lab: its final test loss and
# accuracy equal those of the same script under a local `pipesgd run -np 4 --`, to the bit, and
# every rank ran on its own node (the addresses the example records in summary.json).
TORCH_EXAMPLE="$SRC/examples/torch/train_fashion_mnist.py"
TORCH_ARGS=(--model mlp --train-limit 5120 --test-limit 1000 --epochs 1 --backend pipesgd
            --compression q8 --error-feedback)
torch_reference() {
  [[ -n "${PIPESGD_PYTHONPATH:-}" ]] || fail "PIPESGD_PYTHONPATH (the build's python/) is unset"
  export PYTHONPATH="$PIPESGD_PYTHONPATH"
  /usr/bin/python3 -c "import pipesgd.torch" || fail "import pipesgd.torch from $PYTHONPATH"
  OMP_NUM_THREADS=1 "$PIPESGD" run -np 4 -- /usr/bin/python3 "$TORCH_EXAMPLE" "${TORCH_ARGS[@]}" \
    --out "$tmp/torch_local" > "$tmp/torch_local.out" 2>&1 \
    || { show "$tmp/torch_local.out"; fail "local pipesgd run -np 4 -- the torch example"; }
}
torch_same_bits() {  # DIR WHAT
  python3 - "$tmp/torch_local/summary.json" "$1/summary.json" "$2" "$(addr 0)" "$(addr 1)" \
    "$(addr 2)" "$(addr 3)" << 'PY' || exit 1
import json, sys
want, got = (json.load(open(p)) for p in sys.argv[1:3])
keys = ("final_test_loss", "final_test_accuracy", "steps")
if any(want[k] != got[k] for k in keys):
    print("FAIL: %s: %s, local -np 4: %s" % (sys.argv[3], [got[k] for k in keys], [want[k] for k in keys]))
    sys.exit(1)
if got["details"]["rank_addresses"] != sys.argv[4:8]:
    print("FAIL: %s: ranks at %s, expected one per node: %s" % (sys.argv[3], got["details"]["rank_addresses"], sys.argv[4:8]))
    sys.exit(1)
print("ok: %s: final test loss %r, accuracy %r after %d steps = local -np 4, to the bit; ranks at %s"
      % (sys.argv[3], got["final_test_loss"], got["final_test_accuracy"], got["steps"],
         ", ".join(got["details"]["rank_addresses"])))
PY
}

mode_torch_srun() {
  torch_reference
  slurm_up
  # srun passes this environment (PYTHONPATH included) to every task.
  OMP_NUM_THREADS=1 on_node 0 timeout 180 srun -N4 -n4 --kill-on-bad-exit=1 /usr/bin/python3 \
    "$TORCH_EXAMPLE" "${TORCH_ARGS[@]}" --out "$tmp/torch_srun" > "$tmp/torch_srun.out" 2>&1 \
    || { show "$tmp/torch_srun.out"; fail "srun the torch example"; }
  torch_same_bits "$tmp/torch_srun" "srun -N4 -n4 python3 train_fashion_mnist.py"
}

mode_torch_mpirun() {
  need mpirun "Debian openmpi-bin"
  torch_reference
  lab_mpirun "$tmp/torch_mpirun.out" -x PYTHONPATH /usr/bin/python3 "$TORCH_EXAMPLE" \
    "${TORCH_ARGS[@]}" --out "$tmp/torch_mpirun"
  torch_same_bits "$tmp/torch_mpirun" "mpirun -np 4 --host (4 nodes) python3 train_fashion_mnist.py"
}

case "$MODE" in
  slurm) mode_slurm ;;
  mpirun) mode_mpirun ;;
  torch_srun) mode_torch_srun ;;
  torch_mpirun) mode_torch_mpirun ;;
  program) mode_program ;;
  api) mode_api ;;
  *) fail "unknown mode '$MODE' (slurm, mpirun, program, api, torch_srun, torch_mpirun)" ;;
esac

for f in "${daemon_pidfiles[@]}"; do [[ -f "$f" ]] && kill "$(cat "$f")" 2> /dev/null; done
sleep 0.5
cleanup
trap - EXIT
left=$(ip netns list | grep -c "^${LAB_PREFIX}" || true)
[[ "$left" -eq 0 ]] || fail "$left namespaces left behind"
echo "ok: lab down, daemons stopped"
