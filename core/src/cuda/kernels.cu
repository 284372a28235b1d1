// The CUDA executor for the portable device kernels (portable/kernels.h): one thread per
// element, grid-stride; a block per row for row kernels; and cuBLAS for gemm, all on the legacy
// default stream, which orders them with the caching allocator's frees and with cudaMemcpy.
// Compiled wherever the toolkit is; it runs only where a GPU is.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <climits>
#include <mutex>
#include <string>

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

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

struct SumOp {
  template <class C>
  __device__ C operator()(C a, C b) const {
    return a + b;
  }
};
struct MaxOp {
  template <class C>
  __device__ C operator()(C a, C b) const {
    return b > a ? b : a;
  }
};

// The threads of one block sharing a row (portable/launch.h: launch_rows). A combine folds each
// warp with shuffles, then thread 0 folds the warps' results in order and hands the total to
// every thread through shared memory. Host versions exist only so that the row functors'
// host-device bodies compile; nothing calls them.
struct BlockTeam {
  double* slots;  // kWarps + 1
  TESSERA_HOST_DEVICE int lane() const {
#ifdef __CUDA_ARCH__
    return int(threadIdx.x);
#else
    return 0;
#endif
  }
  TESSERA_HOST_DEVICE int size() const {
#ifdef __CUDA_ARCH__
    return int(blockDim.x);
#else
    return 1;
#endif
  }
  template <class C>
  TESSERA_HOST_DEVICE C sum(C v) {
    return reduce(v, SumOp{});
  }
  template <class C>
  TESSERA_HOST_DEVICE C max(C v) {
    return reduce(v, MaxOp{});
  }
  template <class C, class Op>
  TESSERA_HOST_DEVICE C reduce(C v, Op op) {
#ifdef __CUDA_ARCH__
    for (int offset = 16; offset > 0; offset /= 2)
      v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
    const int warp = int(threadIdx.x) / 32;
    __syncthreads();  // the slots of the previous combine have been read
    if (threadIdx.x % 32 == 0) slots[warp] = double(v);
    __syncthreads();
    if (threadIdx.x == 0) {
      C total = C(slots[0]);
      for (int w = 1; w < kWarps; ++w)
        total = op(total, C(slots[w]));
      slots[kWarps] = double(total);
    }
    __syncthreads();
    return C(slots[kWarps]);
#else
    return v;
#endif
  }
};

template <class F>
__global__ void for_each_row_block(int64_t rows, F f) {
  __shared__ double slots[kWarps + 1];
  BlockTeam team{slots};
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x)
    f(r, team);
}

void check_launch(cudaError_t err, const char* op, Device device, const char* what) {
  TESSERA_CHECK(err == cudaSuccess, op, " on ", device.str(), ": ", what,
                " failed: ", cudaGetErrorString(err));
}

const char* cublas_status_name(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
      return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "cuBLAS error";
  }
}

void check_cublas(cublasStatus_t s, const char* op, Device device, const char* what) {
  TESSERA_CHECK(s == CUBLAS_STATUS_SUCCESS, op, " on ", device.str(), ": ", what,
                " failed: ", cublas_status_name(s), " (", int(s), ")");
}

// cuBLAS is loaded on first use rather than linked: its libraries are over half a gigabyte, and
// loading them at the start of every process (every test rank, on machines without a GPU too)
// cost about 50 ms each.
struct Cublas {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSgemmStridedBatched) sgemm = nullptr;
  decltype(&cublasDgemmStridedBatched) dgemm = nullptr;
};

const Cublas& cublas(const char* op, Device device) {
  static const Cublas api = [] {
    Cublas c;
    const std::string name = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) return c;
    c.create = reinterpret_cast<decltype(c.create)>(dlsym(lib, "cublasCreate_v2"));
    c.set_math_mode = reinterpret_cast<decltype(c.set_math_mode)>(dlsym(lib, "cublasSetMathMode"));
    c.sgemm = reinterpret_cast<decltype(c.sgemm)>(dlsym(lib, "cublasSgemmStridedBatched"));
    c.dgemm = reinterpret_cast<decltype(c.dgemm)>(dlsym(lib, "cublasDgemmStridedBatched"));
    return c;
  }();
  TESSERA_CHECK(api.create && api.set_math_mode && api.sgemm && api.dgemm, op, " on ", device.str(),
                ": cannot load cuBLAS (libcublas.so.", CUBLAS_VER_MAJOR,
                " with cublasCreate_v2, cublasSetMathMode, cublas[SD]gemmStridedBatched); is the "
                "CUDA toolkit's lib64 on the library path?");
  return api;
}

