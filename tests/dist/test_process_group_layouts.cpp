// The MPI process group's collectives on tensors of every layout: uneven and empty pieces,
// strided views, outputs that are views of one tensor, pieces that only agree in element count,
// in-place use, non-contiguous and empty tensors, and tensors that require grad. Part of the
// test_process_group binary.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "dist/process_group_util.h"
#include "tessera/comm/comm.h"
#include "tessera/core/core.h"

using namespace tessera;
using namespace tessera::process_group_test;

// Rank r contributes r % 3 rows (0, 1, 2, 0, ...): uneven, some empty.
TEST(ProcessGroup, AllGatherUneven) {
  auto g = world();
  const int n = g->size();
  auto rows = [](int r) { return int64_t(r % 3); };
  auto v = [](int r, int64_t i) { return 10.0 * r + double(i); };  // exact in bfloat16
  for (DType dt : {DType::Float32, DType::Int64, DType::BFloat16}) {
    for (bool chunks_of_one_tensor : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (chunks_of_one_tensor ? " chunks" : " separate"));
      Tensor in = make(dt, {rows(g->rank()), 2}, [&](int64_t i) { return v(g->rank(), i); });
      std::vector<Tensor> outputs;
      std::vector<int64_t> sizes;
      int64_t total = 0;
      for (int r = 0; r < n; ++r) {
        sizes.push_back(rows(r));
        total += rows(r);
      }
      Tensor whole = zeros({total, 2}, dt);
      if (chunks_of_one_tensor) {
        outputs = kernels::split(whole, sizes, 0);
      } else {
        for (int r = 0; r < n; ++r)
          outputs.push_back(full({rows(r), 2}, -1, dt));
      }
      g->all_gather(outputs, in)->wait();
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(outputs[size_t(r)].shape(), (Shape{rows(r), 2}));
        std::vector<double> expected;
        for (int64_t i = 0; i < rows(r) * 2; ++i)
          expected.push_back(v(r, i));
        EXPECT_EQ(values(outputs[size_t(r)]), expected) << "from rank " << r;
      }
    }
  }
}

// Block s of every rank's input has (s + 1) % 3 elements.
TEST(ProcessGroup, ReduceScatterUneven) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  auto len = [](int s) { return int64_t((s + 1) % 3); };
  auto v = [](int r, int s, int64_t j) { return double(r + 1) * 10.0 + double(s) + double(j); };
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg}) {
    for (bool chunks_of_one_tensor : {false, true}) {
      SCOPED_TRACE(std::string(reduce_op_name(op)) + (chunks_of_one_tensor ? " chunks" : ""));
      std::vector<Tensor> inputs;
      std::vector<int64_t> sizes;
      std::vector<double> flat;
      for (int s = 0; s < n; ++s) {
        sizes.push_back(len(s));
        for (int64_t j = 0; j < len(s); ++j)
          flat.push_back(v(me, s, j));
      }
      Tensor whole = from_vector<double>(flat, {int64_t(flat.size())});
      if (chunks_of_one_tensor) {
        inputs = kernels::split(whole, sizes, 0);
      } else {
        for (const Tensor& piece : kernels::split(whole, sizes, 0))
          inputs.push_back(piece.clone());
      }
      Tensor out = zeros({len(me)}, DType::Float64);
      g->reduce_scatter(out, inputs, op)->wait();
      std::vector<double> expected;
      for (int64_t j = 0; j < len(me); ++j) {
        expected.push_back(
            expected_reduction(op, DType::Float64, n, [&](int r) { return v(r, me, j); }));
      }
      EXPECT_EQ(values(out), expected);
    }
  }
}

// Rank r sends (r + 2 s) % 3 elements to rank s; values stay below 2048, exact in float16.
TEST(ProcessGroup, AllToAllUneven) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  auto count = [](int src, int dst) { return int64_t((src + 2 * dst) % 3); };
  auto v = [](int src, int dst, int64_t j) { return 100.0 * src + 10.0 * dst + double(j); };
  for (DType dt : {DType::Float32, DType::Int32, DType::Float16}) {
    for (bool chunks_of_one_tensor : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (chunks_of_one_tensor ? " chunks" : ""));
      std::vector<Tensor> inputs;
      std::vector<Tensor> outputs;
      std::vector<int64_t> in_sizes;
      std::vector<int64_t> out_sizes;
      int64_t in_total = 0;
      int64_t out_total = 0;
      for (int s = 0; s < n; ++s) {
        in_sizes.push_back(count(me, s));
        out_sizes.push_back(count(s, me));
        in_total += count(me, s);
        out_total += count(s, me);
      }
      Tensor in_whole = empty({in_total}, dt);
      Tensor out_whole = full({out_total}, -1, dt);
      std::vector<Tensor> in_views = kernels::split(in_whole, in_sizes, 0);
      for (int s = 0; s < n; ++s) {
        in_views[size_t(s)].copy_(make(dt, {count(me, s)}, [&](int64_t j) { return v(me, s, j); }));
      }
      if (chunks_of_one_tensor) {
        inputs = in_views;
        outputs = kernels::split(out_whole, out_sizes, 0);
      } else {
        for (int s = 0; s < n; ++s) {
          inputs.push_back(in_views[size_t(s)].clone());
          outputs.push_back(full({count(s, me)}, -1, dt));
        }
      }
      g->all_to_all(outputs, inputs)->wait();
      for (int s = 0; s < n; ++s) {
        std::vector<double> expected;
        for (int64_t j = 0; j < count(s, me); ++j)
          expected.push_back(v(s, me, j));
        EXPECT_EQ(values(outputs[size_t(s)]), expected) << "from rank " << s;
      }
    }
  }
}

