// Inverted dropout: kept elements are scaled by 1/(1-p) in the forward pass, so evaluation needs
// no rescaling. The keep decisions are Philox Bernoulli draws addressed by the generator's
// (seed, offset), hence reproducible from those two numbers alone.
#include <cmath>

#include "../portable/nn_checks.h"
#include "kernels.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/nn.h"

namespace tessera::kernels::cpu {

DropoutResult dropout(const Tensor& x, double p, Generator& gen) {
  portable::check_dropout(x, p);
  Tensor mask = empty(x.shape(), x.dtype());
  const uint64_t base = gen.advance(uint64_t(x.numel()));
  tessera::philox_fill(mask, RandomKind::Bernoulli, 1.0 - p, 0.0, gen.seed(), base,
                       {x.shape(), Shape(size_t(x.dim()), 0)});
  Tensor xc = x.contiguous();
  Tensor out = empty(x.shape(), x.dtype());
  dispatch_dtype(x.dtype(), [&]<class T>() {
    if constexpr (std::is_floating_point_v<compute_t<T>>) {
      using C = compute_t<T>;
      // The scale is rounded to x's dtype once and the output is x * mask with that rounded
      // value, so forward and backward (grad * mask) use the very same factor.
      const T keep = T(C(1.0 / (1.0 - p)));
      const T drop = T(C(0));
      const T* xp = xc.data<T>();
      T* mp = mask.data<T>();
      T* op = out.data<T>();
      for (int64_t i = 0; i < x.numel(); ++i) {
        mp[i] = C(mp[i]) != C(0) ? keep : drop;
        op[i] = T(C(xp[i]) * C(mp[i]));
      }
    }
  });
  return {out, mask};
}

}  // namespace tessera::kernels::cpu
