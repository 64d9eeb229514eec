# The consumer projects, and configures that must fail, driven from ctest
# (see tests/CMakeLists.txt), in one of three steps:
#
#   STEP=install  Installs the build tree BUILD_DIR into PREFIX, replacing
#                 what an earlier run left there, and checks the layout
#                 (LIBDIR is the build's CMAKE_INSTALL_LIBDIR).
#   STEP=consume  Configures the consumer project SOURCE in BINARY with a
#                 fresh cache, builds it and runs it, which checks that the
#                 headers carry VERSION. With PREFIX set, attn must be found
#                 there. Options for the project: ATTN_SOURCE_DIR,
#                 REQUESTED_VERSION, and with GIT_CHECKOUT set,
#                 ATTN_GIT_REPOSITORY and ATTN_GIT_TAG: that checkout and
#                 its HEAD commit, found with GIT_EXECUTABLE. Without git or
#                 a checkout the step prints "consumer test skipped: " and
#                 why, which ctest reports as a skip. GENERATOR, BUILD_TYPE,
#                 CXX_COMPILER and EXE_LINKER_FLAGS repeat the outer build's.
#                 LAUNCHER, if set, runs the program ('|' between words).
#   STEP=reject   Configures SOURCE, which must fail with one error whose
#                 message holds EXPECTED_ERROR (compared with each run of
#                 spaces and newlines made one space). With
#                 STAND_IN_TORCH_VERSION set, a stand-in LibTorch of that
#                 version comes first on the prefix path; without it, no
#                 LibTorch can be found at all, not even one in /usr.
#
# PREFIX_PATH, for both, is CMAKE_PREFIX_PATH with '|' between entries.
# Each phase prints its duration, so that the cost of these tests is known.

