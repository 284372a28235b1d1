// The CUDA executor for the portable device kernels (portable/kernels.h): one thread per
// element, grid-stride, on the legacy default stream, which orders them with the caching
// allocator's frees and with cudaMemcpy. Compiled wherever the toolkit is; it runs only where a
// GPU is.
#include <cuda_runtime.h>

#include <algorithm>

#include "../kernel_table.h"
#include "../portable/kernels.h"

namespace tessera::kernels::cuda {

namespace {

template <class F>
__global__ void for_each_element(int64_t n, F f) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step)
    f(i);
}

void check_launch(cudaError_t err, const char* op, Device device, const char* what) {
  TESSERA_CHECK(err == cudaSuccess, op, " on ", device.str(), ": ", what,
                " failed: ", cudaGetErrorString(err));
}

struct CudaExec {
  static constexpr int kThreads = 256;
  // Enough blocks to fill any current GPU several times; larger launches loop.
  static constexpr int64_t kMaxBlocks = int64_t(1) << 16;

  template <class F>
  static void for_each(const char* op, Device device, int64_t n, const F& f) {
    check_launch(cudaSetDevice(device.index), op, device, "cudaSetDevice");
    const int64_t blocks = std::min((n + kThreads - 1) / kThreads, kMaxBlocks);
    for_each_element<<<unsigned(blocks), kThreads>>>(n, f);
    check_launch(cudaGetLastError(), op, device, "kernel launch");
  }
};

}  // namespace

registry::KernelTable kernels() {
  registry::KernelTable table;
  portable::Kernels<CudaExec>::fill_table(table);
  return table;
}

}  // namespace tessera::kernels::cuda
