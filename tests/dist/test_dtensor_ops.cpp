// Sharding propagation: every op on DTensors gives the global result and the global gradients
// of the same computation on plain tensors, for several meshes and placements.
#include <gtest/gtest.h>

#include "tessera/tessera.h"
#include "tessera/testing/generators.h"

using namespace tessera;
using tessera::testing::random_tensor;

namespace {

// A leaf DTensor holding the window of `global`.
DTensor leaf(const Tensor& global, const DeviceMesh& mesh, const Placements& p) {
  DTensor d = distribute_tensor(global, mesh, p);
  d.set_requires_grad(true);
  return d;
}

Tensor leaf(const Tensor& global) {
  return global.clone().set_requires_grad(true);
}

void expect_close(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  auto g = got.to_vector<double>(), w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i)
    ASSERT_NEAR(g[i], w[i], tol) << what << " element " << i << " of " << shape_str(got.shape());
}

// Backpropagates sum(out * weight) through the DTensor result and the reference.
void backward_weighted(const DTensor& out, const Tensor& ref_out, uint64_t seed) {
  Tensor w = random_tensor(ref_out.shape(), seed, DType::Float64);
  backward(sum(mul(out.full_tensor(), w)));
  backward(sum(mul(ref_out, w)));
}

std::vector<DeviceMesh> meshes() {
  std::vector<DeviceMesh> out;
  const int n = world_size();
  out.emplace_back(Shape{n}, std::vector<std::string>{"tp"});
  if (n == 4) out.emplace_back(Shape{2, 2}, std::vector<std::string>{"dp", "tp"});
  return out;
}

}  // namespace

TEST(DTensorOps, ColumnParallelLinearSumsReplicatedInputGradient) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    Tensor xg = random_tensor({3, 5, 6}, 1, DType::Float64),
           wg = random_tensor({10, 6}, 2, DType::Float64),
           bg = random_tensor({10}, 3, DType::Float64);
    DTensor x = leaf(xg, mesh, {Replicate()});
    DTensor w = leaf(wg, mesh, {Shard(0)});  // 10 rows: uneven over 3 or 4 ranks
    DTensor b = leaf(bg, mesh, {Shard(0)});
    DTensor y = linear(x, w, b);
    EXPECT_EQ(y.placements(), (Placements{Shard(2)}));
    Tensor rx = leaf(xg), rw = leaf(wg), rb = leaf(bg);
    Tensor ry = linear(rx, rw, rb);
    expect_close(y.full_tensor(), ry, 1e-12, "y");
    backward_weighted(y, ry, 4);
    expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dx (replicated, summed over tp)");
    expect_close(w.grad().full_tensor(), rw.grad(), 1e-12, "dW");
    expect_close(b.grad().full_tensor(), rb.grad(), 1e-12, "db");
  }
}

// The replicated input of a column-parallel linear, gathered from a sequence shard, gets its
// gradient as this rank's term of a sum, which the gather's backward may reduce-scatter
// unreduced: not when retain_grad (or a hook) looks at it, which must see the reduced gradient.
TEST(DTensorOps, RetainGradSeesTheReducedGradientOfAGatheredInput) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    const int64_t n = mesh.size();
    Tensor xg = random_tensor({2 * n, 6}, 5, DType::Float64),
           wg = random_tensor({8, 6}, 6, DType::Float64);
    DTensor x = leaf(xg, mesh, {Shard(0)});
    DTensor y = x.redistribute({Replicate()});
    Tensor yl = y.to_local();
    retain_grad(yl);
    DTensor out = linear(y, leaf(wg, mesh, {Shard(0)}));
    Tensor g = random_tensor({2 * n, 8}, 7, DType::Float64);
    backward(sum(mul(out.full_tensor(), g)));
    expect_close(yl.grad(), matmul(g, wg), 1e-12, "the retained gradient of the gathered input");
    expect_close(x.grad().full_tensor(), matmul(g, wg), 1e-12, "dx");
  }
}

