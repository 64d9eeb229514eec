# Runs the demo with ARGS and checks its exit code and report for CASE.
separate_arguments(args UNIX_COMMAND "${ARGS}")
execute_process(
  COMMAND ${DEMO} ${args}
  RESULT_VARIABLE exit_code
  OUTPUT_VARIABLE out
  ERROR_VARIABLE err)

if(NOT exit_code EQUAL EXPECTED_EXIT_CODE)
  message(FATAL_ERROR "exit code ${exit_code}, expected ${EXPECTED_EXIT_CODE}\n"
    "stdout:\n${out}\nstderr:\n${err}")
endif()

function(expect text pattern)
  if(NOT text MATCHES "${pattern}")
    message(FATAL_ERROR "missing '${pattern}' in:\n${text}")
  endif()
endfunction()

if(CASE MATCHES "^reference_shapes")
  expect("${out}" "Output: +\\[4, 20, 512\\]")
  expect("${out}" "Weights: +\\[4, 8, 20, 20\\]")
  expect("${out}" "Built-in output: +\\[4, 20, 512\\]")
  # float32 through four 512-wide projections: agreement to 1e-5 absolute.
  if(NOT out MATCHES "Max \\|output - built-in output\\|: ([0-9.e+-]+)")
    message(FATAL_ERROR "missing the largest difference in:\n${out}")
  endif()
  set(difference "${CMAKE_MATCH_1}")
  if(NOT difference LESS 1e-5)
    message(FATAL_ERROR "output differs from the built-in by ${difference}")
  endif()
  if(CASE STREQUAL "reference_shapes_on_cpu")
    expect("${out}" "Device: +cpu")
  endif()
elseif(CASE STREQUAL "unknown_device")
  expect("${err}" "unknown device 'tpu': expected auto, cpu, cuda or cuda:N")
elseif(CASE STREQUAL "bad_arguments")
  expect("${err}" "usage: attn_demo")
endif()

string(REGEX MATCHALL "\n" stderr_lines "${err}")
list(LENGTH stderr_lines stderr_line_count)
if(stderr_line_count GREATER 1)
  message(FATAL_ERROR "stderr should be at most one line, got:\n${err}")
endif()
