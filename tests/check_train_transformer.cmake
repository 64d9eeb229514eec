# Runs train_transformer (TRAINER) as a user would and checks what it did.
#   CASE=loss_falls       one short run: the training loss at its last
#                         milestone is below half the first step's, and the
#                         piped output is plain lines.
#   CASE=builtin          the short run with --attention attn and with
#                         --attention builtin: the built-in's loss falls as
#                         in loss_falls, its first loss is attn's to the
#                         printed digit, and both report their speed.
#   CASE=resume           a run to step HALF with a checkpoint, resumed to
#                         step FULL, against one run straight to FULL: the
#                         resumed run carries on from HALF and ends with the
#                         same held-out results, to the printed digit. The
#                         checkpoints' names start with PREFIX, if given.
#   CASE=tensor_parallel  a run to FULL with --tensor-parallel over
#                         WORLD_SIZE ranks (started by LAUNCHER) against
#                         one process: every milestone's loss and accuracy
#                         and the held-out loss agree within the tolerances
#                         below, and the checkpoint it wrote loads into the
#                         one-process model, which evaluates it alike. With
#                         HALF, a parallel run resumed at HALF ends as the
#                         uninterrupted one.
#   CASE=packing          the short run with --lengths padded and with
#                         --lengths packed: the loss falls in both, their
#                         first losses agree to the printed digit (the same
#                         strings and weights), and each reports its share
#                         of padding.
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

