#!/usr/bin/env bash
# Installs the pinned PyPI `torch` wheel, whose package carries a complete
# LibTorch 2.x, into a virtual environment this project owns, once:
#
#   scripts/pypi-libtorch.sh          # prints the torch package folder,
#                                     # the CMAKE_PREFIX_PATH to build with
#   scripts/pypi-libtorch.sh python   # prints the environment's Python
#   scripts/pypi-libtorch.sh installed
#                                     # prints the environment's Python if it
#                                     # is installed, else nothing; installs
#                                     # nothing
#
# The environment lives in .deps/pytorch-<version> (ignored by git) and is
# reused while it imports. Progress goes to stderr, the answer to stdout.
#
# The wheel is a CUDA build. Its C++ libraries need, besides LibTorch
# itself, four CUDA libraries that a CUDA 13 toolkit does not ship
# (cuFile, cuSPARSELt, NVSHMEM, and an NCCL newer than the toolkit's);
# they come from their wheels. The rest of the CUDA runtime is the
# machine's toolkit (the project machines have CUDA 13), so the gigabytes
# of nvidia-* wheels that `pip install torch` would add are not fetched.
set -euo pipefail

readonly TORCH_VERSION=2.15.0
# The versions torch 2.15.0's metadata pins (Requires-Dist), and the pure
# Python packages `import torch` needs.
readonly WHEELS=(
  "torch==${TORCH_VERSION}"
  nvidia-cufile==1.17.1.22
  nvidia-cusparselt-cu13==0.8.1
  nvidia-nvshmem-cu13==3.7.2
  nvidia-nccl-cu13==2.30.7
  filelock==4.3.1 fsspec==2026.9.0 jinja2==3.1.6 markupsafe==3.0.4
  mpmath==1.3.0 networkx==3.6.1 sympy==1.14.0 typing-extensions==4.16.0
)

cd "$(dirname "$0")/.."
source scripts/lib/install_missing.sh
venv="$(pwd)/.deps/pytorch-${TORCH_VERSION}"
python="$venv/bin/python"

imports() {
  "$python" -c 'import torch' >/dev/null 2>&1
}

if [ "${1:-}" = installed ]; then
  if imports; then echo "$python"; fi
  exit 0
fi

if ! imports; then
  echo "Installing PyPI torch ${TORCH_VERSION} into $venv" >&2
  # venv itself is in Python's standard library; the pip it installs comes
  # with ensurepip, which Debian packages separately.
  if ! python3 -c 'import ensurepip' >/dev/null 2>&1; then
    install_missing python3-venv
  fi
  rm -rf "$venv"
  python3 -m venv "$venv"
  # --no-deps: exactly the wheels above, none of the CUDA runtime wheels.
  "$python" -m pip install -q --disable-pip-version-check --no-deps "${WHEELS[@]}" >&2
  if ! imports; then
    "$python" -c 'import torch' >&2 || true
    echo "PyPI torch ${TORCH_VERSION} was installed but does not import (see above)" >&2
    exit 1
  fi
fi

case "${1:-prefix}" in
  prefix) "$python" -c 'import os, torch; print(os.path.dirname(torch.__file__))' ;;
  python) echo "$python" ;;
  *) echo "usage: scripts/pypi-libtorch.sh [prefix|python|installed]" >&2; exit 2 ;;
esac
