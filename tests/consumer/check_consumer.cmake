# The consumer projects, driven from ctest (see tests/CMakeLists.txt), in
# one of two steps:
#
#   STEP=install  Installs the build tree BUILD_DIR into PREFIX, replacing
#                 what an earlier run left there, and checks the layout
#                 (LIBDIR is the build's CMAKE_INSTALL_LIBDIR).
#   STEP=consume  Configures the consumer project SOURCE in BINARY with a
#                 fresh cache, builds it and runs it, which checks that the
#                 headers carry VERSION. PREFIX_PATH is CMAKE_PREFIX_PATH
#                 with '|' between entries; with PREFIX set, attn must be
#                 found there. Options for the project: ATTN_SOURCE_DIR,
#                 REQUESTED_VERSION. GENERATOR, BUILD_TYPE and CXX_COMPILER
#                 repeat the outer build's.
#   STEP=reject   Configures SOURCE as `consume` does, but with a stand-in
#                 LibTorch of version OTHER_TORCH_VERSION first on the
#                 prefix path: find_package(attn) must refuse it, naming
#                 both versions.
#
# Each phase prints its duration, so that the cost of these tests is known.

function(run_phase name)
  string(TIMESTAMP start "%s")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE exit_code
    OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(TIMESTAMP end "%s")
  math(EXPR seconds "${end} - ${start}")
  message(STATUS "${name}: ${seconds} s")
  if(NOT exit_code EQUAL 0)
    message(FATAL_ERROR "${name} failed (${exit_code}):\n${out}\n${err}")
  endif()
  set(phase_output "${out}" PARENT_SCOPE)
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE "${PREFIX}")
  run_phase("cmake --install" ${CMAKE_COMMAND} --install "${BUILD_DIR}" --prefix "${PREFIX}")
  set(config_dir "${PREFIX}/${LIBDIR}/cmake/attn")
  foreach(file
      include/attn/attn.h include/attn/version.h
      include/attn/modules/multi_head_attention.h
      ${LIBDIR}/cmake/attn/attnConfig.cmake
      ${LIBDIR}/cmake/attn/attnConfigVersion.cmake
      ${LIBDIR}/cmake/attn/attnTargets.cmake)
    if(NOT EXISTS "${PREFIX}/${file}")
      message(FATAL_ERROR "cmake --install left no ${PREFIX}/${file}")
    endif()
  endforeach()
  file(GLOB library "${PREFIX}/${LIBDIR}/*attn*")
  if(NOT library)
    message(FATAL_ERROR "cmake --install left no attn library in ${PREFIX}/${LIBDIR}")
  endif()
elseif(STEP STREQUAL "reject")
  string(REPLACE "|" ";" prefix_path "${PREFIX_PATH}")
  # Only what find_package reads: a version file and a config that succeeds.
  set(fake_torch "${BINARY}-torch")
  file(WRITE "${fake_torch}/TorchConfigVersion.cmake"
    "set(PACKAGE_VERSION ${OTHER_TORCH_VERSION})\n"
    "set(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
  file(WRITE "${fake_torch}/TorchConfig.cmake" "set(Torch_FOUND TRUE)\n")
  file(REMOVE_RECURSE "${BINARY}")
  execute_process(COMMAND ${CMAKE_COMMAND} -S "${SOURCE}" -B "${BINARY}"
      -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${fake_torch};${prefix_path}"
      "-DREQUESTED_VERSION=${REQUESTED_VERSION}"
    RESULT_VARIABLE exit_code OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " message "${err}")
  if(exit_code EQUAL 0 OR NOT message MATCHES
      "attn was built against LibTorch [0-9]+\\.[0-9]+, but the LibTorch found is ${OTHER_TORCH_VERSION}")
    message(FATAL_ERROR "find_package(attn) accepted LibTorch ${OTHER_TORCH_VERSION} "
      "or failed for another reason (${exit_code}):\n${out}\n${err}")
  endif()
  message(STATUS "refused as expected: ${message}")
elseif(STEP STREQUAL "consume")
  string(REPLACE "|" ";" prefix_path "${PREFIX_PATH}")
  # --fresh (CMake 3.24) keeps the objects, so that a rerun recompiles only
  # what changed; older CMake starts from an empty directory.
  set(fresh --fresh)
  if(CMAKE_VERSION VERSION_LESS 3.24)
    file(REMOVE_RECURSE "${BINARY}")
    set(fresh)
  endif()
  run_phase("configure" ${CMAKE_COMMAND} ${fresh} -S "${SOURCE}" -B "${BINARY}"
    -G "${GENERATOR}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_PREFIX_PATH=${prefix_path}"
    # Only the prefixes given: no package registered by an earlier build.
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
    "-DATTN_SOURCE_DIR=${ATTN_SOURCE_DIR}"
    "-DREQUESTED_VERSION=${REQUESTED_VERSION}")
  if(PREFIX)
    execute_process(COMMAND ${CMAKE_COMMAND} -L -N "${BINARY}"
      OUTPUT_VARIABLE cache)
    if(NOT cache MATCHES "attn_DIR:PATH=${PREFIX}/")
      message(FATAL_ERROR "attn was not found in ${PREFIX}:\n${cache}")
    endif()
  endif()
  run_phase("build" ${CMAKE_COMMAND} --build "${BINARY}")
  run_phase("run" "${BINARY}/consumer" "${VERSION}")
  message(STATUS "consumer: ${phase_output}")
else()
  message(FATAL_ERROR "STEP must be install, consume or reject, got '${STEP}'")
endif()
