# Runs train_transformer (TRAINER) as a user would and checks what it did.
#   CASE=loss_falls       one short run: the training loss at its last
#                         milestone is below half the first step's, and the
#                         piped output is plain lines.
#   CASE=resume           a run to step HALF with a checkpoint, resumed to
#                         step FULL, against one run straight to FULL: the
#                         resumed run carries on from HALF and ends with the
#                         same held-out results, to the printed digit.
#   CASE=help             --help: exit code 0 and every flag listed.
#   EXPECTED_ERROR set    exit code 2 and that text on a one-line stderr.
# ARGS are passed to every run; files go to the working directory.

separate_arguments(args UNIX_COMMAND "${ARGS}")

function(fail)
  string(JOIN "" message ${ARGN})
  message(FATAL_ERROR "${message}")
endfunction()

# Runs the trainer with the given arguments after ARGS; sets `out`, `err`
# and `exit_code` in the caller.
function(train)
  execute_process(COMMAND ${TRAINER} ${args} ${ARGN}
    RESULT_VARIABLE code OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  set(out "${stdout}" PARENT_SCOPE)
  set(err "${stderr}" PARENT_SCOPE)
  set(exit_code "${code}" PARENT_SCOPE)
endfunction()

function(expect_success what)
  if(NOT exit_code EQUAL 0)
    fail("${what} exited with ${exit_code}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
endfunction()

# The line of held-out results that ends a run.
function(held_out_results out_var)
  if(NOT out MATCHES "\nHeld-out strings: [^\n]+")
    fail("no held-out results in\n${out}")
  endif()
  set(${out_var} "${CMAKE_MATCH_0}" PARENT_SCOPE)
endfunction()

if(DEFINED EXPECTED_ERROR AND NOT EXPECTED_ERROR STREQUAL "")
  train()
  if(NOT exit_code EQUAL 2)
    fail("expected exit code 2, got ${exit_code}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
  string(FIND "${err}" "${EXPECTED_ERROR}" found)
  string(REGEX MATCHALL "\n" newlines "${err}")
  list(LENGTH newlines line_count)
  if(found EQUAL -1 OR NOT line_count EQUAL 1)
    fail("expected one line containing '${EXPECTED_ERROR}' on stderr, got:\n${err}")
  endif()
elseif(CASE STREQUAL "loss_falls")
  train()
  expect_success("the run")
  if(out MATCHES "\r")
    fail("carriage returns in piped output:\n${out}")
  endif()
  string(REGEX MATCHALL "step +[0-9]+/[0-9]+  loss [0-9.]+  accuracy +[0-9.]+ %  +[0-9]+ tokens/s"
    milestones "${out}")
  list(LENGTH milestones count)
  if(count LESS 2)
    fail("expected at least two progress lines, got ${count}:\n${out}")
  endif()
  list(GET milestones 0 first)
  list(GET milestones -1 last)
  string(REGEX REPLACE ".*loss ([0-9.]+).*" "\\1" first_loss "${first}")
  string(REGEX REPLACE ".*loss ([0-9.]+).*" "\\1" last_loss "${last}")
  # CMake compares integers only: the loss in ten-thousandths.
  string(REPLACE "." "" first_loss "${first_loss}")
  string(REPLACE "." "" last_loss "${last_loss}")
  math(EXPR doubled "2 * ${last_loss}")
  if(NOT doubled LESS first_loss)
    fail("the loss did not fall below half its first value:\n  ${first}\n  ${last}")
  endif()
  message(STATUS "first: ${first}\nlast:  ${last}")
elseif(CASE STREQUAL "resume")
  file(REMOVE resumed.pt straight.pt)
  train(--steps ${HALF} --checkpoint resumed.pt)
  expect_success("the run to step ${HALF}")
  if(NOT EXISTS resumed.pt)
    fail("no checkpoint written:\n${out}")
  endif()
  train(--steps ${FULL} --checkpoint resumed.pt --resume)
  expect_success("the resumed run")
  if(NOT out MATCHES "Resumed from step ${HALF} of 'resumed.pt'")
    fail("the resumed run does not start from step ${HALF}:\n${out}")
  endif()
  math(EXPR next "${HALF} + 1")
  if(NOT out MATCHES "Trained steps ${next} to ${FULL} ")
    fail("the resumed run did not train steps ${next} to ${FULL}:\n${out}")
  endif()
  held_out_results(resumed)
  train(--steps ${FULL} --checkpoint straight.pt)
  expect_success("the uninterrupted run")
  held_out_results(straight)
  if(NOT resumed STREQUAL straight)
    fail("resumed and uninterrupted runs differ:\n  resumed:${resumed}\n  straight:${straight}")
  endif()
  message(STATUS "both runs:${straight}")
elseif(CASE STREQUAL "help")
  train(--help)
  expect_success("--help")
  foreach(flag device steps seed digits batch eval-every checkpoint resume)
    if(NOT out MATCHES "\n  --${flag} ")
      fail("--help does not list --${flag}:\n${out}")
    endif()
  endforeach()
else()
  fail("unknown CASE '${CASE}'")
endif()