# Runs the command and prints its duration; sets phase_exit_code,
# phase_output and phase_error. A '|' in an argument becomes ';' only here:
# passed on as a list, a ';' would have split the argument in two.
function(time_phase name)
  set(command)
  foreach(arg IN LISTS ARGN)
    string(REPLACE "|" "\\;" arg "${arg}")
    list(APPEND command "${arg}")
  endforeach()
  string(TIMESTAMP start "%s")
  execute_process(COMMAND ${command} RESULT_VARIABLE exit_code
    OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(TIMESTAMP end "%s")
  math(EXPR seconds "${end} - ${start}")
  message(STATUS "${name}: ${seconds} s")
  set(phase_exit_code "${exit_code}" PARENT_SCOPE)
  set(phase_output "${out}" PARENT_SCOPE)
  set(phase_error "${err}" PARENT_SCOPE)
endfunction()

# time_phase for a command that must succeed; sets phase_output.
function(run_phase name)
  time_phase(${name} ${ARGN})
  if(NOT phase_exit_code EQUAL 0)
    message(FATAL_ERROR
      "${name} failed (${phase_exit_code}):\n${phase_output}\n${phase_error}")
  endif()
  set(phase_output "${phase_output}" PARENT_SCOPE)
endfunction()

# A LibTorch of the given version as far as find_package(Torch) can tell:
# a version file and a config that succeeds, and nothing else.
function(write_stand_in_torch dir version)
  file(WRITE "${dir}/TorchConfigVersion.cmake"
    "set(PACKAGE_VERSION ${version})\n"
    "set(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
  file(WRITE "${dir}/TorchConfig.cmake" "set(Torch_FOUND TRUE)\n")
endfunction()

# Called in a function: sets skip_reason in its caller and returns.
macro(skip_because reason)
  set(skip_reason "${reason}" PARENT_SCOPE)
  return()
endmacro()

# Sets attn_git_tag to the commit checked out in GIT_CHECKOUT or, where git
# or the checkout is missing, skip_reason to why the test cannot run.
function(resolve_git_checkout)
  if(NOT GIT_EXECUTABLE OR NOT EXISTS "${GIT_EXECUTABLE}")
    skip_because("git was not found (GIT_EXECUTABLE is '${GIT_EXECUTABLE}')")
  endif()
  execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${GIT_CHECKOUT}"
      rev-parse --show-toplevel HEAD
    RESULT_VARIABLE exit_code OUTPUT_VARIABLE out ERROR_VARIABLE err
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT exit_code EQUAL 0)
    string(STRIP "${err}" err)
    skip_because("${GIT_CHECKOUT} is not a git checkout with a commit (${err})")
  endif()
  string(REPLACE "\n" ";" out "${out}")
  list(GET out 0 top_level)
  list(GET out 1 commit)
  file(REAL_PATH "${GIT_CHECKOUT}" checkout)
  file(REAL_PATH "${top_level}" top_level)
  if(NOT checkout STREQUAL top_level)
    skip_because("${GIT_CHECKOUT} lies inside the git checkout ${top_level}")
  endif()
  execute_process(COMMAND "${GIT_EXECUTABLE}" -C "${GIT_CHECKOUT}"
      status --porcelain --untracked-files=no
    OUTPUT_VARIABLE changes)
  if(changes)
    message(STATUS "uncommitted changes in ${GIT_CHECKOUT} are not part "
      "of this test, which fetches commit ${commit}")
  endif()
  set(attn_git_tag "${commit}" PARENT_SCOPE)
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
  set(hide_torch)
  if(DEFINED STAND_IN_TORCH_VERSION)
    set(stand_in "${BINARY}-torch")
    write_stand_in_torch("${stand_in}" ${STAND_IN_TORCH_VERSION})
    set(PREFIX_PATH "${stand_in}|${PREFIX_PATH}")
  else()
    # Every package search re-rooted under a directory that does not exist:
    # the environment, the system prefixes and the prefix path all miss.
    set(hide_torch "-DCMAKE_FIND_ROOT_PATH=${BINARY}-nowhere"
      -DCMAKE_FIND_ROOT_PATH_MODE_PACKAGE=ONLY)
  endif()
  file(REMOVE_RECURSE "${BINARY}")
  time_phase("configure" ${CMAKE_COMMAND} -S "${SOURCE}" -B "${BINARY}"
    -G "${GENERATOR}" "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}" ${hide_torch}
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
    "-DREQUESTED_VERSION=${REQUESTED_VERSION}")
  string(REGEX REPLACE "[ \n]+" " " message "${phase_error}")
  string(FIND "${message}" "${EXPECTED_ERROR}" expected_at)
  string(REGEX MATCHALL "CMake Error" errors "${phase_error}")
  list(LENGTH errors error_count)
  if(phase_exit_code EQUAL 0 OR expected_at EQUAL -1 OR NOT error_count EQUAL 1)
    message(FATAL_ERROR "configuring ${SOURCE} did not fail with one error "
      "saying '${EXPECTED_ERROR}' (exit code ${phase_exit_code}, "
      "${error_count} errors):\n${phase_output}\n${phase_error}")
  endif()
  message(STATUS "refused as expected: ${message}")
elseif(STEP STREQUAL "consume")
  set(git_args)
  if(GIT_CHECKOUT)
    resolve_git_checkout()
    if(skip_reason)
      # The words that the test's SKIP_REGULAR_EXPRESSION matches.
      message(STATUS "consumer test skipped: ${skip_reason}")
      return()
    endif()
    message(STATUS "fetching commit ${attn_git_tag} from ${GIT_CHECKOUT}")
    set(git_args "-DGIT_EXECUTABLE=${GIT_EXECUTABLE}"
      "-DATTN_GIT_REPOSITORY=${GIT_CHECKOUT}" "-DATTN_GIT_TAG=${attn_git_tag}")
  endif()
  # Flags such as -Wl,-rpath-link that the outer build needed to link
  # LibTorch's programs; unset, LDFLAGS from the environment still applies.
  set(linker_flags)
  string(STRIP "${EXE_LINKER_FLAGS}" EXE_LINKER_FLAGS)
  if(EXE_LINKER_FLAGS)
    set(linker_flags "-DCMAKE_EXE_LINKER_FLAGS=${EXE_LINKER_FLAGS}")
  endif()
  # --fresh (CMake 3.24) removes only the cache and CMakeFiles/, which holds
  # main.cpp's object: attn's objects and FetchContent's clone stay, so that
  # a rerun compiles main.cpp and what changed. Older CMake starts from an
  # empty directory.
  set(fresh --fresh)
  if(CMAKE_VERSION VERSION_LESS 3.24)
    file(REMOVE_RECURSE "${BINARY}")
    set(fresh)
  endif()
  run_phase("configure" ${CMAKE_COMMAND} ${fresh} -S "${SOURCE}" -B "${BINARY}"
    -G "${GENERATOR}" "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}"
    # Only the prefixes given: no package registered by an earlier build.
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
    "-DATTN_SOURCE_DIR=${ATTN_SOURCE_DIR}" ${git_args} ${linker_flags}
    "-DREQUESTED_VERSION=${REQUESTED_VERSION}")
  if(PREFIX)
    execute_process(COMMAND ${CMAKE_COMMAND} -L -N "${BINARY}"
      OUTPUT_VARIABLE cache)
    if(NOT cache MATCHES "attn_DIR:PATH=${PREFIX}/")
      message(FATAL_ERROR "attn was not found in ${PREFIX}:\n${cache}")
    endif()
  endif()
  run_phase("build" ${CMAKE_COMMAND} --build "${BINARY}")
  # LAUNCHER ('|' between its words): what starts the program, if anything.
  string(REPLACE "|" ";" launcher "${LAUNCHER}")
  run_phase("run" ${launcher} "${BINARY}/consumer" "${VERSION}")
  message(STATUS "consumer: ${phase_output}")
else()
  message(FATAL_ERROR "STEP must be install, consume or reject, got '${STEP}'")
endif()
