// tessera-ckpt: looks into checkpoints without writing a program. One process, no MPI at all
// (the inspection calls read with HDF5's POSIX driver), so it also runs inside an MPI job's
// scripts without joining the job.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include "tessera/checkpoint/checkpoint.h"
#include "tessera/checkpoint/safetensors.h"

using namespace tessera;

namespace {

const char* kUsage =
    "usage: tessera-ckpt ls CHECKPOINT\n"
    "       tessera-ckpt verify CHECKPOINT\n"
    "       tessera-ckpt diff A B\n"
    "       tessera-ckpt export-safetensors CHECKPOINT OUT.safetensors [--prefix P]\n"
    "\n"
    "  ls                  entries with global shapes, dtypes, bytes and the mesh they were saved\n"
    "                      from; then the scalar and string entries\n"
    "  verify              reads every tensor and checks every checksum (exit 1 if any fails)\n"
    "  diff                for every tensor present in both, how many elements differ and the\n"
    "                      largest absolute difference (integers exactly, NaN equal to NaN),\n"
    "                      and what only one holds (exit 1 if anything differs)\n"
    "  export-safetensors  the tensors under P (default \"model/\", prefix removed) as one\n"
    "                      safetensors file; --prefix \"\" exports every tensor under its key\n";

std::string bytes_str(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

int ls(const std::string& path) {
  const CheckpointInfo info = read_checkpoint_info(path);
  int64_t total = 0;
  for (const CheckpointEntry& e : info.tensors)
    total += e.bytes;
  std::printf("%s: format %lld, saved by %lld ranks, %zu tensors, %s\n", path.c_str(),
              (long long)info.format_version, (long long)info.world_size, info.tensors.size(),
              bytes_str(double(total)).c_str());
  for (const CheckpointEntry& e : info.tensors) {
    std::string saved = e.saved_mesh.empty() ? "plain" : e.saved_mesh + " " + e.saved_placements;
    std::printf("  %-48s %-16s %-9s %10s  %s\n", e.key.c_str(), shape_str(e.shape).c_str(),
                dtype_name(e.dtype), bytes_str(double(e.bytes)).c_str(), saved.c_str());
  }
  for (const auto& [key, v] : info.scalars)
    std::printf("  %-48s %s\n", key.c_str(), state_value_str(v).c_str());
  return 0;
}

int verify(const std::string& path) {
  const std::vector<std::string> bad = verify_checkpoint(path);
  if (bad.empty()) {
    const CheckpointInfo info = read_checkpoint_info(path);
    std::printf("%s: ok, %zu tensors verified\n", path.c_str(), info.tensors.size());
    return 0;
  }
  for (const std::string& b : bad)
    std::printf("%s: %s\n", path.c_str(), b.c_str());
  std::printf("%s: %zu problems\n", path.c_str(), bad.size());
  return 1;
}

// How two tensors of one shape differ: how many elements hold other values (integers compared
// exactly, as int64 seeds above 2^53 would not be as doubles; NaN equal to NaN and an infinity to
// itself) and the largest |a - b| among those where both are finite.
struct Difference {
  int64_t count = 0, numel = 0, non_finite = 0;
  double max_abs = 0;
  std::string str() const {
    if (count == 0) return "identical";
    char buf[160];
    std::snprintf(buf, sizeof buf, "%lld of %lld elements differ, max |a-b| %.6g%s",
                  (long long)count, (long long)numel, max_abs,
                  non_finite ? " (where both are finite)" : "");
    return buf;
  }
};

Difference compare(const Tensor& x, const Tensor& y) {
  Difference d;
  d.numel = x.numel();
  if (!is_floating(x.dtype()) && !is_floating(y.dtype())) {
    const std::vector<int64_t> u = x.to_vector<int64_t>(), v = y.to_vector<int64_t>();
    for (size_t i = 0; i < u.size(); ++i) {
      if (u[i] == v[i]) continue;
      ++d.count;
      const uint64_t gap =
          u[i] > v[i] ? uint64_t(u[i]) - uint64_t(v[i]) : uint64_t(v[i]) - uint64_t(u[i]);
      d.max_abs = std::max(d.max_abs, double(gap));
    }
    return d;
  }
  const std::vector<double> u = x.to_vector<double>(), v = y.to_vector<double>();
  for (size_t i = 0; i < u.size(); ++i) {
    if (u[i] == v[i] || (std::isnan(u[i]) && std::isnan(v[i]))) continue;
    ++d.count;
    if (std::isfinite(u[i]) && std::isfinite(v[i]))
      d.max_abs = std::max(d.max_abs, std::abs(u[i] - v[i]));
    else
      ++d.non_finite;
  }
  return d;
}

int diff(const std::string& a, const std::string& b) {
  const CheckpointInfo ia = read_checkpoint_info(a), ib = read_checkpoint_info(b);
  std::map<std::string, const CheckpointEntry*> ta, tb;
  for (const auto& e : ia.tensors)
    ta[e.key] = &e;
  for (const auto& e : ib.tensors)
    tb[e.key] = &e;
  bool differs = false;
  for (const auto& [key, e] : ta) {
    auto it = tb.find(key);
    if (it == tb.end()) {
      std::printf("only in A: %s\n", key.c_str());
      differs = true;
      continue;
    }
    if (e->shape != it->second->shape) {
      std::printf("%-48s shape %s vs %s\n", key.c_str(), shape_str(e->shape).c_str(),
                  shape_str(it->second->shape).c_str());
      differs = true;
      continue;
    }
    const Difference d = compare(read_checkpoint_tensor(a, key), read_checkpoint_tensor(b, key));
    const bool same_dtype = e->dtype == it->second->dtype;
    std::printf("%-48s %s%s\n", key.c_str(), d.str().c_str(),
                same_dtype ? ""
                           : (std::string("  (dtypes ") + dtype_name(e->dtype) + " vs " +
                              dtype_name(it->second->dtype) + ")")
                                 .c_str());
    differs |= d.count != 0 || !same_dtype;
  }
  for (const auto& [key, e] : tb)
    if (!ta.count(key)) {
      std::printf("only in B: %s\n", key.c_str());
      differs = true;
    }
  for (const auto& [key, v] : ia.scalars) {
    auto it = ib.scalars.find(key);
    const std::string sa = state_value_str(v);
    const std::string sb = it == ib.scalars.end() ? "(absent)" : state_value_str(it->second);
    if (sa != sb) {
      std::printf("%-48s %s vs %s\n", key.c_str(), sa.c_str(), sb.c_str());
      differs = true;
    }
  }
  for (const auto& [key, v] : ib.scalars)
    if (!ia.scalars.count(key)) {
      std::printf("%-48s (absent) vs %s\n", key.c_str(), state_value_str(v).c_str());
      differs = true;
    }
  return differs ? 1 : 0;
}

int export_safetensors(const std::string& path, const std::string& out, const std::string& prefix) {
  const CheckpointInfo info = read_checkpoint_info(path);
  std::map<std::string, Tensor> tensors;
  for (const CheckpointEntry& e : info.tensors) {
    if (e.key.compare(0, prefix.size(), prefix) != 0) continue;
    tensors[e.key.substr(prefix.size())] = read_checkpoint_tensor(path, e.key);
  }
  TESSERA_CHECK(!tensors.empty(), "export-safetensors: '", path, "' holds no tensor under '",
                prefix, "' (pass --prefix \"\" to export every tensor)");
  save_safetensors(out, tensors, {{"format", "pt"}, {"source", "tessera checkpoint " + path}});
  std::printf("%s: %zu tensors written to %s\n", path.c_str(), tensors.size(), out.c_str());
  return 0;
}

int run(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "-h" || args[0] == "--help") {
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string& cmd = args[0];
  auto need = [&](size_t n) {
    TESSERA_CHECK(args.size() == n + 1, "tessera-ckpt ", cmd, ": takes ", n, " argument",
                  n == 1 ? "" : "s", ", got ", args.size() - 1, "\n", kUsage);
  };
  if (cmd == "ls") {
    need(1);
    return ls(args[1]);
  }
  if (cmd == "verify") {
    need(1);
    return verify(args[1]);
  }
  if (cmd == "diff") {
    need(2);
    return diff(args[1], args[2]);
  }
  if (cmd == "export-safetensors") {
    std::string prefix = "model/";
    std::vector<std::string> pos;
    for (size_t i = 1; i < args.size(); ++i) {
      if (args[i] == "--prefix") {
        TESSERA_CHECK(i + 1 < args.size(),
                      "tessera-ckpt export-safetensors: --prefix needs a value");
        prefix = args[++i];
      } else {
        pos.push_back(args[i]);
      }
    }
    TESSERA_CHECK(pos.size() == 2,
                  "tessera-ckpt export-safetensors: takes CHECKPOINT and OUT, got ", pos.size(),
                  " arguments\n", kUsage);
    return export_safetensors(pos[0], pos[1], prefix);
  }
  TESSERA_FAIL("tessera-ckpt: unknown command '", cmd, "'\n", kUsage);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(std::vector<std::string>(argv + 1, argv + argc));
  } catch (const std::exception& e) {
    // One process: the "[rank 0] " of tessera's errors says nothing here.
    std::string what = e.what();
    if (what.rfind("[rank 0] ", 0) == 0) what.erase(0, 9);
    if (what.rfind("tessera-ckpt", 0) != 0) what = "tessera-ckpt: " + what;
    std::fprintf(stderr, "%s\n", what.c_str());
    return 2;
  }
}
