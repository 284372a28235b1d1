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

#ifndef TESSERA_WITH_CUDA
// A build without CUDA has no libnccl binding (cuda/nccl_library.cpp is not compiled).
std::string system_nccl_unavailable() {
  return "this build has no CUDA support (TESSERA_WITH_CUDA=OFF or no toolkit found)";
}
NcclLibrary& system_nccl_library() {
  TESSERA_FAIL("NCCL is not usable here: ", system_nccl_unavailable());
}
#endif

}  // namespace tessera::detail
