#include "merge_tasks.h"

#include <Eigen/QR>
#include <Eigen/SVD>
#include <algorithm>
#include <cmath>
#include <numeric>

#include "tessera/core/error.h"

namespace tessera::lora_detail {

std::vector<double> prune_by_magnitude(std::vector<double> t, double density) {
  if (density >= 1) return t;
  const size_t keep = size_t(density * double(t.size()));  // Python's int(): toward zero
  std::vector<size_t> order(t.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return std::abs(t[a]) > std::abs(t[b]); });
  for (size_t i = keep; i < order.size(); ++i)
    t[order[i]] = 0;
  return t;
}

namespace {

int sign_of(double v) {
  return (v > 0) - (v < 0);
}

// PEFT's random_pruning with rescale: each value kept with probability `density`, divided by it.
std::vector<double> prune_at_random(std::vector<double> t, double density, Generator& gen) {
  if (density >= 1) return t;
  const std::vector<double> u = rand({int64_t(t.size())}, gen, DType::Float64).to_vector<double>();
  for (size_t e = 0; e < t.size(); ++e)
    t[e] = u[e] < density ? t[e] / density : 0.0;
  return t;
}

}  // namespace

std::vector<double> merge_tasks(TaskMerge how, const std::vector<std::vector<double>>& tasks,
                                const std::vector<double>& weights, const MergeOptions& options) {
  TESSERA_CHECK(!tasks.empty() && tasks.size() == weights.size(), "merge_tasks: ", tasks.size(),
                " tensors and ", weights.size(), " weights");
  const bool dare = how == TaskMerge::DareLinear || how == TaskMerge::DareTies;
  TESSERA_CHECK(!dare || options.gen != nullptr, "merge_tasks: dare without a generator");
  std::vector<std::vector<double>> t = tasks;
  for (auto& v : t) {
    if (dare)
      v = prune_at_random(std::move(v), options.density, *options.gen);
    else if (how != TaskMerge::Arithmetic)
      v = prune_by_magnitude(std::move(v), options.density);
  }
  const bool by_frequency = options.by_frequency;
  const bool ties = how == TaskMerge::Ties || how == TaskMerge::DareTies;
  const size_t n = t.front().size();
  std::vector<double> out(n, 0.0);
  for (size_t e = 0; e < n; ++e) {
    if (!ties) {
      for (size_t i = 0; i < t.size(); ++i)
        out[e] += weights[i] * t[i][e];
      continue;
    }
    // The elected sign comes from the pruned values before weighting, as in PEFT.
    double votes = 0;
    for (const auto& v : t)
      votes += by_frequency ? double(sign_of(v[e])) : v[e];
    const int majority = votes >= 0 ? 1 : -1;
    double sum = 0, kept = 0;
    for (size_t i = 0; i < t.size(); ++i)
      if (sign_of(t[i][e]) == majority) {
        sum += weights[i] * t[i][e];
        kept += 1;
      }
    out[e] = sum / std::max(kept, 1.0);
  }
  return out;
}

namespace {

// torch.quantile's default: linear interpolation between the two nearest sorted values.
double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const double pos = q * double(v.size() - 1);
  const size_t lo = size_t(std::floor(pos)), hi = size_t(std::ceil(pos));
  return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

using Matrix = Eigen::Matrix<double, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// B = U[:, :p] diag(s) [out, k] and A = V[:, :p]^T [k, in], zero past p (and past s's length in
// B), then PEFT's clamp: every value to [-h, h], h the q-quantile of B's and A's first p
// columns and rows, as its SVD returns them.
std::pair<std::vector<double>, std::vector<double>> factors_of(const Matrix& u,
                                                               const Eigen::VectorXd& s,
                                                               const Matrix& v, int64_t p,
                                                               int64_t k,
                                                               std::optional<double> clamp) {
  const int64_t out = u.rows(), in = v.rows();
  std::vector<double> b(size_t(out * k), 0.0), a(size_t(k * in), 0.0), values;
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < std::min<int64_t>(p, s.size()); ++c)
      b[size_t(r * k + c)] = u(r, c) * s(c);
  for (int64_t r = 0; r < p; ++r)
    for (int64_t c = 0; c < in; ++c)
      a[size_t(r * in + c)] = v(c, r);
  if (!clamp) return {b, a};
  for (int64_t r = 0; r < out; ++r)
    for (int64_t c = 0; c < p; ++c)
      values.push_back(b[size_t(r * k + c)]);
  values.insert(values.end(), a.begin(), a.begin() + p * in);
  const double h = quantile(std::move(values), *clamp);
  // torch's clamp(-h, h): with h < 0 (a low quantile of signed values) every value becomes h.
  for (auto* f : {&b, &a})
    for (double& x : *f)
      x = std::min(std::max(x, -h), h);
  return {b, a};
}

}  // namespace

