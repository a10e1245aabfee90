#!/usr/bin/env bash
# The test suite under the sanitizers (CI runs this after scripts/test.sh):
#   ASan+UBSan: every unit and multi-process test (undefined behaviour is fatal);
#   TSan: the concurrency tests (trainer threads, ring, peer failure, compression).
# Usage: scripts/sanitize.sh [asan|tsan|all] [build|test|both]   (defaults: all, both)
#   build: only build the instrumented binaries (CI builds one while the previous suite runs)
#   test:  only run the tests of a build made before
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH="${1:-all}"
PHASE="${2:-both}"
case "$WHICH" in asan|tsan|all) ;; *) echo "sanitize: '$WHICH': expected asan, tsan or all" >&2; exit 2 ;; esac
case "$PHASE" in build|test|both) ;; *) echo "sanitize: '$PHASE': expected build, test or both" >&2; exit 2 ;; esac
building() { [[ "$PHASE" == build || "$PHASE" == both ]]; }
testing() { [[ "$PHASE" == test || "$PHASE" == both ]]; }
jobs="$(nproc)"
# -O1 rather than RelWithDebInfo's -O2: the instrumented builds compile about 30% faster (they
# are most of CI's time) and the sanitizers' reports stay exact.
opt=(-DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g -DNDEBUG")
export OPENBLAS_NUM_THREADS=1
# One OpenMP thread for oneDNN, as `pipesgd run` starts ranks: libgomp is not instrumented, so
# TSan cannot see its barriers and would report its team's hand-offs as races.
export OMP_NUM_THREADS=1
# clang for both builds, CI's longest steps: measured on 2 cores, the ASan+UBSan build in 527 s
# and its tests in 328 s (gcc's: ~940 s and 438 s in CI's log), the TSan build in 167 s and its
# tests in 271 s (gcc's: ~265 s and 399 s). test.sh's Release build is gcc's, so every file also
# compiles with both compilers. clang's ASan also sees a use after scope that gcc's missed.
command -v clang++ >/dev/null || { echo "sanitize: needs clang (apt-get install clang)" >&2; exit 1; }
clang=(-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++)
fresh_if_gcc() {  # a build directory configured by gcc before this script used clang
  if [[ -f $1/CMakeCache.txt ]] && ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++' "$1/CMakeCache.txt"; then
    rm -rf "$1"
  fi
}
# Also excluded under ASan: the longest multi-process jobs (together 140 s of its ~600 s of tests,
# four instrumented ranks each: CI is CPU-bound) whose code under ASan another, shorter test
# runs: every mode's job (PS, pipeline stages, SDPIPE, auto values) in JobModes.EveryMode... and
# BadInput...InEveryMode, the evaluation and target in TimeToAccuracy's other cases, UCX in
# transport_conformance_test, the auto values' trials in autotune_test, the AllReduce the bench
# CLI times in ring_allreduce_test. They run in the Release suite (scripts/test.sh).
asan_skip="TimeToAccuracy.EveryModeEvaluates|Transports.UcxTrains|PipelineJob.TwoStagesTimesTwo"
asan_skip+="|ParameterServer.TrainsAndReports|bench.output_reads|AutoJob.TrainsTheSameBits"
asan_skip+="|AutoJob.AResumeKeeps"
if [[ "$WHICH" == asan || "$WHICH" == all ]]; then
  if building; then
    fresh_if_gcc build-asan
    # PIPESGD_FUZZ=ON: the fuzz targets too (scripts/fuzz.sh --build build-asan), on the same
    # ASan+UBSan libraries, with libFuzzer's edge counters (CMakeLists.txt).
    cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${clang[@]}" \
      -DPIPESGD_SANITIZE=address,undefined -DPIPESGD_FUZZ=ON -DPIPESGD_BUILD_BENCH=OFF "${opt[@]}" >/dev/null
    cmake --build build-asan --parallel "$jobs"
  fi
  if testing; then
    ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1 \
      ctest --test-dir build-asan -LE "cluster|rdma" --output-on-failure -j "$jobs" \
      -E "MainJob|CompressedMainJob|CnnJob|SlowLinkConfigs|StartupFailure|StalledRank|$asan_skip"
  fi
  # Excluded: the accuracy runs (same code paths as shorter tests, 3x slower here) and the
  # phase x victim matrix (38 four-process jobs, mostly waiting out deadlines; the relay and the
  # rendezvous under ASan are failure_relay_test and rendezvous_test).
fi
if [[ "$WHICH" == tsan || "$WHICH" == all ]]; then
  if building; then
    fresh_if_gcc build-tsan
    cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "${clang[@]}" \
      -DPIPESGD_SANITIZE=thread "${opt[@]}" >/dev/null
    # UCX patches mmap/munmap/madvise in every loaded library's relocation table when it is
    # loaded; under TSan's interceptors that crashes any process linking libucx (SIGSEGV, e.g. in
    # the rwlock interceptor as a thread exits), so switch it off: for the tests, and for the
    # build too, which runs each test binary to list its tests (seen crashing there once).
    UCX_MEM_MMAP_HOOK_MODE=none cmake --build build-tsan --parallel "$jobs" --target trainer_test staleness_test \
      ring_allreduce_test ring_compression_test failure_test transport_conformance_test \
      ps_trainer_test timeline_test staged_allreduce_test sdpipe_test device_slots_test api_test \
      pipeline_p2p_test pipeline_trainer_test powersgd_test failure_relay_test rendezvous_test \
      autotune_test outer_loop_test
  fi
  if testing; then
    UCX_MEM_MMAP_HOOK_MODE=none TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 \
      ctest --test-dir build-tsan -LE rdma --output-on-failure -j "$jobs" \
      -R "StaleRecurrence|Divergence|DataParallel|StalenessCompensation|StalenessStability|SyncWarmup|RingAllReduce|RingMatrix|RingStreams|CompressedRing|PeerFailure|PeerStall|Conformance|PsSync|PsAsync|TimelineTraining|StagedAllReduce|SdpipeService|GroupAveraging|SdpipeTrainer|DeviceSlots|ApiTrainer|PipelineP2p|PipelineTrainer|PowerSgd|FailureRelay|Rendezvous\.|AutoTune|OuterLoop|OuterRecurrence"
  fi
fi
