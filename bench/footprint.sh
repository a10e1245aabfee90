#!/usr/bin/env bash
# Footprint of a build (docs/footprint.md): library and binary sizes, and per rank during the
# main job (4 local workers, configs/fashion_mnist_mlp.pbtxt, TCP) the peak resident memory and
# threads, sampled from /proc/PID/status every 50 ms (VmHWM, VmRSS, RssAnon, RssFile, Threads).
#   bench/footprint.sh BUILD_DIR [extra pipesgd run arguments]
# Run it under the exclusive lock:  flock -x /tmp/pipesgd-cpu.lock bench/footprint.sh build
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:?usage: bench/footprint.sh BUILD_DIR}
shift
echo "== sizes (bytes) in $build"
for f in $(find "$build" -name 'libpipesgd_*.a' | sort) "$build/launcher/pipesgd"; do
  [[ -f $f ]] || continue
  line="$(basename "$f") $(stat -c %s "$f")"
  if [[ $f == */pipesgd ]]; then
    tmp=$(mktemp); strip -o "$tmp" "$f"; line+=" stripped $(stat -c %s "$tmp")"; rm -f "$tmp"
    line+=" | needs: $(ldd "$f" | awk '{print $1}' | grep -v 'linux-vdso' | tr '\n' ' ')"
  fi
  echo "$line"
done
bin=$build/launcher/pipesgd
[[ -x $bin ]] || { echo "no $bin (PIPESGD_BUILD_LAUNCHER=OFF?): no main-job numbers"; exit 0; }
out=$(mktemp -d /tmp/pipesgd-footprint.XXXXXX)
trap 'rm -rf "$out"' EXIT
OPENBLAS_NUM_THREADS=1 "$bin" run -np 4 configs/fashion_mnist_mlp.pbtxt --out "$out/job" "$@" \
  > "$out/job.log" 2>&1 &
launcher=$!
python3 - "$launcher" <<'PY'
import os, sys, time
launcher = int(sys.argv[1])
fields = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "Threads")
peak = {}  # pid -> {field: max}
def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []
def status(pid):
    d = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in fields:
                    d[k] = int(v.split()[0])
    except OSError:
        return None
    return d
while os.path.exists(f"/proc/{launcher}") and open(f"/proc/{launcher}/stat").read().split()[2] != "Z":
    for pid in [launcher] + children(launcher):
        s = status(pid)
        if s:
            p = peak.setdefault(pid, {})
            for k, v in s.items():
                p[k] = max(p.get(k, 0), v)
    time.sleep(0.05)
print("== per process peaks (KiB; Threads = most seen)")
for pid, p in peak.items():
    role = "launcher" if pid == launcher else "worker"
    print(role, pid, " ".join(f"{k}={p.get(k, 0)}" for k in fields))
PY
wait "$launcher"
grep -E 'final test accuracy|finished' "$out/job.log" || true