TEST(DTensorOps, RowParallelLinearGivesPartialAndAddsBiasOnce) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    Tensor xg = random_tensor({4, 7}, 5, DType::Float64),
           wg = random_tensor({3, 7}, 6, DType::Float64),
           bg = random_tensor({3}, 7, DType::Float64);
    DTensor x = leaf(xg, mesh, {Shard(1)});
    DTensor w = leaf(wg, mesh, {Shard(1)});
    DTensor b = leaf(bg, mesh, {Replicate()});
    DTensor y = linear(x, w, b);
    if (mesh.size() > 1) {
      EXPECT_TRUE(y.placements()[0].is_partial()) << y.str();
    }
    Tensor rx = leaf(xg), rw = leaf(wg), rb = leaf(bg);
    Tensor ry = linear(rx, rw, rb);
    expect_close(y.full_tensor(), ry, 1e-12, "y");
    backward_weighted(y, ry, 8);
    expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dx");
    expect_close(w.grad().full_tensor(), rw.grad(), 1e-12, "dW");
    expect_close(b.grad().full_tensor(), rb.grad(), 1e-12, "db");
  }
}

TEST(DTensorOps, BatchShardedInputWithReplicatedWeight) {
  for (const DeviceMesh& mesh : meshes()) {
    Placements px(size_t(mesh.ndim()), Shard(0)), pw(size_t(mesh.ndim()), Replicate());
    Tensor xg = random_tensor({9, 4}, 9, DType::Float64),
           wg = random_tensor({5, 4}, 10, DType::Float64);
    DTensor x = leaf(xg, mesh, px), w = leaf(wg, mesh, pw);
    DTensor y = linear(x, w);
    EXPECT_EQ(y.placements(), px);
    Tensor rx = leaf(xg), rw = leaf(wg);
    Tensor ry = linear(rx, rw);
    expect_close(y.full_tensor(), ry, 1e-12, "y");
    backward_weighted(y, ry, 11);
    expect_close(w.grad().full_tensor(), rw.grad(), 1e-12, "dW summed over batch shards");
    expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dx");
  }
}

TEST(DTensorOps, TwoDimMeshLinear) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  Tensor xg = random_tensor({6, 8}, 12, DType::Float64),
         wg = random_tensor({6, 8}, 13, DType::Float64);
  DTensor x = leaf(xg, mesh, {Shard(0), Replicate()});
  DTensor w = leaf(wg, mesh, {Replicate(), Shard(0)});
  DTensor y = linear(x, w);
  EXPECT_EQ(y.placements(), (Placements{Shard(0), Shard(1)}));
  Tensor rx = leaf(xg), rw = leaf(wg);
  Tensor ry = linear(rx, rw);
  expect_close(y.full_tensor(), ry, 1e-12, "y");
  backward_weighted(y, ry, 14);
  expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dx");
  expect_close(w.grad().full_tensor(), rw.grad(), 1e-12, "dW");
}

TEST(DTensorOps, MatmulContractionShardedGivesPartial) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    Tensor ag = random_tensor({2, 3, 10}, 15, DType::Float64),
           bg = random_tensor({10, 4}, 16, DType::Float64);
    DTensor a = leaf(ag, mesh, {Shard(2)}), b = leaf(bg, mesh, {Replicate()});
    DTensor y = matmul(a, b);
    if (mesh.size() > 1) {
      EXPECT_TRUE(y.placements()[0].is_partial());
    }
    Tensor ra = leaf(ag), rb = leaf(bg);
    Tensor ry = matmul(ra, rb);
    expect_close(y.full_tensor(), ry, 1e-12, "y");
    backward_weighted(y, ry, 17);
    expect_close(a.grad().full_tensor(), ra.grad(), 1e-12, "da");
    expect_close(b.grad().full_tensor(), rb.grad(), 1e-12, "db");
  }
}

