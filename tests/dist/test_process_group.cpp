// Every collective of the MPI process group, for every dtype and reduce op, on worlds of 1, 2, 3,
// 4 and 8 ranks. Expected values are computed here from the rank numbers alone.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>

#include "tessera/comm/comm.h"
#include "tessera/core/core.h"

using namespace tessera;

namespace {

ProcessGroupPtr world() {
  return world_group();
}

const std::vector<DType> kDTypes = {DType::Float32, DType::Float64, DType::BFloat16, DType::Float16,
                                    DType::Int64,   DType::Int32,   DType::Bool};
const std::vector<ReduceOp> kOps = {ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min,
                                    ReduceOp::Product};

// A tensor of `shape` and dtype `dt` whose row-major element i is f(i).
Tensor make(DType dt, const Shape& shape, const std::function<double(int64_t)>& f) {
  std::vector<double> v(size_t(shape_numel(shape)));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = f(int64_t(i));
  return from_vector<double>(v, shape).to(dt);
}
std::vector<double> values(const Tensor& t) {
  return t.to_vector<double>();
}

// Rank r's contribution to element i. Small integers, so every dtype (16-bit floats included)
// holds every partial sum, max, min and product exactly, whatever order MPI combines them in.
double contribution(ReduceOp op, DType dt, int r, int64_t i) {
  if (dt == DType::Bool) return (r + i) % 3 == 0 ? 1 : 0;
  if (op == ReduceOp::Product) return double(1 + (r + i) % 2);  // at most 2^8 on 8 ranks
  return double((r * 7 + i * 3) % 5 + 1);
}

// Avg is the sum divided by the rank count in the dtype's own arithmetic: float32 for the 16-bit
// floats (then rounded), truncating division for integers.
double average(DType dt, double sum, int n) {
  switch (dt) {
    case DType::Float64:
      return sum / n;
    case DType::Float32:
      return double(float(sum) / float(n));
    case DType::BFloat16:
      return double(float(BFloat16(float(sum) / float(n))));
    case DType::Float16:
      return double(float(Float16(float(sum) / float(n))));
    default:
      return double(int64_t(sum) / n);
  }
}

double expected_reduction(ReduceOp op, DType dt, int n, const std::function<double(int)>& v) {
  if (dt == DType::Bool) {
    bool any = false;
    bool all = true;
    for (int r = 0; r < n; ++r) {
      any = any || v(r) != 0;
      all = all && v(r) != 0;
    }
    return (op == ReduceOp::Sum || op == ReduceOp::Max) ? any : all;
  }
  double acc = v(0);
  for (int r = 1; r < n; ++r) {
    switch (op) {
      case ReduceOp::Sum:
      case ReduceOp::Avg:
        acc += v(r);
        break;
      case ReduceOp::Max:
        acc = std::max(acc, v(r));
        break;
      case ReduceOp::Min:
        acc = std::min(acc, v(r));
        break;
      case ReduceOp::Product:
        acc *= v(r);
        break;
    }
  }
  return op == ReduceOp::Avg ? average(dt, acc, n) : acc;
}

std::string label(DType dt, ReduceOp op) {
  return std::string(dtype_name(dt)) + " " + reduce_op_name(op);
}

}  // namespace

TEST(ProcessGroup, WorldDescribesTheJob) {
  auto g = world();
  EXPECT_EQ(g->name(), "world");
  EXPECT_EQ(g->size(), world_size());
  EXPECT_EQ(g->rank(), world_rank());
  std::vector<int> expected(size_t(g->size()));
  for (int r = 0; r < g->size(); ++r)
    expected[size_t(r)] = r;
  EXPECT_EQ(g->world_ranks(), expected);
}

