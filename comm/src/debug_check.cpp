#include "debug_check.h"

#include "tessera/core/error.h"
#include "tessera/core/factory.h"

namespace tessera::detail {

namespace {

// One rank's signature as a fixed-size header of int64 plus its per-rank counts and list hashes.
constexpr int64_t kMagic = 0x7e55e7a0c011ec7L;
constexpr int kMaxDims = 8;
enum Field : int {
  kFieldMagic,
  kFieldOp,
  kFieldReduce,
  kFieldDtype,
  kFieldRoot,
  kFieldSeq,  // the call's position among the group's collectives (CallInfo::seq)
  kFieldNdim,
  kFieldDims,
  kFieldShapeHash = kFieldDims + kMaxDims,
  kFieldOutNdim,  // the output shape only describes the call: each rank checks it locally
  kFieldOutDims,
  kFieldNumel = kFieldOutDims + kMaxDims,
  kFieldHasSend,
  kFieldHasRecv,
  kHeaderSize,
};

constexpr uint64_t kFnvBasis = 1469598103934665603ull;
constexpr uint64_t kFnvPrime = 1099511628211ull;

// FNV-1a, one int64 at a time. The hashes sent drop the top bit: non-negative, they never equal
// the -1 of an empty slot.
uint64_t fnv_add(uint64_t h, int64_t v) {
  return (h ^ uint64_t(v)) * kFnvPrime;
}

int64_t shape_hash(const Shape& shape) {
  uint64_t h = kFnvBasis;
  for (int64_t d : shape)
    h = fnv_add(h, d);
  return int64_t(h >> 1);
}

std::vector<int64_t> encode(const Signature& sig, int size) {
  std::vector<int64_t> rec(size_t(kHeaderSize + 3 * size), -1);
  const CallInfo& c = sig.call;
  rec[kFieldMagic] = kMagic;
  rec[kFieldOp] = int64_t(c.op);
  rec[kFieldReduce] = c.reduce ? int64_t(*c.reduce) : -1;
  rec[kFieldDtype] = c.dtype ? int64_t(*c.dtype) : -1;
  rec[kFieldRoot] = c.root;
  rec[kFieldSeq] = c.seq;
  if (c.shape) {
    rec[kFieldNdim] = int64_t(c.shape->size());
    for (size_t d = 0; d < c.shape->size() && d < size_t(kMaxDims); ++d) {
      rec[kFieldDims + d] = (*c.shape)[d];
    }
    rec[kFieldShapeHash] = shape_hash(*c.shape);
  }
  if (c.out_shape) {
    rec[kFieldOutNdim] = int64_t(c.out_shape->size());
    for (size_t d = 0; d < c.out_shape->size() && d < size_t(kMaxDims); ++d) {
      rec[kFieldOutDims + d] = (*c.out_shape)[d];
    }
  }
  rec[kFieldNumel] = sig.numel;
  rec[kFieldHasSend] = !sig.send_counts.empty();
  rec[kFieldHasRecv] = !sig.recv_counts.empty();
  for (int r = 0; r < size && !sig.send_counts.empty(); ++r)
    rec[kHeaderSize + r] = sig.send_counts[r];
  for (int r = 0; r < size && !sig.recv_counts.empty(); ++r) {
    rec[kHeaderSize + size + r] = sig.recv_counts[r];
  }
  for (int r = 0; r < size && !sig.list_hashes.empty(); ++r)
    rec[kHeaderSize + 2 * size + r] = sig.list_hashes[r];
  return rec;
}

// A table of every rank's record, as read back on each rank.
class Table {
 public:
  Table(std::vector<int64_t> data, int size) : data_(std::move(data)), size_(size) {}
  const int64_t* rec(int q) const { return data_.data() + size_t(q) * stride(); }
  int64_t field(int q, int f) const { return rec(q)[f]; }
  int64_t send(int q, int r) const { return rec(q)[kHeaderSize + r]; }
  int64_t recv(int q, int r) const { return rec(q)[kHeaderSize + size_ + r]; }
  int64_t list_hash(int q, int r) const { return rec(q)[kHeaderSize + 2 * size_ + r]; }

