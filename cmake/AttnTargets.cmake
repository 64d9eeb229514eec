# Settings shared by every target the project builds.

option(ATTN_SANITIZE
  "Build attn's own targets with AddressSanitizer and UndefinedBehaviorSanitizer" OFF)

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
  if(ATTN_SANITIZE)
    # Our code only: LibTorch stays uninstrumented. Undefined behaviour
    # aborts instead of printing and carrying on, so that tests fail on it.
    set(sanitize -fsanitize=address,undefined -fno-sanitize-recover=undefined)
    target_compile_options(${target} PRIVATE ${sanitize} -fno-omit-frame-pointer)
    # PUBLIC: whatever links the static library needs the runtimes too.
    target_link_options(${target} PUBLIC ${sanitize})
  endif()
  if(ARG_REUSE_PCH)
    target_precompile_headers(${target} REUSE_FROM attn)
    # A precompiled header is only used with the code model it was built
    # with: the library's -fPIC rather than the executables' default -fPIE.
    if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
      target_compile_options(${target} PRIVATE -fPIC)
    endif()
  endif()
endfunction()
