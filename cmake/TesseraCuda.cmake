# TESSERA_WITH_CUDA: AUTO enables CUDA when a toolkit is found; ON requires one.
set(TESSERA_CUDA_ENABLED OFF)
if(NOT TESSERA_WITH_CUDA STREQUAL "OFF")
  if(NOT DEFINED CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  # The GPU this machine has, where it has one: code for another architecture would be compiled
  # from PTX by every process at its first launch. Without a GPU (CI) the kernels are only
  # compiled, for sm_80. Chosen before enable_language(CUDA), which otherwise caches the
  # compiler's own default (sm_75 for nvcc 13) and leaves nothing to choose.
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
    set(tessera_arch 80)
    find_program(TESSERA_NVIDIA_SMI nvidia-smi)
    if(TESSERA_NVIDIA_SMI)
      execute_process(COMMAND ${TESSERA_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                      OUTPUT_VARIABLE tessera_cap RESULT_VARIABLE tessera_smi_rc ERROR_QUIET)
      string(REGEX MATCH "^[0-9]+\\.[0-9]+" tessera_cap "${tessera_cap}")
      if(tessera_smi_rc EQUAL 0 AND tessera_cap)
        string(REPLACE "." "" tessera_arch "${tessera_cap}")
      endif()
    endif()
    set(CMAKE_CUDA_ARCHITECTURES ${tessera_arch} CACHE STRING "CUDA architectures")
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(TESSERA_CUDA_ENABLED ON)
    # The kernels are C++20. CMake 3.25 does not know that nvcc 12+ takes it (3.26 does), and
    # stops: with the targets' C++ standard at 20 it requires CUDA 20 too. Tell it what a newer
    # CMake knows.
    if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES AND
       CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA" AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
      list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    # Device code is compiled on machines that cannot run it: a warning there (a host-only call
    # from a kernel) is a bug nobody would see until a GPU runs it, so it stops the build.
    add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:SHELL:--Werror all-warnings>")
    # No fused multiply-adds: the CPU build rounds a * b + c twice (-ffp-contract=off, see
    # tessera_arch), and the device kernels must give its bits (tests/unit/test_device_kernels.cpp).
    add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:--fmad=false>")
  elseif(TESSERA_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "TESSERA_WITH_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "Tessera CUDA: ${TESSERA_CUDA_ENABLED}")
