# Sourced by the lab benchmarks (bench/compare_allreduce.sh, bench/compression_lab.sh), from
# the repository root with LAB_PREFIX, LAB_SUBNET and RATE set: brings the 4-node lab up,
# shapes it to RATE, takes it down on exit, and measures the link's TCP goodput with iperf3.
# Sets: master (node 0's address), tmp (a scratch directory), goodput_gbps. Defines run_mode,
# for the training experiments (BIN, CONFIG and the COMMON argument array set by the caller).
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  scripts/lab down >/dev/null 2>&1 || true
  # The runs' scratch (their outputs and logs): the results were copied out of it.
  [[ -z "${tmp:-}" ]] || rm -rf "$tmp"
}
trap cleanup EXIT
scripts/lab up 4
scripts/lab shape "$RATE"
master=$(scripts/lab addr 0)
tmp=$(mktemp -d)
# TCP congestion control inside the nodes: the host's default unless TCP_CC names one (each
# namespace has its own setting; a kernel whose default is bbr gives the lab bbr, while Debian's
# is cubic). Printed, as it changes what a shaped link delivers. A namespace may only take what
# the host's net.ipv4.tcp_allowed_congestion_control lists (a host-wide setting: not changed here).
if [[ -n "${TCP_CC:-}" ]]; then
  allowed=$(sysctl -n net.ipv4.tcp_allowed_congestion_control)
  if [[ " $allowed " != *" $TCP_CC "* ]]; then
    echo "TCP_CC=$TCP_CC: the host allows only '$allowed' in a namespace;" \
      "add it with: sysctl -w net.ipv4.tcp_allowed_congestion_control='$allowed $TCP_CC'" >&2
    exit 2
  fi
  for i in 0 1 2 3; do
    scripts/lab exec "$i" sysctl -qw "net.ipv4.tcp_congestion_control=$TCP_CC"
  done
fi
echo "tcp congestion control in the nodes: $(scripts/lab exec 0 sysctl -n net.ipv4.tcp_congestion_control)"

# Link goodput, one TCP flow, measured inside the lab (never from the root namespace).
scripts/lab exec 0 iperf3 -s -1 -B "$master" > /dev/null 2>&1 &
pids+=($!)
sleep 0.5
scripts/lab exec 1 iperf3 -c "$master" -t 10 -J > "$tmp/iperf.json"
wait "${pids[@]}" 2>/dev/null || true
pids=()
goodput_gbps=$(python3 -c "import json; print(f\"{json.load(open('$tmp/iperf.json'))['end']['sum_received']['bits_per_second']/1e9:.4f}\")")
echo "iperf3 goodput: $goodput_gbps Gbit/s"

run_mode() {  # run_mode NAME --set ...: one rank per node, rank 0's metrics into $tmp/NAME
  local name="$1"; shift
  local port=$((29600 + RANDOM % 300))
  for i in 0 1 2 3; do
    RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 \
      timeout 900 scripts/lab exec "$i" "$BIN" worker "$CONFIG" "${COMMON[@]}" "$@" \
      $([[ $i == 0 ]] && echo --out "$tmp/$name") > "$tmp/$name.$i.log" 2>&1 &
    pids+=($!)
  done
  local rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=$?; done
  pids=()
  grep -E "epoch|final" "$tmp/$name.0.log" | tail -n 3 || true
  [[ $rc == 0 ]] || { echo "$name failed (rc $rc):"; tail -n 20 "$tmp"/$name.*.log; exit 1; }
}