  CallInfo call(int q) const {
    CallInfo c;
    c.op = OpKind(field(q, kFieldOp));
    if (field(q, kFieldReduce) >= 0) c.reduce = ReduceOp(field(q, kFieldReduce));
    if (field(q, kFieldDtype) >= 0) c.dtype = DType(field(q, kFieldDtype));
    c.root = int(field(q, kFieldRoot));
    c.seq = field(q, kFieldSeq);
    const int64_t ndim = field(q, kFieldNdim);
    if (ndim >= 0) {
      Shape s;
      for (int64_t d = 0; d < ndim && d < kMaxDims; ++d)
        s.push_back(field(q, kFieldDims + int(d)));
      c.shape = s;
    }
    const int64_t out_ndim = field(q, kFieldOutNdim);
    if (out_ndim >= 0) {
      Shape s;
      for (int64_t d = 0; d < out_ndim && d < kMaxDims; ++d) {
        s.push_back(field(q, kFieldOutDims + int(d)));
      }
      c.out_shape = s;
    }
    return c;
  }
  bool same_call(int q) const {
    for (int f : {kFieldOp, kFieldReduce, kFieldDtype, kFieldRoot}) {
      if (field(q, f) != field(0, f)) return false;
    }
    return true;
  }
  bool same_shape(int q) const {
    for (int f = kFieldNdim; f <= kFieldShapeHash; ++f) {
      if (field(q, f) != field(0, f)) return false;
    }
    return true;
  }
  // "rank 0: all_reduce(sum) float32 [4]; rank 1: ..."
  std::string calls() const {
    std::string s;
    for (int q = 0; q < size_; ++q) {
      if (q) s += "; ";
      s += "rank " + std::to_string(q) + ": " + to_string(call(q));
      if (field(q, kFieldNdim) > kMaxDims || field(q, kFieldOutNdim) > kMaxDims) {
        s += " (first " + std::to_string(kMaxDims) + " dims)";
      }
    }
    return s;
  }

