// Every DTensor op against the same op on the global tensor, over every mesh of the world, every
// placement list of its inputs (Partial included) and shapes whose shards are even, uneven and
// empty: the result's full tensor and each input's gradient must be the reference's. Partial
// inputs hold a random split of their value over the ranks (not all of it on one rank, as
// distribute_tensor lays them out), so an op that runs on unreduced pieces where it must not
// shows. An op may refuse a layout (a view that would cut a shard), but then every rank must
// refuse it, with a message that names the op.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "tessera/tessera.h"
#include "tessera/testing.h"

using namespace tessera;
using namespace tessera::testing;

namespace {

using UnaryOp = std::function<DTensor(const DTensor&)>;
using UnaryRef = std::function<Tensor(const Tensor&)>;
using BinaryOp = std::function<DTensor(const DTensor&, const DTensor&)>;
using BinaryRef = std::function<Tensor(const Tensor&, const Tensor&)>;

const std::vector<DeviceMesh>& meshes() {
  static const std::vector<DeviceMesh> kMeshes = device_meshes(2);
  return kMeshes;
}

uint64_t mix(uint64_t seed, int64_t v) {
  return (seed ^ uint64_t(v + 0x9e37)) * 0x100000001b3ull;
}

// This rank's piece of `global` laid out by `p`. Over a Partial mesh dim the group's k members
// hold a random split of the value, exact in dyadic values: for a sum, member c != 0 holds noise
// and member 0 the value minus the others' noise; for avg, member 0 holds k times the value
// minus the noise; for max (min), each member the value minus (plus) its own distance
// |noise_c| - min_c' |noise_c'|, so that per element some member, not always the same, holds the
// value itself. Replicas (ranks differing only in Replicate mesh dims) hold the same piece.
DTensor laid_out(const Tensor& global, const DeviceMesh& mesh, const Placements& p, uint64_t seed,
                 bool requires_grad = true) {
  const std::vector<int64_t> coord = mesh.coordinate();
  Tensor local = cut_window(global, reference_window(global.shape(), mesh.shape(), coord, p));
  for (size_t m = 0; m < p.size(); ++m) {
    if (!p[m].is_partial()) continue;
    uint64_t base = mix(seed, int64_t(m));
    // The members of this group agree on the value being split: it depends on their shard
    // coordinates and on the splits of earlier mesh dims, not on the later splits it is about
    // to receive.
    for (size_t k = 0; k < p.size(); ++k)
      if (p[k].is_shard() || (p[k].is_partial() && k < m)) base = mix(base, coord[k]);
    auto noise = [&](int64_t c) {
      return dyadic_tensor(local.shape(), mix(base, c), global.dtype());
    };
    const int64_t k = mesh.size(int64_t(m)), me = coord[m];
    switch (p[m].reduce_op()) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        if (me != 0) {
          local = noise(me);
        } else {
          if (p[m].reduce_op() == ReduceOp::Avg) local = mul(local, double(k));
          for (int64_t c = 1; c < k; ++c)
            local = sub(local, noise(c));
        }
        break;
      case ReduceOp::Max:
      case ReduceOp::Min: {
        Tensor nearest = abs(noise(0));
        for (int64_t c = 1; c < k; ++c)
          nearest = minimum(nearest, abs(noise(c)));
        Tensor distance = sub(abs(noise(me)), nearest);
        local = p[m].reduce_op() == ReduceOp::Max ? sub(local, distance) : add(local, distance);
        break;
      }
      default:
        ADD_FAILURE() << "no split for " << p[m].str();
    }
  }
  DTensor d = DTensor::from_local(local.contiguous(), mesh, p, global.shape());
  if (requires_grad) d.set_requires_grad(true);
  return d;
}

std::string case_name(const DeviceMesh& mesh, const std::vector<Placements>& ps,
                      const std::vector<Shape>& shapes) {
  std::string s = mesh.str();
  for (size_t i = 0; i < ps.size(); ++i) {
    s += " input " + std::to_string(i) + " " + shape_str(shapes[i]) + " [";
    for (size_t m = 0; m < ps[i].size(); ++m)
      s += (m ? ", " : "") + ps[i][m].str();
    s += "]";
  }
  return s;
}

