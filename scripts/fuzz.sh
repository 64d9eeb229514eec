#!/usr/bin/env bash
# Builds attn's libFuzzer targets (fuzz/) with clang, AddressSanitizer and
# UBSan over attn's own code (LibTorch is not instrumented), against
# Debian's LibTorch 1.13, and runs each for a bounded time on its corpus:
#
#   scripts/fuzz.sh [SECONDS] [--seed S]   # per run; default 60
#   scripts/fuzz.sh --runs N [--seed S]    # the first N inputs, however long
#
#   attn_fuzz_state_dict     the torch.save reader (fuzz/state_dict_input.h)
#   attn_fuzz_entry_points   scaled_dot_product_attention, MultiHeadAttention,
#                            KV-cache decoding, RotaryEmbedding, against a
#                            float64 oracle (fuzz/entry_points_input.h), at
#                            the widest CPU capability and at avx2 where the
#                            CPU has more (ATTN_CPU_CAPABILITY), whose
#                            vectors offset operands by other widths
#
# Each runs its committed regression inputs (fuzz/<target>/regressions)
# first, the entry points' at every CPU capability this CPU runs, portable
# included; then fuzzes from its seeds (fuzz/<target>/seeds) into a corpus
# started afresh (build-fuzz/corpus/).
#
# A run is reproducible: libFuzzer's seed is derived from the commit
# (`git rev-parse HEAD`; --seed S sets it) and printed, the seeds are
# listed in a fixed order, the address space is not randomised (setarch
# -R, where the kernel allows it) and the corpus is not reloaded, so the
# same commit on the same kind of CPU tries the same inputs in the same
# order; SECONDS only decides where the run stops. Each run prints its
# seed and the number of inputs it tried: `scripts/fuzz.sh --runs N --seed
# S` replays them all, on a slower machine too.
#
# It fails on any finding: a crash, a sanitizer report, an exception
# other than a c10::Error with a message, a wrong result, a leak, an
# input that runs over 30 s or a process over 2 GB. The input is then
# written to build-fuzz/findings/ (and printed in base64);
# `build-fuzz/fuzz/attn_fuzz_<target> FILE` replays it (with the run's
# ATTN_CPU_CAPABILITY), and ATTN_FUZZ_VERBOSE=1 prints what it decodes
# to. Once fixed, it goes to fuzz/<target>/regressions with its expected
# outcome in tests/test_fuzz_regressions.cpp.
#
# It also builds attn_backend_choices with clang and compares what it
# prints with the GCC build's in build/ (scripts/setup.sh test makes it,
# against the same LibTorch): attn::select_backend must choose the same
# backend for every request whichever compiler built attn.
set -euo pipefail

usage() {
  echo "usage: scripts/fuzz.sh [SECONDS | --runs N] [--seed S] (positive numbers)" >&2
  exit 2
}
positive() {
  [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -gt 0 ]
}

seconds=60
runs=
seed=
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) [ $# -ge 2 ] && positive "$2" || usage; runs="$2"; shift 2 ;;
    --seed) [ $# -ge 2 ] && positive "$2" || usage; seed="$2"; shift 2 ;;
    *) positive "$1" || usage; seconds="$1"; shift ;;
  esac
done

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

# libFuzzer's seed: --seed's, else one derived from the commit.
commit="$(git rev-parse HEAD 2>/dev/null || true)"
if [ -n "$seed" ]; then
  seed_source="--seed"
