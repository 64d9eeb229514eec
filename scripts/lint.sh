#!/usr/bin/env bash
# Formatting and static analysis (Debian 12, as root or with sudo; installs
# what is missing: Debian's clang-format 14, PyPI's clang-tidy 23).
#
#   scripts/lint.sh format         # every tracked C++ file against .clang-format
#   scripts/lint.sh format --fix   # rewrites the files that differ
#   scripts/lint.sh tidy [DIR]     # clang-tidy (.clang-tidy) over src/ and apps/
#
# tidy reads the compile database in DIR (default build-tidy), configuring
# one there when it has none: with Debian's LibTorch, or whichever
# CMAKE_PREFIX_PATH the environment names. A database of a build with
# precompiled headers works too (the headers, built by g++, are left out),
# but not one of a unity build, which lists batches instead of sources.
# About 5 minutes on 2 cores.
# Both commands fail on any finding.
set -euo pipefail

usage() {
  echo "usage: scripts/lint.sh format [--fix] | tidy [build-dir]" >&2
  exit 2
}

cd "$(dirname "$0")/.."

source scripts/lib/install_missing.sh

cpp_files() {
  git ls-files -z '*.cpp' '*.cc' '*.h' '*.hpp'
}

format() {
  install_missing clang-format
  local files=()
  mapfile -d '' -t files < <(cpp_files)
  if [ "${1:-}" = --fix ]; then
    clang-format -i "${files[@]}"
    return
  fi
  # The files that differ; `clang-format --dry-run FILE` shows where.
  local differ=() file
  for file in "${files[@]}"; do
    clang-format --dry-run --Werror "$file" 2>/dev/null || differ+=("$file")
  done
  if [ "${#differ[@]}" -gt 0 ]; then
    printf '%s\n' "${differ[@]}" >&2
    echo "${#differ[@]} of ${#files[@]} files differ from .clang-format:" \
         "scripts/lint.sh format --fix rewrites them" >&2
    return 1
  fi
  echo "${#files[@]} files formatted as .clang-format says"
}

# pinned_clang_tidy: prints the path of clang-tidy ${CLANG_TIDY_VERSION}, the
# PyPI wheel, installed into .deps/clang-tidy-<version> (ignored by git) on
# first use. Newer than Debian's 14, it matches its checks against attn's
# code only, not against every inline function of LibTorch's headers: the
# run takes a third of the time.
readonly CLANG_TIDY_VERSION=23.1.4
pinned_clang_tidy() {
  local venv=".deps/clang-tidy-${CLANG_TIDY_VERSION}"
  if ! "$venv/bin/clang-tidy" --version >/dev/null 2>&1; then
    echo "Installing PyPI clang-tidy ${CLANG_TIDY_VERSION} into $venv" >&2
    python3 -c 'import ensurepip' >/dev/null 2>&1 || install_missing python3-venv
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check \
      "clang-tidy==${CLANG_TIDY_VERSION}" >&2
  fi
  echo "$(pwd)/$venv/bin/clang-tidy"
}

tidy() {
  local dir="${1:-build-tidy}"
  install_missing cmake ninja-build g++ python3
  if [ ! -f "$dir/compile_commands.json" ] && [ "$dir" != build-tidy ]; then
    # Another build's folder is never reconfigured with the options below.
    echo "scripts/lint.sh tidy: $dir has no compile_commands.json; configure it with" \
         "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON, or leave DIR out to use build-tidy" >&2
    exit 2
  fi
  if [ ! -f "$dir/compile_commands.json" ]; then
    # Configured only, never built: clang-tidy needs the flags and the
    # generated <attn/version.h>. No precompiled header (it would be g++'s),
    # tests or benchmark: src/ and apps/ are what is checked.
    [ -n "${CMAKE_PREFIX_PATH:-}" ] || install_missing libtorch-dev
    install_missing libfmt-dev libcli11-dev nlohmann-json3-dev libgloo-dev
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON \
          -DATTN_UNITY_BUILD=OFF \
          -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_BENCHMARKS=OFF >/dev/null
  fi
  # The database without g++'s precompiled header, so that one of an
  # ordinary build (build, build-pypi) serves as well.
  tidy_database="$(mktemp -d)"
  trap 'rm -rf "$tidy_database"' EXIT
  sed -E 's/ -Winvalid-pch//g; s/ -include [^ ]*cmake_pch\.hxx//g' \
      "$dir/compile_commands.json" >"$tidy_database/compile_commands.json"

  local sources=() source
  mapfile -t sources < <(git ls-files 'src/*.cpp' 'apps/*.cpp')
  for source in "${sources[@]}"; do
    if ! grep -q "\"file\": \"[^\"]*/$source\"" "$tidy_database/compile_commands.json"; then
      echo "scripts/lint.sh tidy: $dir/compile_commands.json has no entry for $source;" \
           "configure $dir with -DATTN_UNITY_BUILD=OFF (a unity build lists its batches)" >&2
      exit 2
    fi
  done
  local clang_tidy
  clang_tidy="$(pinned_clang_tidy)"
  # C++17, as g++ compiles it; the database's g++ warning flags that clang
  # does not know are no finding; <omp.h>, which LibTorch's headers
  # include, from g++'s own folder (clang's has none), after clang's.
  local extra=(-extra-arg=-std=c++17 -extra-arg=-Wno-unknown-warning-option
               "-extra-arg=-idirafter$(g++ -print-file-name=include)")
  echo "$("$clang_tidy" --version | grep -m 1 -o 'LLVM version .*'):" \
       "${#sources[@]} files of src/ and apps/, $(nproc) at a time"
  # .clang-tidy's WarningsAsErrors makes every finding fail the run.
  printf '%s\0' "${sources[@]}" |
    xargs -0 -n 1 -P "$(nproc)" "$clang_tidy" --quiet -p "$tidy_database" "${extra[@]}"
}

case "${1:-}" in
  format)
    [ $# -le 2 ] || usage
    [ $# -lt 2 ] || [ "$2" = --fix ] || usage
    format "${2:-}"
    ;;
  tidy)
    [ $# -le 2 ] || usage
    tidy "${2:-}"
    ;;
  *) usage ;;
esac