 private:
  size_t stride() const { return size_t(kHeaderSize + 3 * size_); }
  std::vector<int64_t> data_;
  int size_;
};

// The pairing rules of the uneven collectives; "" when every pair fits.
std::string pairing_errors(const Table& t, OpKind op, int size) {
  std::string errs;
  auto add = [&](const std::string& e) {
    if (!errs.empty()) errs += "; ";
    errs += e;
  };
  for (int q = 0; q < size; ++q) {
    for (int s = 0; s < size; ++s) {
      const std::string rq = "rank " + std::to_string(q);
      const std::string rs = "rank " + std::to_string(s);
      if (op == OpKind::AllGather && t.recv(q, s) != t.field(s, kFieldNumel)) {
        add(rq + " expects " + std::to_string(t.recv(q, s)) + " elements from " + rs +
            ", whose input has " + std::to_string(t.field(s, kFieldNumel)));
      }
      // all_gather_runs: what rank q's runs[s] gather against what rank s's runs[s] send.
      const bool exchange = op == OpKind::AllToAll || op == OpKind::AllGatherRuns;
      if (exchange && t.recv(q, s) != t.send(s, q)) {
        add(rq + " expects " + std::to_string(t.recv(q, s)) + " elements from " + rs +
            ", which sends " + std::to_string(t.send(s, q)));
      }
      if (op == OpKind::ReduceScatter && t.send(q, s) != t.send(0, s)) {
        add(rq + "'s input for " + rs + " has " + std::to_string(t.send(q, s)) +
            " elements but rank 0's has " + std::to_string(t.send(0, s)));
      }
    }
    if (op == OpKind::Scatter) {
      const int root = int(t.field(0, kFieldRoot));
      if (t.field(q, kFieldNumel) != t.send(root, q)) {
        add("rank " + std::to_string(q) + "'s output has " +
            std::to_string(t.field(q, kFieldNumel)) + " elements but root " + std::to_string(root) +
            " sends it " + std::to_string(t.send(root, q)));
      }
    }
  }
  return errs;
}

// all_gather_runs takes the runs given alike on every rank; "" when each rank's hash of each
// runs[s] matches rank 0's. The totals (recv) say whether lengths or only places differ.
std::string runs_errors(const Table& t, int size) {
  std::string errs;
  for (int q = 1; q < size; ++q) {
    for (int s = 0; s < size; ++s) {
      if (t.list_hash(q, s) == t.list_hash(0, s)) continue;
      const int64_t mine = t.recv(q, s), first = t.recv(0, s);
      if (!errs.empty()) errs += "; ";
      errs +=
          "rank " + std::to_string(q) + "'s runs[" + std::to_string(s) + "] differ from rank 0's (";
      errs += mine == first ? std::to_string(mine) + " elements in both: other places or splits"
                            : std::to_string(mine) + " elements, rank 0's " + std::to_string(first);
      errs += ")";
    }
  }
  return errs;
}

}  // namespace

int64_t runs_hash(const std::vector<GatherRun>& runs) {
  uint64_t h = fnv_add(kFnvBasis, int64_t(runs.size()));
  for (const GatherRun& r : runs)
    h = fnv_add(fnv_add(fnv_add(h, r.src), r.dst), r.length);
  return int64_t(h >> 1);
}

void check_signatures(ProcessGroup& debug, const std::string& group_name, const Signature& mine,
                      const std::function<void(const WorkPtr&, const CallInfo&)>& wait) {
  const int size = debug.size();
  std::vector<int64_t> rec = encode(mine, size);
  const int64_t n = int64_t(rec.size());
  Tensor all_t = empty({n * size}, DType::Int64);
  wait(debug.all_gather_into_tensor(all_t, from_vector<int64_t>(rec, {n})), mine.call);
  std::vector<int64_t> all = all_t.to_vector<int64_t>();

  Table t(std::move(all), size);
  const std::string group = "'" + group_name + "'";
  for (int q = 0; q < size; ++q) {
    TESSERA_CHECK(t.field(q, kFieldMagic) == kMagic, "collective mismatch on group ", group,
                  ": rank ", q, " sent a malformed debug record; is TESSERA_DEBUG_COLLECTIVES on ",
                  "for every rank?");
  }
  // Every rank numbers its collectives on the group; ranks that disagree on the number have not
  // all made the same ones (one made a collective the others skipped, outside this check).
  std::string positions;
  bool same = true;
  for (int q = 0; q < size; ++q) {
    same = same && t.field(q, kFieldSeq) == t.field(0, kFieldSeq);
    positions += q ? ", rank " : "rank ";
    positions += std::to_string(q);
    positions += " at #";
    positions += std::to_string(t.field(q, kFieldSeq) + 1);
  }
  TESSERA_CHECK(same, "collective mismatch on group ", group,
                ": the ranks are at different positions in the group's sequence of collectives (",
                positions,
                "): a rank skipped a collective or made an extra one; calls: ", t.calls());
  for (int q = 0; q < size; ++q)
    same = same && t.same_call(q);
  TESSERA_CHECK(same, "collective mismatch on group ", group,
                ": the ranks called different operations: ", t.calls());
  const OpKind op = OpKind(t.field(0, kFieldOp));
  if (is_even(op)) {
    for (int q = 0; q < size; ++q)
      same = same && t.same_shape(q);
    TESSERA_CHECK(same, "collective mismatch on group ", group, ": ", op_kind_name(op),
                  " needs the same shape on every rank, but got ", t.calls());
  }
  const std::string errs = pairing_errors(t, op, size);
  TESSERA_CHECK(errs.empty(), "collective mismatch on group ", group, ": ", op_kind_name(op),
                " sizes do not pair up: ", errs, " (calls: ", t.calls(), ")");
  if (op == OpKind::AllGatherRuns) {
    const std::string diff = runs_errors(t, size);
    TESSERA_CHECK(diff.empty(), "collective mismatch on group ", group,
                  ": all_gather_runs needs the same runs on every rank, but ", diff,
                  " (calls: ", t.calls(), ")");
  }
}

}  // namespace tessera::detail
