#include "plan.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "checksum.h"
#include "tessera/core/factory.h"

namespace tessera::ckpt {

const char* kind_name(ValueKind k) {
  switch (k) {
    case ValueKind::Tensor:
      return "tensor";
    case ValueKind::Int:
      return "int64";
    case ValueKind::Double:
      return "double";
    case ValueKind::String:
      return "string";
  }
  return "?";
}

ValueKind kind_of(const StateValue& v) {
  switch (v.index()) {
    case 0:
    case 1:
      return ValueKind::Tensor;
    case 2:
      return ValueKind::Int;
    case 3:
      return ValueKind::Double;
    default:
      return ValueKind::String;
  }
}

std::string dataset_path(const std::string& key) {
  std::string p(1, '/');
  p += key;
  return p;
}

std::string group_of(const std::string& key) {
  const size_t slash = key.rfind('/');
  std::string g(1, '/');
  if (slash != std::string::npos) g.append(key, 0, slash);
  return g;
}

std::string attribute_of(const std::string& key) {
  const size_t slash = key.rfind('/');
  return slash == std::string::npos ? key : key.substr(slash + 1);
}

namespace {

// Keys and string values travel between the ranks as JSON and are stored as HDF5 strings,
// both UTF-8 text.
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80           ? 1
                     : (c >> 5) == 0x6  ? 2
                     : (c >> 4) == 0xE  ? 3
                     : (c >> 3) == 0x1E ? 4
                                        : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (size_t k = 1; k < n; ++k) {
      const auto d = static_cast<unsigned char>(s[i + k]);
      if ((d >> 6) != 0x2) return false;
      cp = (cp << 6) | (d & 0x3F);
    }
    // No overlong forms, surrogates or code points past U+10FFFF.
    const uint32_t least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[n] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return false;
    i += n;
  }
  return true;
}

void check_text(const std::string& text, const std::string& key, const char* what,
                const std::string& context) {
  TESSERA_CHECK(text.find('\0') == std::string::npos, context, ": ", what, " of '", key,
                "' holds a NUL byte (checkpoint strings are text; store bytes as a tensor)");
  TESSERA_CHECK(valid_utf8(text), context, ": ", what, " of '", key,
                "' is not valid UTF-8 (checkpoint strings are UTF-8 text; store bytes as a "
                "tensor)");
}

void check_key(const std::string& key, const std::string& context) {
  TESSERA_CHECK(!key.empty(), context, ": an empty key");
  TESSERA_CHECK(valid_utf8(key), context, ": a key is not valid UTF-8 (", key.size(), " bytes)");
  size_t start = 0;
  while (true) {
    const size_t slash = key.find('/', start);
    const std::string part =
        key.substr(start, slash == std::string::npos ? key.npos : slash - start);
    TESSERA_CHECK(!part.empty() && part != "." && part != "..", context, ": key '", key,
                  "' has an empty, '.' or '..' part (keys are '/'-separated paths)");
    TESSERA_CHECK(part.find('\0') == std::string::npos, context, ": key '", key,
                  "' holds a NUL byte");
    if (slash == std::string::npos) break;
    start = slash + 1;
  }
  TESSERA_CHECK(key.rfind("_tessera", 0) != 0, context, ": key '", key,
                "' starts with _tessera, which the file format reserves");
  TESSERA_CHECK(attribute_of(key).rfind("tessera.", 0) != 0, context, ": key '", key,
                "' names an attribute tessera.*, which the file format reserves");
}

std::string double_bits(double v) {
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof b);
  return std::to_string(b);
}

std::string scalar_repr(const StateValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return std::to_string(*i);
  if (const auto* d = std::get_if<double>(&v)) return double_bits(*d);
  return std::get<std::string>(v);
}

