#!/usr/bin/env bash
# Installs what the PyTorch backend (python/, `import pipesgd.torch`) and its test tier need on
# Debian 12: PyTorch 1.13 for /usr/bin/python3 (python3-torch), its C++ headers and libraries
# (libtorch-dev, which brings python3-dev) and pybind11-dev. About 400 MB installed. Not in
# install_deps.sh: the trainer, its tests and the quick start need none of it. After it, a
# configure of the build (cmake -S . -B build) finds them and builds python/ (cmake/torch.cmake).
# Idempotent (scripts/apt_install.sh). Needs root (or sudo).
set -euo pipefail
exec "$(dirname "$0")/apt_install.sh" torch_deps python3-torch libtorch-dev pybind11-dev python3-numpy
