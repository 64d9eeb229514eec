# `cmake --install` lays out the headers, the library and a package config,
# so that consumers can `find_package(attn)` and link `attn::attn`.
include(CMakePackageConfigHelpers)
include(GNUInstallDirs)

set(ATTN_CONFIG_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/attn)

install(TARGETS attn EXPORT attnTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY include/attn DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT attnTargets NAMESPACE attn:: DESTINATION ${ATTN_CONFIG_DIR})

configure_package_config_file(cmake/attnConfig.cmake.in
  ${PROJECT_BINARY_DIR}/attnConfig.cmake
  INSTALL_DESTINATION ${ATTN_CONFIG_DIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/attnConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES
  ${PROJECT_BINARY_DIR}/attnConfig.cmake
  ${PROJECT_BINARY_DIR}/attnConfigVersion.cmake
  DESTINATION ${ATTN_CONFIG_DIR})
