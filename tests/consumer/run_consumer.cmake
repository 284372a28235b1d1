# Script mode, one STEP per ctest test:
#   install       install the build tree into ${WORK_DIR}/prefix
#   find_package  configure, build and run tests/consumer/project against it
#   testing_kit   configure and build tests/consumer/testing_project, run its tests under ctest:
#                 the correct layer's must pass, the buggy layer's must fail with messages that
#                 name the rank and the global index
set(prefix ${WORK_DIR}/prefix)

function(run)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "command failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

function(configure_and_build build_dir)
  file(REMOVE_RECURSE ${build_dir})
  run(${CMAKE_COMMAND} -S ${CONSUMER_SOURCE_DIR} -B ${build_dir} -G ${GENERATOR}
      -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release)
  run(${CMAKE_COMMAND} --build ${build_dir})
endfunction()

if(STEP STREQUAL "install")
  file(REMOVE_RECURSE ${prefix})
  run(${CMAKE_COMMAND} --install ${TESSERA_BUILD_DIR} --prefix ${prefix})
elseif(STEP STREQUAL "find_package")
  configure_and_build(${WORK_DIR}/find_package)
  run(${WORK_DIR}/find_package/consumer)
  if(NOT last_output MATCHES "consumer ok")
    message(FATAL_ERROR "consumer printed: ${last_output}")
  endif()
  message(STATUS "${last_output}")
elseif(STEP STREQUAL "testing_kit")
  set(build ${WORK_DIR}/testing_kit)
  configure_and_build(${build})
  # The two directories found the package each: the second's tests start as the first's do.
  run(${CMAKE_CTEST_COMMAND} --test-dir ${build} -N -V)
  string(REGEX MATCH "Test command: [^\n]*buggy/test_column_parallel_buggy" first "${last_output}")
  string(REGEX MATCH "Test command: [^\n]*correct/test_column_parallel" second "${last_output}")
  if(NOT first OR NOT second)
    message(FATAL_ERROR "no test commands of both directories in:\n${last_output}")
  endif()
  foreach(flag --oversubscribe --allow-run-as-root)
    set(in_first OFF)
    set(in_second OFF)
    if(first MATCHES "${flag}")
      set(in_first ON)
    endif()
    if(second MATCHES "${flag}")
      set(in_second ON)
    endif()
    if(NOT in_first STREQUAL in_second)
      message(FATAL_ERROR "'${flag}' in one directory's mpiexec command only:\n${first}\n${second}")
    endif()
  endforeach()
  run(${CMAKE_CTEST_COMMAND} --test-dir ${build} --output-on-failure -R "^test_column_parallel\\.")
  message(STATUS "correct layer:\n${last_output}")
  execute_process(COMMAND ${CMAKE_CTEST_COMMAND} --test-dir ${build} --output-on-failure
                          -R "^test_column_parallel_buggy\\."
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(rc EQUAL 0)
    message(FATAL_ERROR "the buggy layer's tests passed:\n${out}\n${err}")
  endif()
  # On 2 ranks rank 1 holds row 1 where Shard(0) puts rows 2 and 3.
  foreach(needle
      "expect_local_matches: rank 1 \\(coordinate \\(1\\) of DeviceMesh\\(tp=2\\)\\)"
      "first at local \\[0, 0\\] = global index \\[2, 0\\]: got 4 \\(the value of global index \\[1, 0\\]\\)"
      "expect_close_global: global values of \\[S\\(1\\)\\]"
      "diverges after step 0 in loss"
      "tests failed on rank\\(s\\) 0, 1 of 2")
    if(NOT out MATCHES "${needle}")
      message(FATAL_ERROR "the buggy layer's failures lack '${needle}':\n${out}\n${err}")
    endif()
  endforeach()
  message(STATUS "buggy layer, failing as it must:\n${out}")
else()
  message(FATAL_ERROR "run_consumer.cmake: unknown STEP '${STEP}'")
endif()
