#!/usr/bin/env bash
# The README's first command: installs the Debian packages, builds pipesgd (Release), and runs the
# main job: 4 local workers train the Fashion-MNIST MLP with Pipe-SGD (pipeline width 2) over a
# TCP ring AllReduce on loopback. Metrics land in out/main_job/ (metrics.jsonl, summary.json).
# Extra arguments go to `pipesgd run`, e.g.  scripts/quickstart.sh --set train.pipeline_width=1
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install_deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build --parallel "$(nproc)"
exec build/launcher/pipesgd run -np 4 configs/fashion_mnist_mlp.pbtxt --out out/main_job --overwrite "$@"
