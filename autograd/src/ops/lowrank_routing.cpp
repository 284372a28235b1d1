// The low-rank products of a mixed batch, one adapter per sample. Each adapter's samples are
// gathered (the routing lists them adapter by adapter), multiplied by that adapter's matrices
// alone, and scattered back; no product ever reads another adapter's values for a sample, so a
// NaN or an infinity in one adapter cannot reach the others' samples as 0 * inf would through a
// mask. Forward and backward each gather the operands again rather than keep gathered copies.
#include <numeric>

#include "tessera/autograd/function.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/linalg.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/views.h"

namespace tessera {

namespace {

// x [samples, ..., c] seen as samples of `per` rows of c: what one sample contributes to a
// product. A 1-D x is one sample of one row.
struct Samples {
  int64_t samples, per, c;
};

Samples samples_of(const Tensor& x, const LowRankRouting& r, const char* op) {
  const int64_t s = x.dim() >= 2 ? x.size(0) : 1;
  int64_t per = 1;
  for (int64_t d = 1; d + 1 < x.dim(); ++d)
    per *= x.size(d);
  TESSERA_CHECK(s == r.samples, op, ": the routing names ", r.samples, " samples but ",
                shape_str(x.shape()), " holds ", s);
  return {s, per, x.size(-1)};
}

// The routed samples of x, adapter by adapter: [used * per, c].
Tensor gather(const Tensor& x, const Samples& d, const LowRankRouting& r) {
  Tensor g = kernels::index_select(kernels::reshape(x, {d.samples, d.per * d.c}), 0, r.rows);
  return kernels::view(g, {g.size(0) * d.per, d.c});
}

// The inverse of gather: rows [used * per, c] back into zeros shaped `shape` ([..., c]).
Tensor scatter(const Tensor& rows, const Samples& d, const LowRankRouting& r, Shape shape) {
  const Tensor v = kernels::view(rows.contiguous(), {r.rows.size(0), d.per * d.c});
  return kernels::view(kernels::index_add({d.samples, d.per * d.c}, 0, r.rows, v), shape);
}

Shape with_last(const Tensor& x, int64_t c) {
  Shape s = x.shape();
  s.back() = c;
  return s;
}

// Calls f(j, first row, rows) for each adapter j of the gathered rows.
template <class F>
void for_each_adapter(const LowRankRouting& r, int64_t per, F f) {
  int64_t off = 0;
  for (size_t j = 0; j < r.counts.size(); ++j) {
    const int64_t n = r.counts[j] * per;
    f(int64_t(j), off, n);
    off += n;
  }
}

void check_routing(const LowRankRouting& r, int64_t stacked, const char* op) {
  TESSERA_CHECK(r.width > 0 && stacked == int64_t(r.counts.size()) * r.width, op,
                ": adapters stacked ", stacked, " wide, but the routing has ", r.counts.size(),
                " adapters of ", r.width);
  TESSERA_CHECK(r.rows.defined() && r.rows.dim() == 1 &&
                    r.rows.size(0) == std::accumulate(r.counts.begin(), r.counts.end(), int64_t(0)),
                op, ": the routing's rows do not add up to its counts");
}

class LowRankDownFn final : public autograd::Function {
 public:
  explicit LowRankDownFn(LowRankRouting r) : r_(std::move(r)) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& x = in[0];
    const Tensor& a = in[1];
    const Samples d = samples_of(x, r_, "lowrank_down");
    const Tensor xs = gather(x, d, r_);
    const int64_t w = r_.width;
    Tensor hs = zeros({xs.size(0), a.size(0)}, TensorOptions(a.dtype(), a.device()));
    for_each_adapter(r_, d.per, [&](int64_t j, int64_t off, int64_t n) {
      Tensor block = kernels::narrow(kernels::narrow(hs, 0, off, n), 1, j * w, w);
      block.copy_(kernels::matmul(kernels::narrow(xs, 0, off, n), kernels::narrow(a, 0, j * w, w),
                                  false, true));
    });
    save_for_backward({x, a});
    return {scatter(hs, {d.samples, d.per, a.size(0)}, r_, with_last(x, a.size(0)))};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& x = saved_tensors()[0];
    const Tensor& a = saved_tensors()[1];
    const Samples d = samples_of(x, r_, "lowrank_down");
    const Tensor xs = gather(x, d, r_);
    const Tensor gs = gather(grads[0], {d.samples, d.per, a.size(0)}, r_);
    const int64_t w = r_.width;
    std::vector<Tensor> gx, ga;
    for_each_adapter(r_, d.per, [&](int64_t j, int64_t off, int64_t n) {
      const Tensor g = kernels::narrow(kernels::narrow(gs, 0, off, n), 1, j * w, w);
      const Tensor xj = kernels::narrow(xs, 0, off, n);
      if (needs_input_grad(0)) gx.push_back(kernels::matmul(g, kernels::narrow(a, 0, j * w, w)));
      if (needs_input_grad(1)) ga.push_back(kernels::matmul(g, xj, true, false));
    });
    Tensor gxt, gat;
    if (needs_input_grad(0)) gxt = scatter(kernels::cat(gx, 0), d, r_, x.shape());
    if (needs_input_grad(1)) gat = kernels::cat(ga, 0);
    return {gxt, gat};
  }

