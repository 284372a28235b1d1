#pragma once
// Every kernel that computes on tensor data, once: name, result, parameters, arguments. The
// list declares the per-device implementations (cpu/kernels.h, and a device's own files),
// builds the dispatch table and defines the public entry points (dispatch.cpp), so adding a
// kernel is one line here plus its implementations; the compiler finds what is missing.
//
// Views (views.h) are not here: they only make new shapes and strides over the same storage,
// which is device-neutral. Tensor-less factories (rope_tables) build on the CPU.
#include "tessera/core/kernels/elementwise.h"
#include "tessera/core/kernels/linalg.h"
#include "tessera/core/kernels/nn.h"
#include "tessera/core/kernels/optim.h"
#include "tessera/core/kernels/reduce.h"
#include "tessera/core/kernels/shape_ops.h"
#include "tessera/core/kernels/vocab_parallel.h"
#include "tessera/core/random.h"

namespace tessera::kernels {
// Kernels behind Tensor methods rather than public calls: the strided, dtype-converting copy
// between two tensors of one device (Tensor::copy_), the fill with one value (Tensor::fill_),
// and the Philox fill (philox_fill).
void copy_(Tensor& dst, const Tensor& src);
void fill_(Tensor& t, double value);
void philox_fill(Tensor& out, RandomKind kind, double a, double b, uint64_t seed, uint64_t base,
                 const RandomWindow& window);
}  // namespace tessera::kernels

