#pragma once
// Private to core: the argument checks and shared geometry of the nn kernels (softmax, norms,
// cross-entropy, attention), used by the CPU implementation and the device one (portable/nn.h and
// its parts), so both refuse the same inputs with the same words.
#include <algorithm>
#include <cmath>
#include <vector>

#include "tessera/core/error.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/tensor.h"

namespace tessera::kernels::portable {

// Softmax-style kernels view a contiguous tensor as [outer, n, inner] with the reduced dim n in
// the middle.
struct Geometry {
  int64_t outer = 1, n = 1, inner = 1;
};

inline Geometry geometry(const Shape& shape, int64_t dim) {
  Geometry g;
  g.n = shape.empty() ? 1 : shape[size_t(dim)];
  for (int64_t i = 0; i < dim; ++i)
    g.outer *= shape[size_t(i)];
  for (size_t i = size_t(dim) + 1; i < shape.size(); ++i)
    g.inner *= shape[i];
  return g;
}

inline void check_softmax_input(const char* op, const Tensor& x) {
  TESSERA_CHECK(x.defined(), op, ": undefined input");
  TESSERA_CHECK(is_floating(x.dtype()), op, ": needs a floating-point tensor, got ", x.str());
}

// The norms work on rows: x viewed as [rows, d], d its last dim.
struct RowLayout {
  Shape lead;  // x's leading dims: the shape of the per-row statistics
  int64_t rows;
  int64_t d;
};

inline void check_norm_param(const char* op, const char* name, const Tensor& p, const Tensor& x) {
  if (!p.defined()) return;
  TESSERA_CHECK(p.device() == x.device(), op, ": ", name, " ", p.str(), " is not on x's device ",
                x.device().str());
  TESSERA_CHECK(is_floating(p.dtype()), op, ": ", name, " must be floating, got ", p.str());
  TESSERA_CHECK(p.shape() == Shape{x.size(-1)}, op, ": ", name, " of shape ", shape_str(p.shape()),
                " does not match the normalised dim of x ", shape_str(x.shape()), " (expected [",
                x.size(-1), "])");
}

inline RowLayout check_norm_input(const char* op, const Tensor& x, const Tensor& weight,
                                  const Tensor& bias) {
  TESSERA_CHECK(x.defined(), op, ": x is undefined");
  TESSERA_CHECK(is_floating(x.dtype()), op, ": x must be floating, got ", x.str());
  TESSERA_CHECK(x.dim() >= 1, op, ": x must have at least one dim to normalise over, got ",
                x.str());
  TESSERA_CHECK(x.size(-1) > 0, op, ": the normalised (last) dim of x ", shape_str(x.shape()),
                " is empty");
  check_norm_param(op, "weight", weight, x);
  check_norm_param(op, "bias", bias, x);
  RowLayout r;
  r.lead.assign(x.shape().begin(), x.shape().end() - 1);
  r.rows = shape_numel(r.lead);
  r.d = x.size(-1);
  return r;
}

inline void check_norm_backward(const char* op, const Tensor& grad_out, const Tensor& x,
                                const Tensor& stat, const char* stat_name, const RowLayout& r) {
  TESSERA_CHECK(grad_out.defined() && grad_out.shape() == x.shape(), op, ": grad_out ",
                grad_out.defined() ? shape_str(grad_out.shape()) : std::string("undefined"),
                " does not match x ", shape_str(x.shape()));
  TESSERA_CHECK(grad_out.device() == x.device(), op, ": grad_out ", grad_out.str(),
                " is not on x's device");
  TESSERA_CHECK(stat.defined() && stat.shape() == r.lead, op, ": ", stat_name, " ",
                stat.defined() ? shape_str(stat.shape()) : std::string("undefined"),
                " does not match x's leading dims ", shape_str(r.lead));
}

inline void check_cross_entropy_args(const char* op, const Tensor& logits, const Tensor& target,
                                     double label_smoothing, const Tensor& weight) {
  TESSERA_CHECK(logits.defined() && target.defined(), op, ": undefined logits or target");
  TESSERA_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op,
                ": label_smoothing must be in [0, 1], got ", label_smoothing);
  TESSERA_CHECK(logits.dim() == 2 && is_floating(logits.dtype()), op,
                ": logits must be a floating-point [N, C] tensor, got ", logits.str());
  TESSERA_CHECK(target.dtype() == DType::Int64 || target.dtype() == DType::Int32, op,
                ": target must be int64 or int32 class indices, got ", target.str());
  TESSERA_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, ": target shape ",
                shape_str(target.shape()), " does not match logits ", shape_str(logits.shape()),
                " (expected [", logits.size(0), "])");
  const std::string problem =
      class_weight_problem(weight, logits.shape(), logits.dtype(), logits.device());
  TESSERA_CHECK(problem.empty(), op, ": ", problem);
}

