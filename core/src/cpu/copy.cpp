// The CPU copy between two tensors of any strides and dtypes (Tensor::copy_ on the CPU), and the
// fill of one (Tensor::fill_).
#include <cstring>
#include <type_traits>

#include "../portable/copy_checks.h"
#include "kernels.h"
#include "tessera/core/detail/strided_loop.h"

namespace tessera::kernels::cpu {

namespace {

template <class D, class S>
void copy_runs(const Tensor& dst, const Tensor& src) {
  D* d = static_cast<D*>(dst.raw_data());
  const S* s = static_cast<const S*>(src.raw_data());
  detail::for_each_run<2>(dst.shape(), {&dst.strides(), &src.strides()},
                          [&](const detail::Run<2>& r) {
                            D* dp = d + r.offset[0];
                            const S* sp = s + r.offset[1];
                            if (r.stride[0] == 1 && r.stride[1] == 1) {
                              if constexpr (std::is_same_v<D, S>) {
                                std::memcpy(dp, sp, size_t(r.length) * sizeof(D));
                              } else {
                                for (int64_t i = 0; i < r.length; ++i)
                                  dp[i] = D(to_compute(sp[i]));
                              }
                              return;
                            }
                            // Within one dtype the bits move as they are (a 16-bit NaN keeps
                            // its payload), as the contiguous memcpy above does.
                            if constexpr (std::is_same_v<D, S>) {
                              for (int64_t i = 0; i < r.length; ++i)
                                dp[i * r.stride[0]] = sp[i * r.stride[1]];
                            } else {
                              for (int64_t i = 0; i < r.length; ++i)
                                dp[i * r.stride[0]] = D(to_compute(sp[i * r.stride[1]]));
                            }
                          });
}

}  // namespace

void copy_(Tensor& dst, const Tensor& src) {
  dispatch_dtype(dst.dtype(), [&]<class D>() {
    dispatch_dtype(src.dtype(), [&]<class S>() { copy_runs<D, S>(dst, src); });
  });
}

void fill_(Tensor& t, double value) {
  dispatch_dtype(t.dtype(), [&]<class T>() {
    T v = T(static_cast<compute_t<T>>(value));
    T* p = static_cast<T*>(t.raw_data());
    tessera::detail::for_each_run<1>(t.shape(), {&t.strides()},
                                     [&](const tessera::detail::Run<1>& r) {
                                       for (int64_t i = 0; i < r.length; ++i)
                                         p[r.offset[0] + i * r.stride[0]] = v;
                                     });
  });
}

void copy_runs_(Tensor& dst, const Tensor& src, const std::vector<CopyRun>& runs) {
  portable::check_copy_runs(dst, src, runs);
  const size_t es = dst.element_size();
  auto* d = static_cast<unsigned char*>(dst.raw_data());
  const auto* s = static_cast<const unsigned char*>(src.raw_data());
  for (const CopyRun& r : runs)
    if (r.length > 0)
      std::memcpy(d + size_t(r.dst) * es, s + size_t(r.src) * es, size_t(r.length) * es);
}

}  // namespace tessera::kernels::cpu
