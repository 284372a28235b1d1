#pragma once
// Raw neural-network kernels and their backward kernels.
#include <string>
#include <string_view>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera {
// A loss's reduction, as PyTorch's reduction="none"|"mean"|"sum". Declared outside kernels so
// that argument-dependent lookup of an unqualified cross_entropy(logits, target, ignore_index,
// Reduction::Sum) finds only the differentiable tessera::cross_entropy, not this kernel too.
enum class Reduction : uint8_t { None, Mean, Sum };
// PyTorch's spelling of it ("none", "mean", "sum"), for messages.
inline const char* reduction_name(Reduction r) {
  switch (r) {
    case Reduction::None:
      return "none";
    case Reduction::Mean:
      return "mean";
    case Reduction::Sum:
      return "sum";
  }
  return "?";
}
}  // namespace tessera

namespace tessera::kernels {

using tessera::Reduction;

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);
Tensor softmax_backward(const Tensor& grad_out, const Tensor& out, int64_t dim);
Tensor log_softmax_backward(const Tensor& grad_out, const Tensor& out, int64_t dim);

// logits [N, C], target int64 or int32 [N]; rows whose target is ignore_index contribute nothing
// and Mean divides by the count of the others. label_smoothing eps in [0, 1] makes a kept row's
// loss (1 - eps) * -log p[target] + eps * mean over the classes of -log p, as PyTorch's; both
// terms come from the row's log-sum-exp and sum of logits, so no [N, C] log-softmax is made.
// weight, when defined, holds C class weights (the logits' dtype and device), as PyTorch's: the
// first term is scaled by weight[target], the second becomes the mean of weight[j] * -log p[j],
// and Mean divides by the sum of weight[target] over the kept rows instead of their count.
Tensor cross_entropy(const Tensor& logits, const Tensor& target, int64_t ignore_index = -100,
                     Reduction reduction = Reduction::Mean, double label_smoothing = 0.0,
                     const Tensor& weight = Tensor());
// What is wrong with a class weight for logits of this shape (the classes last), dtype and
// device, described for an error message (empty when nothing, and for an undefined weight): it
// must hold one weight per class, of the logits' dtype and device. The message calls the logits
// `logits_name` and says where the count of classes comes from (`classes`). Every cross-entropy
// checks with it: these kernels, the differentiable loss and the loss-parallel one (whose ranks
// agree on the finding before throwing).
std::string class_weight_problem(const Tensor& weight, const Shape& logits_shape,
                                 DType logits_dtype, const Device& logits_device,
                                 std::string_view logits_name = "logits",
                                 std::string_view classes = "the last dim");
// grad_loss has the loss's shape (scalar, or [N] for None).
Tensor cross_entropy_backward(const Tensor& grad_loss, const Tensor& logits, const Tensor& target,
                              int64_t ignore_index, Reduction reduction,
                              double label_smoothing = 0.0, const Tensor& weight = Tensor());

// weight [V, D], indices int64 of any shape -> [..., D].
Tensor embedding(const Tensor& weight, const Tensor& indices);
Tensor embedding_backward(const Tensor& grad_out, const Tensor& indices, int64_t num_embeddings);

// Normalises over the last dim. Returns the output and the per-row statistics kept for backward.
struct NormResult {
  Tensor out;
  Tensor mean;  // LayerNorm only
  Tensor rstd;
};
NormResult rms_norm(const Tensor& x, const Tensor& weight, double eps);
struct NormGrads {
  Tensor grad_x;
  Tensor grad_weight;
  Tensor grad_bias;
};
NormGrads rms_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                            const Tensor& rstd);
NormResult layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps);
NormGrads layer_norm_backward(const Tensor& grad_out, const Tensor& x, const Tensor& weight,
                              const Tensor& mean, const Tensor& rstd);

// Rotary embedding on x [B, T, H, D] (D even, pairs (2i, 2i+1)) with cos/sin [T, D/2]. The
// backward is the same rotation with -sin.
Tensor rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse = false);
// cos/sin tables [max_seq, head_dim/2] for base theta.
std::pair<Tensor, Tensor> rope_tables(int64_t max_seq, int64_t head_dim, double theta = 10000.0,
                                      DType dtype = DType::Float32);

// Scaled dot-product attention: q [B, H, T, D], k/v [B, H, S, D]; causal masks keys after the
// query position, aligned at the end when S != T (query i sees keys up to i + S - T: PyTorch's
// causal_lower_right, as a decode step with a KV cache needs, where torch's is_causal=True
// aligns at the start); a query that sees no key outputs zeros with logsumexp -inf. Returns the
// output and the row logsumexp [B, H, T] that the backward needs.
struct AttentionResult {
  Tensor out;
  Tensor lse;
};
AttentionResult scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                             bool causal, double scale);
struct AttentionGrads {
  Tensor dq, dk, dv;
};
AttentionGrads scaled_dot_product_attention_backward(const Tensor& grad_out, const Tensor& q,
                                                     const Tensor& k, const Tensor& v,
                                                     const Tensor& out, const Tensor& lse,
                                                     bool causal, double scale);

// Returns the output and the mask (x's dtype, values 0 or 1/(1-p)) so backward is grad * mask.
struct DropoutResult {
  Tensor out;
  Tensor mask;
};
DropoutResult dropout(const Tensor& x, double p, Generator& gen);

}  // namespace tessera::kernels
