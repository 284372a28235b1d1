#include "nccl_library.h"

#include <atomic>

#include "tessera/core/error.h"

namespace tessera::detail {

namespace {
std::atomic<NcclLibrary*> g_installed{nullptr};
}  // namespace

NcclLibrary& nccl_library() {
  if (NcclLibrary* lib = g_installed.load()) return *lib;
  return system_nccl_library();
}

NcclLibrary* set_nccl_library(NcclLibrary* library) {
  return g_installed.exchange(library);
}

// Where cuda/nccl_library.cpp binds nothing: a build without CUDA, or one whose toolkit has no
// nccl.h (the same test as there).
#if !defined(TESSERA_WITH_CUDA) || !__has_include(<nccl.h>)
std::string system_nccl_unavailable() {
#ifdef TESSERA_WITH_CUDA
  return "this build found the CUDA toolkit but no nccl.h";
#else
  return "this build has no CUDA support (TESSERA_WITH_CUDA=OFF or no toolkit found)";
#endif
}
NcclLibrary& system_nccl_library() {
  TESSERA_FAIL("NCCL is not usable here: ", system_nccl_unavailable());
}
#endif

}  // namespace tessera::detail