// Whether every rank of the world says yes.
bool all_ranks(bool mine) {
  Tensor t = from_vector<int64_t>({mine ? 0 : 1}, {1});
  world_group()->all_reduce(t, ReduceOp::Sum)->wait();
  return t.item<int64_t>() == 0;
}

// Runs `op` on DTensors laid out as `ps` and `ref` on the global tensors, and compares the result
// and every input's gradient after backpropagating sum(out * w). Only an op that `may_refuse`
// (view) may refuse a layout, on every rank, naming `op_name`.
void check_case(const std::string& op_name, const DeviceMesh& mesh,
                const std::vector<Tensor>& globals, const std::vector<Placements>& ps,
                const std::function<DTensor(const std::vector<DTensor>&)>& op,
                const std::function<Tensor(const std::vector<Tensor>&)>& ref, uint64_t seed,
                bool may_refuse = false) {
  const double rtol = 1e-12;
  std::vector<Shape> shapes;
  for (const Tensor& g : globals)
    shapes.push_back(g.shape());
  const std::string what = op_name + " on " + case_name(mesh, ps, shapes);
  std::vector<DTensor> in;
  std::vector<Tensor> rin;
  // Integer inputs (embedding ids) take no gradient.
  std::vector<bool> grads;
  for (size_t i = 0; i < globals.size(); ++i) {
    grads.push_back(is_floating(globals[i].dtype()));
    in.push_back(laid_out(globals[i], mesh, ps[i], mix(seed, int64_t(i)), grads[i]));
    rin.push_back(globals[i].clone().set_requires_grad(grads[i]));
  }
  DTensor out;
  std::string refused;
  try {
    out = op(in);
  } catch (const Error& e) {
    refused = e.what();
  }
  ASSERT_EQ(all_ranks(refused.empty()), refused.empty())
      << what << ": refused on some ranks only; here: " << (refused.empty() ? "ran" : refused);
  if (!refused.empty()) {
    EXPECT_TRUE(may_refuse) << what << ": " << refused;
    EXPECT_NE(refused.find(op_name), std::string::npos) << what << ": " << refused;
    return;
  }
  Tensor rout = ref(rin);
  Tensor full = out.full_tensor();
  expect_close(full, rout, {rtol, rtol}, what + ": output");
  expect_replicas_equal(out);
  Tensor w = dyadic_tensor(rout.shape(), mix(seed, 99), rout.dtype());
  backward(sum(mul(full, w)));
  backward(sum(mul(rout, w)));
  for (size_t i = 0; i < in.size(); ++i) {
    if (!grads[i]) continue;
    const std::string g = what + ": gradient of input " + std::to_string(i);
    DTensor grad = in[i].grad();
    ASSERT_TRUE(grad.defined()) << g << " is missing";
    for (const Placement& q : grad.placements())
      EXPECT_FALSE(q.is_partial()) << g << " is Partial: " << grad.str();
    expect_close(grad.full_tensor(), rin[i].grad(), {rtol, rtol}, g);
  }
}

// Every placement list, FSDP-over-TP's StridedShard included.
std::vector<Placements> lists(const DeviceMesh& mesh, int64_t ndim) {
  return placement_lists(mesh.shape(), ndim, {.strided = true});
}

// The same, and again with Partials of avg, max and min, which the ops must reduce before
// anything that is not linear in them: each list of Partial and Replicate only (the lists with
// shards too would double a sweep on a 2-D mesh, and their Partials take the same paths).
std::vector<Placements> lists_all_partials(const DeviceMesh& mesh, int64_t ndim) {
  std::vector<Placements> out = lists(mesh, ndim);
  const size_t n = out.size();
  for (ReduceOp op : {ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min})
    for (size_t i = 0; i < n; ++i) {
      Placements q = out[i];
      if (std::any_of(q.begin(), q.end(), [](const Placement& x) { return x.is_shard(); }) ||
          std::none_of(q.begin(), q.end(), [](const Placement& x) { return x.is_partial(); }))
        continue;
      for (Placement& x : q)
        if (x.is_partial()) x = Partial(op);
      out.push_back(q);
    }
  return out;
}

