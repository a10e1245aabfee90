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
    RANK=$i WORLD_SIZE=4 MASTER_ADDR=$master MASTER_PORT=$port OPENBLAS_NUM_THREADS=1 \
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