 private:
  LowRankRouting r_;
};

class LowRankUpFn final : public autograd::Function {
 public:
  explicit LowRankUpFn(LowRankRouting r) : r_(std::move(r)) {}

  std::vector<Tensor> forward(const std::vector<Tensor>& in) override {
    const Tensor& h = in[0];
    const Tensor& b = in[1];
    const Samples d = samples_of(h, r_, "lowrank_up");
    const Tensor hs = gather(h, d, r_);
    const int64_t w = r_.width;
    std::vector<Tensor> parts;
    for_each_adapter(r_, d.per, [&](int64_t j, int64_t off, int64_t n) {
      parts.push_back(kernels::matmul(kernels::narrow(kernels::narrow(hs, 0, off, n), 1, j * w, w),
                                      kernels::narrow(b, 1, j * w, w), false, true));
    });
    save_for_backward({h, b});
    return {scatter(kernels::cat(parts, 0), {d.samples, d.per, b.size(0)}, r_,
                    with_last(h, b.size(0)))};
  }

  std::vector<Tensor> backward(const std::vector<Tensor>& grads) override {
    const Tensor& h = saved_tensors()[0];
    const Tensor& b = saved_tensors()[1];
    const Samples d = samples_of(h, r_, "lowrank_up");
    const Tensor hs = gather(h, d, r_);
    const Tensor gs = gather(grads[0], {d.samples, d.per, b.size(0)}, r_);
    const int64_t w = r_.width;
    Tensor ghs;
    if (needs_input_grad(0)) ghs = zeros(hs.shape(), TensorOptions(hs.dtype(), hs.device()));
    std::vector<Tensor> gb;
    for_each_adapter(r_, d.per, [&](int64_t j, int64_t off, int64_t n) {
      const Tensor g = kernels::narrow(gs, 0, off, n);
      if (needs_input_grad(0))
        kernels::narrow(kernels::narrow(ghs, 0, off, n), 1, j * w, w)
            .copy_(kernels::matmul(g, kernels::narrow(b, 1, j * w, w)));
      if (needs_input_grad(1))
        gb.push_back(kernels::matmul(
            g, kernels::narrow(kernels::narrow(hs, 0, off, n), 1, j * w, w), true, false));
    });
    Tensor ght, gbt;
    if (needs_input_grad(0)) ght = scatter(ghs, d, r_, h.shape());
    if (needs_input_grad(1)) gbt = kernels::cat(gb, 1);
    return {ght, gbt};
  }

 private:
  LowRankRouting r_;
};

}  // namespace

Tensor lowrank_down(const Tensor& x, const Tensor& a, const LowRankRouting& routing) {
  TESSERA_CHECK(x.defined() && a.defined() && x.dim() >= 1 && a.dim() == 2 &&
                    x.size(-1) == a.size(1) && x.dtype() == a.dtype(),
                "lowrank_down: input ", x.defined() ? x.str() : "undefined", " and a ",
                a.defined() ? a.str() : "undefined",
                " do not fit (a [k*width, in] of the input's dtype)");
  check_routing(routing, a.size(0), "lowrank_down");
  return autograd::Function::apply<LowRankDownFn>({x, a}, routing)[0];
}

Tensor lowrank_up(const Tensor& h, const Tensor& b, const LowRankRouting& routing) {
  TESSERA_CHECK(h.defined() && b.defined() && h.dim() >= 1 && b.dim() == 2 &&
                    h.size(-1) == b.size(1) && h.dtype() == b.dtype(),
                "lowrank_up: activations ", h.defined() ? h.str() : "undefined", " and b ",
                b.defined() ? b.str() : "undefined",
                " do not fit (b [out, k*width] of the activations' dtype)");
  check_routing(routing, b.size(1), "lowrank_up");
  return autograd::Function::apply<LowRankUpFn>({h, b}, routing)[0];
}

}  // namespace tessera
