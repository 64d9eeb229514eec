#!/usr/bin/env bash
# Formatting and static analysis (Debian 12, as root or with sudo; installs
# clang-format or clang-tidy when missing).
#
#   scripts/lint.sh format         # every tracked C++ file against .clang-format
#   scripts/lint.sh format --fix   # rewrites the files that differ
#   scripts/lint.sh tidy [DIR]     # clang-tidy (.clang-tidy) over src/ and apps/
#
# tidy reads the compile database in DIR (default build-tidy), configuring
# one there when it has none: with Debian's LibTorch, or whichever
# CMAKE_PREFIX_PATH the environment names. A database of a build with
# precompiled headers works too (the headers, built by g++, are left out).
# About 5 minutes on 2 cores: each source parses LibTorch's headers.
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

tidy() {
  local dir="${1:-build-tidy}"
  install_missing clang-tidy cmake ninja-build g++
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
    install_missing libfmt-dev
    cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DCMAKE_EXPORT_COMPILE_COMMANDS=ON -DCMAKE_DISABLE_PRECOMPILE_HEADERS=ON \
          -DATTN_BUILD_TESTS=OFF -DATTN_BUILD_BENCHMARKS=OFF >/dev/null
  fi
  # The database without g++'s precompiled header, so that one of an
  # ordinary build (build, build-pypi) serves as well.
  tidy_database="$(mktemp -d)"
  trap 'rm -rf "$tidy_database"' EXIT
  sed -E 's/ -Winvalid-pch//g; s/ -include [^ ]*cmake_pch\.hxx//g' \
      "$dir/compile_commands.json" >"$tidy_database/compile_commands.json"

  local sources=()
  mapfile -t sources < <(git ls-files 'src/*.cpp' 'apps/*.cpp')
  # C++17 as g++ compiles it (g++ 12 needs no -std flag for that, clang 14
  # does); the database's g++ warning flags that clang does not know are no
  # finding.
  local extra=(-extra-arg=-std=c++17 -extra-arg=-Wno-unknown-warning-option)
  echo "clang-tidy: ${#sources[@]} files of src/ and apps/, $(nproc) at a time"
  if command -v run-clang-tidy >/dev/null; then
    # Files as regular expressions on their absolute paths. .clang-tidy's
    # WarningsAsErrors makes every finding fail the run.
    local root
    root="$(pwd | sed 's/[][\.*^$+?(){}|]/\\&/g')"
    run-clang-tidy -quiet -j "$(nproc)" -p "$tidy_database" "${extra[@]}" \
                   "^$root/(src|apps)/.*\\.cpp\$"
  else
    printf '%s\0' "${sources[@]}" |
      xargs -0 -n 1 -P "$(nproc)" clang-tidy --quiet -p "$tidy_database" "${extra[@]}"
  fi
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
