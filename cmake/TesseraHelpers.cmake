include(GNUInstallDirs)

# Flags for project code only: dependencies' headers are included as SYSTEM so their warnings
# do not trip -Werror.
add_library(tessera_warnings INTERFACE)
target_compile_options(tessera_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Werror -Wno-error=deprecated-declarations>
  # GCC 12 reports false maybe-uninitialized inside its own AVX-512 intrinsics when Eigen is
  # compiled with -march=native (GCC bug 105593).
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-maybe-uninitialized>)
add_library(tessera_arch INTERFACE)
# a * b + c rounded twice, never fused: GCC contracts it in C++ by default wherever the target
# has FMA (-march=native), so the CPU's bits would depend on the machine and on what the
# vectorizer chose, and the device kernels (built with --fmad=false) could not match them.
target_compile_options(tessera_arch INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-ffp-contract=off>)
if(TESSERA_NATIVE)
  target_compile_options(tessera_arch INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-march=native>)
endif()
install(TARGETS tessera_warnings tessera_arch EXPORT tesseraTargets)

set(TESSERA_LAYER_TARGETS "" CACHE INTERNAL "")

# tessera_add_layer(<folder> DEPS <targets...>)
# One library per folder: sources are every .cpp under src/ (and .cu under src/cuda when CUDA is
# on), public headers under include/tessera/<folder>/.
function(tessera_add_layer folder)
  cmake_parse_arguments(ARG "" "" "DEPS;PRIVATE_DEPS" ${ARGN})
  set(target tessera_${folder})
  file(GLOB_RECURSE srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/*.cpp)
  list(FILTER srcs EXCLUDE REGEX "/src/cuda/")
  if(TESSERA_CUDA_ENABLED)
    file(GLOB_RECURSE cuda_srcs CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/*.cpp
         ${CMAKE_CURRENT_SOURCE_DIR}/src/cuda/*.cu)
    list(APPEND srcs ${cuda_srcs})
  endif()
  add_library(${target} ${srcs})
  add_library(tessera::${folder} ALIAS ${target})
  set_target_properties(${target} PROPERTIES OUTPUT_NAME tessera_${folder} EXPORT_NAME ${folder}
                                             UNITY_BUILD ${TESSERA_UNITY_BUILD})
  target_include_directories(${target} PUBLIC
    $<BUILD_INTERFACE:${CMAKE_CURRENT_SOURCE_DIR}/include>
    $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
  target_link_libraries(${target} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS}
                        $<BUILD_INTERFACE:tessera_warnings> $<BUILD_INTERFACE:tessera_arch>)
  install(DIRECTORY include/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
  install(TARGETS ${target} EXPORT tesseraTargets
          ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
          LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})
  set(TESSERA_LAYER_TARGETS ${TESSERA_LAYER_TARGETS} ${target} CACHE INTERNAL "")
endfunction()
