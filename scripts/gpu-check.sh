#!/usr/bin/env bash
# Builds attn against a given LibTorch (2.x with CUDA, or any other), runs
# the whole test suite, the demo and the benchmarks on the GPU, and writes
# the reports to a folder. Made for a machine without network access:
#
#   scripts/gpu-check.sh prepare [DEPS]     # on a Debian 12 machine with apt:
#                                           # gathers GoogleTest and Google
#                                           # Benchmark sources and the fmt
#                                           # headers into DEPS (default .deps)
#   scripts/gpu-check.sh run LIBTORCH REPORTS [DEPS]
#                                           # on the GPU machine
#
# LIBTORCH is a LibTorch prefix (the unzipped C++ archive, or Python's
# `python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))'`, the torch package).
# Dependencies come from DEPS when it exists (built there once, into
# DEPS/install), else from the system. With CUDA present the CUDA variants
# of the tests must run (ATTN_REQUIRE_CUDA=1 turns their skips into
# failures), the demo runs with --device cuda and the benchmarks run the
# CUDA suite: attn against torch::nn::MultiheadAttention and
# at::scaled_dot_product_attention in float32, bfloat16 and float16, T up
# to 8192. Without CUDA everything runs on the CPU, with a short benchmark
# that only checks the harness. Exit code: 0 when every step passed.
set -euo pipefail

cd "$(dirname "$0")/.."
source scripts/lib/install_missing.sh
root="$(pwd)"

usage() {
  echo "usage: scripts/gpu-check.sh prepare [DEPS] | run LIBTORCH REPORTS [DEPS]" >&2
  exit 2
}

prepare() {
  local deps="${1:-.deps}"
  mkdir -p "$deps"
  deps="$(cd "$deps" && pwd)"
  # Sources of what Debian's libgtest-dev, libfmt-dev and libbenchmark-dev
  # provide, so that the GPU machine can build them with its own compiler.
  install_missing googletest libfmt-dev curl ca-certificates
  rm -rf "$deps/googletest" "$deps/fmt" "$deps/benchmark"
  cp -r /usr/src/googletest "$deps/googletest"
  mkdir -p "$deps/fmt/include"
  cp -r /usr/include/fmt "$deps/fmt/include/fmt"
  # Google Benchmark 1.7.1, as Debian 12 packages it, checked against the
  # SHA-256 that Debian's source description lists.
  local pool=http://deb.debian.org/debian/pool/main/b/benchmark
  local tarball=benchmark_1.7.1.orig.tar.gz
  curl -sSfo "$deps/benchmark.dsc" "$pool/benchmark_1.7.1-1.dsc"
  curl -sSfo "$deps/$tarball" "$pool/$tarball"
  local expected
  expected="$(awk -v f="$tarball" '/^Checksums-Sha256:/ {in_sums = 1; next}
                                   /^[^ ]/ {in_sums = 0}
                                   in_sums && $3 == f {print $1}' "$deps/benchmark.dsc")"
  echo "$expected  $deps/$tarball" | sha256sum -c --quiet
  mkdir -p "$deps/benchmark"
  tar -xzf "$deps/$tarball" -C "$deps/benchmark" --strip-components=1
  rm "$deps/$tarball" "$deps/benchmark.dsc"
  echo "Dependencies ready in $deps"
}

# Builds the sources in DEPS into DEPS/install, once.
build_deps() {
  local deps="$1" generator=("${@:2}")
  local install="$deps/install"
  if [ -d "$deps/googletest" ] && [ ! -f "$install/.googletest" ]; then
    cmake -S "$deps/googletest" -B "$deps/build/googletest" "${generator[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$install" -DCMAKE_POSITION_INDEPENDENT_CODE=ON
    cmake --build "$deps/build/googletest" --target install
    touch "$install/.googletest"
  fi
  if [ -d "$deps/benchmark" ] && [ ! -f "$install/.benchmark" ]; then
    cmake -S "$deps/benchmark" -B "$deps/build/benchmark" "${generator[@]}" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$install" \
      -DBENCHMARK_ENABLE_TESTING=OFF -DBENCHMARK_ENABLE_GTEST_TESTS=OFF -DBENCHMARK_ENABLE_WERROR=OFF
    cmake --build "$deps/build/benchmark" --target install
    touch "$install/.benchmark"
  fi
  if [ -d "$deps/fmt" ] && [ ! -f "$install/lib/cmake/fmt/fmt-config.cmake" ]; then
    # fmt as a header-only package: its headers compile the library inline.
    mkdir -p "$install/lib/cmake/fmt"
    cat > "$install/lib/cmake/fmt/fmt-config.cmake" <<EOF
if(NOT TARGET fmt::fmt)
  add_library(fmt::fmt INTERFACE IMPORTED)
  set_target_properties(fmt::fmt PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "$deps/fmt/include"
    INTERFACE_COMPILE_DEFINITIONS FMT_HEADER_ONLY=1)
endif()
EOF
  fi
}

