# Settings shared by every target the project builds.

option(ATTN_SANITIZE
  "Build attn's own targets with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)
# Every translation unit that includes <torch/torch.h>, precompiled or
# not, spends seconds on it before compiling a line of its own (g++ 12
# loads LibTorch 2.x's 700 MB precompiled header in about 9 s of CPU):
# batches of source files compiled as one unit pay that once.
option(ATTN_UNITY_BUILD "Compile each target's source files in batches (CMake's unity build)" ON)
set(ATTN_UNITY_BATCH_SIZE 8)

# attn_configure_target(<target>)
#   C++17, OpenMP (for at::parallel_for) and the project's warnings. Every
#   target gets the same flags, so that targets other than the library can
#   reuse its precompiled <torch/torch.h>: pass REUSE_PCH for them.
function(attn_configure_target target)
  cmake_parse_arguments(ARG "REUSE_PCH" "" "" ${ARGN})
  target_compile_features(${target} PUBLIC cxx_std_17)
  set_target_properties(${target} PROPERTIES CXX_EXTENSIONS OFF)
  target_link_libraries(${target} PRIVATE OpenMP::OpenMP_CXX)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra -Wpedantic)
  endif()
  if(ATTN_SANITIZE OR ATTN_FUZZ)
    # Our code only: LibTorch stays uninstrumented. Undefined behaviour
    # aborts instead of printing and carrying on, so that tests fail on it.
    set(sanitize -fsanitize=address,undefined -fno-sanitize-recover=undefined)
    target_compile_options(${target} PRIVATE ${sanitize} -fno-omit-frame-pointer)
    # PUBLIC: whatever links the static library needs the runtimes too.
    target_link_options(${target} PUBLIC ${sanitize})
  endif()
  if(ATTN_FUZZ)
    # Coverage feedback for libFuzzer from our code; fuzz/ links the fuzzer.
    # Clang's -Wpedantic flags LibTorch's own macros, and at -O1 it cannot
    # honour LibTorch's vectorisation pragmas: neither is ours to fix.
    target_compile_options(${target} PRIVATE -fsanitize=fuzzer-no-link
      -Wno-gnu-zero-variadic-macro-arguments -Wno-pass-failed)
  endif()
  set_target_properties(${target} PROPERTIES
    UNITY_BUILD ${ATTN_UNITY_BUILD} UNITY_BUILD_BATCH_SIZE ${ATTN_UNITY_BATCH_SIZE})
  if(ARG_REUSE_PCH)
    target_precompile_headers(${target} REUSE_FROM attn)
    # A precompiled header is only used with the code model it was built
    # with: the library's -fPIC rather than the executables' default -fPIE.
    if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
      target_compile_options(${target} PRIVATE -fPIC)
    endif()
  endif()
endfunction()

# attn_find_fmt()
#   Defines attn_fmt, the fmt that the apps link. LibTorch 2.x ships fmt's
#   headers in its include folder, which the compiler searches before the
#   system's: there the apps use those headers, header-only, because the
#   system's libfmt would not match them. Elsewhere, the installed fmt.
function(attn_find_fmt)
  # Looked up afresh each configure: the LibTorch may have changed.
  unset(ATTN_TORCH_FMT_DIR CACHE)
  find_path(ATTN_TORCH_FMT_DIR fmt/format.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  add_library(attn_fmt INTERFACE)
  if(ATTN_TORCH_FMT_DIR AND NOT ATTN_TORCH_FMT_DIR STREQUAL "/usr/include")
    message(STATUS "fmt: LibTorch's own headers in ${ATTN_TORCH_FMT_DIR}, header-only")
    target_compile_definitions(attn_fmt INTERFACE FMT_HEADER_ONLY)
  else()
    find_package(fmt REQUIRED)
    target_link_libraries(attn_fmt INTERFACE fmt::fmt)
  endif()
endfunction()

# attn_link_torch_wheel_libraries(<target>)
#   The LibTorch inside PyPI's torch wheel finds the CUDA libraries it needs
#   (NCCL, cuSPARSELt, ...) in the nvidia-* wheels beside it, through its
#   own RPATH. At link time, though, the linker searches the executable's
#   RPATH first, and that names the CUDA toolkit's folder, whose older NCCL
#   then fails the link. Pointing -rpath-link at the wheels' folders first
#   keeps link time and run time on the same libraries; consumers of
#   <target> inherit the option (an installed attn names the folders of
#   the wheel it was built with). Other LibTorch layouts need nothing.
function(attn_link_torch_wheel_libraries target)
  file(GLOB wheel_library_dirs LIST_DIRECTORIES true "${TORCH_INSTALL_PREFIX}/../nvidia/*/lib")
  foreach(dir IN LISTS wheel_library_dirs)
    get_filename_component(dir "${dir}" REALPATH)
    target_link_options(${target} INTERFACE "LINKER:-rpath-link,${dir}")
  endforeach()
endfunction()