// The reshard of a matrix from row blocks to column blocks and back, with pieces that are views
// of one tensor: column blocks (strided, sent where they lie), row blocks (received in place),
// the column blocks of the output (interleaved in memory, sharing no element) and transposed
// outputs. Rank r holds (r % 3) + 1 rows and gets (r + 1) % 3 columns, so some pieces are empty.
TEST(ProcessGroup, AllToAllStridedViews) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  auto rows = [](int r) { return int64_t(r % 3 + 1); };
  auto cols = [](int r) { return int64_t((r + 1) % 3); };
  std::vector<int64_t> row0(1, 0), col0(1, 0);
  for (int r = 0; r < n; ++r) {
    row0.push_back(row0.back() + rows(r));
    col0.push_back(col0.back() + cols(r));
  }
  const int64_t total_rows = row0.back(), total_cols = col0.back();
  for (DType dt : kDTypes) {
    SCOPED_TRACE(dtype_name(dt));
    // Below 256: exact in every dtype; bool sees parity.
    auto global = [&](int64_t i, int64_t j) {
      const double v = double((i * 7 + j * 3) % 200);
      return dt == DType::Bool ? double(int64_t(v) % 2) : v;
    };
    auto block = [&](int64_t r0, int64_t nr, int64_t c0, int64_t nc) {
      return make(dt, {nr, nc}, [&](int64_t k) { return global(r0 + k / nc, c0 + k % nc); });
    };
    const Tensor my_rows = block(row0[size_t(me)], rows(me), 0, total_cols);
    const Tensor my_cols = block(0, total_rows, col0[size_t(me)], cols(me));

    // Row block -> column block: every input a column block of this rank's rows.
    for (bool transposed_out : {false, true}) {
      SCOPED_TRACE(transposed_out ? "into a transposed output" : "into row blocks");
      Tensor backing = full({cols(me), total_rows}, -1, dt);
      Tensor out =
          transposed_out ? kernels::transpose(backing, 0, 1) : full({total_rows, cols(me)}, -1, dt);
      std::vector<Tensor> inputs, outputs;
      for (int s = 0; s < n; ++s) {
        inputs.push_back(kernels::narrow(my_rows, 1, col0[size_t(s)], cols(s)));
        outputs.push_back(kernels::narrow(out, 0, row0[size_t(s)], rows(s)));
      }
      g->all_to_all(outputs, inputs)->wait();
      EXPECT_EQ(values(out), values(my_cols));
    }

    // Column block -> row block: contiguous inputs, outputs the interleaved column blocks of one
    // tensor, which sits inside a wider one whose other columns must stay untouched.
    Tensor wide = full({rows(me), total_cols + 2}, -1, dt);
    Tensor out = kernels::narrow(wide, 1, 1, total_cols);
    std::vector<Tensor> inputs, outputs;
    for (int s = 0; s < n; ++s) {
      inputs.push_back(kernels::narrow(my_cols, 0, row0[size_t(s)], rows(s)));
      outputs.push_back(kernels::narrow(out, 1, col0[size_t(s)], cols(s)));
    }
    g->all_to_all(outputs, inputs)->wait();
    EXPECT_EQ(values(out), values(my_rows));
    const double untouched = dt == DType::Bool ? 1.0 : -1.0;
    EXPECT_EQ(values(kernels::narrow(wide, 1, 0, 1)),
              std::vector<double>(size_t(rows(me)), untouched));
    EXPECT_EQ(values(kernels::narrow(wide, 1, total_cols + 1, 1)),
              std::vector<double>(size_t(rows(me)), untouched));
  }
}

