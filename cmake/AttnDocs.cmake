# `cmake --build <build dir> --target docs` writes the API reference, made
# by Doxygen from the public headers' `///` comments, to
# <build dir>/docs/html/index.html. Any Doxygen warning, such as an
# undocumented public declaration, fails the target.
find_package(Doxygen QUIET)
if(NOT DOXYGEN_FOUND)
  message(STATUS "Doxygen not found: no docs target (Debian: apt-get install doxygen)")
  return()
endif()

configure_file(docs/Doxyfile.in ${PROJECT_BINARY_DIR}/docs/Doxyfile @ONLY)
add_custom_target(docs
  COMMAND Doxygen::doxygen ${PROJECT_BINARY_DIR}/docs/Doxyfile
  COMMENT "Writing the API reference to ${PROJECT_BINARY_DIR}/docs/html"
  VERBATIM)