elif [ -n "$commit" ]; then
  seed=$((16#${commit:0:8} % 2147483647 + 1))
  seed_source="from commit ${commit:0:12}"
else
  seed=1
  seed_source="no git commit to derive it from"
fi
if [ -n "$runs" ]; then
  bound=(-runs="$runs")
  extent="the first $runs inputs"
else
  bound=(-max_total_time="$seconds")
  extent="$seconds s"
fi
# Without address randomisation: attn's coverage depends on alignments.
same_addresses=(setarch "$(uname -m)" -R)
if ! "${same_addresses[@]}" true 2>/dev/null; then
  echo "== setarch -R is refused here: addresses are randomised, and a run may not repeat exactly"
  same_addresses=()
fi
echo "== libFuzzer seed $seed ($seed_source), $extent per run, on $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"

flags=(-timeout=30 -rss_limit_mb=2048)
# fuzzer NAME [CAPABILITY] -- ARGS...: attn_fuzz_NAME at the CPU
# capability named (ATTN_CPU_CAPABILITY; the widest where none is).
fuzzer() {
  local name="$1" capability="$2"
  shift 3
  env ${capability:+ATTN_CPU_CAPABILITY="$capability"} "${same_addresses[@]}" \
    "./build-fuzz/fuzz/attn_fuzz_$name" "${flags[@]}" "$@"
}

# replay_regressions NAME [CAPABILITY]: the committed regression inputs,
# once each and whole.
replay_regressions() {
  local name="$1" capability="${2:-}" regressions=("fuzz/$1/regressions"/*)
  echo "== attn_fuzz_$name${capability:+ at $capability}: ${#regressions[@]} regression inputs"
  fuzzer "$name" "$capability" -- -artifact_prefix="build-fuzz/findings/$name-" \
    "${regressions[@]}"
}

# fuzz NAME CAPABILITY SEED_FOLDER... -- LIBFUZZER_FLAGS...: fuzzing from
# the seeds, in a fixed order, into a corpus started afresh; prints the
# number of inputs tried.
fuzz() {
  local name="$1" capability="$2"
  shift 2
  local folders=()
  while [ "$1" != -- ]; do
    [ -d "$1" ] && folders+=("$1")
    shift
  done
  shift
  local run="$name${capability:+-$capability}"
  local corpus="build-fuzz/corpus/$run" log="build-fuzz/$run.log"
  rm -rf "$corpus"
  mkdir -p "$corpus"
  find "${folders[@]}" -type f | LC_ALL=C sort | paste -sd, >"$corpus.seeds"
  echo "== attn_fuzz_$name${capability:+ at $capability} for $extent"
  local status=0
  fuzzer "$name" "$capability" -- "${bound[@]}" -seed="$seed" -reload=0 -print_final_stats=1 \
    -artifact_prefix="build-fuzz/findings/$run-" -seed_inputs=@"$corpus.seeds" "$@" "$corpus" \
    2>&1 | tee "$log" |
    grep -v -E '^#[0-9]+.*(NEW|REDUCE|pulse)|NEW_FUNC|^".*" # Uses: [0-9]+$|recommended dictionary' ||
    status=$?
  local tried
  tried="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")"
  echo "== attn_fuzz_$name${capability:+ at $capability}: ${tried:-?} inputs tried;" \
    "scripts/fuzz.sh --runs ${tried:-N} --seed $seed tries them again"
  return "$status"
}

mkdir -p build-fuzz/findings
failed=()
# Inputs up to 8 KB: the seeds' size. The regressions go whole.
{ replay_regressions state_dict &&
  fuzz state_dict "" fuzz/state_dict/seeds tests/fixtures/python -- \
    -dict=fuzz/state_dict.dict -max_len=8192; } || failed+=(state_dict)
# The entry points' regressions at every CPU capability this CPU runs;
# fuzzing at the widest, and at avx2 where the CPU has wider vectors.
mapfile -t capabilities < <(ATTN_FUZZ_LIST_CAPABILITIES=1 ./build-fuzz/fuzz/attn_fuzz_entry_points)
for capability in "${capabilities[@]}"; do
  replay_regressions entry_points "$capability" ||
    failed+=("entry_points regressions at $capability")
done
for capability in "${capabilities[@]}"; do
  if [ "$capability" = "${capabilities[0]}" ] ||
    { [ "$capability" = avx2 ] && [ "${capabilities[0]}" != avx2 ]; }; then
    fuzz entry_points "$capability" fuzz/entry_points/seeds -- ||
      failed+=("entry_points at $capability")
  fi
done

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
  printf 'fuzzing found a problem in: %s\n' "${failed[@]}" >&2
  echo "the inputs are in build-fuzz/findings/; the runs' whole output in build-fuzz/*.log" >&2
  exit 1
fi
echo "fuzzing found nothing in $extent per run (seed $seed)"