Entry describe_tensor(const std::string& key, const StateValue& v, const std::string& context,
                      bool for_load) {
  Entry e;
  e.key = key;
  e.kind = ValueKind::Tensor;
  if (const auto* d = std::get_if<DTensor>(&v)) {
    TESSERA_CHECK(d->defined(), context, ": '", key, "' is an undefined DTensor");
    const DTensorSpec& s = d->spec();
    if (for_load)
      TESSERA_CHECK(!s.has_partial(), context, ": '", key, "' is ", d->str(),
                    "; a Partial DTensor cannot receive a loaded value (redistribute it first)");
    e.dtype = s.dtype;
    e.global_shape = s.global_shape;
    const LocalLayout l = s.local_layout();
    e.window = {l.global_offset, l.local_shape};
    e.mesh = s.mesh.str();
    e.placements = placements_str(s.placements);
  } else {
    const Tensor& t = std::get<Tensor>(v);
    // A tensor on a device is written from, and read into, a host copy.
    TESSERA_CHECK(t.defined(), context, ": '", key, "' is an undefined tensor");
    e.dtype = t.dtype();
    e.global_shape = t.shape();
    e.window = {Shape(t.shape().size(), 0), t.shape()};
  }
  return e;
}

nlohmann::json to_json(const std::vector<Entry>& entries) {
  nlohmann::json j = nlohmann::json::array();
  for (const Entry& e : entries) {
    nlohmann::json x;
    x["k"] = e.key;
    x["t"] = int(e.kind);
    if (e.kind == ValueKind::Tensor) {
      x["d"] = int(e.dtype);
      x["g"] = e.global_shape;
      x["o"] = e.window.offset;
      x["s"] = e.window.shape;
      x["m"] = e.mesh;
      x["p"] = e.placements;
    } else {
      x["v"] = scalar_repr(e.scalar);
    }
    j.push_back(std::move(x));
  }
  return j;
}

std::vector<std::string> gather_strings(const ProcessGroupPtr& pg, const std::string& mine) {
  const int n = pg->size();
  Tensor len = full({1}, double(mine.size()), DType::Int64);
  Tensor lens = empty({n}, DType::Int64);
  pg->all_gather_into_tensor(lens, len)->wait();
  const std::vector<int64_t> l = lens.to_vector<int64_t>();
  // Bytes travel packed four to an int32 (padded): the descriptions of a large model are
  // megabytes, and there is no byte dtype.
  auto words = [](int64_t bytes) { return (bytes + 3) / 4; };
  Tensor in = zeros({words(int64_t(mine.size()))}, DType::Int32);
  if (!mine.empty()) std::memcpy(in.raw_data(), mine.data(), mine.size());
  std::vector<Tensor> out;
  for (int r = 0; r < n; ++r)
    out.push_back(empty({words(l[size_t(r)])}, DType::Int32));
  pg->all_gather(out, in)->wait();
  std::vector<std::string> result;
  for (int r = 0; r < n; ++r)
    result.emplace_back(static_cast<const char*>(out[size_t(r)].raw_data()), size_t(l[size_t(r)]));
  return result;
}

std::string tensor_desc(const nlohmann::json& x) {
  return shape_str(x["g"].get<Shape>()) + " " + dtype_name(DType(x["d"].get<int>())) + " tensor";
}

std::string entry_desc(const nlohmann::json& x) {
  const auto kind = ValueKind(x["t"].get<int>());
  if (kind == ValueKind::Tensor) return tensor_desc(x);
  return std::string(kind_name(kind)) + " value";
}

