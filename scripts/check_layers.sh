#!/usr/bin/env bash
# Checks that every include in include/ and src/ points down the layers of
# the code (CONTRIBUTING.md, "Where things live"), lowest first:
#
#   runtime        threads, LibTorch versions, devices
#   kernels        the kernels below the API boundary (kernels/cpu/...)
#   sdpa           the function: argument checks, backend choice, masks,
#                  the math path
#   serialization  Python state_dicts, the torch.save reader
#   modules        the modules
#   distributed    attn::distributed
#
# A folder includes its own headers and those of the layers it names below;
# public headers (<attn/...>) include only public headers, and the kernels
# none at all: they see plain parameters, never the options. Prints each
# include that breaks a rule and exits 1; exits 0 when there is none.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A allowed=(
  [runtime]="runtime"
  [kernels]="runtime kernels"
  [sdpa]="runtime kernels sdpa"
  [serialization]="runtime serialization"
  [modules]="runtime sdpa modules"
  [distributed]="runtime sdpa modules distributed"
)
failures=0
report() {
  echo "$1:$2: $3" >&2
  failures=$((failures + 1))
}

while IFS=: read -r file line text; do
  header="$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^>"]+)[>"].*/\1/' <<<"$text")"
  case "$file" in
    include/*)
      if [[ "$text" == *'"'* ]]; then
        report "$file" "$line" "a public header includes the internal header \"$header\""
      fi
      continue ;;
  esac
  layer="$(cut -d/ -f2 <<<"$file")"
  if [[ -z "${allowed[$layer]+set}" ]]; then
    report "$file" "$line" "src/$layer/ is not a layer of check_layers.sh"
    continue
  fi
  if [[ "$text" == *'<attn/'* ]]; then
    [[ "$layer" == kernels ]] && report "$file" "$line" "a kernel includes the public header <$header>"
    continue
  fi
  [[ "$text" == *'"'* ]] || continue
  target="$(cut -d/ -f1 <<<"$header")"
  if [[ " ${allowed[$layer]} " != *" $target "* ]]; then
    report "$file" "$line" "src/$layer/ includes \"$header\", a layer it may not reach (it may: ${allowed[$layer]})"
  fi
done < <(git grep -n -E '^[[:space:]]*#[[:space:]]*include' -- 'include/*' 'src/*')

if [ "$failures" -gt 0 ]; then
  echo "check_layers.sh: $failures include(s) point against the layers" >&2
  exit 1
fi
echo "check_layers.sh: every include in include/ and src/ points down the layers"