# The same with --tensor-parallel, over WORLD_SIZE ranks.
function(train_in_parallel)
  execute_process(COMMAND ${LAUNCHER} ${WORLD_SIZE} 120 ${TRAINER} --tensor-parallel ${args} ${ARGN}
    RESULT_VARIABLE code OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  set(out "${stdout}" PARENT_SCOPE)
  set(err "${stderr}" PARENT_SCOPE)
  set(exit_code "${code}" PARENT_SCOPE)
endfunction()

# Every "loss X" and "accuracy Y" of `text` (milestones and held-out
# results), as integers in units of their last printed digit.
function(printed_numbers out_var text)
  string(REGEX MATCHALL "(loss|accuracy) +[0-9]+\\.[0-9]+" numbers "${text}")
  list(TRANSFORM numbers REPLACE "[a-z ]+" "")
  list(TRANSFORM numbers REPLACE "\\." "")
  list(TRANSFORM numbers REPLACE "^0+([0-9])" "\\1")
  set(${out_var} "${numbers}" PARENT_SCOPE)
endfunction()

# Fails with `what` unless `expected_text` and `actual_text` print as many
# losses and accuracies, each within 3 units of its last digit.
function(expect_same_numbers expected_text actual_text what)
  printed_numbers(expected "${expected_text}")
  printed_numbers(actual "${actual_text}")
  list(LENGTH expected count)
  list(LENGTH actual actual_count)
  if(count EQUAL 0 OR NOT count EQUAL actual_count)
    fail("${what}: not the same numbers printed in\n${expected_text}\nand\n${actual_text}")
  endif()
  math(EXPR last "${count} - 1")
  foreach(i RANGE ${last})
    list(GET expected ${i} e)
    list(GET actual ${i} a)
    math(EXPR difference "${a} - ${e}")
    if(difference GREATER 3 OR difference LESS -3)
      fail("${what} (number ${i}: ${a} against ${e} in units of the last digit):\n"
           "${expected_text}\nand\n${actual_text}")
    endif()
  endforeach()
endfunction()

function(expect_success what)
  if(NOT exit_code EQUAL 0)
    fail("${what} exited with ${exit_code}\nstdout:\n${out}\nstderr:\n${err}")
  endif()
endfunction()

# Fails unless the training loss of `out`, at its last milestone, is below
# half the first step's; sets `first` and `last` (the first and last
# progress lines) and `first_loss` (as printed) in the caller.
function(expect_loss_falls)
  string(REGEX MATCHALL "step +[0-9]+/[0-9]+  loss [0-9.]+  accuracy +[0-9.]+ %  +[0-9]+ tokens/s"
    milestones "${out}")
  list(LENGTH milestones count)
  if(count LESS 2)
    fail("expected at least two progress lines, got ${count}:\n${out}")
  endif()
  list(GET milestones 0 first_line)
  list(GET milestones -1 last_line)
  string(REGEX REPLACE ".*loss ([0-9.]+).*" "\\1" first_printed "${first_line}")
  string(REGEX REPLACE ".*loss ([0-9.]+).*" "\\1" last_printed "${last_line}")
  # CMake compares integers only: the loss in ten-thousandths.
  string(REPLACE "." "" first_units "${first_printed}")
  string(REPLACE "." "" last_units "${last_printed}")
  math(EXPR doubled "2 * ${last_units}")
  if(NOT doubled LESS first_units)
    fail("the loss did not fall below half its first value:\n  ${first_line}\n  ${last_line}")
  endif()
  set(first "${first_line}" PARENT_SCOPE)
  set(last "${last_line}" PARENT_SCOPE)
  set(first_loss "${first_printed}" PARENT_SCOPE)
endfunction()

# Fails unless `out` ends its training with the steps per second and the
# attention's share of a step.
function(expect_speed_report)
  if(NOT out MATCHES "\n[0-9.]+ steps/s; attention forward: [0-9.]+ % of the step's time")
    fail("no steps per second and attention share in\n${out}")
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
  expect_loss_falls()
  message(STATUS "first: ${first}\nlast:  ${last}")
elseif(CASE STREQUAL "builtin")
  train()
  expect_success("the run with attn")
  expect_loss_falls()
  expect_speed_report()
  set(attn_first "${first}")
  set(attn_loss "${first_loss}")
  train(--attention builtin)
  expect_success("the run with --attention builtin")
  if(NOT out MATCHES "heads of torch::nn::MultiheadAttention")
    fail("the run with --attention builtin does not say so:\n${out}")
  endif()
  expect_loss_falls()
  expect_speed_report()
  # The same initial weights, data and arithmetic up to the order of sums:
  # the first step's loss agrees to its printed 4 decimals.
  if(NOT first_loss STREQUAL attn_loss)
    fail("the first losses differ:\n  attn:    ${attn_first}\n  builtin: ${first}")
  endif()
  message(STATUS "attn:    ${attn_first}\nbuiltin: ${first}\nbuiltin: ${last}")
elseif(CASE STREQUAL "packing")
  foreach(layout padded packed)
    train(--lengths ${layout})
    expect_success("the run with --lengths ${layout}")
    expect_loss_falls()
    if(NOT out MATCHES "\nStrings of 2 to [0-9]+ digits, ${layout}: [0-9.]+ % of the positions computed were padding")
      fail("the run with --lengths ${layout} reports no padding share:\n${out}")
    endif()
    set(${layout}_first "${first}")
    set(${layout}_loss "${first_loss}")
  endforeach()
  if(NOT packed_loss STREQUAL padded_loss)
    fail("the first losses differ:\n  padded: ${padded_first}\n  packed: ${first}")
  endif()
  message(STATUS "padded: ${padded_first}\npacked: ${first}\npacked: ${last}")
elseif(CASE STREQUAL "resume")
  set(resumed ${PREFIX}resumed.pt)
  set(straight ${PREFIX}straight.pt)
  file(REMOVE ${resumed} ${straight})
  train(--steps ${HALF} --checkpoint ${resumed})
  expect_success("the run to step ${HALF}")
  if(NOT EXISTS ${resumed})
    fail("no checkpoint written:\n${out}")
  endif()
  train(--steps ${FULL} --checkpoint ${resumed} --resume)
  expect_success("the resumed run")
  if(NOT out MATCHES "Resumed from step ${HALF} of '${resumed}'")
    fail("the resumed run does not start from step ${HALF}:\n${out}")
  endif()
  math(EXPR next "${HALF} + 1")
  if(NOT out MATCHES "Trained steps ${next} to ${FULL} ")
    fail("the resumed run did not train steps ${next} to ${FULL}:\n${out}")
  endif()
  held_out_results(resumed_results)
  train(--steps ${FULL} --checkpoint ${straight})
  expect_success("the uninterrupted run")
  held_out_results(straight_results)
  if(NOT resumed_results STREQUAL straight_results)
    fail("resumed and uninterrupted runs differ:\n  resumed:${resumed_results}\n"
         "  straight:${straight_results}")
  endif()
  message(STATUS "both runs:${straight_results}")
elseif(CASE STREQUAL "tensor_parallel")
  file(REMOVE parallel_${WORLD_SIZE}.pt)
  train(--steps ${FULL})
  expect_success("the one-process run")
  set(one_process "${out}")
  train_in_parallel(--steps ${FULL} --checkpoint parallel_${WORLD_SIZE}.pt)
  expect_success("the run over ${WORLD_SIZE} ranks")
  set(parallel "${out}")
  if(NOT parallel MATCHES "Tensor-parallel over ${WORLD_SIZE} ranks")
    fail("the run over ${WORLD_SIZE} ranks does not say so:\n${parallel}")
  endif()
  # Splitting the heads changes the order of sums only: the curves agree to
  # within 3 units of the printed last digit (losses to 3e-4 and the
  # held-out loss to 3e-6, accuracies to 0.03 %).
  expect_same_numbers("${one_process}" "${parallel}"
    "the run over ${WORLD_SIZE} ranks left the one-process curve")
  held_out_results(parallel_results)
  # Its checkpoint, of the whole model, in the one-process trainer: resumed
  # at its last step, it only evaluates.
  train(--steps ${FULL} --checkpoint parallel_${WORLD_SIZE}.pt --resume)
  expect_success("the one-process run resumed from the parallel checkpoint")
  held_out_results(resumed_results)
  expect_same_numbers("${parallel_results}" "${resumed_results}"
    "the parallel checkpoint evaluates otherwise in one process")
  if(DEFINED HALF)
    # Resumed at step HALF, over the ranks or in one process, the runs end
    # as the uninterrupted ones: the checkpoint holds the whole optimizer.
    file(REMOVE parallel_half.pt one_process_half.pt)
    train_in_parallel(--steps ${HALF} --checkpoint parallel_half.pt)
    expect_success("the run over ${WORLD_SIZE} ranks to step ${HALF}")
    file(COPY_FILE parallel_half.pt one_process_half.pt)
    math(EXPR next "${HALF} + 1")
    train_in_parallel(--steps ${FULL} --checkpoint parallel_half.pt --resume)
    expect_success("the run over ${WORLD_SIZE} ranks resumed at step ${HALF}")
    if(NOT out MATCHES "Resumed from step ${HALF} of 'parallel_half.pt'" OR
       NOT out MATCHES "Trained steps ${next} to ${FULL} ")
      fail("the run over ${WORLD_SIZE} ranks did not resume at step ${HALF}:\n${out}")
    endif()
    held_out_results(parallel_resumed_results)
    if(NOT parallel_resumed_results STREQUAL parallel_results)
      fail("resumed over the ranks, the run ends otherwise:\n"
           "  resumed:${parallel_resumed_results}\n  uninterrupted:${parallel_results}")
    endif()
  endif()
  if(DEFINED HALF)
    train(--steps ${FULL} --checkpoint one_process_half.pt --resume)
    expect_success("the one-process run resumed from the parallel checkpoint at ${HALF}")
    if(NOT out MATCHES "Trained steps ${next} to ${FULL} ")
      fail("the one-process run did not resume at step ${HALF}:\n${out}")
    endif()
    held_out_results(one_process_resumed_results)
    set(out "${one_process}")
    held_out_results(one_process_results)
    expect_same_numbers("${one_process_results}" "${one_process_resumed_results}"
      "resumed in one process from the parallel checkpoint, the run ends otherwise")
  endif()
  message(STATUS "${WORLD_SIZE} ranks:${parallel_results}\none process:${resumed_results}")
elseif(CASE STREQUAL "help")
  train(--help)
  expect_success("--help")
  foreach(flag device steps seed digits batch eval-every checkpoint resume tensor-parallel
      attention dropout modifier lengths)
    if(NOT out MATCHES "\n  --${flag} ")
      fail("--help does not list --${flag}:\n${out}")
    endif()
  endforeach()
else()
  fail("unknown CASE '${CASE}'")
endif()