// Outputs that are column blocks of one matrix (interleaved in memory, sharing no element) are
// received where they lie; an input that is this rank's own output needs no copy, and one lying
// in another rank's output is read before that output is written.
TEST(ProcessGroup, AllGatherIntoViewsOfOneTensor) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  auto v = [](int r, int64_t i) { return 100.0 * r + double(i); };
  auto expect_gathered = [&](const std::vector<Tensor>& outputs) {
    for (int r = 0; r < n; ++r) {
      std::vector<double> expected;
      for (int64_t i = 0; i < 6; ++i)
        expected.push_back(v(r, i));
      EXPECT_EQ(values(outputs[size_t(r)]), expected) << "from rank " << r;
    }
  };
  for (int own : {-1, 0, 1}) {  // the input: separate, this rank's block, the next rank's block
    SCOPED_TRACE("input " + std::to_string(own));
    Tensor matrix = full({3, 2 * n}, -1, DType::Float32);
    std::vector<Tensor> blocks;
    for (int r = 0; r < n; ++r)
      blocks.push_back(kernels::narrow(matrix, 1, 2 * r, 2));
    Tensor mine = make(DType::Float32, {3, 2}, [&](int64_t i) { return v(me, i); });
    Tensor in = mine;
    if (own >= 0) {
      in = blocks[size_t((me + own) % n)];
      in.copy_(mine);
    }
    g->all_gather(blocks, in)->wait();
    expect_gathered(blocks);
  }
}

// Pieces need only agree in element count (row-major order), also for this rank's own piece;
// and an all-to-all may run in place, inputs and outputs being the same rows of one tensor.
TEST(ProcessGroup, AllToAllReshapesAndInPlace) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  auto v = [](int src, int dst, int64_t k) { return 100.0 * src + 10.0 * dst + double(k); };
  std::vector<Tensor> inputs, outputs;
  for (int s = 0; s < n; ++s) {
    // A [2, 3] view with strides [1, 2]: row-major values v(me, s, 0..5).
    Tensor t = make(DType::Float32, {3, 2}, [&](int64_t k) { return v(me, s, k % 2 * 3 + k / 2); });
    inputs.push_back(kernels::transpose(t, 0, 1));
    outputs.push_back(full({6}, -1, DType::Float32));
  }
  g->all_to_all(outputs, inputs)->wait();
  for (int s = 0; s < n; ++s) {
    std::vector<double> expected;
    for (int64_t k = 0; k < 6; ++k)
      expected.push_back(v(s, me, k));
    EXPECT_EQ(values(outputs[size_t(s)]), expected) << "from rank " << s;
  }

  Tensor buf = make(DType::Int64, {n, 4}, [&](int64_t k) { return v(me, int(k / 4), k % 4); });
  std::vector<Tensor> rows;
  for (int s = 0; s < n; ++s)
    rows.push_back(kernels::select(buf, 0, s));
  g->all_to_all(rows, rows)->wait();
  EXPECT_EQ(values(buf), values(make(DType::Int64, {n, 4},
                                     [&](int64_t k) { return v(int(k / 4), me, k % 4); })));
}

TEST(ProcessGroup, NonContiguousTensors) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  // all_reduce writes back through a transposed view: the backing buffer must hold the result.
  Tensor backing = make(DType::Float32, {3, 4}, [&](int64_t i) { return me + double(i); });
  Tensor view = kernels::transpose(backing, 0, 1);
  g->all_reduce(view, ReduceOp::Sum)->wait();
  const double rank_sum = n * (n - 1) / 2.0;
  EXPECT_EQ(values(backing), values(make(DType::Float32, {3, 4},
                                         [&](int64_t i) { return rank_sum + n * double(i); })));

  // Gather from a strided input into a transposed output.
  Tensor src = make(DType::Float64, {4, 2}, [&](int64_t i) { return me * 100.0 + i; });
  Tensor every_other = kernels::slice(src, 0, 0, 4, 2);  // rows 0 and 2: [2, 2]
  Tensor out_backing = zeros({2, 2 * n}, DType::Float64);
  Tensor out = kernels::transpose(out_backing, 0, 1);  // [2n, 2]
  g->all_gather_into_tensor(out, every_other)->wait();
  std::vector<double> expected;
  for (int r = 0; r < n; ++r) {
    for (double i : {0.0, 1.0, 4.0, 5.0})
      expected.push_back(r * 100.0 + i);
  }
  EXPECT_EQ(values(out), expected);

  // Reduce-scatter from a transposed input into a strided output.
  Tensor in_backing = make(DType::Float32, {3, 2 * n}, [&](int64_t i) { return double(i % 7); });
  Tensor in = kernels::transpose(in_backing, 0, 1);  // [2n, 3]
  Tensor rs_backing = zeros({2, 6}, DType::Float32);
  Tensor rs_out = kernels::slice(rs_backing, 1, 0, 6, 2);  // [2, 3], stride 2
  g->reduce_scatter_tensor(rs_out, in, ReduceOp::Sum)->wait();
  std::vector<double> in_values = values(in);
  std::vector<double> rs_expected;
  for (int64_t j = 0; j < 6; ++j)
    rs_expected.push_back(n * in_values[size_t(me * 6 + j)]);
  EXPECT_EQ(values(rs_out), rs_expected);
  // The skipped columns of the backing buffer stay untouched.
  EXPECT_EQ(values(kernels::slice(rs_backing, 1, 1, 6, 2)), std::vector<double>(6, 0.0));

  // Uneven gather into non-contiguous outputs.
  std::vector<Tensor> outputs;
  std::vector<Tensor> backings;
  for (int r = 0; r < n; ++r) {
    backings.push_back(zeros({2, 3}, DType::Int32));
    outputs.push_back(kernels::transpose(backings.back(), 0, 1));
  }
  g->all_gather(outputs, make(DType::Int32, {3, 2}, [&](int64_t i) { return me * 10.0 + i; }))
      ->wait();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(values(outputs[size_t(r)]),
              values(make(DType::Int32, {3, 2}, [&](int64_t i) { return r * 10.0 + i; })));
  }
}

