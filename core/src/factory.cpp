#include "tessera/core/factory.h"

#include <cmath>
#include <cstring>

#include "tessera/core/allocator.h"
#include "tessera/core/storage.h"

namespace tessera {

Tensor empty(const Shape& shape, TensorOptions opts) {
  for (int64_t d : shape)
    TESSERA_CHECK(d >= 0, "empty: negative dimension in ", shape_str(shape));
  const size_t nbytes = size_t(shape_numel(shape)) * element_size(opts.dtype);
  if (opts.pinned) {
    TESSERA_CHECK(opts.device.is_cpu(), "empty: pinned memory is host memory; asked for ",
                  opts.device.str());
    Allocator* pinned = pinned_allocator();
    TESSERA_CHECK(pinned != nullptr, "empty(", shape_str(shape),
                  ", pinned): nothing can pin host memory here (it needs a CUDA build and a GPU)");
    return Tensor::make(Storage(nbytes, opts.device, pinned), shape, contiguous_strides(shape), 0,
                        opts.dtype);
  }
  Storage storage(nbytes, opts.device);
  return Tensor::make(std::move(storage), shape, contiguous_strides(shape), 0, opts.dtype);
}

Tensor zeros(const Shape& shape, TensorOptions opts) {
  Tensor t = empty(shape, opts);
  if (opts.device.is_cpu()) {
    if (t.nbytes()) std::memset(t.raw_data(), 0, t.nbytes());  // all dtypes: 0 bits == 0
  } else {
    t.zero_();
  }
  return t;
}

Tensor ones(const Shape& shape, TensorOptions opts) {
  return full(shape, 1.0, opts);
}

Tensor full(const Shape& shape, double value, TensorOptions opts) {
  Tensor t = empty(shape, opts);
  t.fill_(value);
  return t;
}

Tensor empty_like(const Tensor& t) {
  return empty(t.shape(), TensorOptions(t.dtype(), t.device()));
}
Tensor zeros_like(const Tensor& t) {
  return zeros(t.shape(), TensorOptions(t.dtype(), t.device()));
}
Tensor ones_like(const Tensor& t) {
  return ones(t.shape(), TensorOptions(t.dtype(), t.device()));
}
Tensor full_like(const Tensor& t, double value) {
  return full(t.shape(), value, TensorOptions(t.dtype(), t.device()));
}

Tensor arange(int64_t end, TensorOptions opts) {
  return arange(0, double(end), 1, opts);
}

Tensor arange(double start, double end, double step, TensorOptions opts) {
  TESSERA_CHECK(step != 0, "arange: step must be non-zero");
  // As PyTorch: an infinite or NaN bound or step, or a step pointing away from the end, is an
  // error (the length's conversion to an integer was undefined for the first, and both gave an
  // empty tensor where torch.arange refuses).
  TESSERA_CHECK(std::isfinite(start) && std::isfinite(end) && std::isfinite(step),
                "arange: unsupported range: ", start, " -> ", end, " with step ", step);
  TESSERA_CHECK((step > 0 && end >= start) || (step < 0 && end <= start), "arange: the range ",
                start, " -> ", end, " is inconsistent with the sign of step ", step);
  int64_t n = std::max<int64_t>(0, int64_t(std::ceil((end - start) / step)));
  Tensor host = empty({n}, TensorOptions(opts.dtype, Device::cpu()));
  dispatch_dtype(opts.dtype, [&]<class T>() {
    T* p = host.data<T>();
    for (int64_t i = 0; i < n; ++i)
      p[i] = T(compute_t<T>(start + double(i) * step));
  });
  return host.to(opts.device);
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& shape) {
  Shape s = shape.empty() ? Shape{int64_t(values.size())} : shape;
  TESSERA_CHECK(shape_numel(s) == int64_t(values.size()), "from_vector: ", values.size(),
                " values do not fill shape ", shape_str(s));
  Tensor t = empty(s, DTypeOf<T>::value);
  T* p = t.data<T>();
  for (size_t i = 0; i < values.size(); ++i)
    p[i] = values[i];
  return t;
}
template Tensor from_vector<float>(const std::vector<float>&, const Shape&);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&);
template Tensor from_vector<BFloat16>(const std::vector<BFloat16>&, const Shape&);
template Tensor from_vector<Float16>(const std::vector<Float16>&, const Shape&);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&);
template Tensor from_vector<int32_t>(const std::vector<int32_t>&, const Shape&);
template <>
Tensor from_vector<bool>(const std::vector<bool>& values, const Shape& shape) {
  Shape s = shape.empty() ? Shape{int64_t(values.size())} : shape;
  TESSERA_CHECK(shape_numel(s) == int64_t(values.size()), "from_vector: ", values.size(),
                " values do not fill shape ", shape_str(s));
  Tensor t = empty(s, DType::Bool);
  bool* p = t.data<bool>();
  for (size_t i = 0; i < values.size(); ++i)
    p[i] = values[i];
  return t;
}

Tensor scalar_tensor(double value, TensorOptions opts) {
  return full({}, value, opts);
}

}  // namespace tessera
