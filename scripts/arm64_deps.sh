#!/usr/bin/env bash
# Installs what scripts/arm64_check.sh needs on a Debian 12 amd64 host: the aarch64 cross
# toolchain, arm64 multiarch -dev packages of the minimal build's libraries, and qemu-user.
# Idempotent; apt runs under /tmp/pipesgd-apt.lock so concurrent installs on a shared machine
# queue instead of failing on dpkg's lock. Needs root (or sudo).
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
  libgtest-dev:arm64 nlohmann-json3-dev
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "arm64_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi
echo "arm64_deps: installing ${missing[*]}"
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO flock /tmp/pipesgd-apt.lock apt-get update -q
$SUDO flock /tmp/pipesgd-apt.lock apt-get install -y -q --no-install-recommends "${missing[@]}"