// The lists of `b` that list i of the other input meets: all of them on a 1-D mesh; on larger
// meshes, where the product runs to hundreds, three, chosen so that every list of `b` meets
// several lists of the other input too.
std::vector<Placements> partners(const DeviceMesh& mesh, size_t i,
                                 const std::vector<Placements>& b) {
  if (mesh.ndim() == 1) return b;
  std::vector<Placements> out;
  for (size_t k = 0; k < 3; ++k)
    out.push_back(b[(i + k * (b.size() / 3 + 1)) % b.size()]);
  return out;
}

std::vector<std::pair<Placements, Placements>> pairs(const DeviceMesh& mesh,
                                                     const std::vector<Placements>& a,
                                                     const std::vector<Placements>& b) {
  std::vector<std::pair<Placements, Placements>> out;
  for (size_t i = 0; i < a.size(); ++i)
    for (const Placements& q : partners(mesh, i, b))
      out.emplace_back(a[i], q);
  return out;
}

Tensor positive(const Shape& s, uint64_t seed) {
  return add(abs(dyadic_tensor(s, seed)), 1.0);
}

}  // namespace

TEST(DTensorOpsSweep, UnaryOps) {
  struct Case {
    std::string name;
    UnaryOp op;
    UnaryRef ref;
    bool positive = false;
  };
  const std::vector<Case> cases = {
      {"neg", [](auto& x) { return neg(x); }, [](auto& x) { return neg(x); }},
      {"exp", [](auto& x) { return exp(x); }, [](auto& x) { return exp(x); }},
      {"log", [](auto& x) { return log(x); }, [](auto& x) { return log(x); }, true},
      {"sqrt", [](auto& x) { return sqrt(x); }, [](auto& x) { return sqrt(x); }, true},
      {"rsqrt", [](auto& x) { return rsqrt(x); }, [](auto& x) { return rsqrt(x); }, true},
      {"tanh", [](auto& x) { return tanh(x); }, [](auto& x) { return tanh(x); }},
      {"sigmoid", [](auto& x) { return sigmoid(x); }, [](auto& x) { return sigmoid(x); }},
      {"relu", [](auto& x) { return relu(x); }, [](auto& x) { return relu(x); }},
      {"gelu", [](auto& x) { return gelu(x); }, [](auto& x) { return gelu(x); }},
      {"silu", [](auto& x) { return silu(x); }, [](auto& x) { return silu(x); }},
      {"square", [](auto& x) { return square(x); }, [](auto& x) { return square(x); }},
      {"mul", [](auto& x) { return mul(x, -2.5); }, [](auto& x) { return mul(x, -2.5); }},
      {"add", [](auto& x) { return add(x, 3.0); }, [](auto& x) { return add(x, 3.0); }},
      {"sub", [](auto& x) { return sub(x, 3.0); }, [](auto& x) { return sub(x, 3.0); }},
      {"div", [](auto& x) { return div(x, -4.0); }, [](auto& x) { return div(x, -4.0); }},
      {"abs", [](auto& x) { return abs(x); }, [](auto& x) { return abs(x); }},
      {"pow", [](auto& x) { return pow(x, 3.0); }, [](auto& x) { return pow(x, 3.0); }},
      {"pow", [](auto& x) { return pow(x, 0.5); }, [](auto& x) { return pow(x, 0.5); }, true},
  };
  uint64_t seed = 1;
  for (const DeviceMesh& mesh : meshes())
    for (const Shape& shape : edge_shapes(mesh.shape(), 2))
      for (const Placements& p : lists_all_partials(mesh, 2))
        for (const Case& c : cases) {
          Tensor g = c.positive ? positive(shape, ++seed) : dyadic_tensor(shape, ++seed);
          check_case(
              c.name, mesh, {g}, {p}, [&](auto& in) { return c.op(in[0]); },
              [&](auto& in) { return c.ref(in[0]); }, seed);
          if (HasFatalFailure()) return;
        }
}

