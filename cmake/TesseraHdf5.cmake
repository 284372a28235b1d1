# Parallel HDF5 (MPI-IO) for checkpoint/, as the target hdf5::hdf5 and HDF5_C_LIBRARIES /
# HDF5_C_INCLUDE_DIRS (which the installed package config records). Checked here so that a
# serial HDF5 fails at configure time.
#
# TESSERA_HDF5_PREFIX: the /usr of a Debian parallel HDF5 unpacked elsewhere (scripts/fetch-deps,
# for a machine without network: scripts/gpu-check --deps). FindHDF5 asks HDF5's compiler wrapper
# for the paths, and an unpacked Debian wrapper names the system's /usr, so the library and its
# headers are taken from the prefix directly instead.
set(TESSERA_HDF5_PREFIX "" CACHE PATH "an unpacked Debian parallel HDF5's usr/ to build against")
if(TESSERA_HDF5_PREFIX)
  set(_tessera_h5_sub hdf5/openmpi)
  find_path(TESSERA_HDF5_INCLUDE_DIR H5pubconf.h REQUIRED NO_DEFAULT_PATH
            PATHS ${TESSERA_HDF5_PREFIX}/include/${_tessera_h5_sub})
  find_library(TESSERA_HDF5_LIBRARY hdf5 REQUIRED NO_DEFAULT_PATH
               PATHS ${TESSERA_HDF5_PREFIX}/lib/${CMAKE_LIBRARY_ARCHITECTURE}/${_tessera_h5_sub})
  file(STRINGS ${TESSERA_HDF5_INCLUDE_DIR}/H5pubconf.h _tessera_h5_parallel
       REGEX "#define H5_HAVE_PARALLEL 1")
  set(HDF5_IS_PARALLEL FALSE)
  if(_tessera_h5_parallel)
    set(HDF5_IS_PARALLEL TRUE)
  endif()
  # The shared library names what it links itself (libsz, libcurl, ...); only it is needed.
  set(HDF5_C_LIBRARIES ${TESSERA_HDF5_LIBRARY})
  set(HDF5_C_INCLUDE_DIRS ${TESSERA_HDF5_INCLUDE_DIR})
  add_library(hdf5::hdf5 UNKNOWN IMPORTED)
  set_target_properties(hdf5::hdf5 PROPERTIES IMPORTED_LOCATION ${TESSERA_HDF5_LIBRARY}
                                              INTERFACE_INCLUDE_DIRECTORIES ${TESSERA_HDF5_INCLUDE_DIR})
else()
  set(HDF5_PREFER_PARALLEL TRUE)
  find_package(HDF5 REQUIRED COMPONENTS C)
endif()
if(NOT HDF5_IS_PARALLEL)
  message(FATAL_ERROR
    "checkpoint/ needs HDF5 built with MPI-IO (parallel HDF5); found a serial HDF5 at "
    "${HDF5_C_INCLUDE_DIRS}. On Debian/Ubuntu install libhdf5-openmpi-dev (scripts/setup-deps).")
endif()
