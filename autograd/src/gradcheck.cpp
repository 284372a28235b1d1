#include "tessera/autograd/gradcheck.h"

#include <cmath>
#include <sstream>

#include "tessera/autograd/engine.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/core/random.h"

namespace tessera {

namespace {
double weighted_sum(const Tensor& out, const std::vector<double>& w) {
  std::vector<double> v = out.to_vector<double>();
  double s = 0;
  for (size_t i = 0; i < v.size(); ++i)
    s += v[i] * w[i];
  return s;
}
}  // namespace

GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f,
                          const std::vector<Tensor>& inputs, const GradcheckOptions& opts) {
  GradcheckResult res;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.defined() || !x.requires_grad()) continue;
    // Inputs are perturbed in place through host pointers.
    TESSERA_CHECK(
        x.dtype() == DType::Float64 && x.is_contiguous() && x.is_leaf() && x.device().is_cpu(),
        "gradcheck: input ", i, " must be a contiguous float64 leaf on the CPU, got ", x.str(),
        " on ", x.device().str());
    const_cast<Tensor&>(x).set_grad(Tensor());
  }
  Tensor out;
  {
    EnableGradGuard grad;
    out = f(inputs);
  }
  Generator gen(opts.seed);
  Tensor w = randn(out.shape(), gen, out.dtype());
  std::vector<double> wv = w.to_vector<double>();
  if (out.requires_grad()) backward(out, w);

  for (size_t i = 0; i < inputs.size(); ++i) {
    const Tensor& x = inputs[i];
    if (!x.defined() || !x.requires_grad()) continue;
    std::vector<double> analytic(size_t(x.numel()), 0.0);
    if (x.grad().defined()) analytic = x.grad().to_vector<double>();
    double* p = x.data<double>();
    for (int64_t j = 0; j < x.numel(); ++j) {
      double orig = p[j];
      double fp, fm;
      {
        NoGradGuard no_grad;
        p[j] = orig + opts.eps;
        fp = weighted_sum(f(inputs), wv);
        p[j] = orig - opts.eps;
        fm = weighted_sum(f(inputs), wv);
        p[j] = orig;
      }
      double numeric = (fp - fm) / (2 * opts.eps);
      double err = std::abs(numeric - analytic[size_t(j)]);
      res.max_abs_error = std::max(res.max_abs_error, err);
      if (err > opts.atol + opts.rtol * std::abs(numeric) && res.ok) {
        res.ok = false;
        std::ostringstream os;
        os << "input " << i << " " << x.str() << " element " << j << ": analytic "
           << analytic[size_t(j)] << " vs numeric " << numeric;
        res.message = os.str();
      }
    }
  }
  return res;
}

}  // namespace tessera
