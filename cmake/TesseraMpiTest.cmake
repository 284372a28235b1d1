# tessera_add_mpi_test(<target> SOURCES <files...> RANKS <world sizes...> [TIMEOUT <seconds>]
#                      [NAME <test name>] [ARGS <arguments...>] [ENV <VAR=value...>]
#                      [LAUNCH_ARGS <mpirun arguments...>]
#                      [FIXTURES_SETUP <fixture>] [FIXTURES_REQUIRED <fixture>]
#                      [SANITIZE <world sizes...>] [SANITIZE_ARGS <arguments...>])
#
# Builds a GoogleTest binary with tessera::testing_main (every rank runs every test, rank 0
# prints the summary, other ranks print their failures prefixed with their rank, and every rank
# exits non-zero when any rank failed) linked to tessera::testing, and registers one ctest test
# per world size, `<name>.np<N>` (name defaults to the target), run under mpirun with label
# `dist`; the world sizes listed in SANITIZE also get label `sanitize` (Tessera's own
# sanitizer run); in a build with -fsanitize in CMAKE_CXX_FLAGS those world sizes run with
# SANITIZE_ARGS appended (a --gtest_filter leaving out what is slow under the sanitizers and
# checks nothing the other tests do not). Without SOURCES it registers more tests of an existing target (other ARGS,
# such as a --gtest_filter, and fixtures that order stages across world sizes). Installed with
# the package: find_package(tessera) defines it when GoogleTest is found. ENV sets environment
# variables for the ranks (a second registration of a target run another way, say); LAUNCH_ARGS
# go to mpirun itself, before the program (a binding to test what the ranks do with it).
include_guard(GLOBAL)

# OpenMPI refuses to run as root and to start more ranks than cores unless told; other MPIs do
# not know these flags. Worked out once (include_guard) but read in every directory that
# registers tests, so kept in the cache, which every scope sees.
set(_tessera_extra_flags "")
if(MPIEXEC_EXECUTABLE)
  execute_process(COMMAND ${MPIEXEC_EXECUTABLE} --version OUTPUT_VARIABLE _tessera_mpiexec_version
                  ERROR_QUIET RESULT_VARIABLE _tessera_mpiexec_rc)
  if(_tessera_mpiexec_rc EQUAL 0 AND _tessera_mpiexec_version MATCHES "Open MPI|OpenRTE")
    set(_tessera_extra_flags --oversubscribe --allow-run-as-root)
    # OpenMPI refuses to start, even ranks on this machine only, when its remote-shell agent (ssh
    # or rsh) is not installed; a harmless program in its place is never run for local ranks.
    find_program(_tessera_remote_shell NAMES ssh rsh NO_CACHE)
    if(NOT _tessera_remote_shell AND NOT DEFINED ENV{OMPI_MCA_plm_rsh_agent})
      find_program(_tessera_false NAMES false NO_CACHE REQUIRED)
      list(APPEND _tessera_extra_flags --mca plm_rsh_agent ${_tessera_false})
    endif()
  endif()
endif()
set(TESSERA_MPIEXEC_EXTRA_FLAGS "${_tessera_extra_flags}" CACHE INTERNAL
    "mpiexec flags tessera_add_mpi_test adds (OpenMPI: oversubscribe, run as root)")

function(tessera_add_mpi_test target)
  cmake_parse_arguments(ARG "" "TIMEOUT;NAME;FIXTURES_SETUP;FIXTURES_REQUIRED"
                        "SOURCES;RANKS;ARGS;ENV;SANITIZE;SANITIZE_ARGS;LAUNCH_ARGS" ${ARGN})
  if(NOT ARG_SOURCES AND NOT TARGET ${target})
    message(FATAL_ERROR "tessera_add_mpi_test(${target}): SOURCES is required for a new target")
  endif()
  if(NOT ARG_NAME)
    set(ARG_NAME ${target})
  endif()
  if(NOT ARG_RANKS)
    message(FATAL_ERROR "tessera_add_mpi_test(${target}): RANKS (world sizes) is required")
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()

  if(ARG_SOURCES)
    add_executable(${target} ${ARG_SOURCES})
    # Tessera's own warning flags apply inside its tree only.
    target_link_libraries(${target} PRIVATE tessera::testing_main tessera::testing
                          $<TARGET_NAME_IF_EXISTS:tessera_warnings>
                          $<TARGET_NAME_IF_EXISTS:tessera_arch>)
  endif()

  set(sanitized_build OFF)
  if(CMAKE_CXX_FLAGS MATCHES "-fsanitize=")
    set(sanitized_build ON)
  endif()
  foreach(n IN LISTS ARG_RANKS)
    set(test_name ${ARG_NAME}.np${n})
    set(args ${ARG_ARGS})
    if(sanitized_build AND n IN_LIST ARG_SANITIZE)
      list(APPEND args ${ARG_SANITIZE_ARGS})
    endif()
    add_test(NAME ${test_name}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} ${TESSERA_MPIEXEC_EXTRA_FLAGS}
                     ${ARG_LAUNCH_ARGS} ${MPIEXEC_PREFLAGS} $<TARGET_FILE:${target}> ${MPIEXEC_POSTFLAGS} ${args})
    set(labels dist)
    if(n IN_LIST ARG_SANITIZE)
      list(APPEND labels sanitize)
    endif()
    # Ranks are the parallelism: keep each rank single-threaded. A rank spends much of a test
    # waiting for its peers (yielding or sleeping, see comm/src/mpi/work.h), so ctest counts two
    # ranks per core: on 2 cores the suite took 66 s instead of 76 s with one rank per core.
    math(EXPR cores "(${n} + 1) / 2")
    set_tests_properties(${test_name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${labels}"
                         PROCESSORS ${cores} ENVIRONMENT "OMP_NUM_THREADS=1;${ARG_ENV}")
    if(ARG_FIXTURES_SETUP)
      set_tests_properties(${test_name} PROPERTIES FIXTURES_SETUP ${ARG_FIXTURES_SETUP})
    endif()
    if(ARG_FIXTURES_REQUIRED)
      set_tests_properties(${test_name} PROPERTIES FIXTURES_REQUIRED ${ARG_FIXTURES_REQUIRED})
    endif()
  endforeach()
endfunction()
