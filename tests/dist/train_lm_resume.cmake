# Script mode: train_lm's resume continues a run exactly. Trains STEPS steps with an lr schedule
# (warmup, then cosine), saving half way and at the end; deletes the final checkpoint, resumes
# from the half-way one, and compares the resumed steps' losses (9 significant digits) with the
# uninterrupted run's. LAUNCH is the mpirun command before the program, POSTFLAGS what follows
# it, ARGS train_lm's flags: lists with '|' for ';'.
string(REPLACE "|" ";" launch "${LAUNCH}")
string(REPLACE "|" ";" postflags "${POSTFLAGS}")
string(REPLACE "|" ";" args "${ARGS}")
math(EXPR half "${STEPS} / 2")
math(EXPR last "${STEPS} - 1")

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
endfunction()

# "step,loss" of each row of a train_lm CSV from step `from` on, as a list.
function(losses csv from out_var)
  file(STRINGS ${csv} rows)
  set(out "")
  foreach(row IN LISTS rows)
    if(row MATCHES "^([0-9]+),([^,]+),")
      if(NOT CMAKE_MATCH_1 LESS from)
        list(APPEND out "${CMAKE_MATCH_1}:${CMAKE_MATCH_2}")
      endif()
    endif()
  endforeach()
  set(${out_var} "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
run(${launch} ${TRAIN_LM} ${postflags} ${args} --steps ${STEPS} --save-every ${half}
    --checkpoint-dir ${WORK_DIR}/ckpt --csv ${WORK_DIR}/full.csv)
file(GLOB saved ${WORK_DIR}/ckpt/step_*.h5)
list(LENGTH saved n_saved)
if(NOT n_saved EQUAL 2)
  message(FATAL_ERROR "expected 2 checkpoints, found: ${saved}")
endif()
list(SORT saved)
list(GET saved 1 final)
file(REMOVE ${final})
run(${launch} ${TRAIN_LM} ${postflags} ${args} --steps ${STEPS} --resume
    --checkpoint-dir ${WORK_DIR}/ckpt --csv ${WORK_DIR}/resumed.csv)
losses(${WORK_DIR}/full.csv ${half} want)
losses(${WORK_DIR}/resumed.csv 0 got)
list(LENGTH want n_want)
if(n_want EQUAL 0 OR NOT got STREQUAL want)
  message(FATAL_ERROR "resumed losses differ from the uninterrupted run's:\n"
                      "  uninterrupted: ${want}\n  resumed:       ${got}")
endif()
message(STATUS "resumed steps ${half} to ${last} match: ${got}")
