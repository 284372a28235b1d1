# Helpers of the train_lm example tests (script mode): running train_lm under mpirun and reading
# the losses it writes. LAUNCH is the mpirun command before the program, POSTFLAGS what follows
# it, ARGS train_lm's flags: lists with '|' for ';'.
string(REPLACE "|" ";" launch "${LAUNCH}")
string(REPLACE "|" ";" postflags "${POSTFLAGS}")
string(REPLACE "|" ";" args "${ARGS}")

# Runs train_lm with ARGS and the extra flags given; its output lands in `last_output`.
function(train_lm)
  execute_process(COMMAND ${launch} ${TRAIN_LM} ${postflags} ${args} ${ARGN} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "train_lm failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

# "step:loss" of each row of a train_lm CSV from step `from` on, as a list.
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
