#pragma once
// Differentiable operations on Tensors. Each records autograd history when grad mode is on and an
// input requires grad; the raw kernels they call are in <tessera/core/kernels/*.h>.
#include <string>
#include <string_view>
#include <vector>

#include "tessera/core/kernels/nn.h"
#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera {

// --- views (share storage with the input) ---
Tensor view(const Tensor& x, const Shape& shape);
Tensor reshape(const Tensor& x, const Shape& shape);
Tensor narrow(const Tensor& x, int64_t dim, int64_t start, int64_t length);
Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step = 1);
Tensor select(const Tensor& x, int64_t dim, int64_t index);
Tensor transpose(const Tensor& x, int64_t d0, int64_t d1);
Tensor permute(const Tensor& x, const std::vector<int64_t>& dims);
Tensor expand(const Tensor& x, const Shape& shape);
Tensor unsqueeze(const Tensor& x, int64_t dim);
Tensor squeeze(const Tensor& x, int64_t dim);
Tensor flatten(const Tensor& x, int64_t start_dim = 0, int64_t end_dim = -1);
Tensor contiguous(const Tensor& x);
std::vector<Tensor> chunk(const Tensor& x, int64_t chunks, int64_t dim);
std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim);

// --- copies ---
Tensor clone(const Tensor& x);
// Differentiable dtype cast (the gradient is cast back to x's dtype).
Tensor cast(const Tensor& x, DType dtype);
// x.to(device) with a gradient: the backward moves the gradient back to x's device.
Tensor to_device(const Tensor& x, Device device);