// cross_entropy_backward's grad_loss: [N] for reduction none, one value otherwise.
inline void check_cross_entropy_grad(const char* op, const Tensor& grad_loss, int64_t n,
                                     Reduction reduction) {
  TESSERA_CHECK(grad_loss.defined(), op, ": undefined grad_loss");
  if (reduction == Reduction::None) {
    TESSERA_CHECK(grad_loss.shape() == Shape{n}, op, ": grad_loss ", shape_str(grad_loss.shape()),
                  " for reduction none must be [", n, "]");
  } else {
    TESSERA_CHECK(grad_loss.numel() == 1, op, ": grad_loss ", shape_str(grad_loss.shape()),
                  " for reduction ", reduction_name(reduction), " must hold one value");
  }
}

// cross_entropy's targets read to the host and checked (ignored rows become -1), the class
// weights in float64 (empty without), their total (C without), and what a mean divides by: the
// kept rows' count, or the sum of their targets' weights (PyTorch's weighted mean).
struct CrossEntropyTargets {
  std::vector<int64_t> classes;
  std::vector<double> weight;
  double weight_total = 0;
  double mean_divisor = 0;
};

inline CrossEntropyTargets cross_entropy_targets(const char* op, const Tensor& target,
                                                 int64_t num_classes, int64_t ignore_index,
                                                 const Tensor& weight) {
  CrossEntropyTargets r;
  r.classes = target.to_vector<int64_t>();
  if (weight.defined()) r.weight = weight.to_vector<double>();
  for (int64_t j = 0; j < num_classes; ++j)
    r.weight_total += r.weight.empty() ? 1.0 : r.weight[size_t(j)];
  for (size_t i = 0; i < r.classes.size(); ++i) {
    int64_t& t = r.classes[i];
    if (t == ignore_index) {
      t = -1;
      continue;
    }
    TESSERA_CHECK(t >= 0 && t < num_classes, op, ": target ", t, " at row ", i,
                  " is out of range for ", num_classes, " classes (ignore_index is ", ignore_index,
                  ")");
    r.mean_divisor += r.weight.empty() ? 1.0 : r.weight[size_t(t)];
  }
  return r;
}

// q [B, H, T, D], k [B, H, S, D], v [B, H, S, Dv]; with `causal`, query i sees the keys up to
// i + (S - T) (the last T queries of an S-long sequence).
struct AttentionDims {
  int64_t batch, heads, t, s, d, dv;
  // Queries see keys j <= i + (s - t): the causal diagonal is aligned at the end, so a query
  // block that continues a cached prefix of keys sees the whole prefix.
  int64_t visible(int64_t i, bool causal) const {
    if (!causal) return s;
    return std::clamp<int64_t>(i + (s - t) + 1, 0, s);
  }
};

inline AttentionDims check_attention_inputs(const char* op, const Tensor& q, const Tensor& k,
                                            const Tensor& v, double scale) {
  TESSERA_CHECK(q.defined() && k.defined() && v.defined(), op, ": q, k and v must be defined");
  TESSERA_CHECK(is_floating(q.dtype()) && k.dtype() == q.dtype() && v.dtype() == q.dtype(), op,
                ": q, k and v must share one floating dtype, got ", dtype_name(q.dtype()), ", ",
                dtype_name(k.dtype()), ", ", dtype_name(v.dtype()));
  TESSERA_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
                ": expected q [B, H, T, D] and k/v [B, H, S, D], got q ", shape_str(q.shape()),
                ", k ", shape_str(k.shape()), ", v ", shape_str(v.shape()));
  TESSERA_CHECK(q.size(0) == k.size(0) && q.size(0) == v.size(0) && q.size(1) == k.size(1) &&
                    q.size(1) == v.size(1),
                op, ": batch and head dims differ between q ", shape_str(q.shape()), ", k ",
                shape_str(k.shape()), " and v ", shape_str(v.shape()));
  TESSERA_CHECK(q.size(3) == k.size(3), op, ": head dim mismatch between q ", shape_str(q.shape()),
                " (D=", q.size(3), ") and k ", shape_str(k.shape()), " (D=", k.size(3), ")");
  TESSERA_CHECK(k.size(2) == v.size(2), op, ": k ", shape_str(k.shape()), " and v ",
                shape_str(v.shape()), " must have the same number of keys S");
  TESSERA_CHECK(std::isfinite(scale) && scale > 0, op, ": scale must be finite and > 0, got ",
                scale, " (the autograd op turns scale <= 0 into 1/sqrt(D); the kernel does not)");
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
}