run() {
  [ $# -ge 2 ] || usage
  local libtorch reports deps
  libtorch="$(cd "$1" && pwd)"
  mkdir -p "$2"
  reports="$(cd "$2" && pwd)"
  deps="${3:-.deps}"
  [ -d "$deps" ] && deps="$(cd "$deps" && pwd)"

  for tool in cmake c++; do
    command -v "$tool" >/dev/null || { echo "gpu-check: $tool is needed and not installed" >&2; exit 2; }
  done
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"

  local prefix="$libtorch"
  if [ -d "$deps" ]; then
    build_deps "$deps" "${generator[@]}"
    prefix="$deps/install;$libtorch"
  fi

  local build="$root/build-gpu"
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "libtorch: $libtorch"
    echo "compiler: $(c++ --version | head -1)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    command -v nvcc >/dev/null && nvcc --version | tail -1
  } > "$reports/environment.txt" 2>&1 || true

  # A fresh configuration, so that no package found for another LibTorch
  # or another DEPS lingers in the cache (the objects are reused).
  rm -f "$build/CMakeCache.txt"
  cmake -S "$root" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$prefix" 2>&1 | tee "$reports/configure.log"
  cmake --build "$build" 2>&1 | tee "$reports/build.log" | tail -5

  # Whether this LibTorch sees a GPU: the demo says which device "auto" chose.
  local device=cpu
  if "$build/apps/attn_demo" --device auto --json > "$reports/demo-auto.json" 2>&1 &&
     grep -q '"device": *"cuda' "$reports/demo-auto.json"; then
    device=cuda
  fi
  echo "device: $device" | tee -a "$reports/environment.txt"

  local status=0
  if [ "$device" = cuda ]; then
    ATTN_REQUIRE_CUDA=1 ctest --test-dir "$build" --output-on-failure -j "$(nproc)" \
      > "$reports/ctest.log" 2>&1 || status=1
  else
    ctest --test-dir "$build" --output-on-failure -j "$(nproc)" > "$reports/ctest.log" 2>&1 || status=1
  fi
  tail -3 "$reports/ctest.log"

  "$build/apps/attn_demo" --device "$device" > "$reports/demo.txt" 2>&1 || status=1
  tail -3 "$reports/demo.txt"

  if [ -x "$build/bench/attn_bench" ]; then
    local bench=(--benchmark_out="$reports/bench-$device.json" --benchmark_out_format=json)
    if [ "$device" = cuda ]; then
      ATTN_BENCH_DEVICE=cuda "$build/bench/attn_bench" "${bench[@]}" > "$reports/bench-$device.txt" 2>&1 || status=1
    else
      # The CPU suite takes minutes; its smallest shapes check the harness.
      "$build/bench/attn_bench" "${bench[@]}" '--benchmark_filter=/T:128/B:1/causal:0' \
        > "$reports/bench-$device.txt" 2>&1 || status=1
    fi
    if command -v python3 >/dev/null; then
      python3 "$root/bench/report.py" "$reports/bench-$device.json" "$reports/bench-$device.md" \
        > "$reports/report.log" 2>&1 || status=1
    fi
  else
    echo "gpu-check: no Google Benchmark, so no benchmarks (give DEPS from 'prepare')" | tee -a "$reports/environment.txt"
    status=1
  fi

  if [ "$status" -eq 0 ]; then
    echo "gpu-check: every step passed on $device; reports in $reports"
  else
    echo "gpu-check: a step failed on $device; see the logs in $reports" >&2
  fi
  return "$status"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  run) shift; run "$@" ;;
  *) usage ;;
esac
