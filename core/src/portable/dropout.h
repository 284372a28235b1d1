#pragma once
// Private to core: dropout on devices (see kernels.h for executors). The mask is a Philox draw
// (random.h), so a device keeps the same elements as the CPU for the same generator state.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "../kernel_table.h"
#include "element_ops.h"
#include "launch.h"
#include "nn_checks.h"
#include "nn_launch.h"
#include "strided_index.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/views.h"
#include "tessera/core/random.h"

namespace tessera::kernels::portable {

template <class T>
struct DropoutFn {
  const T* x;
  T* mask;  // Bernoulli draws in, the scaled keep mask out
  T* out;
  T keep;
  TESSERA_HOST_DEVICE void operator()(int64_t i) const {
    using C = compute_t<T>;
    const T m = C(mask[i]) != C(0) ? keep : T(C(0));
    mask[i] = m;
    out[i] = T(C(x[i]) * C(m));
  }
};

template <class Exec>
struct Dropout {
  using L = NnLaunch<Exec>;

  static DropoutResult dropout(const Tensor& x, double p, Generator& gen) {
    check_dropout(x, p);
    Tensor mask = L::on(x, x.shape(), x.dtype());
    const uint64_t base = gen.advance(uint64_t(x.numel()));
    tessera::philox_fill(mask, RandomKind::Bernoulli, 1.0 - p, 0.0, gen.seed(), base,
                         {x.shape(), Shape(size_t(x.dim()), 0)});
    const Tensor xc = x.contiguous();
    Tensor out = L::on(x, x.shape(), x.dtype());
    dispatch_dtype(x.dtype(), [&]<class T>() {
      if constexpr (std::is_floating_point_v<compute_t<T>>) {
        using C = compute_t<T>;
        L::run(
            "dropout", x.device(), x.numel(),
            DropoutFn<T>{data_of<T>(xc), data_of<T>(mask), data_of<T>(out), T(C(1.0 / (1.0 - p)))});
      }
    });
    return {out, mask};
  }

  static void fill_table(registry::KernelTable& table) { table.dropout = &dropout; }
};

}  // namespace tessera::kernels::portable