// One cuBLAS handle per device, made on first use. Its math mode stays CUBLAS_DEFAULT_MATH, which
// never lowers float32 to TF32, so float32 products keep float32 precision as on the CPU.
cublasHandle_t cublas_handle(const char* op, Device device) {
  static std::mutex mutex;
  static std::array<cublasHandle_t, 64> handles{};
  TESSERA_CHECK(device.index >= 0 && device.index < int(handles.size()), op, ": ", device.str(),
                " is beyond the ", handles.size(), " devices Tessera keeps cuBLAS handles for");
  std::lock_guard<std::mutex> lock(mutex);
  cublasHandle_t& h = handles[size_t(device.index)];
  if (!h) {
    check_cublas(cublas(op, device).create(&h), op, device, "cublasCreate");
    check_cublas(cublas(op, device).set_math_mode(h, CUBLAS_DEFAULT_MATH), op, device,
                 "cublasSetMathMode");
  }
  return h;
}

int as_int(int64_t v, const char* op, Device device, const char* what) {
  TESSERA_CHECK(v >= 0 && v <= INT_MAX, op, " on ", device.str(), ": ", what, " = ", v,
                " exceeds what cuBLAS takes (", INT_MAX, ")");
  return int(v);
}

struct CudaExec {
  // Enough blocks to fill any current GPU several times; larger launches loop.
  static constexpr int64_t kMaxBlocks = int64_t(1) << 16;

  template <class F>
  static void for_each(const char* op, Device device, int64_t n, const F& f) {
    check_launch(cudaSetDevice(device.index), op, device, "cudaSetDevice");
    const int64_t blocks = std::min((n + kThreads - 1) / kThreads, kMaxBlocks);
    for_each_element<<<unsigned(blocks), kThreads>>>(n, f);
    check_launch(cudaGetLastError(), op, device, "kernel launch");
  }

  // Every thread of a block runs every row the block takes, so the team's combines line up.
  template <class F>
  static void for_each_row(const char* op, Device device, int64_t rows, const F& f) {
    check_launch(cudaSetDevice(device.index), op, device, "cudaSetDevice");
    const int64_t blocks = std::min(rows, kMaxBlocks);
    for_each_row_block<<<unsigned(blocks), kThreads>>>(rows, f);
    check_launch(cudaGetLastError(), op, device, "kernel launch");
  }

  static void gemm(const char* op, Device device, const portable::GemmCall& g) {
    portable::check_gemm_call(op, device, g);
    check_launch(cudaSetDevice(device.index), op, device, "cudaSetDevice");
    cublasHandle_t h = cublas_handle(op, device);
    const cublasOperation_t ta = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    const int m = as_int(g.m, op, device, "m"), n = as_int(g.n, op, device, "n");
    const int k = as_int(g.k, op, device, "k"), batch = as_int(g.batch, op, device, "batch");
    const int lda = as_int(g.lda, op, device, "lda"), ldb = as_int(g.ldb, op, device, "ldb");
    const int ldc = as_int(g.ldc, op, device, "ldc");
    if (g.dtype == DType::Float64) {
      const double alpha = g.alpha, beta = g.beta;
      check_cublas(cublas(op, device)
                       .dgemm(h, ta, tb, m, n, k, &alpha, static_cast<const double*>(g.a), lda,
                              g.stride_a, static_cast<const double*>(g.b), ldb, g.stride_b, &beta,
                              static_cast<double*>(g.c), ldc, g.stride_c, batch),
                   op, device, "cublasDgemmStridedBatched");
    } else {
      const float alpha = float(g.alpha), beta = float(g.beta);
      check_cublas(cublas(op, device)
                       .sgemm(h, ta, tb, m, n, k, &alpha, static_cast<const float*>(g.a), lda,
                              g.stride_a, static_cast<const float*>(g.b), ldb, g.stride_b, &beta,
                              static_cast<float*>(g.c), ldc, g.stride_c, batch),
                   op, device, "cublasSgemmStridedBatched");
    }
  }
};

}  // namespace

registry::KernelTable kernels() {
  registry::KernelTable table;
  portable::fill_device_table<CudaExec>(table);
  return table;
}

}  // namespace tessera::kernels::cuda
