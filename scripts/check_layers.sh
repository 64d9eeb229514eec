#!/usr/bin/env bash
# Checks that every include in include/ and src/ points down the layers of
# the code (CONTRIBUTING.md, "Where things live"), lowest first:
#
#   runtime        threads, LibTorch versions, devices
#   kernels        the kernels below the API boundary (kernels/cpu/...)
#   sdpa           the function: argument checks, backend choice, masks,
#                  the math path
#   modules        the modules, the KV cache, multi-head attention as a
#                  function
#   serialization  weights from the built-in module and Python's state_dicts
#   distributed    attn::distributed
#
# A layer includes its own headers and those of the layers it names below,
# internal ("sdpa/masks.h") and public (<attn/sdpa.h>) alike: each public
# header belongs to a layer (public_layer below), and includes only public
# headers of its own layer and those below. The kernels include no public
# header at all: they see plain parameters, never the options; and no
# source includes the umbrella <attn/attn.h>. Prints each include that
# breaks a rule and exits 1; exits 0 when there is none.
set -euo pipefail
cd "$(dirname "$0")/.."

declare -A allowed=(
  [runtime]="runtime"
  [kernels]="runtime kernels"
  [sdpa]="runtime kernels sdpa"
  [modules]="runtime sdpa modules"
  [serialization]="runtime sdpa modules serialization"
  [distributed]="runtime sdpa modules distributed"
)

# The layer of public header HEADER (attn/...); "umbrella" for attn/attn.h,
# which includes every other; nothing for a header no rule names.
public_layer() {
  case "$1" in
    attn/threads.h | attn/device.h | attn/version.h) echo runtime ;;
    attn/backend.h | attn/block_mask.h | attn/options.h | attn/sdpa.h) echo sdpa ;;
    attn/kv_cache.h | attn/functional.h | attn/modules/*) echo modules ;;
    attn/interop.h) echo serialization ;;
    attn/distributed/*) echo distributed ;;
    attn/attn.h) echo umbrella ;;
  esac
}

failures=0
report() {
  echo "$1:$2: $3" >&2
  failures=$((failures + 1))
}

# check_public FILE LINE LAYER HEADER: LAYER's include of <HEADER>.
check_public() {
  local file="$1" line="$2" layer="$3" header="$4" target
  target="$(public_layer "$header")"
  if [ -z "$target" ]; then
    report "$file" "$line" "<$header> is not assigned a layer in check_layers.sh"
  elif [ "$target" = umbrella ]; then
    [ "$layer" = umbrella ] || report "$file" "$line" "only a user includes the umbrella <$header>"
  elif [ "$layer" != umbrella ] && [[ " ${allowed[$layer]} " != *" $target "* ]]; then
    report "$file" "$line" \
      "$layer includes <$header>, of the layer $target, which it may not reach (it may: ${allowed[$layer]})"
  fi
}

# Every public header has a layer.
while read -r file; do
  [ -n "$(public_layer "${file#include/}")" ] ||
    report "$file" 1 "a public header that check_layers.sh assigns no layer"
done < <(git ls-files 'include/*.h')

while IFS=: read -r file line text; do
  header="$(sed -E 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*[<"]([^>"]+)[>"].*/\1/' <<<"$text")"
  case "$file" in
    include/*)
      if [[ "$text" == *'"'* ]]; then
        report "$file" "$line" "a public header includes the internal header \"$header\""
      elif [[ "$header" == attn/* ]]; then
        layer="$(public_layer "${file#include/}")"
        [ -n "$layer" ] && check_public "$file" "$line" "$layer" "$header"
      fi
      continue ;;
  esac
  layer="$(cut -d/ -f2 <<<"$file")"
  if [[ -z "${allowed[$layer]+set}" ]]; then
    report "$file" "$line" "src/$layer/ is not a layer of check_layers.sh"
    continue
  fi
  if [[ "$header" == attn/* ]] && [[ "$text" == *'<'* ]]; then
    if [[ "$layer" == kernels ]]; then
      report "$file" "$line" "a kernel includes the public header <$header>"
    else
      check_public "$file" "$line" "$layer" "$header"
    fi
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