// --- elementwise (broadcasting) ---
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor pow(const Tensor& a, const Tensor& b);
Tensor maximum(const Tensor& a, const Tensor& b);
Tensor minimum(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor sub(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor div(const Tensor& a, double s);
Tensor pow(const Tensor& a, double exponent);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor sqrt(const Tensor& x);
Tensor rsqrt(const Tensor& x);
Tensor tanh(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor relu(const Tensor& x);
// Exact (erf) GELU; approximate = true uses the tanh form.
Tensor gelu(const Tensor& x, bool approximate = false);
Tensor silu(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor square(const Tensor& x);
Tensor where(const Tensor& cond, const Tensor& a, const Tensor& b);
Tensor masked_fill(const Tensor& x, const Tensor& mask, double value);

Tensor operator+(const Tensor& a, const Tensor& b);
Tensor operator-(const Tensor& a, const Tensor& b);
Tensor operator*(const Tensor& a, const Tensor& b);
Tensor operator/(const Tensor& a, const Tensor& b);
Tensor operator+(const Tensor& a, double s);
Tensor operator-(const Tensor& a, double s);
Tensor operator*(const Tensor& a, double s);
Tensor operator/(const Tensor& a, double s);
Tensor operator*(double s, const Tensor& a);
Tensor operator-(const Tensor& x);

// --- reductions ---
Tensor sum(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);
// Gradient flows to the maximal elements (split evenly among ties); a slice whose maximum is NaN
// gets NaN gradients, as in PyTorch.
Tensor amax(const Tensor& x, const std::vector<int64_t>& dims = {}, bool keepdim = false);

// --- linear algebra ---
Tensor matmul(const Tensor& a, const Tensor& b);
Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias = {});
// A mixed batch for the low-rank products: `a` and `b` stack k adapters of `width` activations
// each ([k·width, in] and [out, k·width]) and each sample (dim 0 of x; a 1-D x is one sample)
// uses at most one of them. Each adapter's product runs on its own samples only, as PEFT's
// adapter_names do, so an adapter holding a NaN or an infinity reaches no other sample's output
// nor any gradient through another sample, and the arithmetic is one adapter's over the batch.
struct LowRankRouting {
  int64_t width = 0;
  int64_t samples = 0;          // x's dim 0
  Tensor rows;                  // int64 [used] on the operands' device: adapter 0's samples, ...
  std::vector<int64_t> counts;  // k: how many of `rows` each adapter takes
  bool defined() const { return width > 0; }
};
// [..., k·width]: sample s of adapter j gets x_s a_jᵀ in adapter j's columns; every other entry
// is zero. x [..., in] and a [k·width, in] of one dtype.
Tensor lowrank_down(const Tensor& x, const Tensor& a, const LowRankRouting& routing);
// [..., out]: sample s of adapter j gets h_s b_jᵀ from adapter j's columns of h [..., k·width]
// alone (the other columns are never read); a sample of no adapter gets zero.
Tensor lowrank_up(const Tensor& h, const Tensor& b, const LowRankRouting& routing);
// y = linear(x, weight, bias) + (scale * (x_lowrank a^T)) b^T with a [r, in] and b [out, r]:
// a linear layer with a low-rank (LoRA) update. x_lowrank defaults to x. When every operand is
// float32 (or every one float64) the update is added by the products themselves, in place,
// forward and backward (no output-sized addition); otherwise it is computed in a's dtype and
// added. With a routing (a mixed batch) the update is lowrank_up(scale * lowrank_down(...)),
// computed in a's dtype and added.
Tensor linear_lowrank(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& a,
                      const Tensor& b, double scale, const Tensor& x_lowrank = {},
                      const LowRankRouting& routing = {});

// --- neural-network ops ---
Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
// logits [..., C] (flattened to [N, C]), target class indices [...] (int64 as PyTorch's, or
// int32, as vocab_parallel_cross_entropy takes too), or, as PyTorch's, floating class
// probabilities [..., C] of the logits' dtype: -sum(target * log_softmax(logits)) per row,
// differentiable in the target too (ignore_index does not apply to them).
// label_smoothing eps in [0, 1], as PyTorch's: class indices give (1 - eps) * nll + eps * (the
// mean over the classes of -log_softmax) per kept row, a mean dividing both by the kept rows,
// fused into one kernel each way (no [N, C] temporary but the gradient); probabilities become
// target * (1 - eps) + eps / C.
// weight, as PyTorch's: C class weights of the logits' dtype and device, which receive no
// gradient (PyTorch's backward refuses one; here a weight requiring grad is an error). With class
// indices a kept row's nll is scaled by weight[target], the smoothing term is the mean of
// weight[c] * -log_softmax[c], and a mean divides by the sum of weight[target] over the kept rows;
// with probabilities each class's term is scaled by weight[c] and a mean still divides by the
// rows.
// Unlike PyTorch, the class dim is the LAST dim at every rank: PyTorch's F.cross_entropy on
// [N, C, d1, ...] takes dim 1 as the classes, so a [B, T, V] call here is PyTorch's
// F.cross_entropy(logits.flatten(0, -2), target.flatten()), not F.cross_entropy(logits, target).
// Move a class dim 1 last (permute) before calling: [N, C, d] logits with C == d, or with
// probabilities (their shape is the logits' under both conventions), are accepted and read dim 2.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     kernels::Reduction reduction = kernels::Reduction::Mean,
                     double label_smoothing = 0.0, const Tensor& weight = Tensor());
// What cross_entropy refuses in a class weight for logits of this shape, dtype and device,
// described (empty when nothing): kernels::class_weight_problem's findings, and a weight that
// requires grad. For a caller that must agree on it across ranks before it throws.
std::string cross_entropy_weight_problem(const Tensor& weight, const Shape& logits_shape,
                                         DType logits_dtype, const Device& logits_device,
                                         std::string_view logits_name = "logits",
                                         std::string_view classes = "the last dim");
Tensor embedding(const Tensor& indices, const Tensor& weight);
Tensor rms_norm(const Tensor& x, const Tensor& weight, double eps);
// rms_norm's eps when none is given, as F.rms_norm's eps=None: the machine epsilon of the type it
// computes in (PyTorch's opmath type, not the documented finfo(dtype).eps): float64 2.2e-16, and
// float32 1.19e-7 also for bfloat16 and float16 inputs. 0 for other dtypes, which rms_norm
// refuses.
inline double rms_norm_default_eps(DType dtype) {
  switch (dtype) {
    case DType::Float64:
      return 2.220446049250313e-16;
    case DType::Float32:
      return 1.1920928955078125e-07;
    case DType::BFloat16:
    case DType::Float16:
      return 1.1920928955078125e-07;
    default:
      return 0.0;
  }
}
inline Tensor rms_norm(const Tensor& x, const Tensor& weight) {
  return rms_norm(x, weight, x.defined() ? rms_norm_default_eps(x.dtype()) : 0.0);
}
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5);
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin);
// q [B, H, T, D], k/v [B, H, S, D]; scale <= 0 means 1/sqrt(D). `causal` aligns the mask at
// the bottom right: query i sees keys j <= i + (S - T), the last query every key (the KV-cache
// convention, PyTorch's causal_lower_right). PyTorch's is_causal = true aligns it at the top
// left instead; the two agree when T == S. With T > S the first T - S queries see no key and
// give zeros.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal = true, double scale = 0.0);
// Identity when !training or p == 0; zeros (times x, as PyTorch) when p == 1.
Tensor dropout(const Tensor& x, double p, bool training, Generator& gen);
Tensor cat(const std::vector<Tensor>& tensors, int64_t dim);
Tensor stack(const std::vector<Tensor>& tensors, int64_t dim);
Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index);

}  // namespace tessera