TEST(ProcessGroup, AllReduceEveryDTypeAndOp) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  for (DType dt : kDTypes) {
    for (ReduceOp op : kOps) {
      if (dt == DType::Bool && op == ReduceOp::Avg) continue;  // an error: test_comm_errors
      SCOPED_TRACE(label(dt, op));
      Tensor t = make(dt, {3, 5}, [&](int64_t i) { return contribution(op, dt, me, i); });
      g->all_reduce(t, op)->wait();
      EXPECT_EQ(t.dtype(), dt);
      EXPECT_EQ(t.shape(), (Shape{3, 5}));
      std::vector<double> expected(15);
      for (int64_t i = 0; i < 15; ++i) {
        expected[size_t(i)] =
            expected_reduction(op, dt, n, [&](int r) { return contribution(op, dt, r, i); });
      }
      EXPECT_EQ(values(t), expected);
    }
  }
}

// 16-bit sums combine in float32 and round to nearest even. With two ranks that is exactly one
// float32 addition then one rounding; with more, each combining step rounds, so the result stays
// within a rounding step per rank of the float32 sum.
TEST(ProcessGroup, HalfSumRoundsFromFloat32) {
  auto g = world();
  const int n = g->size();
  for (DType dt : {DType::BFloat16, DType::Float16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int mantissa_bits = dt == DType::BFloat16 ? 7 : 10;
    const double unit = std::ldexp(1.0, -mantissa_bits);  // the spacing of values in [1, 2)
    // 1 + k * unit is exact in the dtype; sums of several of them are not.
    auto v = [&](int r, int64_t i) { return 1.0 + double((r + 3 * i) % 7 + 1) * unit; };
    Tensor t = make(dt, {8}, [&](int64_t i) { return v(g->rank(), i); });
    g->all_reduce(t, ReduceOp::Sum)->wait();
    const std::vector<double> got = values(t);
    for (int64_t i = 0; i < 8; ++i) {
      float sum = 0;
      for (int r = 0; r < n; ++r)
        sum += float(v(r, i));
      const double rounded =
          dt == DType::BFloat16 ? double(float(BFloat16(sum))) : double(float(Float16(sum)));
      if (n <= 2) {
        EXPECT_EQ(got[size_t(i)], rounded) << "element " << i;
      } else {
        const double ulp = std::ldexp(1.0, int(std::floor(std::log2(sum))) - mantissa_bits);
        EXPECT_LE(std::abs(got[size_t(i)] - double(sum)), double(n) * ulp) << "element " << i;
      }
    }
  }
}

TEST(ProcessGroup, AllGatherIntoTensorEveryDType) {
  auto g = world();
  const int n = g->size();
  for (DType dt : kDTypes) {
    SCOPED_TRACE(dtype_name(dt));
    auto v = [&](int r, int64_t i) {
      return dt == DType::Bool ? double((r + i) % 2) : double(r * 10 + i);
    };
    Tensor in = make(dt, {2, 3}, [&](int64_t i) { return v(g->rank(), i); });
    Tensor out = zeros({2 * n, 3}, dt);
    g->all_gather_into_tensor(out, in)->wait();
    std::vector<double> expected;
    for (int r = 0; r < n; ++r)
      for (int64_t i = 0; i < 6; ++i)
        expected.push_back(v(r, i));
    EXPECT_EQ(values(out), expected);
  }
}

// FSDP's layout: the input is this rank's slot of the output (MPI_IN_PLACE).
TEST(ProcessGroup, AllGatherIntoTensorInPlace) {
  auto g = world();
  const int n = g->size();
  Tensor out = zeros({2 * n, 3}, DType::Float32);
  Tensor mine = kernels::narrow(out, 0, 2 * g->rank(), 2);
  mine.copy_(make(DType::Float32, {2, 3}, [&](int64_t i) { return g->rank() * 100.0 + i; }));
  g->all_gather_into_tensor(out, mine)->wait();
  std::vector<double> expected;
  for (int r = 0; r < n; ++r)
    for (int64_t i = 0; i < 6; ++i)
      expected.push_back(r * 100.0 + i);
  EXPECT_EQ(values(out), expected);

  // An input lying in another rank's slot is read before any slot is written.
  Tensor out2 = zeros({2 * n, 3}, DType::Float32);
  Tensor next_slot = kernels::narrow(out2, 0, 2 * ((g->rank() + 1) % n), 2);
  next_slot.copy_(make(DType::Float32, {2, 3}, [&](int64_t i) { return g->rank() * 100.0 + i; }));
  g->all_gather_into_tensor(out2, next_slot)->wait();
  EXPECT_EQ(values(out2), expected);
}

TEST(ProcessGroup, ReduceScatterTensorEveryDTypeAndOp) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  for (DType dt : kDTypes) {
    for (ReduceOp op : kOps) {
      if (dt == DType::Bool && op == ReduceOp::Avg) continue;
      SCOPED_TRACE(label(dt, op));
      Tensor in = make(dt, {2 * n, 3}, [&](int64_t i) { return contribution(op, dt, me, i); });
      Tensor out = zeros({2, 3}, dt);
      g->reduce_scatter_tensor(out, in, op)->wait();
      std::vector<double> expected(6);
      for (int64_t j = 0; j < 6; ++j) {
        const int64_t i = me * 6 + j;  // this rank's block of the input
        expected[size_t(j)] =
            expected_reduction(op, dt, n, [&](int r) { return contribution(op, dt, r, i); });
      }
      EXPECT_EQ(values(out), expected);
    }
  }
}

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

