# Script mode: train_lm's resume continues a run exactly. Trains STEPS steps with an lr schedule
# (warmup, then cosine), saving half way and at the end; deletes the final checkpoint, resumes
# from the half-way one, and compares the resumed steps' losses (the CSV's 9 decimals, exactly)
# with the uninterrupted run's.
include(${CMAKE_CURRENT_LIST_DIR}/train_lm_common.cmake)
math(EXPR half "${STEPS} / 2")
math(EXPR last "${STEPS} - 1")

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
train_lm(--steps ${STEPS} --save-every ${half} --checkpoint-dir ${WORK_DIR}/ckpt
         --csv ${WORK_DIR}/full.csv)
file(GLOB saved ${WORK_DIR}/ckpt/step_*.h5)
list(LENGTH saved n_saved)
if(NOT n_saved EQUAL 2)
  message(FATAL_ERROR "expected 2 checkpoints, found: ${saved}")
endif()
list(SORT saved)
list(GET saved 1 final)
file(REMOVE ${final})
train_lm(--steps ${STEPS} --resume --checkpoint-dir ${WORK_DIR}/ckpt --csv ${WORK_DIR}/resumed.csv)
losses(${WORK_DIR}/full.csv ${half} want)
losses(${WORK_DIR}/resumed.csv 0 got)
list(LENGTH want n_want)
if(n_want EQUAL 0 OR NOT got STREQUAL want)
  message(FATAL_ERROR "resumed losses differ from the uninterrupted run's:\n"
                      "  uninterrupted: ${want}\n  resumed:       ${got}")
endif()
message(STATUS "resumed steps ${half} to ${last} match: ${got}")
