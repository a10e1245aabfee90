#!/usr/bin/env bash
# Whether a refactor changed any number: the same short jobs with two pipesgd binaries, and
# their final test loss, accuracy and step count compared to the bit.
#
#   scripts/same_bits.sh OLD_PIPESGD NEW_PIPESGD
#
# OLD_PIPESGD is typically a build of the commit before the change, e.g.
#   git worktree add /tmp/old HEAD~1 && cmake -S /tmp/old -B /tmp/oldbuild -G Ninja \
#     -DCMAKE_BUILD_TYPE=Release -DPIPESGD_TORCH=OFF && ninja -C /tmp/oldbuild pipesgd
# The jobs: the MLP at width 2 (the shipped config, whole), width 1 with q8 and error feedback,
# width 2 with PowerSGD, a run that writes checkpoints (compared byte for byte too), the CNN,
# PS_SYNC (what is deterministic: PS_ASYNC, SDPIPE and the auto values depend on timing). Exit
# status 1 if any differs.
set -uo pipefail
OLD=$(realpath "${1:?OLD_PIPESGD}"); NEW=$(realpath "${2:?NEW_PIPESGD}")
cd "$(dirname "$0")/.."
C=$PWD/configs
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
differ=0
run() {  # run NAME CONFIG ARGS... (CKDIR in ARGS: a checkpoint directory of each binary's own)
  local name=$1 cfg=$2 v bin; shift 2
  for v in old new; do
    bin=$OLD; [[ $v == new ]] && bin=$NEW
    local args=("${@//CKDIR/$out/ck.$v}")
    if ! OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$bin" run -np 4 "$cfg" "${args[@]}" \
        --out "$out/$name.$v" > "$out/$name.$v.log" 2>&1; then
      echo "FAILED: $name with $bin"; tail -n 5 "$out/$name.$v.log"; differ=1; return
    fi
  done
  python3 - "$out/$name.old/summary.json" "$out/$name.new/summary.json" "$name" << 'PY' || differ=1
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
keys = ("final_test_loss", "final_test_accuracy", "steps")
same = all(a[k] == b[k] for k in keys)
print("%s %s: %s %s" % ("same" if same else "DIFFERENT", sys.argv[3], [a[k] for k in keys],
                        "" if same else [b[k] for k in keys]))
sys.exit(0 if same else 1)
PY
}
short=(--set train.epochs=1 --set data.train_limit=15360 --set data.test_limit=2000)
run mlp_shipped "$C/fashion_mnist_mlp.pbtxt"
run mlp_width1_q8_ef "$C/fashion_mnist_mlp.pbtxt" "${short[@]}" --set train.pipeline_width=1 \
  --set comm.compression=q8 --set comm.error_feedback=true
run mlp_powersgd4 "$C/fashion_mnist_mlp.pbtxt" "${short[@]}" --set comm.powersgd_rank=4
run mlp_checkpoints "$C/fashion_mnist_mlp.pbtxt" "${short[@]}" --set checkpoint.dir=CKDIR \
  --set checkpoint.every_steps=20
# The checkpoints themselves (parameters, optimizer state, pending aggregates, own gradients,
# residuals), byte for byte.
if [[ -d $out/ck.old && -d $out/ck.new ]]; then
  if diff -r -q "$out/ck.old" "$out/ck.new" > /dev/null; then
    echo "same mlp_checkpoints: $(ls "$out/ck.new" | wc -l) checkpoint files, byte for byte"
  else
    echo "DIFFERENT mlp_checkpoints: checkpoint files"; diff -r -q "$out/ck.old" "$out/ck.new"; differ=1
  fi
fi
run cnn "$C/fashion_mnist_cnn.pbtxt" --set train.max_steps=60 --set data.train_limit=15360 \
  --set data.test_limit=1000
run ps_sync "$C/fashion_mnist_mlp.pbtxt" "${short[@]}" --set train.mode=PS_SYNC
exit $differ