TEST(ProcessGroup, BroadcastFromEveryRoot) {
  auto g = world();
  for (int root = 0; root < g->size(); ++root) {
    for (DType dt : kDTypes) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " root " + std::to_string(root));
      auto v = [&](int64_t i) { return dt == DType::Bool ? double(i % 2) : double(root * 10 + i); };
      Tensor t = g->rank() == root ? make(dt, {4, 3}, v) : zeros({4, 3}, dt);
      g->broadcast(t, root)->wait();
      EXPECT_EQ(values(t), values(make(dt, {4, 3}, v)));
    }
  }
}

// The root sends (s + 1) % 3 elements to rank s: uneven, some empty.
TEST(ProcessGroup, ScatterUneven) {
  auto g = world();
  const int n = g->size();
  const int root = n - 1;
  auto len = [](int s) { return int64_t((s + 1) % 3); };
  auto v = [](int s, int64_t j) { return 10.0 * s + double(j); };
  for (bool root_output_in_place : {false, true}) {
    SCOPED_TRACE(root_output_in_place ? "root's output is its own input" : "separate tensors");
    std::vector<Tensor> inputs;
    std::vector<int64_t> sizes;
    int64_t total = 0;
    for (int s = 0; s < n; ++s) {
      sizes.push_back(len(s));
      total += len(s);
    }
    Tensor whole = empty({total}, DType::Float32);
    Tensor out = full({len(g->rank())}, -1, DType::Float32);
    if (g->rank() == root) {
      inputs = kernels::split(whole, sizes, 0);
      for (int s = 0; s < n; ++s) {
        inputs[size_t(s)].copy_(make(DType::Float32, {len(s)}, [&](int64_t j) { return v(s, j); }));
      }
      if (root_output_in_place) out = inputs[size_t(root)];
    }
    g->scatter(out, inputs, root)->wait();
    std::vector<double> expected;
    for (int64_t j = 0; j < len(g->rank()); ++j)
      expected.push_back(v(g->rank(), j));
    EXPECT_EQ(values(out), expected);
  }
}