inline void check_attention_backward(const char* op, const AttentionDims& n, const Tensor& grad_out,
                                     const Tensor& out, const Tensor& lse) {
  const Shape out_shape{n.batch, n.heads, n.t, n.dv}, lse_shape{n.batch, n.heads, n.t};
  TESSERA_CHECK(grad_out.defined() && out.defined() && lse.defined(), op,
                ": grad_out, out and lse must be defined");
  TESSERA_CHECK(grad_out.shape() == out_shape && out.shape() == out_shape, op, ": grad_out ",
                shape_str(grad_out.shape()), " and out ", shape_str(out.shape()),
                " must be [B, H, T, Dv] = ", shape_str(out_shape));
  TESSERA_CHECK(lse.shape() == lse_shape, op, ": lse ", shape_str(lse.shape()), " must be ",
                shape_str(lse_shape));
}

// rope's x is [B, T, H, D] with D even; cos and sin are [>= T, D/2] tables.
struct RopeDims {
  int64_t batch, seq, heads, half;
};
inline RopeDims check_rope(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  TESSERA_CHECK(x.defined() && cos.defined() && sin.defined(),
                "rope: x, cos and sin must all be defined");
  TESSERA_CHECK(is_floating(x.dtype()) && is_floating(cos.dtype()) && is_floating(sin.dtype()),
                "rope: x ", x.str(), ", cos ", cos.str(), ", sin ", sin.str(), " must be floating");
  TESSERA_CHECK(x.dim() == 4, "rope: x must be [B, T, H, D], got ", shape_str(x.shape()));
  const int64_t batch = x.size(0), seq = x.size(1), heads = x.size(2), d = x.size(3);
  TESSERA_CHECK(d % 2 == 0, "rope: head dim D=", d, " of x ", shape_str(x.shape()),
                " is odd; rotary pairs (2i, 2i+1) need an even D");
  const int64_t half = d / 2;
  TESSERA_CHECK(cos.dim() == 2 && sin.shape() == cos.shape(), "rope: cos ", shape_str(cos.shape()),
                " and sin ", shape_str(sin.shape()), " must both be [T, D/2]");
  TESSERA_CHECK(cos.size(1) == half && cos.size(0) >= seq, "rope: tables ", shape_str(cos.shape()),
                " do not fit x ", shape_str(x.shape()), " (expected [>=", seq, ", ", half, "])");
  return {batch, seq, heads, half};
}

inline void check_dropout(const Tensor& x, double p) {
  TESSERA_CHECK(x.defined(), "dropout: x is undefined");
  TESSERA_CHECK(is_floating(x.dtype()), "dropout: x must be floating, got ", x.str());
  TESSERA_CHECK(std::isfinite(p) && p >= 0 && p < 1,
                "dropout: probability p must be in [0, 1), got ", p, " for x ",
                shape_str(x.shape()));
}

// index_select/index_add's index: 1-D int32/int64, read to the host and each value checked
// against `size` (a device checks on the host too, so a bad index is an error, not a fault).
inline std::vector<int64_t> checked_indices(const char* op, const Tensor& index, int64_t size,
                                            int64_t dim) {
  TESSERA_CHECK(index.defined(), op, ": undefined index");
  TESSERA_CHECK(index.dtype() == DType::Int64 || index.dtype() == DType::Int32, op,
                ": index must be int64 or int32, got ", index.str());
  TESSERA_CHECK(index.dim() <= 1, op, ": index must be 1-D, got ", shape_str(index.shape()));
  std::vector<int64_t> idx = index.to_vector<int64_t>();
  for (size_t i = 0; i < idx.size(); ++i) {
    TESSERA_CHECK(idx[i] >= 0 && idx[i] < size, op, ": index ", idx[i], " at position ", i,
                  " is out of range for dim ", dim, " of size ", size);
  }
  return idx;
}

// index_select of a 0-dim input, which behaves as 1-D of size 1 (PyTorch): dim must be 0 or -1
// and the index hold one value.
inline void check_zero_dim_index_select(const Tensor& x, int64_t dim, const Tensor& index) {
  wrap_dim(dim, 0, "index_select");
  TESSERA_CHECK(!index.defined() || index.numel() == 1, "index_select: index to a 0-dim input ",
                x.str(), " can have only 1 value, got ", index.numel(), " (index ",
                shape_str(index.shape()), ")");
}

}  // namespace tessera::kernels::portable
