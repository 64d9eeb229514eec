# attn::distributed, the tensor-parallel part of attn, built on LibTorch's
# c10d. It needs a LibTorch built with c10d and Gloo (its torch_cpu target
# then defines USE_C10D_GLOO) and the Gloo headers, which c10d's
# ProcessGroupGloo.hpp includes but LibTorch does not always ship (Debian's
# come in libgloo-dev). ATTN_DISTRIBUTED is ON when both are there.

get_target_property(attn_torch_cpu_definitions torch_cpu INTERFACE_COMPILE_DEFINITIONS)
find_path(ATTN_GLOO_INCLUDE_DIR gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS})
set(attn_distributed_missing "")
if(NOT "USE_C10D_GLOO" IN_LIST attn_torch_cpu_definitions)
  set(attn_distributed_missing "the LibTorch found (${Torch_DIR}) was built without c10d's Gloo")
elseif(NOT ATTN_GLOO_INCLUDE_DIR)
  set(attn_distributed_missing
    "the Gloo headers are missing (on Debian: apt-get install libgloo-dev)")
endif()
if(attn_distributed_missing)
  set(attn_distributed_default OFF)
else()
  set(attn_distributed_default ON)
endif()
option(ATTN_DISTRIBUTED "Build attn::distributed, tensor parallelism over c10d"
  ${attn_distributed_default})
if(ATTN_DISTRIBUTED AND attn_distributed_missing)
  message(FATAL_ERROR "ATTN_DISTRIBUTED is ON, but ${attn_distributed_missing}. "
    "Configure with -DATTN_DISTRIBUTED=OFF to build attn without it.")
elseif(NOT ATTN_DISTRIBUTED)
  if(attn_distributed_missing)
    message(STATUS "attn::distributed: not built: ${attn_distributed_missing}")
  else()
    message(STATUS "attn::distributed: not built (ATTN_DISTRIBUTED=OFF)")
  endif()
  return()
endif()
message(STATUS "attn::distributed: built, Gloo headers in ${ATTN_GLOO_INCLUDE_DIR}")

add_library(attn_distributed
  src/distributed/all_to_all_attention.cpp
  src/distributed/collectives.cpp
  src/distributed/context_parallel.cpp
  src/distributed/context_parallel_multi_head_attention.cpp
  src/distributed/mappings.cpp
  src/distributed/process_group.cpp
  src/distributed/ring_attention.cpp
  src/distributed/sequence_sharding.cpp
  src/distributed/tensor_parallel_multi_head_attention.cpp)
add_library(attn::distributed ALIAS attn_distributed)
set_target_properties(attn_distributed PROPERTIES
  EXPORT_NAME distributed
  POSITION_INDEPENDENT_CODE ON
  VERSION ${PROJECT_VERSION}
  SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})
# The public headers name c10d's ProcessGroup only; Gloo's headers are
# needed by the sources that create Gloo groups.
target_include_directories(attn_distributed PRIVATE ${PROJECT_SOURCE_DIR}/src)
target_include_directories(attn_distributed SYSTEM PRIVATE ${ATTN_GLOO_INCLUDE_DIR})
target_link_libraries(attn_distributed PUBLIC attn)
attn_configure_target(attn_distributed REUSE_PCH)
# Inside another project it is built only when that project links it: a
# parent that uses attn alone does not compile it.
if(NOT PROJECT_IS_TOP_LEVEL)
  set_target_properties(attn_distributed PROPERTIES EXCLUDE_FROM_ALL TRUE)
endif()