TEST(DTensorOpsSweep, BinaryOps) {
  struct Case {
    std::string name;
    BinaryOp op;
    BinaryRef ref;
  };
  const std::vector<Case> cases = {
      {"add", [](auto& a, auto& b) { return add(a, b); },
       [](auto& a, auto& b) { return add(a, b); }},
      {"sub", [](auto& a, auto& b) { return sub(a, b); },
       [](auto& a, auto& b) { return sub(a, b); }},
      {"mul", [](auto& a, auto& b) { return mul(a, b); },
       [](auto& a, auto& b) { return mul(a, b); }},
      {"div", [](auto& a, auto& b) { return div(a, b); },
       [](auto& a, auto& b) { return div(a, b); }},
      {"maximum", [](auto& a, auto& b) { return maximum(a, b); },
       [](auto& a, auto& b) { return maximum(a, b); }},
      {"minimum", [](auto& a, auto& b) { return minimum(a, b); },
       [](auto& a, auto& b) { return minimum(a, b); }},
  };
  uint64_t seed = 5000;
  for (const DeviceMesh& mesh : meshes()) {
    const std::vector<Shape> shapes = edge_shapes(mesh.shape(), 2);
    // The even shape and one uneven per dim, with the second operand the same shape or
    // broadcast (a row, as a bias is).
    for (size_t s : {size_t(0), size_t(1), size_t(4)}) {
      const Shape& shape = shapes[s];
      for (bool row : {false, true}) {
        const Shape bshape = row ? Shape{shape[1]} : shape;
        for (const auto& [pa, pb] :
             pairs(mesh, lists_all_partials(mesh, 2), lists(mesh, int64_t(bshape.size()))))
          for (const Case& c : cases) {
            Tensor a = dyadic_tensor(shape, ++seed);
            // A divisor away from zero.
            Tensor b = c.name == "div" ? positive(bshape, ++seed) : dyadic_tensor(bshape, ++seed);
            check_case(
                c.name, mesh, {a, b}, {pa, pb}, [&](auto& in) { return c.op(in[0], in[1]); },
                [&](auto& in) { return c.ref(in[0], in[1]); }, seed);
            if (HasFatalFailure()) return;
          }
        // where and masked_fill: the mask laid out as the second operand, never partial.
        for (const auto& [pa, pb] :
             pairs(mesh, lists(mesh, 2), lists(mesh, int64_t(bshape.size())))) {
          if (std::any_of(pb.begin(), pb.end(), [](const Placement& q) { return q.is_partial(); }))
            continue;
          Tensor a = dyadic_tensor(shape, ++seed), x = dyadic_tensor(shape, ++seed);
          Tensor mask =
              kernels::compare_scalar(kernels::CompareOp::Gt, dyadic_tensor(bshape, ++seed), 0.0);
          check_case(
              "where", mesh, {mask, a, x}, {pb, pa, pa},
              [](auto& in) { return where(in[0], in[1], in[2]); },
              [](auto& in) { return where(in[0], in[1], in[2]); }, seed);
          check_case(
              "masked_fill", mesh, {a, mask}, {pa, pb},
              [](auto& in) { return masked_fill(in[0], in[1], -7.5); },
              [](auto& in) { return masked_fill(in[0], in[1], -7.5); }, seed);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(DTensorOpsSweep, ReductionsAndSoftmax) {
  uint64_t seed = 9000;
  const std::vector<std::vector<int64_t>> dim_lists = {{}, {0}, {-1}, {0, 1}};
  for (const DeviceMesh& mesh : meshes())
    for (const Shape& shape : edge_shapes(mesh.shape(), 2))
      for (const Placements& p : lists_all_partials(mesh, 2)) {
        for (const auto& dims : dim_lists)
          for (bool keepdim : {false, true}) {
            Tensor g = dyadic_tensor(shape, ++seed);
            check_case(
                "sum", mesh, {g}, {p}, [&](auto& in) { return sum(in[0], dims, keepdim); },
                [&](auto& in) { return sum(in[0], dims, keepdim); }, seed);
            bool empty_reduction = false;
            for (int64_t d : dims.empty() ? std::vector<int64_t>{0, 1} : dims)
              empty_reduction = empty_reduction || shape[size_t(d < 0 ? d + 2 : d)] == 0;
            if (!empty_reduction)
              check_case(
                  "amax", mesh, {g}, {p}, [&](auto& in) { return amax(in[0], dims, keepdim); },
                  [&](auto& in) { return amax(in[0], dims, keepdim); }, seed);
            if (shape_numel(shape) > 0)
              check_case(
                  "mean", mesh, {g}, {p}, [&](auto& in) { return mean(in[0], dims, keepdim); },
                  [&](auto& in) { return mean(in[0], dims, keepdim); }, seed);
            if (HasFatalFailure()) return;
          }
        for (int64_t dim : {0, 1, -1}) {
          Tensor g = dyadic_tensor(shape, ++seed);
          check_case(
              "softmax", mesh, {g}, {p}, [&](auto& in) { return softmax(in[0], dim); },
              [&](auto& in) { return softmax(in[0], dim); }, seed);
          check_case(
              "log_softmax", mesh, {g}, {p}, [&](auto& in) { return log_softmax(in[0], dim); },
              [&](auto& in) { return log_softmax(in[0], dim); }, seed);
          if (HasFatalFailure()) return;
        }
      }
}

TEST(DTensorOpsSweep, ViewsAndSlices) {
  uint64_t seed = 13000;
  for (const DeviceMesh& mesh : meshes())
    for (const Shape& shape : edge_shapes(mesh.shape(), 2))
      for (size_t pi = 0; pi < lists_all_partials(mesh, 2).size(); ++pi) {
        const Placements p = lists_all_partials(mesh, 2)[pi];
        Tensor g = dyadic_tensor(shape, ++seed);
        check_case(
            "transpose", mesh, {g}, {p}, [](auto& in) { return transpose(in[0], 0, 1); },
            [](auto& in) { return transpose(in[0], 0, 1); }, seed);
        check_case(
            "permute", mesh, {g}, {p},
            [](auto& in) {
              return permute(in[0], {1, 0});
            },
            [](auto& in) {
              return permute(in[0], {1, 0});
            },
            seed);
        for (int64_t dim : {0, 1, 2, -1})
          check_case(
              "unsqueeze", mesh, {g}, {p}, [&](auto& in) { return unsqueeze(in[0], dim); },
              [&](auto& in) { return unsqueeze(in[0], dim); }, seed);
        check_case(
            "flatten", mesh, {g}, {p}, [](auto& in) { return flatten(in[0]); },
            [](auto& in) { return flatten(in[0]); }, seed);
        // squeeze of a dim of size 1 and of one that is not (left alone, even where a shard of
        // it has local size 1).
        for (int64_t dim : {0, 1}) {
          Tensor h = narrow(g, dim, 0, std::min<int64_t>(1, shape[size_t(dim)]));
          check_case(
              "squeeze", mesh, {h}, {p}, [&](auto& in) { return squeeze(in[0], dim); },
              [&](auto& in) { return squeeze(in[0], dim); }, seed);
          check_case(
              "squeeze", mesh, {g}, {p}, [&](auto& in) { return squeeze(in[0], dim); },
              [&](auto& in) { return squeeze(in[0], dim); }, seed);
        }
        const Shape flat = {shape_numel(shape)};
        const Shape split = {shape[0], 1, shape[1]};
        for (const Shape& to : {flat, split}) {
          check_case(
              "view", mesh, {g}, {p}, [&](auto& in) { return view(in[0], to); },
              [&](auto& in) { return view(in[0], to); }, seed, /*may_refuse=*/true);
          check_case(
              "reshape", mesh, {g}, {p}, [&](auto& in) { return reshape(in[0], to); },
              [&](auto& in) { return reshape(in[0], to); }, seed);
        }
        for (int64_t dim : {0, 1}) {
          const int64_t n = shape[size_t(dim)];
          const int64_t start = n / 3, length = n - start - n / 4;
          check_case(
              "narrow", mesh, {g}, {p}, [&](auto& in) { return narrow(in[0], dim, start, length); },
              [&](auto& in) { return narrow(in[0], dim, start, length); }, seed);
          Shape other = shape;
          other[size_t(dim)] = 3;
          for (const Placements& q : partners(mesh, pi, lists(mesh, 2))) {
            Tensor h = dyadic_tensor(other, ++seed);
            check_case(
                "cat", mesh, {g, h}, {p, q},
                [&](auto& in) {
                  return cat({in[0], in[1]}, dim);
                },
                [&](auto& in) {
                  return cat({in[0], in[1]}, dim);
                },
                seed);
          }
        }
        if (HasFatalFailure()) return;
      }
}

TEST(DTensorOpsSweep, MatmulAndLinear) {
  uint64_t seed = 17000;
  for (const DeviceMesh& mesh : meshes()) {
    const int64_t n = mesh.size();
    // Even and uneven splits of every dim, and one shorter than the number of pieces.
    for (const auto& [m, k, o] : std::vector<std::array<int64_t, 3>>{
             {2 * n, 2 * n, 2 * n}, {2 * n + 1, n + 1, 3}, {1, n - 1, n + 1}}) {
      for (const auto& [pa, pb] : pairs(mesh, lists(mesh, 2), lists(mesh, 2))) {
        Tensor a = dyadic_tensor({m, k}, ++seed), b = dyadic_tensor({k, o}, ++seed);
        check_case(
            "matmul", mesh, {a, b}, {pa, pb}, [](auto& in) { return matmul(in[0], in[1]); },
            [](auto& in) { return matmul(in[0], in[1]); }, seed);
        Tensor w = dyadic_tensor({o, k}, ++seed);
        check_case(
            "linear", mesh, {a, w}, {pa, pb}, [](auto& in) { return linear(in[0], in[1]); },
            [](auto& in) { return linear(in[0], in[1]); }, seed);
        if (HasFatalFailure()) return;
      }
      // With a bias: every layout of it against the two tensor-parallel weights and a
      // replicated one, the input following the weight.
      for (const Placements& pw : lists(mesh, 2)) {
        Placements px(pw.size(), Replicate());
        for (size_t d = 0; d < pw.size(); ++d)
          if (pw[d].is_shard(1)) px[d] = Shard(1);
        for (const Placements& pbias : lists(mesh, 1)) {
          Tensor x = dyadic_tensor({m, k}, ++seed), w = dyadic_tensor({o, k}, ++seed),
                 bias = dyadic_tensor({o}, ++seed);
          check_case(
              "linear", mesh, {x, w, bias}, {px, pw, pbias},
              [](auto& in) { return linear(in[0], in[1], in[2]); },
              [](auto& in) { return linear(in[0], in[1], in[2]); }, seed);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(DTensorOpsSweep, LayerOps) {
  uint64_t seed = 21000;
  for (const DeviceMesh& mesh : meshes()) {
    const int64_t n = mesh.size();
    for (const Shape& shape : {Shape{2, 2 * n, 2 * n}, Shape{3, n + 1, 2 * n - 1}}) {
      const int64_t d = shape[2];
      const std::vector<Placements> xs = lists(mesh, 3), ws = lists(mesh, 1);
      for (size_t i = 0; i < xs.size(); ++i)
        for (const Placements& pw : partners(mesh, i, ws)) {
          Tensor x = dyadic_tensor(shape, ++seed), w = dyadic_tensor({d}, ++seed),
                 b = dyadic_tensor({d}, ++seed);
          check_case(
              "rms_norm", mesh, {x, w}, {xs[i], pw},
              [](auto& in) { return rms_norm(in[0], in[1], 1e-6); },
              [](auto& in) { return rms_norm(in[0], in[1], 1e-6); }, seed);
          check_case(
              "layer_norm", mesh, {x, w, b}, {xs[i], pw, pw},
              [](auto& in) { return layer_norm(in[0], in[1], in[2]); },
              [](auto& in) { return layer_norm(in[0], in[1], in[2]); }, seed);
          if (HasFatalFailure()) return;
        }
    }
    // Ids of any layout but Partial against every layout of the table (vocab parallel
    // included), with vocabularies whose row shards are even, uneven and empty.
    for (int64_t vocab : {2 * n, n + 1, n - 1 > 0 ? n - 1 : 1}) {
      std::vector<Placements> ids_lists;
      for (const Placements& p : lists(mesh, 2))
        if (std::none_of(p.begin(), p.end(), [](const Placement& q) { return q.is_partial(); }))
          ids_lists.push_back(p);
      const std::vector<Placements> tables = lists(mesh, 2);
      for (size_t i = 0; i < ids_lists.size(); ++i)
        for (const Placements& pt : partners(mesh, i, tables)) {
          std::vector<int64_t> v(size_t(3 * (n + 1)));
          for (int64_t& id : v)
            id = int64_t(mix(++seed, 7) % uint64_t(vocab));
          Tensor ids = from_vector<int64_t>(v, {3, n + 1});
          Tensor table = dyadic_tensor({vocab, 5}, ++seed);
          check_case(
              "embedding", mesh, {ids, table}, {ids_lists[i], pt},
              [](auto& in) { return embedding(in[0], in[1]); },
              [](auto& in) { return embedding(in[0], in[1]); }, seed);
          if (HasFatalFailure()) return;
        }
    }
  }
}

TEST(DTensorOpsSweep, BatchedMatmulAndLowRank) {
  uint64_t seed = 25000;
  for (const DeviceMesh& mesh : meshes()) {
    const int64_t n = mesh.size();
    const std::vector<Placements> a3 = lists(mesh, 3);
    for (size_t i = 0; i < a3.size(); ++i)
      for (const Placements& pb : partners(mesh, i, a3)) {
        Tensor a = dyadic_tensor({n + 1, 3, 2 * n}, ++seed),
               b = dyadic_tensor({n + 1, 2 * n, n + 2}, ++seed);
        check_case(
            "matmul", mesh, {a, b}, {a3[i], pb}, [](auto& in) { return matmul(in[0], in[1]); },
            [](auto& in) { return matmul(in[0], in[1]); }, seed);
        if (HasFatalFailure()) return;
      }
    // linear_lowrank: every weight layout with every layout of its low-rank factors, the input
    // following the weight as a tensor-parallel layer's does.
    const int64_t in_f = 2 * n, out_f = 2 * n + 1, r = 3;
    const std::vector<Placements> w2 = lists(mesh, 2);
    for (size_t i = 0; i < w2.size(); ++i) {
      const Placements& pw = w2[i];
      Placements px(pw.size(), Replicate());
      for (size_t m = 0; m < pw.size(); ++m)
        if (pw[m].is_shard(1)) px[m] = Shard(2);
      for (const Placements& pab : partners(mesh, i, w2)) {
        Tensor x = dyadic_tensor({2, n + 1, in_f}, ++seed),
               w = dyadic_tensor({out_f, in_f}, ++seed), a = dyadic_tensor({r, in_f}, ++seed),
               b = dyadic_tensor({out_f, r}, ++seed);
        check_case(
            "linear_lowrank", mesh, {x, w, a, b}, {px, pw, pab, pab},
            [](auto& in) { return linear_lowrank(in[0], in[1], DTensor(), in[2], in[3], 0.5); },
            [](auto& in) { return linear_lowrank(in[0], in[1], Tensor(), in[2], in[3], 0.5); },
            seed);
        if (HasFatalFailure()) return;
      }
    }
  }
}

TEST(DTensorOpsSweep, Operators) {
  uint64_t seed = 29000;
  for (const DeviceMesh& mesh : meshes()) {
    const std::vector<Placements> ps = lists(mesh, 2);
    for (size_t i = 0; i < ps.size(); ++i)
      for (const Placements& q : partners(mesh, i, ps)) {
        Tensor a = dyadic_tensor({5, 3}, ++seed), b = positive({5, 3}, ++seed);
        check_case(
            "operators", mesh, {a, b}, {ps[i], q},
            [](auto& in) { return -((in[0] + in[1]) * 2.0 - in[0] / in[1] * in[0]) / 4.0 + 1.0; },
            [](auto& in) { return -((in[0] + in[1]) * 2.0 - in[0] / in[1] * in[0]) / 4.0 + 1.0; },
            seed);
        if (HasFatalFailure()) return;
      }
  }
}