// Rank r's entries against rank 0's; "" when they agree.
std::string compare(const nlohmann::json& ref, const nlohmann::json& other, int r) {
  std::map<std::string, const nlohmann::json*> a, b;
  for (const auto& x : ref)
    a[x["k"].get<std::string>()] = &x;
  for (const auto& x : other)
    b[x["k"].get<std::string>()] = &x;
  for (const auto& [k, x] : b)
    if (!a.count(k)) return "rank " + std::to_string(r) + " has key '" + k + "' that rank 0 lacks";
  for (const auto& [k, x] : a) {
    auto it = b.find(k);
    if (it == b.end()) return "rank " + std::to_string(r) + " lacks key '" + k + "' of rank 0";
    const nlohmann::json& y = *it->second;
    const bool same_kind = (*x)["t"] == y["t"];
    const bool tensor = (*x)["t"].get<int>() == int(ValueKind::Tensor);
    const bool same =
        same_kind && (tensor ? ((*x)["d"] == y["d"] && (*x)["g"] == y["g"]) : (*x)["v"] == y["v"]);
    // The file records one mesh and placements per tensor: they must agree too.
    if (same && tensor && ((*x)["m"] != y["m"] || (*x)["p"] != y["p"]))
      return "'" + k + "' is laid out as " + (*x)["p"].get<std::string>() + " on " +
             (*x)["m"].get<std::string>() + " on rank 0 but as " + y["p"].get<std::string>() +
             " on " + y["m"].get<std::string>() + " on rank " + std::to_string(r);
    if (!same) {
      std::string what = "'" + k + "' is a " + entry_desc(*x) + " on rank 0 but a " +
                         entry_desc(y) + " on rank " + std::to_string(r);
      if (same_kind && !tensor)
        what = "'" + k + "' has different values on rank 0 and rank " + std::to_string(r);
      return what;
    }
  }
  return "";
}

bool overlap(const Window& a, const Window& b) {
  for (size_t d = 0; d < a.offset.size(); ++d) {
    if (a.offset[d] + a.shape[d] <= b.offset[d] || b.offset[d] + b.shape[d] <= a.offset[d])
      return false;
  }
  return true;
}

// Whether windows inside `global`, whose sizes add up to its size, tile it. A box's indicator
// is the sum, with signs, of the quadrants {x >= c} of its 2^d corners c; modulo 2 the signs go.
// So when the corners met an odd number of times are exactly the global box's, every element
// lies in an odd number of windows, at least one, and with the sizes adding up to the tensor's,
// in exactly one; otherwise some element lies in none or in several. Only the dims some window
// splits count (in the others every window, and the global box, spans the whole): 2^k corners
// per window for k split dims, at most the mesh's dims for a DTensor. O(n log n) in the windows,
// where comparing every pair is quadratic in the ranks.
bool corners_tile(const std::vector<Holders>& windows, const Shape& global) {
  std::vector<size_t> split;
  for (size_t d = 0; d < global.size(); ++d)
    if (std::any_of(windows.begin(), windows.end(), [&](const Holders& h) {
          return h.window.offset[d] != 0 || h.window.shape[d] != global[d];
        }))
      split.push_back(d);
  const size_t k = split.size(), n_corners = size_t(1) << k;
  std::vector<Shape> corners;
  corners.reserve(windows.size() * n_corners);
  for (const Holders& h : windows)
    for (size_t bits = 0; bits < n_corners; ++bits) {
      Shape c(k);
      for (size_t j = 0; j < k; ++j)
        c[j] = h.window.offset[split[j]] + ((bits >> j & 1) ? h.window.shape[split[j]] : 0);
      corners.push_back(std::move(c));
    }
  std::sort(corners.begin(), corners.end());
  std::vector<Shape> odd;
  for (size_t i = 0; i < corners.size();) {
    size_t j = i;
    while (j < corners.size() && corners[j] == corners[i])
      ++j;
    if ((j - i) % 2 == 1) odd.push_back(corners[i]);
    i = j;
  }
  std::vector<Shape> want;
  for (size_t bits = 0; bits < n_corners; ++bits) {
    Shape c(k, 0);
    for (size_t j = 0; j < k; ++j)
      if (bits >> j & 1) c[j] = global[split[j]];
    want.push_back(std::move(c));
  }
  std::sort(want.begin(), want.end());
  return odd == want;
}

