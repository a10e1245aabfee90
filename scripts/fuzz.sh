#!/usr/bin/env bash
# Fuzzes every decoder of untrusted input with libFuzzer (clang from Debian's archive):
# job configs and --set overrides, control-message frames (rendezvous and connection hellos),
# chunk headers, checkpoint files. Any crash, sanitizer report or non-pipesgd exception fails.
#   scripts/fuzz.sh [SECONDS_PER_TARGET]    default 10 (CI runs 5); a longer run: scripts/fuzz.sh 600
#   scripts/fuzz.sh --build-only            build the targets, run nothing
#   scripts/fuzz.sh --build DIR [SECONDS]   the targets of an existing build configured with
#                                           PIPESGD_FUZZ=ON: CI uses scripts/sanitize.sh's
#                                           ASan+UBSan build (build-asan), which has them, instead
#                                           of compiling every library under the sanitizers again
#                                           (edge counters only there, no comparison tracing)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_ONLY=0
BUILD=build-fuzz
OWN_BUILD=1
if [[ ${1:-} == --build-only ]]; then BUILD_ONLY=1; shift; fi
if [[ ${1:-} == --build ]]; then
  [[ $# -ge 2 ]] || { echo "fuzz: --build needs a build directory" >&2; exit 2; }
  BUILD=$2 OWN_BUILD=0
  shift 2
  grep -q '^PIPESGD_FUZZ:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null ||
    { echo "fuzz: $BUILD is not a build configured with -DPIPESGD_FUZZ=ON" >&2; exit 2; }
fi
SECONDS_PER_TARGET="${1:-10}"
[[ "$SECONDS_PER_TARGET" =~ ^[0-9]+$ ]] ||
  { echo "fuzz: '$SECONDS_PER_TARGET': expected seconds per target, --build-only or --build DIR" >&2; exit 2; }
command -v clang++ >/dev/null || { echo "fuzz: needs clang (apt-get install clang)" >&2; exit 1; }
if [[ $OWN_BUILD -eq 1 ]]; then
  # -O1, as the sanitizer builds: about a third less compile time; libFuzzer's coverage and the
  # sanitizers' reports do not depend on the level.
  CC=clang CXX=clang++ cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g -DNDEBUG" -DPIPESGD_FUZZ=ON -DPIPESGD_BUILD_TESTS=OFF >/dev/null
fi
targets=(config_fuzz message_fuzz chunk_header_fuzz checkpoint_fuzz)
cmake --build "$BUILD" --parallel "$(nproc)" --target "${targets[@]}"
[[ $BUILD_ONLY -eq 1 ]] && { echo "fuzz: targets built"; exit 0; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for t in "${targets[@]}"; do
  corpus="$work/${t%_fuzz}"
  mkdir -p "$corpus"
  cp tests/fuzz/corpus/"${t%_fuzz}"/* "$corpus"/
  echo "fuzz: $t for $SECONDS_PER_TARGET s"
  # New inputs go to the scratch corpus, never into the repository; crashes land in $work.
  "$BUILD/tests/fuzz/$t" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$work/$t-" -print_final_stats=1 "$corpus" 2>&1 | grep -E "^(#|stat::number_of_executed_units|==|SUMMARY|Done)" | tail -3 ||
    { echo "fuzz: $t failed"; ls "$work"; exit 1; }
  if ls "$work/$t-"* >/dev/null 2>&1; then
    echo "fuzz: $t found a crash:"; ls "$work/$t-"*; exit 1
  fi
done
echo "fuzz: all targets ran clean"