TEST(ProcessGroup, EmptyTensors) {
  auto g = world();
  Tensor t = zeros({0, 3}, DType::Float32);
  g->all_reduce(t, ReduceOp::Sum)->wait();
  EXPECT_EQ(t.shape(), (Shape{0, 3}));
  Tensor out = zeros({0, 3}, DType::Float32);
  g->all_gather_into_tensor(out, t)->wait();
  g->broadcast(t, 0)->wait();
  EXPECT_EQ(out.numel(), 0);
}

// Collectives write into their tensors whatever autograd says of them (as c10d's do): one that
// requires grad, under grad mode, takes the result alike whether it is written where it lies
// or copied in once the transfers are done (a strided view, this rank's own piece of a gather).
TEST(ProcessGroup, TensorsThatRequireGradTakeTheResultOnEveryPath) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  auto needing_grad = [](Tensor t) {
    t.set_requires_grad(true);
    return t;
  };
  Tensor backing = make(DType::Float32, {3, 4}, [&](int64_t i) { return me + double(i); });
  Tensor view = needing_grad(kernels::transpose(backing, 0, 1));
  g->all_reduce(view, ReduceOp::Sum)->wait();
  const double rank_sum = n * (n - 1) / 2.0;
  EXPECT_EQ(values(backing), values(make(DType::Float32, {3, 4},
                                         [&](int64_t i) { return rank_sum + n * double(i); })));

  const Tensor in = make(DType::Float32, {2}, [&](int64_t i) { return me * 10.0 + i; });
  std::vector<double> gathered;
  for (int r = 0; r < n; ++r)
    for (int i = 0; i < 2; ++i)
      gathered.push_back(r * 10.0 + i);
  Tensor out = needing_grad(zeros({2 * n}, DType::Float32));
  g->all_gather_into_tensor(out, in)->wait();
  EXPECT_EQ(values(out), gathered);
  Tensor out_t = needing_grad(kernels::transpose(zeros({2, n}, DType::Float32), 0, 1));  // [n, 2]
  g->all_gather_into_tensor(out_t, kernels::reshape(in, {1, 2}))->wait();
  EXPECT_EQ(values(out_t), gathered);

  Tensor b_backing = make(DType::Float32, {2, 3}, [&](int64_t i) { return me * 100.0 + i; });
  Tensor b = needing_grad(kernels::transpose(b_backing, 0, 1));
  g->broadcast(b, 0)->wait();
  EXPECT_EQ(values(b),
            values(kernels::transpose(
                make(DType::Float32, {2, 3}, [&](int64_t i) { return double(i); }), 0, 1)));

  Tensor s = needing_grad(kernels::transpose(zeros({2, 3}, DType::Float32), 0, 1));
  std::vector<Tensor> pieces;
  if (me == 0)
    for (int r = 0; r < n; ++r)
      pieces.push_back(make(DType::Float32, {3, 2}, [&](int64_t i) { return r * 10.0 + i; }));
  g->scatter(s, pieces, 0)->wait();
  EXPECT_EQ(values(s),
            values(make(DType::Float32, {3, 2}, [&](int64_t i) { return me * 10.0 + i; })));

  if (n == 1) return;
  Tensor r = needing_grad(kernels::transpose(zeros({2, 3}, DType::Float32), 0, 1));
  WorkPtr rw = g->recv(r, (me + n - 1) % n, 7);
  g->send(make(DType::Float32, {3, 2}, [&](int64_t i) { return me * 10.0 + i; }), (me + 1) % n, 7)
      ->wait();
  rw->wait();
  EXPECT_EQ(values(r), values(make(DType::Float32, {3, 2},
                                   [&](int64_t i) { return ((me + n - 1) % n) * 10.0 + i; })));
}
