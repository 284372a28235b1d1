#pragma once
// Private to core: rotary position embedding (and its inverse, its backward) on devices (see
// kernels.h for executors), a thread per rotated pair; formulas and checks are the CPU's.
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

namespace tessera::kernels::portable {

template <class C>
struct RopeFn {
  const C* x;
  const C* cos;
  const C* sin;
  C* out;
  int64_t seq, heads, half;
  C sign;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    const int64_t pair = t / half, i = t - pair * half;  // pair: ((b * seq + s) * heads + h)
    const int64_t s = (pair / heads) % seq;
    const C c = cos[s * half + i], sn = sign * sin[s * half + i];
    const int64_t base = pair * 2 * half;
    const C x0 = x[base + 2 * i], x1 = x[base + 2 * i + 1];
    out[base + 2 * i] = x0 * c - x1 * sn;
    out[base + 2 * i + 1] = x0 * sn + x1 * c;
  }
};

template <class Exec>
struct Rope {
  using L = NnLaunch<Exec>;

  static Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse) {
    const RopeDims r = check_rope(x, cos, sin);
    const DType cdt = compute_dtype(x.dtype());
    auto rows = [&](const Tensor& table) {
      return table.as_strided({r.seq, r.half}, table.strides(), table.storage_offset())
          .to(cdt)
          .contiguous();
    };
    const Tensor xc = x.to(cdt).contiguous(), cc = rows(cos), sc = rows(sin);
    Tensor out = L::on(x, x.shape(), cdt);
    on_compute(cdt, [&]<class C>() {
      L::run("rope", x.device(), r.batch * r.seq * r.heads * r.half,
             RopeFn<C>{data_of<C>(xc), data_of<C>(cc), data_of<C>(sc), data_of<C>(out), r.seq,
                       r.heads, r.half, inverse ? C(-1) : C(1)});
    });
    return out.to(x.dtype());
  }

  static void fill_table(registry::KernelTable& table) { table.rope = &rope; }
};

}  // namespace tessera::kernels::portable