TEST(DTensorOps, BatchedMatmulHeadSharded) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    Tensor qg = random_tensor({2, 5, 3, 4}, 18, DType::Float64),
           kg = random_tensor({2, 5, 4, 3}, 19, DType::Float64);
    DTensor q = leaf(qg, mesh, {Shard(1)}), k = leaf(kg, mesh, {Replicate()});
    DTensor s = matmul(q, k);
    EXPECT_EQ(s.placements(), (Placements{Shard(1)}));
    Tensor rq = leaf(qg), rk = leaf(kg);
    Tensor rs = matmul(rq, rk);
    expect_close(s.full_tensor(), rs, 1e-12, "scores");
    backward_weighted(s, rs, 20);
    expect_close(q.grad().full_tensor(), rq.grad(), 1e-12, "dq");
    expect_close(k.grad().full_tensor(), rk.grad(), 1e-12, "dk");
  }
}

// a cut on a batch dim and a batched b cut elsewhere: b's batches must be cut alike (a
// batch-cut a times a full-batch b would not even multiply), or a gathered when b is larger.
TEST(DTensorOps, BatchedMatmulWithOperandsShardedOnDifferentDims) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    struct Case {
      Shape a, b;
      Placement pa, pb;
    };
    for (const Case& c : {Case{{2, 5, 3, 4}, {2, 5, 4, 3}, Shard(1), Shard(3)},
                          Case{{2, 5, 3, 4}, {2, 5, 4, 3}, Shard(0), Shard(2)},
                          Case{{2, 5, 3, 4}, {2, 5, 4, 9}, Shard(1), Shard(3)}}) {
      SCOPED_TRACE(shape_str(c.a) + " " + c.pa.str() + " @ " + shape_str(c.b) + " " + c.pb.str());
      Tensor ag = random_tensor(c.a, 25, DType::Float64),
             bg = random_tensor(c.b, 26, DType::Float64);
      DTensor a = leaf(ag, mesh, {c.pa}), b = leaf(bg, mesh, {c.pb});
      DTensor s = matmul(a, b);
      Tensor ra = leaf(ag), rb = leaf(bg);
      Tensor rs = matmul(ra, rb);
      expect_close(s.full_tensor(), rs, 1e-12, "product");
      backward_weighted(s, rs, 27);
      expect_close(a.grad().full_tensor(), ra.grad(), 1e-12, "da");
      expect_close(b.grad().full_tensor(), rb.grad(), 1e-12, "db");
    }
  }
}

TEST(DTensorOps, ElementwiseBroadcastAndPartialAddition) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    Tensor ag = random_tensor({7, 4}, 21, DType::Float64),
           bg = random_tensor({4}, 22, DType::Float64),
           cg = random_tensor({7, 4}, 23, DType::Float64);
    DTensor a = leaf(ag, mesh, {Shard(0)}), b = leaf(bg, mesh, {Replicate()});
    DTensor c = leaf(cg, mesh, {Shard(1)});
    // gelu(a * b) + c: c is re-cut to a's shard; b's gradient is summed over shards.
    DTensor y = add(gelu(mul(a, b)), c);
    EXPECT_EQ(y.placements(), (Placements{Shard(0)}));
    Tensor ra = leaf(ag), rb = leaf(bg), rc = leaf(cg);
    Tensor ry = add(gelu(mul(ra, rb)), rc);
    expect_close(y.full_tensor(), ry, 1e-12, "y");
    backward_weighted(y, ry, 24);
    expect_close(a.grad().full_tensor(), ra.grad(), 1e-12, "da");
    expect_close(b.grad().full_tensor(), rb.grad(), 1e-12, "db");
    expect_close(c.grad().full_tensor(), rc.grad(), 1e-12, "dc");
    // Partial + Replicate: the replicated addend counts once.
    DTensor p = linear(leaf(random_tensor({3, 6}, 25, DType::Float64), mesh, {Shard(1)}),
                       leaf(random_tensor({2, 6}, 26, DType::Float64), mesh, {Shard(1)}));
    DTensor r = leaf(random_tensor({3, 2}, 27, DType::Float64), mesh, {Replicate()});
    Tensor want = add(linear(random_tensor({3, 6}, 25, DType::Float64),
                             random_tensor({2, 6}, 26, DType::Float64)),
                      random_tensor({3, 2}, 27, DType::Float64));
    expect_close(add(p, r).full_tensor(), want, 1e-12, "P + R");
    expect_close(mul(p, 3.0).full_tensor(),
                 mul(sub(want, random_tensor({3, 2}, 27, DType::Float64)), 3.0), 1e-12, "P * s");
    expect_close(relu(p).full_tensor(), relu(sub(want, random_tensor({3, 2}, 27, DType::Float64))),
                 1e-12, "relu(P) reduces first");
  }
}