// Two distinct windows that overlap, if any, to name them: a sweep along dim 0 compares each
// window only with those it meets there. Runs only when the windows do not tile.
std::optional<std::pair<size_t, size_t>> overlapping_pair(const std::vector<Holders>& windows) {
  if (windows.empty() || windows.front().window.offset.empty()) return std::nullopt;
  std::vector<size_t> order(windows.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  auto start = [&](size_t i) { return windows[i].window.offset[0]; };
  auto end = [&](size_t i) { return start(i) + windows[i].window.shape[0]; };
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return start(a) < start(b); });
  std::vector<size_t> open;  // the windows reaching past the sweep's position on dim 0
  for (size_t i : order) {
    std::erase_if(open, [&](size_t o) { return end(o) <= start(i); });
    for (size_t o : open)
      if (overlap(windows[o].window, windows[i].window))
        return std::make_pair(std::min(o, i), std::max(o, i));
    open.push_back(i);
  }
  return std::nullopt;
}

}  // namespace

std::vector<Holders> distinct_windows(const std::vector<Window>& windows, const std::string& key,
                                      const Shape& global, const std::string& context) {
  std::vector<Holders> out;
  std::map<std::pair<Shape, Shape>, size_t> index;  // a window's place in `out`
  for (int r = 0; r < int(windows.size()); ++r) {
    const Window& w = windows[size_t(r)];
    TESSERA_CHECK(w.offset.size() == global.size() && w.shape.size() == global.size(), context,
                  ": '", key, "': rank ", r, "'s piece does not match the tensor's rank");
    for (size_t d = 0; d < global.size(); ++d)
      TESSERA_CHECK(w.offset[d] >= 0 && w.shape[d] >= 0 && w.offset[d] + w.shape[d] <= global[d],
                    context, ": '", key, "': rank ", r, "'s piece at ", shape_str(w.offset),
                    " of shape ", shape_str(w.shape), " lies outside ", shape_str(global));
    if (shape_numel(w.shape) == 0) continue;
    const auto [it, made] = index.try_emplace({w.offset, w.shape}, out.size());
    if (made)
      out.push_back({w, {r}});
    else
      out[it->second].ranks.push_back(r);
  }
  int64_t covered = 0;
  for (const Holders& h : out)
    covered += shape_numel(h.window.shape);
  // An empty tensor has no pieces (and its box's corners are not distinct).
  if (covered == shape_numel(global) && (out.empty() || corners_tile(out, global))) return out;
  if (const auto pair = overlapping_pair(out)) {
    const Holders& a = out[pair->first];
    const Holders& b = out[pair->second];
    TESSERA_FAIL(context, ": '", key, "': the pieces of rank ", a.ranks.front(), " (at ",
                 shape_str(a.window.offset), ", ", shape_str(a.window.shape), ") and rank ",
                 b.ranks.front(), " (at ", shape_str(b.window.offset), ", ",
                 shape_str(b.window.shape), ") overlap without being the same block");
  }
  TESSERA_FAIL(context, ": '", key, "': the ranks' pieces cover ", covered, " of the ",
               shape_numel(global), " elements of ", shape_str(global),
               " (a DTensor built from local pieces with a wrong global shape?)");
}

std::vector<Entry> describe(const StateDict& state, const std::string& context, bool for_load) {
  std::set<std::string> tensor_keys;
  for (const auto& [key, v] : state) {
    check_key(key, context);
    if (kind_of(v) == ValueKind::Tensor) tensor_keys.insert(key);
  }
  std::vector<Entry> out;
  for (const auto& [key, v] : state) {
    for (size_t slash = key.find('/'); slash != std::string::npos; slash = key.find('/', slash + 1))
      TESSERA_CHECK(!tensor_keys.count(key.substr(0, slash)), context, ": key '", key,
                    "' lies under the tensor key '", key.substr(0, slash),
                    "' (a tensor cannot also be a group)");
    if (kind_of(v) == ValueKind::Tensor) {
      out.push_back(describe_tensor(key, v, context, for_load));
    } else {
      if (const auto* text = std::get_if<std::string>(&v))
        check_text(*text, key, "the string value", context);
      Entry e;
      e.key = key;
      e.kind = kind_of(v);
      e.scalar = v;
      out.push_back(std::move(e));
    }
  }
  return out;
}

