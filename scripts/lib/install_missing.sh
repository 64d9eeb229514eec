# Sourced by the scripts in scripts/: install_missing PACKAGE... installs
# those of the Debian packages that are not installed yet (apt-get update
# first), as root or through sudo. apt's output goes to stderr, so that a
# caller's captured stdout holds only its own answer.
install_missing() {
  local missing=() package
  for package in "$@"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
      missing+=("$package")
    fi
  done
  [ "${#missing[@]}" -gt 0 ] || return 0
  echo "Installing: ${missing[*]}" >&2
  local as_root=()
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  "${as_root[@]}" apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive "${as_root[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >&2
}

# One thread pool for the CPU: Debian's OpenMP build of OpenBLAS runs its
# threads in libgomp's pool, the one ATen's loops and attn's kernels use,
# where the pthreads build keeps a second pool whose spinning threads
# compete for the same cores (docs/design/cpu-kernels.md, "Thread pools"). Selects
# it for the three names LibTorch links: BLAS, LAPACK and OpenBLAS itself.
use_openmp_openblas() {
  local multiarch name target as_root=()
  multiarch="$(gcc -print-multiarch)"
  [ "$(id -u)" -eq 0 ] || as_root=(sudo)
  for name in libblas.so.3 liblapack.so.3 libopenblas.so.0; do
    target="/usr/lib/$multiarch/openblas-openmp/$name"
    [ -e "$target" ] || continue
    if [ "$(update-alternatives --query "$name-$multiarch" 2>/dev/null | sed -n 's/^Value: //p')" \
         != "$target" ]; then
      echo "Selecting OpenBLAS's OpenMP build for $name" >&2
      "${as_root[@]}" update-alternatives --set "$name-$multiarch" "$target" >&2
    fi
  done
}
