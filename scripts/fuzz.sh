#!/usr/bin/env bash
# Builds attn's libFuzzer targets (fuzz/) with clang, AddressSanitizer and
# UBSan over attn's own code (LibTorch is not instrumented), against
# Debian's LibTorch 1.13, and runs each for a bounded time on its corpus:
#
#   scripts/fuzz.sh [SECONDS]   # per target; default 60
#
#   attn_fuzz_state_dict     the torch.save reader (fuzz/state_dict_input.h)
#   attn_fuzz_entry_points   scaled_dot_product_attention, MultiHeadAttention,
#                            KV-cache decoding, RotaryEmbedding, against a
#                            float64 oracle (fuzz/entry_points_input.h)
#
# Each runs its committed regression inputs (fuzz/<target>/regressions),
# then fuzzes from its seeds (fuzz/<target>/seeds) and the corpus that
# earlier runs grew in build-fuzz/corpus/<target>. It
# fails on any finding: a crash, a sanitizer report, an exception other
# than a c10::Error with a message, a wrong result, a leak, an input that
# runs over 30 s or a process over 2 GB. The input is then written to
# build-fuzz/findings/; `build-fuzz/fuzz/attn_fuzz_<target> FILE` replays
# it, and ATTN_FUZZ_VERBOSE=1 prints what it decodes to. Once fixed, it
# goes to fuzz/<target>/regressions with its expected outcome in
# tests/test_fuzz_regressions.cpp.
#
# It also builds attn_backend_choices with clang and compares what it
# prints with the GCC build's in build/ (scripts/setup.sh test makes it,
# against the same LibTorch): attn::select_backend must choose the same
# backend for every request whichever compiler built attn.
set -euo pipefail

seconds="${1:-60}"
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "usage: scripts/fuzz.sh [SECONDS] (a positive number of seconds per target)" >&2
  exit 2
fi

cd "$(dirname "$0")/.."
source scripts/lib/install_missing.sh

packages=(clang-14 libclang-rt-14-dev libomp-14-dev libtorch-dev cmake ninja-build)
install_missing "${packages[@]}"

# -O1 and line tables only: a quick build with readable stack traces. Only
# the library and the two targets are built.
cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++-14 -DCMAKE_BUILD_TYPE=Release \
      "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -gline-tables-only" -DATTN_FUZZ=ON \
      -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_APPS=OFF -DATTN_BUILD_BENCHMARKS=OFF -DATTN_INSTALL=OFF
cmake --build build-fuzz --target attn_fuzz_state_dict attn_fuzz_entry_points attn_backend_choices

# allocator_may_return_null: an allocation too large for the machine makes
# LibTorch throw its c10::Error, as without ASan. The smaller quarantine,
# malloc stacks and fill keep the runs fast; leaks are still found.
export ASAN_OPTIONS=allocator_may_return_null=1:detect_leaks=1:malloc_context_size=2:quarantine_size_mb=16:max_malloc_fill_size=0
export UBSAN_OPTIONS=print_stacktrace=1

mkdir -p build-fuzz/findings
# run_target NAME EXTRA_CORPUS... -- LIBFUZZER_FLAGS...: the regression
# inputs once each, whole, then fuzzing from the seeds and the grown corpus.
run_target() {
  local name="$1"
  shift
  local corpora=()
  while [ "$1" != -- ]; do
    corpora+=("$1")
    shift
  done
  shift
  local fuzzer="./build-fuzz/fuzz/attn_fuzz_$name"
  local flags=(-timeout=30 -rss_limit_mb=2048 -artifact_prefix="build-fuzz/findings/$name-")
  local regressions=("fuzz/$name/regressions"/*)
  echo "== attn_fuzz_$name: ${#regressions[@]} regression inputs"
  "$fuzzer" "${flags[@]}" "${regressions[@]}" || return 1
  mkdir -p "build-fuzz/corpus/$name"
  echo "== attn_fuzz_$name for $seconds s"
  "$fuzzer" "${flags[@]}" -max_total_time="$seconds" -print_final_stats=1 "$@" \
    "build-fuzz/corpus/$name" "fuzz/$name/seeds" "${corpora[@]}" \
    2>&1 | grep -v -E '^#[0-9]+.*(NEW|REDUCE|pulse)|NEW_FUNC|^".*" # Uses: [0-9]+$|recommended dictionary'
}

failed=()
# Inputs up to 8 KB: the seeds' size. The regressions go whole.
run_target state_dict tests/fixtures/python -- -dict=fuzz/state_dict.dict -max_len=8192 ||
  failed+=(state_dict)
run_target entry_points -- || failed+=(entry_points)

if [ -x build/attn_backend_choices ]; then
  ./build/attn_backend_choices >build-fuzz/backend-choices-gcc.txt
  ./build-fuzz/attn_backend_choices >build-fuzz/backend-choices-clang.txt
  if diff build-fuzz/backend-choices-gcc.txt build-fuzz/backend-choices-clang.txt \
      >build-fuzz/backend-choices.diff; then
    echo "== backend choices: clang's and GCC's builds agree on $(wc -l <build-fuzz/backend-choices-gcc.txt) requests"
  else
    echo "clang's and GCC's builds choose different backends (build-fuzz/backend-choices.diff):" >&2
    head -20 build-fuzz/backend-choices.diff >&2
    failed+=(backend_choices)
  fi
else
  echo "== backend choices: not compared, there is no GCC build in build/ (run scripts/setup.sh test first)"
fi
if [ "${#failed[@]}" -gt 0 ]; then
  echo "fuzzing found a problem in: ${failed[*]}; the inputs are in build-fuzz/findings/" >&2
  exit 1
fi
echo "fuzzing found nothing in $seconds s per target"