// X(name, result, (parameters), (arguments))
#define TESSERA_KERNELS(X)                                                                         \
  /* elementwise.h */                                                                              \
  X(unary, Tensor, (UnaryOp op, const Tensor& x), (op, x))                                         \
  X(binary, Tensor, (BinaryOp op, const Tensor& a, const Tensor& b), (op, a, b))                   \
  X(binary_scalar, Tensor, (BinaryOp op, const Tensor& a, double s), (op, a, s))                   \
  X(rbinary_scalar, Tensor, (BinaryOp op, double s, const Tensor& a), (op, s, a))                  \
  X(compare, Tensor, (CompareOp op, const Tensor& a, const Tensor& b), (op, a, b))                 \
  X(compare_scalar, Tensor, (CompareOp op, const Tensor& a, double s), (op, a, s))                 \
  X(add_, void, (Tensor & dst, const Tensor& src, double alpha), (dst, src, alpha))                \
  X(mul_scalar_, void, (Tensor & dst, double s), (dst, s))                                         \
  X(unary_backward, Tensor, (UnaryOp op, const Tensor& grad, const Tensor& x), (op, grad, x))      \
  X(where, Tensor, (const Tensor& cond, const Tensor& a, const Tensor& b), (cond, a, b))           \
  X(masked_fill, Tensor, (const Tensor& x, const Tensor& mask, double value), (x, mask, value))    \
  X(sum_to_shape, Tensor, (const Tensor& x, const Shape& shape), (x, shape))                       \
  /* linalg.h */                                                                                   \
  X(matmul, Tensor, (const Tensor& a, const Tensor& b, bool trans_a, bool trans_b),                \
    (a, b, trans_a, trans_b))                                                                      \
  X(addmm, Tensor,                                                                                 \
    (const Tensor& c, const Tensor& a, const Tensor& b, double beta, double alpha, bool trans_a,   \
     bool trans_b),                                                                                \
    (c, a, b, beta, alpha, trans_a, trans_b))                                                      \
  X(matmul_accumulate_, void,                                                                      \
    (Tensor & c, const Tensor& a, const Tensor& b, double alpha, bool trans_a, bool trans_b),      \
    (c, a, b, alpha, trans_a, trans_b))                                                            \
  X(linear, Tensor, (const Tensor& x, const Tensor& w, const Tensor& bias), (x, w, bias))          \
  /* nn.h */                                                                                       \
  X(softmax, Tensor, (const Tensor& x, int64_t dim), (x, dim))                                     \
  X(log_softmax, Tensor, (const Tensor& x, int64_t dim), (x, dim))                                 \
  X(softmax_backward, Tensor, (const Tensor& grad_out, const Tensor& out, int64_t dim),            \
    (grad_out, out, dim))                                                                          \
  X(log_softmax_backward, Tensor, (const Tensor& grad_out, const Tensor& out, int64_t dim),        \
    (grad_out, out, dim))                                                                          \
  X(cross_entropy, Tensor,                                                                         \
    (const Tensor& logits, const Tensor& target, int64_t ignore_index, Reduction reduction,        \
     double label_smoothing, const Tensor& weight),                                                \
    (logits, target, ignore_index, reduction, label_smoothing, weight))                            \
  X(cross_entropy_backward, Tensor,                                                                \
    (const Tensor& grad_loss, const Tensor& logits, const Tensor& target, int64_t ignore_index,    \
     Reduction reduction, double label_smoothing, const Tensor& weight),                           \
    (grad_loss, logits, target, ignore_index, reduction, label_smoothing, weight))                 \
  X(embedding, Tensor, (const Tensor& weight, const Tensor& indices), (weight, indices))           \
  X(embedding_backward, Tensor,                                                                    \
    (const Tensor& grad_out, const Tensor& indices, int64_t num_embeddings),                       \
    (grad_out, indices, num_embeddings))                                                           \
  X(rms_norm, NormResult, (const Tensor& x, const Tensor& weight, double eps), (x, weight, eps))   \
  X(rms_norm_backward, NormGrads,                                                                  \
    (const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& rstd),           \
    (grad_out, x, weight, rstd))                                                                   \
  X(layer_norm, NormResult,                                                                        \
    (const Tensor& x, const Tensor& weight, const Tensor& bias, double eps),                       \
    (x, weight, bias, eps))                                                                        \
  X(layer_norm_backward, NormGrads,                                                                \
    (const Tensor& grad_out, const Tensor& x, const Tensor& weight, const Tensor& mean,            \
     const Tensor& rstd),                                                                          \
    (grad_out, x, weight, mean, rstd))                                                             \
  X(rope, Tensor, (const Tensor& x, const Tensor& cos, const Tensor& sin, bool inverse),           \
    (x, cos, sin, inverse))                                                                        \
  X(scaled_dot_product_attention, AttentionResult,                                                 \
    (const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale),                \
    (q, k, v, causal, scale))                                                                      \
  X(scaled_dot_product_attention_backward, AttentionGrads,                                         \
    (const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, \
     const Tensor& lse, bool causal, double scale),                                                \
    (grad_out, q, k, v, out, lse, causal, scale))                                                  \
  X(dropout, DropoutResult, (const Tensor& x, double p, Generator& gen), (x, p, gen))              \
  /* reduce.h */                                                                                   \
  X(sum, Tensor, (const Tensor& x, const std::vector<int64_t>& dims, bool keepdim),                \
    (x, dims, keepdim))                                                                            \
  X(mean, Tensor, (const Tensor& x, const std::vector<int64_t>& dims, bool keepdim),               \
    (x, dims, keepdim))                                                                            \
  X(amax, Tensor, (const Tensor& x, const std::vector<int64_t>& dims, bool keepdim),               \
    (x, dims, keepdim))                                                                            \
  X(amin, Tensor, (const Tensor& x, const std::vector<int64_t>& dims, bool keepdim),               \
    (x, dims, keepdim))                                                                            \
  X(max, MaxResult, (const Tensor& x, int64_t dim, bool keepdim), (x, dim, keepdim))               \
  X(argmax, Tensor, (const Tensor& x, int64_t dim, bool keepdim), (x, dim, keepdim))               \
  /* shape_ops.h */                                                                                \
  X(cat, Tensor, (const std::vector<Tensor>& tensors, int64_t dim), (tensors, dim))                \
  X(stack, Tensor, (const std::vector<Tensor>& tensors, int64_t dim), (tensors, dim))              \
  X(index_select, Tensor, (const Tensor& x, int64_t dim, const Tensor& index), (x, dim, index))    \
  X(copy_runs_, void, (Tensor & dst, const Tensor& src, const std::vector<CopyRun>& runs),         \
    (dst, src, runs))                                                                              \
  X(index_add, Tensor, (const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src),  \
    (shape, dim, index, src))                                                                      \
  /* optim.h */                                                                                    \
  X(adamw_update_, void,                                                                           \
    (Tensor & param, Tensor & exp_avg, Tensor & exp_avg_sq, Tensor & max_exp_avg_sq,               \
     const Tensor& grad, const AdamWStep& step),                                                   \
    (param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad, step))                                      \
  X(sgd_update_, void,                                                                             \
    (Tensor & param, Tensor & momentum_buffer, const Tensor& grad, const SgdStep& step),           \
    (param, momentum_buffer, grad, step))                                                          \
  X(sum_of_squares, Tensor, (const Tensor& x), (x))                                                \
  /* vocab_parallel.h */                                                                           \
  X(vocab_shard_ids, VocabShardIds,                                                                \
    (const Tensor& ids, int64_t start, int64_t rows, int64_t vocab), (ids, start, rows, vocab))    \
  X(vocab_ce_stats, Tensor,                                                                        \
    (const Tensor& x, const Tensor& row_max, const Tensor& target, int64_t start),                 \
    (x, row_max, target, start))                                                                   \
  X(vocab_ce_loss, VocabCrossEntropy,                                                              \
    (const Tensor& stats, const Tensor& row_max, const Tensor& target, int64_t kept),              \
    (stats, row_max, target, kept))                                                                \
  X(vocab_ce_backward, Tensor,                                                                     \
    (const Tensor& x, const Tensor& lse, const Tensor& target, int64_t start, double scale),       \
    (x, lse, target, start, scale))                                                                \
  /* Tensor methods */                                                                             \
  X(copy_, void, (Tensor & dst, const Tensor& src), (dst, src))                                    \
  X(fill_, void, (Tensor & t, double value), (t, value))                                           \
  X(philox_fill, void,                                                                             \
    (Tensor & out, RandomKind kind, double a, double b, uint64_t seed, uint64_t base,              \
     const RandomWindow& window),                                                                  \
    (out, kind, a, b, seed, base, window))