std::pair<std::vector<double>, std::vector<double>> svd_factors(const std::vector<double>& delta,
                                                                int64_t out, int64_t in, int64_t k,
                                                                std::optional<double> clamp) {
  TESSERA_CHECK(int64_t(delta.size()) == out * in && k >= 1, "svd_factors: ", delta.size(),
                " values for [", out, ", ", in, "] at rank ", k);
  const Matrix m = Eigen::Map<const Matrix>(delta.data(), out, in);
  const Eigen::BDCSVD<Matrix> svd(m, Eigen::ComputeThinU | Eigen::ComputeThinV);
  const int64_t p = std::min<int64_t>(k, int64_t(svd.singularValues().size()));
  return factors_of(svd.matrixU(), svd.singularValues(), svd.matrixV(), p, k, clamp);
}

// B A = Qb (Rb Ra^T) Qa^T from the QR decompositions B = Qb Rb and A^T = Qa Ra, so the SVD
// U_m S V_m^T of the small Rb Ra^T gives B A's: U = Qb U_m, V = Qa V_m. V is completed past
// Qa's columns (where s is 0) by the next columns of A^T's full Householder Q, orthogonal to
// them, as many as the full SVD's min(out, in) allows: A's rows stay orthonormal at any k.
std::pair<std::vector<double>, std::vector<double>> svd_factors_of_product(
    const std::vector<double>& b, const std::vector<double>& a, int64_t out, int64_t r, int64_t in,
    int64_t k, std::optional<double> clamp) {
  TESSERA_CHECK(int64_t(b.size()) == out * r && int64_t(a.size()) == r * in && k >= 1,
                "svd_factors_of_product: ", b.size(), " and ", a.size(), " values for [", out, ", ",
                r, "] x [", r, ", ", in, "] at rank ", k);
  const Eigen::HouseholderQR<Matrix> qb(Eigen::Map<const Matrix>(b.data(), out, r));
  const Eigen::HouseholderQR<Matrix> qa(Eigen::Map<const Matrix>(a.data(), r, in).transpose());
  const int64_t cb = std::min(out, r), ca = std::min(in, r);
  const int64_t p = std::min(k, std::min(out, in));
  const Matrix rb = qb.matrixQR().topRows(cb).triangularView<Eigen::Upper>();
  const Matrix ra = qa.matrixQR().topRows(ca).triangularView<Eigen::Upper>();
  const Eigen::JacobiSVD<Matrix> small(rb * ra.transpose(),
                                       Eigen::ComputeThinU | Eigen::ComputeFullV);
  const Matrix qb_thin = qb.householderQ() * Matrix::Identity(out, cb);
  const Matrix qa_cols = qa.householderQ() * Matrix::Identity(in, std::max(ca, p));
  Matrix v(in, std::max(ca, p));
  v.leftCols(ca) = qa_cols.leftCols(ca) * small.matrixV();
  v.rightCols(v.cols() - ca) = qa_cols.rightCols(v.cols() - ca);
  return factors_of(qb_thin * small.matrixU(), small.singularValues(), v, p, k, clamp);
}

}  // namespace tessera::lora_detail
