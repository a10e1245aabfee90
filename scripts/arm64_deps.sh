#!/usr/bin/env bash
# Installs what scripts/arm64_check.sh needs on a Debian 12 amd64 host: the aarch64 cross
# toolchain, arm64 multiarch -dev packages of the minimal build's libraries, and qemu-user.
# Idempotent; scripts/apt_install.sh queues concurrent installs and finishes an interrupted one.
# Needs root (or sudo).
set -euo pipefail
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"

PACKAGES=(
  g++-aarch64-linux-gnu qemu-user file
  # host tools used by the cross build
  protobuf-compiler cmake ninja-build pkg-config
  # arm64 libraries of the minimal build (TCP + CPU; no UCX, verbs, CUDA)
  libprotobuf-dev:arm64 libboost-dev:arm64 libopenblas-dev:arm64
  libspdlog-dev:arm64 libfmt-dev:arm64 zlib1g-dev:arm64 libssl-dev:arm64
  libgtest-dev:arm64 libgmock-dev:arm64 nlohmann-json3-dev
)
# Before the check: `dpkg-query` of a :arm64 name and apt both need the architecture known.
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
exec "$(dirname "$0")/apt_install.sh" arm64_deps "${PACKAGES[@]}"
