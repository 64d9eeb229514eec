# `cmake --install` lays out the headers, the library and a package config,
# so that consumers can `find_package(attn)` and link `attn::attn`:
#
#   <prefix>/include/attn/...                 public headers and version.h
#   <prefix>/lib/libattn.a                    (or .so with BUILD_SHARED_LIBS)
#   <prefix>/lib/libattn_distributed.a        attn::distributed, when built
#   <prefix>/lib/cmake/attn/attnConfig.cmake  with attnConfigVersion.cmake
#                                             and the exported attnTargets
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(ATTN_CONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/attn)
# LibTorch's C++ ABI changes between minor releases: the config refuses a
# LibTorch whose major.minor differs from the one attn was compiled against.
set(ATTN_TORCH_VERSION ${Torch_VERSION_MAJOR}.${Torch_VERSION_MINOR})

install(TARGETS attn EXPORT attnTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
if(TARGET attn_distributed)
  install(TARGETS attn_distributed EXPORT attnTargets
    ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
    LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
    RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
  set(attn_exclude_distributed "")
else()
  set(attn_exclude_distributed PATTERN distributed EXCLUDE)
endif()
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/attn
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} ${attn_exclude_distributed})
install(FILES ${ATTN_VERSION_HEADER}
  DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/attn)
install(EXPORT attnTargets NAMESPACE attn:: DESTINATION ${ATTN_CONFIG_DIR})

configure_package_config_file(cmake/attnConfig.cmake.in
  ${PROJECT_BINARY_DIR}/attnConfig.cmake
  INSTALL_DESTINATION ${ATTN_CONFIG_DIR})
# Before 1.0 a minor release may break callers, so only the same minor
# version satisfies a request.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/attnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/attnConfig.cmake
  ${PROJECT_BINARY_DIR}/attnConfigVersion.cmake
  DESTINATION ${ATTN_CONFIG_DIR})