TEST(ProcessGroup, AsyncOperationsOverlap) {
  auto g = world();
  const int n = g->size();
  Tensor a = full({16}, g->rank() + 1, DType::Float64);
  Tensor in = full({2}, g->rank(), DType::Int64);
  Tensor gathered = zeros({2 * n}, DType::Int64);
  WorkPtr first = g->all_reduce(a, ReduceOp::Sum);
  WorkPtr second = g->all_gather_into_tensor(gathered, in);
  WorkPtr third = g->barrier();
  // Waited out of order: completion does not depend on it.
  third->wait();
  second->wait();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!first->is_completed() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::yield();
  }
  ASSERT_TRUE(first->is_completed());
  first->wait();  // a second wait after completion is a no-op
  EXPECT_EQ(values(a), std::vector<double>(16, n * (n + 1) / 2.0));
  std::vector<double> expected;
  for (int r = 0; r < n; ++r)
    expected.insert(expected.end(), {double(r), double(r)});
  EXPECT_EQ(values(gathered), expected);
}

TEST(ProcessGroup, SendRecvRing) {
  auto g = world();
  const int n = g->size();
  const int dst = (g->rank() + 1) % n;
  const int src = (g->rank() + n - 1) % n;
  for (DType dt : {DType::Float32, DType::BFloat16, DType::Int64}) {
    SCOPED_TRACE(dtype_name(dt));
    Tensor out = make(dt, {3, 2}, [&](int64_t i) { return g->rank() * 10.0 + i; });
    // The receive lands in a transposed (non-contiguous) view.
    Tensor backing = zeros({2, 3}, dt);
    Tensor in = kernels::transpose(backing, 0, 1);
    WorkPtr r = g->recv(in, src, 7);
    WorkPtr s = g->send(out, dst, 7);
    s->wait();
    r->wait();
    EXPECT_EQ(values(in), values(make(dt, {3, 2}, [&](int64_t i) { return src * 10.0 + i; })));
  }
}

TEST(ProcessGroup, SplitIntoEvenAndOddRanks) {
  auto g = world();
  const int n = g->size();
  const int me = g->rank();
  const int parity = me % 2;
  auto sub = g->split(parity, me, "parity");
  ASSERT_NE(sub, nullptr);
  std::vector<int> members;
  for (int r = parity; r < n; r += 2)
    members.push_back(r);
  EXPECT_EQ(sub->name(), "parity");
  EXPECT_EQ(sub->size(), int(members.size()));
  EXPECT_EQ(sub->rank(), me / 2);
  EXPECT_EQ(sub->world_ranks(), members);

  Tensor t = full({5}, me, DType::Int64);
  sub->all_reduce(t, ReduceOp::Sum)->wait();
  double sum = 0;
  for (int r : members)
    sum += r;
  EXPECT_EQ(values(t), std::vector<double>(5, sum));

  Tensor gathered = zeros({sub->size()}, DType::Int32);
  sub->all_gather_into_tensor(gathered, full({1}, me, DType::Int32))->wait();
  EXPECT_EQ(values(gathered), std::vector<double>(members.begin(), members.end()));

  // Key orders the new ranks: a descending key reverses the world order.
  auto reversed = g->split(0, -me, "reversed");
  ASSERT_NE(reversed, nullptr);
  EXPECT_EQ(reversed->rank(), n - 1 - me);
  Tensor who = full({1}, me, DType::Int64);
  reversed->broadcast(who, 0)->wait();
  EXPECT_EQ(who.item<int64_t>(), n - 1);

  // A negative color leaves a rank out; a split of a split works too.
  auto without_zero = g->split(me == 0 ? -1 : 0, me, "without_zero");
  if (me == 0) {
    EXPECT_EQ(without_zero, nullptr);
  } else {
    ASSERT_NE(without_zero, nullptr);
    EXPECT_EQ(without_zero->size(), n - 1);
    EXPECT_EQ(without_zero->rank(), me - 1);
    auto nested = without_zero->split(me % 2, me, "nested");
    ASSERT_NE(nested, nullptr);
    Tensor c = ones({2}, DType::Float32);
    nested->all_reduce(c, ReduceOp::Sum)->wait();
    int expected = 0;
    for (int r = 1; r < n; ++r)
      expected += (r % 2 == me % 2);
    EXPECT_EQ(values(c), std::vector<double>(2, expected));
  }
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
