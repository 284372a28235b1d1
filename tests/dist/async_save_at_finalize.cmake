# Script mode: async_save_at_finalize (PROGRAM) under LAUNCH (mpirun on 2 ranks, '|' for ';')
# leaves a save nobody waited for to the runtime's finalize: `ok` must exit 0 with a file that
# tessera-ckpt (CKPT) verifies; `differ` must exit non-zero naming the failed save, with no file;
# `hook-throws` (a finalize hook throwing a non-std exception) must exit non-zero saying so.
string(REPLACE "|" ";" launch "${LAUNCH}")
string(REPLACE "|" ";" postflags "${POSTFLAGS}")
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})

execute_process(COMMAND ${launch} ${PROGRAM} ${postflags} ok ${WORK_DIR}/ok.h5
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the save left to finalize failed (${rc}):\n${out}\n${err}")
endif()
execute_process(COMMAND ${CKPT} verify ${WORK_DIR}/ok.h5 RESULT_VARIABLE rc OUTPUT_VARIABLE out
                ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the save left to finalize wrote no valid file (${rc}):\n${out}\n${err}")
endif()

execute_process(COMMAND ${launch} ${PROGRAM} ${postflags} differ ${WORK_DIR}/bad.h5
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "a save that failed at finalize exited 0:\n${out}\n${err}")
endif()
if(NOT "${out}${err}" MATCHES "async_save to '[^']*bad.h5' failed and nobody waited for it")
  message(FATAL_ERROR "a save that failed at finalize did not say so:\n${out}\n${err}")
endif()
if(EXISTS ${WORK_DIR}/bad.h5)
  message(FATAL_ERROR "a save that failed left ${WORK_DIR}/bad.h5")
endif()

execute_process(COMMAND ${launch} ${PROGRAM} ${postflags} hook-throws ${WORK_DIR}/none.h5
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT "${out}${err}" MATCHES "a hook threw an exception not derived from")
  message(FATAL_ERROR "a finalize hook that threw did not end the job (${rc}):\n${out}\n${err}")
endif()