void agree_on_entries(std::vector<Entry>& entries, const ProcessGroupPtr& pg,
                      const std::string& context) {
  const std::vector<std::string> texts = gather_strings(pg, to_json(entries).dump());
  std::vector<nlohmann::json> all;
  for (const std::string& t : texts)
    all.push_back(nlohmann::json::parse(t));
  for (int r = 1; r < int(all.size()); ++r) {
    const std::string diff = compare(all[0], all[size_t(r)], r);
    TESSERA_CHECK(diff.empty(), context, ": every rank must pass the same state dict: ", diff);
  }
  std::vector<int64_t> load(all.size(), 0);  // bytes given to each rank so far
  const int me = pg->rank();
  for (size_t i = 0; i < entries.size(); ++i) {
    Entry& e = entries[i];
    if (e.kind != ValueKind::Tensor) continue;
    e.owner = false;
    e.window_owner = -1;
    std::vector<Window> windows;  // each rank's
    for (const nlohmann::json& rank_entries : all)
      windows.push_back({rank_entries[i]["o"].get<Shape>(), rank_entries[i]["s"].get<Shape>()});
    for (const Holders& h : distinct_windows(windows, e.key, e.global_shape, context)) {
      int best = h.ranks.front();
      for (int r : h.ranks)
        if (load[size_t(r)] < load[size_t(best)]) best = r;
      load[size_t(best)] += shape_numel(h.window.shape) * int64_t(element_size(e.dtype));
      if (best == me) e.owner = true;
      if (std::find(h.ranks.begin(), h.ranks.end(), me) != h.ranks.end()) e.window_owner = best;
    }
  }
}

GatheredSums gather_sums(const ProcessGroupPtr& pg, const std::vector<Entry>& entries,
                         const std::vector<int64_t>& first, const std::vector<int64_t>& count,
                         std::span<const uint64_t> sums) {
  // Each rank's words, then the owner of its window of each entry: who counts in the totals and
  // whom each replica is compared with.
  const size_t words = sums.size(), stride = words + entries.size();
  std::vector<int64_t> mine(stride);
  // A rank that read no tensor has no words: an empty span may hold a null pointer.
  if (!sums.empty()) std::memcpy(mine.data(), sums.data(), sums.size_bytes());
  for (size_t i = 0; i < entries.size(); ++i)
    mine[words + i] = entries[i].window_owner;
  Tensor all = empty({int64_t(pg->size() * stride)}, DType::Int64);
  pg->all_gather_into_tensor(all, from_vector<int64_t>(mine, {int64_t(stride)}))->wait();
  const auto* a = static_cast<const uint64_t*>(all.raw_data());
  GatheredSums out;
  out.total.assign(words, 0);
  for (size_t i = 0; i < entries.size(); ++i) {
    if (count[i] == 0) continue;
    for (int q = 0; q < pg->size(); ++q) {
      const uint64_t* row = a + size_t(q) * stride;
      const auto owner = int(int64_t(row[words + i]));
      const uint64_t* got = row + first[i];
      if (owner == q) {
        for (int64_t w = 0; w < count[i]; ++w)
          out.total[size_t(first[i] + w)] += got[w];
        continue;
      }
      if (owner < 0) continue;
      // The same window: the same partial sums, tile by tile, unless the bytes differ.
      const uint64_t* want = a + size_t(owner) * stride + first[i];
      ReplicaMismatch m{i, q, owner, {}};
      for (int64_t w = 0; w < count[i]; w += kWordsPerTile)
        if (!std::equal(got + w, got + w + kWordsPerTile, want + w))
          m.tiles.push_back(w / kWordsPerTile);
      if (!m.tiles.empty()) out.mismatches.push_back(std::move(m));
    }
  }
  return out;
}

}  // namespace tessera::ckpt
