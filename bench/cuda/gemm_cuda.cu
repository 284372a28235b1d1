// GEMM on one GPU: tessera::kernels::matmul on cuda:0 tensors against a direct cuBLAS call on the
// same operand buffers, same run. Prints JSON; per shape, ratio = cublas_ms / tessera_ms from the
// median of interleaved timings (1.0: no overhead; the issue's bar is >= 0.95). Tessera allocates
// its output on every call (through its caching allocator), as a user's code would; cuBLAS writes
// a preallocated buffer. float32 with TF32 off on both sides.
//
//   gemm_cuda [--quick]
//
// Without a GPU it prints {"skipped": "..."} and exits 0.
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "../stats.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/linalg.h"
#include "tessera/core/random.h"

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "gemm_cuda: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void check(cublasStatus_t s, const char* what) {
  if (s != CUBLAS_STATUS_SUCCESS) {
    std::fprintf(stderr, "gemm_cuda: %s: cuBLAS status %d\n", what, int(s));
    std::exit(1);
  }
}

// Milliseconds of `f` run `reps` times, between two events on the default stream.
template <class F>
float time_ms(F&& f, int reps) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  check(cudaEventRecord(start), "cudaEventRecord");
  for (int i = 0; i < reps; ++i)
    f();
  check(cudaEventRecord(stop), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms / float(reps);
}

using tessera::bench::median;

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  if (tessera::cuda_device_count() == 0) {
    std::printf("{\"bench\": \"gemm_cuda\", \"skipped\": \"no CUDA device\"}\n");
    return 0;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cublasHandle_t h;
  check(cublasCreate(&h), "cublasCreate");
  check(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), "cublasSetMathMode");
  std::vector<std::vector<int64_t>> shapes = {{256, 256, 256}, {1024, 1024, 1024}};
  if (!quick) {
    shapes.push_back({4096, 4096, 4096});
    shapes.push_back({8192, 1024, 4096});  // a decoder projection: tokens x hidden x ffn
  }
  std::printf(
      "{\"bench\": \"gemm_cuda\", \"device\": \"%s\", \"dtype\": \"float32\", "
      "\"tf32\": false, \"shapes\": [",
      prop.name);
  tessera::Generator gen(1);
  for (size_t s = 0; s < shapes.size(); ++s) {
    const int64_t m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
    const tessera::Device dev = tessera::Device::cuda(0);
    const tessera::Tensor a = tessera::randn({m, k}, gen).to(dev);
    const tessera::Tensor b = tessera::randn({k, n}, gen).to(dev);
    tessera::Tensor c =
        tessera::empty({m, n}, tessera::TensorOptions(tessera::DType::Float32, dev));
    const float alpha = 1, beta = 0;
    // Row-major C = A B is column-major C^T = B^T A^T: B as the first operand.
    auto direct = [&] {
      check(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, int(n), int(m), int(k), &alpha,
                        static_cast<const float*>(b.raw_data()), int(n),
                        static_cast<const float*>(a.raw_data()), int(k), &beta,
                        static_cast<float*>(c.raw_data()), int(n)),
            "cublasSgemm");
    };
    auto through = [&] { (void)tessera::kernels::matmul(a, b); };
    const int reps = m * n * k > (int64_t(1) << 33) ? 5 : 20;
    for (int w = 0; w < 3; ++w) {
      direct();
      through();
    }
    std::vector<float> td, tt;
    for (int r = 0; r < 9; ++r) {
      td.push_back(time_ms(direct, reps));
      tt.push_back(time_ms(through, reps));
    }
    const float md = median(td), mt = median(tt);
    const double flops = 2.0 * double(m) * double(n) * double(k);
    std::printf(
        "%s{\"m\": %lld, \"n\": %lld, \"k\": %lld, \"cublas_ms\": %.4f, "
        "\"tessera_ms\": %.4f, \"tessera_tflops\": %.2f, \"ratio\": %.3f, "
        "\"tessera_ms_min\": %.4f, \"tessera_ms_max\": %.4f}",
        s ? ", " : "", (long long)m, (long long)n, (long long)k, md, mt, flops / (double(mt) * 1e9),
        double(md / mt), *std::min_element(tt.begin(), tt.end()),
        *std::max_element(tt.begin(), tt.end()));
  }
  std::printf("]}\n");
  cublasDestroy(h);
  return 0;
}