// As PyTorch's: distributing a tensor that requires grad gives a new leaf that requires grad,
// from a source rank (which tells the others) or from every rank (which agree on it).
TEST(DTensorOps, DistributeTensorKeepsRequiresGrad) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    const Tensor g = random_tensor({5, 3}, 31, DType::Float64);
    for (int src : {kMeshFirstRank, kEveryRank}) {
      SCOPED_TRACE(src);
      const bool holds = src == kEveryRank || mesh.coordinate()[0] == 0;
      const Tensor mine = holds ? g.clone().set_requires_grad(true) : Tensor();
      DTensor d = distribute_tensor(mine, mesh, {Shard(0)}, src);
      ASSERT_TRUE(d.requires_grad());
      EXPECT_FALSE(d.to_local().grad_fn());
      const Tensor w = random_tensor({5, 3}, 32, DType::Float64);
      backward(sum(mul(d.full_tensor(), w)));
      ASSERT_TRUE(d.grad().defined());
      expect_close(d.grad().full_tensor(), w, 0, "the leaf's gradient");
      EXPECT_FALSE(distribute_tensor(holds ? g : Tensor(), mesh, {Shard(0)}, src).requires_grad());
    }
    if (mesh.size() > 1) {
      const Tensor mine = mesh.coordinate()[0] == 0 ? g.clone().set_requires_grad(true) : g;
      EXPECT_THROW(distribute_tensor(mine, mesh, {Shard(0)}, kEveryRank), Error);
    }
  }
}

// A partial sum casts as its sum does: it stays partial where the cast is linear (into
// floats), and is summed first where it is not (into integers or bool: each rank's piece of 0.5
// truncates to 0 while the sum, 0.5 times the ranks, does not).
TEST(DTensorOps, CastOfAPartialSumIsTheCastOfTheSum) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    const int64_t n = mesh.size();
    // Pieces 0.5 and, on rank 1, -1.5: sums 0.5 n and, with rank 1's, 0.5 n - 2.
    const double second = mesh.local_rank(0) == 1 ? -1.5 : 0.5;
    const DTensor p =
        DTensor::from_local(from_vector<double>({0.5, second}, {2}), mesh, {Partial()}, Shape{2});
    const std::vector<double> sums = {0.5 * double(n), 0.5 * double(n) - (n > 1 ? 2.0 : 0.0)};
    const DTensor f = cast(p, DType::Float32);
    EXPECT_EQ(f.placements(), (Placements{Partial()}));
    EXPECT_EQ(f.full_tensor().to_vector<double>(), sums);
    for (DType dt : {DType::Int64, DType::Int32, DType::Bool}) {
      SCOPED_TRACE(dtype_name(dt));
      const DTensor c = cast(p, dt);
      EXPECT_EQ(c.placements(), (Placements{Replicate()}));
      EXPECT_EQ(c.full_tensor().to_vector<double>(),
                cast(from_vector<double>(sums, {2}), dt).to_vector<double>());
    }
    const DTensor i =
        DTensor::from_local(from_vector<int64_t>({3, -1}, {2}), mesh, {Partial()}, Shape{2});
    EXPECT_EQ(cast(i, DType::Int32).placements(), (Placements{Partial()}));
    EXPECT_EQ(cast(i, DType::Int32).full_tensor().to_vector<int64_t>(),
              (std::vector<int64_t>{3 * n, -n}));
    EXPECT_EQ(cast(i, DType::Bool).placements(), (Placements{Replicate()}));
  }
}

