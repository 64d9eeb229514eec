#!/usr/bin/env bash
# Installs what is missing (Debian 12, as root or with sudo), builds attn,
# then runs the demo or the whole test suite.
#
#   scripts/setup.sh demo   # install, build, run the shape demo
#   scripts/setup.sh test   # install, build, run every test through ctest,
#                           # then the tests under ASan and UBSan
#
# Against Debian's LibTorch 1.13 by default (build, build-asan); with
# `--libtorch pypi`, against the LibTorch inside the pinned PyPI torch 2.x
# wheel (scripts/pypi-libtorch.sh; build-pypi, build-asan-pypi).
set -euo pipefail

usage() {
  echo "usage: scripts/setup.sh demo|test [--libtorch debian|pypi]" >&2
  exit 2
}

mode="${1:-}"
case "$mode" in
  demo|test) ;;
  *) usage ;;
esac
libtorch=debian
if [ $# -gt 1 ]; then
  [ $# -eq 3 ] && [ "$2" = --libtorch ] || usage
  libtorch="$3"
fi
case "$libtorch" in
  debian|pypi) ;;
  *) usage ;;
esac

cd "$(dirname "$0")/.."
source scripts/lib/install_missing.sh

# libgloo-dev: the Gloo headers that c10d's ProcessGroupGloo.hpp includes,
# for attn::distributed; Debian's LibTorch and the PyPI wheel both have Gloo
# compiled in but ship no headers for it.
packages=(libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas0-openmp
          libcli11-dev nlohmann-json3-dev libgloo-dev cmake ninja-build g++ python3)
[ "$libtorch" = debian ] && packages+=(libtorch-dev)
# The Debian leg's sanitizer suite is built by clang (below).
[ "$libtorch" = debian ] && [ "$mode" = test ] && packages+=(clang-14 libclang-rt-14-dev libomp-14-dev)
install_missing "${packages[@]}"
use_openmp_openblas

configure=(-G Ninja -DCMAKE_BUILD_TYPE=Release)
if [ "$libtorch" = pypi ]; then
  suffix=-pypi
  configure+=("-DCMAKE_PREFIX_PATH=$(scripts/pypi-libtorch.sh prefix)")
else
  suffix=
fi
# State_dicts written by PyTorch 2.x's Python, for the interop tests, where
# the wheel's environment is installed (always on the pypi leg).
test_python="$(scripts/pypi-libtorch.sh installed)"
if [ -n "$test_python" ]; then
  configure+=("-DATTN_TEST_PYTHON=$test_python")
fi

cmake -S . -B "build$suffix" "${configure[@]}"
cmake --build "build$suffix"

if [ "$mode" = demo ]; then
  "./build$suffix/apps/attn_demo"
else
  # ctest runs as many test processes as there are cores, each with an
  # OpenMP pool as large as the machine: idle workers that spin (OpenMP's
  # default) would take the cores the other processes need.
  OMP_WAIT_POLICY=passive ctest --test-dir "build$suffix" --output-on-failure -j "$(nproc)"
  # The reliability suites again, built with AddressSanitizer and UBSan over
  # attn's own code (LibTorch is not instrumented), in one process. -O1 and
  # a test binary of seven sources keep the instrumented build short. The
  # Debian leg's is built by clang, whose UBSan also refuses an offset
  # applied to a null pointer (an empty tensor's data), which GCC's lets
  # pass; the PyPI leg's by GCC. detect_leaks=0: LibTorch keeps its
  # allocators and operator registries alive until exit, by design.
  sanitizer_compiler=()
  [ "$libtorch" = debian ] && sanitizer_compiler=(-DCMAKE_CXX_COMPILER=clang++-14)
  cmake -S . -B "build-asan$suffix" "${configure[@]}" "${sanitizer_compiler[@]}" \
        "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" -DATTN_SANITIZE=ON -DATTN_BUILD_BENCHMARKS=OFF
  cmake --build "build-asan$suffix" --target attn_sanitizer_tests
  ASAN_OPTIONS=detect_leaks=0 "./build-asan$suffix/tests/attn_sanitizer_tests" --gtest_brief=1
fi
