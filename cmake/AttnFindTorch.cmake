# Finds LibTorch, or stops the configure with one message that names the
# LibTorch found (or says that none was) and where to point
# CMAKE_PREFIX_PATH, instead of failing later inside TorchConfig.cmake or
# the compiler. Included at the top level, so that TorchConfig's variables
# (TORCH_LIBRARIES, Torch_VERSION, ...) reach the rest of the build.

# 1.13 is the oldest LibTorch whose API src/runtime/compat.h covers.
set(ATTN_MIN_TORCH_VERSION 1.13)
set(attn_torch_wanted
  "attn needs LibTorch ${ATTN_MIN_TORCH_VERSION} or later (tested: 1.13 and 2.15)")
# Indented lines are printed as they are, so the command stays on one line.
string(CONCAT attn_torch_where
  "Point CMAKE_PREFIX_PATH at a LibTorch:\n"
  "  the directory unzipped from the LibTorch archive on pytorch.org\n"
  "  (the one holding share/cmake/Torch), or the directory of Python's\n"
  "  torch package, which this prints:\n"
  "    python3 -c 'import torch, os; print(os.path.dirname(torch.__file__))'\n"
  "  or, on Debian 12, install one: apt-get install libtorch-dev")

# Without a version: a LibTorch that is too old must be named, not passed
# over for another one further down the prefix path.
find_package(Torch QUIET)
if(NOT Torch_FOUND)
  message(FATAL_ERROR "${attn_torch_wanted}, but no LibTorch was found "
    "(no TorchConfig.cmake on the prefix path).\n${attn_torch_where}")
endif()
if(Torch_VERSION VERSION_LESS ATTN_MIN_TORCH_VERSION)
  message(FATAL_ERROR "${attn_torch_wanted}, but the LibTorch found is "
    "${Torch_VERSION} (${Torch_DIR}).\n${attn_torch_where}")
endif()