TEST(DTensorOps, ReductionsOverShardedDimsArePartial) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    Tensor xg = random_tensor({5, 6, 3}, 28, DType::Float64);
    for (std::vector<int64_t> dims : {std::vector<int64_t>{0}, {1}, {0, 2}, {}}) {
      for (bool keep : {false, true}) {
        DTensor x = leaf(xg, mesh, {Shard(0)});
        Tensor rx = leaf(xg);
        DTensor s = mean(x, dims, keep);
        Tensor rs = mean(rx, dims, keep);
        expect_close(s.full_tensor(), rs, 1e-12, "mean");
        backward_weighted(s, rs, 29);
        expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dmean");
        DTensor x2 = leaf(xg, mesh, {Shard(1)});
        expect_close(sum(x2, dims, keep).full_tensor(), sum(xg, dims, keep), 1e-12, "sum");
      }
    }
  }
}

TEST(DTensorOps, SoftmaxGathersItsDimOnly) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    Tensor xg = random_tensor({6, 5}, 30, DType::Float64);
    DTensor x = leaf(xg, mesh, {Shard(0)});
    DTensor y = log_softmax(x, -1);
    EXPECT_EQ(y.placements(), (Placements{Shard(0)}));
    DTensor x2 = leaf(xg, mesh, {Shard(1)});
    DTensor y2 = softmax(x2, 1);
    EXPECT_EQ(y2.placements(), (Placements{Replicate()}));
    Tensor rx = leaf(xg);
    expect_close(y.full_tensor(), log_softmax(xg, -1), 1e-12, "log_softmax");
    Tensor ry2 = softmax(rx, 1);
    expect_close(y2.full_tensor(), ry2, 1e-12, "softmax");
    backward_weighted(y2, ry2, 31);
    expect_close(x2.grad().full_tensor(), rx.grad(), 1e-12, "dsoftmax");
  }
}

TEST(DTensorOps, ViewsKeepShardedDimsIntact) {
  for (const DeviceMesh& mesh0 : meshes()) {
    DeviceMesh mesh = mesh0["tp"];
    const int64_t n = mesh.size();
    Tensor xg = random_tensor({2, 3, 4 * n * 2}, 32,
                              DType::Float64);  // [B, T, H*Dh] with H = 4n heads of 2
    DTensor x = leaf(xg, mesh, {Shard(2)});
    DTensor heads = view(x, {2, 3, 4 * n, 2});
    EXPECT_EQ(heads.placements(), (Placements{Shard(2)}));
    DTensor t = transpose(heads, 1, 2);  // [B, H, T, Dh]
    EXPECT_EQ(t.placements(), (Placements{Shard(1)}));
    Tensor rx = leaf(xg);
    Tensor rt = transpose(view(rx, {2, 3, 4 * n, 2}), 1, 2);
    expect_close(t.full_tensor(), rt, 0, "heads");
    backward_weighted(t, rt, 33);
    expect_close(x.grad().full_tensor(), rx.grad(), 1e-12, "dheads");
    DTensor back = reshape(transpose(t, 1, 2), {2, 3, -1});
    EXPECT_EQ(back.placements(), (Placements{Shard(2)}));
    expect_close(back.full_tensor(), xg, 0, "round trip");
    if (n > 1) {
      DTensor odd =
          leaf(random_tensor({2, 3}, 34, DType::Float64), mesh, {Shard(1)});  // 3 rows over n ranks
      try {
        view(odd, {6});
        if (n != 3) FAIL() << "merging an unevenly sharded dim must be refused";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("view: no sharding rule"), std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("[S(1)]"), std::string::npos) << e.what();
      }
    }
  }
}

TEST(DTensorOps, MismatchedMeshesAreAnError) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
  DeviceMesh mesh({2, 2}, {"dp", "tp"});
  DTensor a = distribute_tensor(random_tensor({4, 4}, 35, DType::Float64), mesh["dp"], {Shard(0)});
  DTensor b = distribute_tensor(random_tensor({4, 4}, 36, DType::Float64), mesh["tp"], {Shard(0)});
  try {
    add(a, b);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("different meshes"), std::string::npos) << e.what();
  }
}
