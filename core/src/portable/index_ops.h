#pragma once
// Private to core: the row gather and scatter under embedding on devices (see kernels.h for
// executors): index_select along one dim, and index_add, which adds repeated indices in the
// CPU's order so that the result does not depend on timing.
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

// out[..., k, ...] = x[..., idx[k], ...]: operand 0 walks out, operand 1 walks x with 0 along dim.
template <class W>
struct IndexSelectFn {
  StridedIndex<2> ix;
  const W* x;
  W* out;
  const int64_t* idx;
  int64_t inner, n, x_dim_stride;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    int64_t off[2];
    ix.offsets(t, off);
    const int64_t k = (t / inner) % n;
    out[off[0]] = x[off[1] + idx[k] * x_dim_stride];
  }
};

// One thread per (outer, inner) column adds src's rows into acc in index order, so repeated
// indices add in the CPU's order and the result does not depend on timing.
template <class T>
struct IndexAddFn {
  const T* src;
  compute_t<T>* acc;
  const int64_t* idx;
  int64_t inner, n, size;
  TESSERA_HOST_DEVICE void operator()(int64_t t) const {
    const int64_t o = t / inner, i = t - o * inner;
    for (int64_t k = 0; k < n; ++k)
      acc[(o * size + idx[k]) * inner + i] += compute_t<T>(src[(o * n + k) * inner + i]);
  }
};

template <class Exec>
struct IndexOps {
  using L = NnLaunch<Exec>;

  static Tensor index_select(const Tensor& x, int64_t dim, const Tensor& index) {
    TESSERA_CHECK(x.defined(), "index_select: undefined input");
    if (x.dim() == 0) {
      check_zero_dim_index_select(x, dim, index);
      return view(index_select(view(x, {1}), 0, index), {});
    }
    dim = wrap_dim(dim, x.dim(), "index_select");
    const std::vector<int64_t> idx = checked_indices("index_select", index, x.size(dim), dim);
    Shape out_shape = x.shape();
    out_shape[size_t(dim)] = int64_t(idx.size());
    Tensor out = L::on(x, out_shape, x.dtype());
    if (out.numel() == 0) return out;
    const Tensor id = L::to_device(idx, x);
    Shape xs = x.strides();
    xs[size_t(dim)] = 0;
    int64_t inner = 1;
    for (size_t i = size_t(dim) + 1; i < out_shape.size(); ++i)
      inner *= out_shape[i];
    const StridedIndex<2> ix = make_index<2>("index_select", out_shape, {&out.strides(), &xs});
    dispatch_width(x.element_size(), [&]<class W>() {
      L::run("index_select", x.device(), out.numel(),
             IndexSelectFn<W>{ix, data_of<W>(x), data_of<W>(out), data_of<int64_t>(id), inner,
                              int64_t(idx.size()), x.stride(dim)});
    });
    return out;
  }

  static Tensor index_add(const Shape& shape, int64_t dim, const Tensor& index, const Tensor& src) {
    TESSERA_CHECK(src.defined(), "index_add: undefined source");
    TESSERA_CHECK(src.dtype() != DType::Bool, "index_add: bool tensors cannot be added");
    if (shape.empty())
      return view(index_add({1}, 0, index, src.dim() == 0 ? view(src, {1}) : src), {});
    dim = wrap_dim(dim, int64_t(shape.size()), "index_add");
    const std::vector<int64_t> idx = checked_indices("index_add", index, shape[size_t(dim)], dim);
    Shape expected = shape;
    expected[size_t(dim)] = int64_t(idx.size());
    TESSERA_CHECK(src.shape() == expected, "index_add: source ", shape_str(src.shape()),
                  " does not match destination ", shape_str(shape), " with ", idx.size(),
                  " indices along dim ", dim, " (expected ", shape_str(expected), ")");
    Tensor acc = zeros(shape, TensorOptions(compute_dtype(src.dtype()), src.device()));
    if (src.numel() == 0) return acc.to(src.dtype());
    const Tensor s = src.contiguous(), id = L::to_device(idx, src);
    int64_t outer = 1, inner = 1;
    for (int64_t i = 0; i < dim; ++i)
      outer *= shape[size_t(i)];
    for (size_t i = size_t(dim) + 1; i < shape.size(); ++i)
      inner *= shape[i];
    dispatch_dtype(src.dtype(), [&]<class T>() {
      if constexpr (!std::is_same_v<T, bool>)
        L::run("index_add", src.device(), outer * inner,
               IndexAddFn<T>{data_of<T>(s), data_of<compute_t<T>>(acc), data_of<int64_t>(id), inner,
                             int64_t(idx.size()), shape[size_t(dim)]});
    });
    return acc.to(src.dtype());
  }

  static void fill_table(registry::KernelTable& table) {
    table.index_select = &index_select;
    table.index_add = &index_add;
  }
};

}  // namespace tessera::kernels::portable
