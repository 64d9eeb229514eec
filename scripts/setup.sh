#!/usr/bin/env bash
# Installs what is missing (Debian 12, as root or with sudo), builds attn in
# ./build, then runs the demo or the whole test suite.
#
#   scripts/setup.sh demo   # install, build, run the shape demo
#   scripts/setup.sh test   # install, build, run every test through ctest,
#                           # then the tests under ASan and UBSan (build-asan)
set -euo pipefail

mode="${1:-}"
case "$mode" in
  demo|test) ;;
  *) echo "usage: scripts/setup.sh demo|test" >&2; exit 2 ;;
esac

cd "$(dirname "$0")/.."

packages=(libtorch-dev libfmt-dev libgtest-dev libgmock-dev libbenchmark-dev libopenblas0-pthread
          cmake ninja-build g++)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "Installing: ${missing[*]}"
  as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  "${as_root[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build

if [ "$mode" = demo ]; then
  ./build/apps/attn_demo
else
  ctest --test-dir build --output-on-failure -j "$(nproc)"
  # The reliability suites again, built with AddressSanitizer and UBSan over
  # attn's own code (LibTorch is not instrumented), in one process. -O1 and
  # a test binary of four sources keep the instrumented build short.
  # detect_leaks=0: LibTorch keeps its allocators and operator registries
  # alive until exit, by design.
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release \
        "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" -DATTN_SANITIZE=ON -DATTN_BUILD_BENCHMARKS=OFF
  cmake --build build-asan --target attn_sanitizer_tests
  ASAN_OPTIONS=detect_leaks=0 ./build-asan/tests/attn_sanitizer_tests --gtest_brief=1
fi
