#include "slots.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "context.h"
#include "plan.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"

namespace tessera::ckpt {

namespace {

bool is_tensor(const StateValue& v) {
  return std::holds_alternative<Tensor>(v) || std::holds_alternative<DTensor>(v);
}

Shape shape_of(const StateValue& v) {
  if (const auto* d = std::get_if<DTensor>(&v)) return d->shape();
  return std::get<Tensor>(v).shape();
}

std::string tensor_problem(const Slot& s, const StateValue& v, bool broadcast) {
  if (!is_tensor(v))
    return "expected a tensor of " + shape_str(s.global_shape) + ", got " + state_value_str(v);
  if (const auto* d = std::get_if<DTensor>(&v)) {
    if (!d->defined()) return "an undefined DTensor";
    if (broadcast) return "broadcast_from_rank0 takes full tensors, got " + d->str();
  } else if (!std::get<Tensor>(v).defined()) {
    return "an undefined tensor";
  }
  const Shape got = shape_of(v);
  if (got == s.global_shape) return "";
  std::string p =
      "expected the global shape " + shape_str(s.global_shape) + ", got " + shape_str(got);
  if (s.sharded() && std::holds_alternative<Tensor>(v) && got == s.local.shape())
    p += ", the shape of this rank's shard: a local piece cannot stand for the global tensor";
  return p;
}

bool fits(const IncompatibleKeys& k, const std::string& key);

// The slots' units load whole or not at all (leave_out_broken_units).
void keep_units_whole(const std::vector<Slot>& slots, const std::vector<ScalarSlot>& scalars,
                      const StateDict& state, IncompatibleKeys& k) {
  std::vector<std::pair<std::string, std::string>> keys;
  for (const Slot& s : slots)
    keys.emplace_back(s.key, s.unit);
  for (const ScalarSlot& s : scalars)
    keys.emplace_back(s.key, s.unit);
  leave_out_broken_units(
      keys, [&](const std::string& key) { return state.count(key) > 0; }, k);
}

IncompatibleKeys check_keys(const std::vector<Slot>& slots, const std::vector<ScalarSlot>& scalars,
                            const StateDict& state, bool broadcast) {
  IncompatibleKeys k;
  std::set<std::string> known;
  for (const Slot& s : slots) {
    known.insert(s.key);
    auto it = state.find(s.key);
    if (it == state.end()) {
      k.missing_keys.push_back(s.key);
      continue;
    }
    const std::string p = tensor_problem(s, it->second, broadcast);
    if (!p.empty()) k.mismatched_keys.push_back(s.key + " (" + p + ")");
  }
  for (const ScalarSlot& s : scalars) {
    known.insert(s.key);
    auto it = state.find(s.key);
    if (it == state.end()) {
      if (!s.optional) k.missing_keys.push_back(s.key);
      continue;
    }
    const bool ok = s.kind == ScalarKind::Int64 ? std::holds_alternative<int64_t>(it->second)
                    : s.kind == ScalarKind::Double
                        ? std::holds_alternative<double>(it->second)
                        : std::holds_alternative<std::string>(it->second);
    const char* expected = s.kind == ScalarKind::Int64    ? "an int64"
                           : s.kind == ScalarKind::Double ? "a double"
                                                          : "a string";
    if (!ok) {
      k.mismatched_keys.push_back(s.key + " (expected " + expected + ", got " +
                                  state_value_str(it->second) + ")");
    } else if (s.problem) {
      const std::string p = s.problem(it->second);
      if (!p.empty()) k.mismatched_keys.push_back(s.key + " (" + p + ")");
    }
  }
  for (const auto& [key, v] : state)
    if (!known.count(key)) k.unexpected_keys.push_back(key);
  keep_units_whole(slots, scalars, state, k);
  std::sort(k.missing_keys.begin(), k.missing_keys.end());
  std::sort(k.mismatched_keys.begin(), k.mismatched_keys.end());
  return k;
}

bool fits(const IncompatibleKeys& k, const std::string& key) {
  if (std::find(k.missing_keys.begin(), k.missing_keys.end(), key) != k.missing_keys.end())
    return false;
  for (const std::string& m : k.mismatched_keys)
    if (m.compare(0, key.size() + 2, key + " (") == 0) return false;
  return true;
}

void copy_local(const Tensor& dst, const Tensor& src) {
  // A value that is the slot itself (a sharded state dict loaded in place) needs no copy.
  if (src.storage().is_same(dst.storage()) && src.storage_offset() == dst.storage_offset() &&
      src.shape() == dst.shape() && src.strides() == dst.strides() && src.dtype() == dst.dtype())
    return;
  Tensor(dst).copy_(src);
}

void copy_full(const Slot& s, const Tensor& full) {
  if (s.sharded())
    DTensor(s.spec, s.local).copy_from_full(full);
  else
    copy_local(s.local, full);
}

void copy_into(const Slot& s, const StateValue& v) {
  if (const auto* d = std::get_if<DTensor>(&v)) {
    if (s.sharded() && d->mesh() == s.spec->mesh)
      copy_local(s.local, d->redistribute(s.spec->placements).to_local());
    else
      copy_full(s, d->full_tensor());
  } else {
    copy_full(s, std::get<Tensor>(v));
  }
}

[[noreturn]] void fail_keys(const std::string& what, const std::string& problem) {
  TESSERA_FAIL(what, ": ", problem);
}

// The keys a rank passed, and the keys it will load: one per line.
std::pair<std::string, std::string> key_lists(const StateDict& state,
                                              const std::vector<Slot>& slots,
                                              const std::vector<ScalarSlot>& scalars,
                                              const IncompatibleKeys& k) {
  std::string passed, loaded;
  for (const auto& [key, v] : state)
    passed += key + "\n";
  for (const Slot& s : slots)
    if (fits(k, s.key)) loaded += s.key + "\n";
  for (const ScalarSlot& s : scalars)
    if (fits(k, s.key) && state.count(s.key)) loaded += s.key + "\n";
  return {passed, loaded};
}

// The keys in some of the ranks' lists but not all, each with the ranks that lack it.
std::vector<std::string> keys_not_on_every_rank(const std::vector<std::string>& lists) {
  std::map<std::string, std::vector<bool>> on;
  for (size_t r = 0; r < lists.size(); ++r)
    for (size_t pos = 0, end; pos < lists[r].size(); pos = end + 1) {
      end = lists[r].find('\n', pos);
      auto& ranks = on[lists[r].substr(pos, end - pos)];
      ranks.resize(lists.size());
      ranks[r] = true;
    }
  std::vector<std::string> out;
  for (const auto& [key, ranks] : on) {
    std::string lacking;
    for (size_t r = 0; r < ranks.size(); ++r)
      if (!ranks[r]) lacking += (lacking.empty() ? "" : ", ") + std::to_string(r);
    if (!lacking.empty()) out.push_back(key + " (not on rank " + lacking + ")");
  }
  return out;
}

// After an agreed check: every rank must have passed the same keys and be about to load the
// same ones (with strict = false, a key missing or mis-shaped on one rank only would otherwise
// be loaded by the others). Digests are compared first; the lists travel only when they differ,
// and then every rank throws the same error naming the keys.
void agree_on_keys(const ProcessGroupPtr& pg, const std::string& what, const StateDict& state,
                   const std::vector<Slot>& slots, const std::vector<ScalarSlot>& scalars,
                   const IncompatibleKeys& k) {
  const auto [passed, loaded] = key_lists(state, slots, scalars, k);
  const std::vector<int64_t> digest = {int64_t(std::hash<std::string>()(passed)),
                                       int64_t(std::hash<std::string>()(loaded))};
  Tensor all = empty({2 * int64_t(pg->size())}, DType::Int64);
  pg->all_gather_into_tensor(all, from_vector<int64_t>(digest, {2}))->wait();
  const std::vector<int64_t> a = all.to_vector<int64_t>();
  bool same_passed = true, same_loaded = true;
  for (size_t r = 0; r < size_t(pg->size()); ++r) {
    same_passed &= a[2 * r] == digest[0];
    same_loaded &= a[2 * r + 1] == digest[1];
  }
  if (same_passed && same_loaded) return;
  std::string msg = what + ": the ranks' state dicts differ (every rank must pass the same keys)";
  std::vector<std::string> diff;
  if (!same_passed) {
    diff = keys_not_on_every_rank(all_gather_strings(pg, passed));
    msg += "; keys passed by some ranks only: ";
  } else {
    diff = keys_not_on_every_rank(all_gather_strings(pg, loaded));
    msg += "; keys that some ranks would load and others not: ";
  }
  for (size_t i = 0; i < diff.size() && i < 8; ++i)
    msg += (i ? ", " : "") + diff[i];
  if (diff.size() > 8) msg += ", and " + std::to_string(diff.size() - 8) + " more";
  throw Error(msg);
}

// Rank 0's verdict (or its error) and the scalar values, as text every rank receives.
std::string broadcast_text(const ProcessGroupPtr& pg, const std::string& text) {
  Tensor len = full({1}, double(text.size()), DType::Int64);
  pg->broadcast(len, 0)->wait();
  const int64_t n = len.item<int64_t>();
  Tensor bytes = zeros({(n + 3) / 4}, DType::Int32);
  if (pg->rank() == 0 && n > 0) std::memcpy(bytes.raw_data(), text.data(), size_t(n));
  pg->broadcast(bytes, 0)->wait();
  return std::string(static_cast<const char*>(bytes.raw_data()), size_t(n));
}

Window slot_window(const Slot& s) {
  if (!s.sharded()) return {Shape(s.global_shape.size(), 0), s.global_shape};
  const LocalLayout l = s.spec->local_layout();
  return {l.global_offset, l.local_shape};
}

// Every rank's window of every slot in `order`, gathered on every rank: [rank][slot].
std::vector<std::vector<Window>> gather_windows(const ProcessGroupPtr& pg,
                                                const std::vector<const Slot*>& order) {
  std::vector<int64_t> mine;
  for (const Slot* s : order) {
    const Window w = slot_window(*s);
    mine.insert(mine.end(), w.offset.begin(), w.offset.end());
    mine.insert(mine.end(), w.shape.begin(), w.shape.end());
  }
  const int64_t n = int64_t(mine.size());
  Tensor in = from_vector<int64_t>(mine, {n});
  Tensor all = empty({int64_t(pg->size()) * n}, DType::Int64);
  pg->all_gather_into_tensor(all, in)->wait();
  const std::vector<int64_t> a = all.to_vector<int64_t>();
  std::vector<std::vector<Window>> out(size_t(pg->size()));
  for (int r = 0; r < pg->size(); ++r) {
    size_t pos = size_t(r * n);
    for (const Slot* s : order) {
      const size_t nd = s->global_shape.size();
      Window w{Shape(a.begin() + long(pos), a.begin() + long(pos + nd)),
               Shape(a.begin() + long(pos + nd), a.begin() + long(pos + 2 * nd))};
      pos += 2 * nd;
      out[size_t(r)].push_back(std::move(w));
    }
  }
  return out;
}

Tensor window_of(const Tensor& full, const Window& w) {
  Tensor t = full;
  for (size_t d = 0; d < w.shape.size(); ++d)
    t = kernels::narrow(t, int64_t(d), w.offset[d], w.shape[d]);
  return t;
}

nlohmann::json scalar_json(const StateValue& v) {
  if (const auto* i = std::get_if<int64_t>(&v)) return *i;
  if (const auto* x = std::get_if<double>(&v)) return *x;
  return std::get<std::string>(v);
}

// Rank 0's part of broadcast_from_rank0 for slot `i`: sends every other rank its window of
// `full` and copies its own. Each distinct window is converted once and sent to every rank that
// holds it (a slot every rank holds whole cost one converted copy per rank, all kept until the
// last send); distinct windows do not overlap, so the copies come to at most one tensor.
void send_windows(const ProcessGroupPtr& pg, const Slot& s, const Tensor& full,
                  const std::vector<std::vector<Window>>& windows, size_t i, int tag) {
  std::vector<std::pair<Window, Tensor>> packed;  // kept until the sends complete
  std::vector<WorkPtr> sends;
  for (int r = 1; r < pg->size(); ++r) {
    const Window& w = windows[size_t(r)][i];
    if (shape_numel(w.shape) == 0) continue;
    auto it =
        std::find_if(packed.begin(), packed.end(), [&](const auto& p) { return p.first == w; });
    // The group moves host memory: a device value travels through a host copy.
    if (it == packed.end())
      it = packed.insert(packed.end(),
                         {w, window_of(full, w).to(s.dtype).to(Device::cpu()).contiguous()});
    sends.push_back(pg->send(it->second, r, tag));
  }
  copy_local(s.local, window_of(full, windows[0][i]));
  for (const WorkPtr& w : sends)
    w->wait();
}

// The indices of the optional groups `state` holds a key of.
std::vector<int64_t> present_groups(const std::vector<OptionalSlots>& optional,
                                    const StateDict& state) {
  std::vector<int64_t> out;
  for (size_t g = 0; g < optional.size(); ++g) {
    const std::string& p = optional[g].prefix;
    auto it = state.lower_bound(p);
    if (it != state.end() && it->first.compare(0, p.size(), p) == 0) out.push_back(int64_t(g));
  }
  return out;
}

void add_present(const std::vector<OptionalSlots>& optional, const std::vector<int64_t>& present,
                 std::vector<Slot>& slots, std::vector<ScalarSlot>& scalars) {
  for (int64_t g : present)
    optional.at(size_t(g)).add(slots, scalars);
}

// broadcast_from_rank0: rank 0 checks its dict and says what it holds; then, one tensor at a
// time, it sends every rank just its window (point to point on the checkpoint group).
IncompatibleKeys set_from_rank0(std::vector<Slot>& slots, std::vector<ScalarSlot>& scalars,
                                const std::vector<OptionalSlots>& optional, const StateDict& state,
                                const StateDictOptions& options, const std::string& what) {
  const ProcessGroupPtr& pg = context().group;
  const int me = pg->rank();
  std::string text;
  if (me == 0) {
    nlohmann::json v;
    try {
      const std::vector<int64_t> present = present_groups(optional, state);
      v["groups"] = present;
      add_present(optional, present, slots, scalars);
      const IncompatibleKeys k = check_keys(slots, scalars, state, /*broadcast=*/true);
      v["missing"] = k.missing_keys;
      v["unexpected"] = k.unexpected_keys;
      v["mismatched"] = k.mismatched_keys;
      for (const ScalarSlot& s : scalars)
        if (fits(k, s.key) && state.count(s.key))
          v["scalars"][s.key] = scalar_json(state.at(s.key));
    } catch (...) {
      v["error"] = current_error_text();
    }
    text = v.dump();
  }
  const nlohmann::json v = nlohmann::json::parse(broadcast_text(pg, text));
  if (v.contains("error")) throw Error(what + ": on rank 0: " + v["error"].get<std::string>());
  if (me != 0) add_present(optional, v["groups"].get<std::vector<int64_t>>(), slots, scalars);
  IncompatibleKeys k;
  k.missing_keys = v["missing"].get<std::vector<std::string>>();
  k.unexpected_keys = v["unexpected"].get<std::vector<std::string>>();
  k.mismatched_keys = v["mismatched"].get<std::vector<std::string>>();
  if (options.strict && !k.empty()) throw Error(what + ": rank 0's state dict: " + k.str());

  std::vector<const Slot*> order;
  for (const Slot& s : slots)
    if (fits(k, s.key)) order.push_back(&s);
  const auto windows = gather_windows(pg, order);
  constexpr int kTag = 0x5d1;
  for (size_t i = 0; i < order.size(); ++i) {
    const Slot& s = *order[i];
    if (me == 0) {
      send_windows(pg, s, std::get<Tensor>(state.at(s.key)), windows, i, kTag);
    } else if (s.local.numel() > 0) {
      Tensor buf = empty(s.local.shape(), s.dtype);
      pg->recv(buf, 0, kTag)->wait();
      copy_local(s.local, buf);
    }
  }
  if (v.contains("scalars"))
    for (const ScalarSlot& s : scalars) {
      if (!v["scalars"].contains(s.key)) continue;
      const nlohmann::json& x = v["scalars"][s.key];
      if (s.kind == ScalarKind::Int64)
        s.apply(StateValue(x.get<int64_t>()));
      else if (s.kind == ScalarKind::Double)
        s.apply(StateValue(x.get<double>()));
      else
        s.apply(StateValue(x.get<std::string>()));
    }
  return k;
}

}  // namespace

std::set<std::string> leave_out_broken_units(
    const std::vector<std::pair<std::string, std::string>>& keys,
    const std::function<bool(const std::string&)>& present, IncompatibleKeys& k) {
  std::map<std::string, std::vector<std::string>> members;  // unit -> its keys present
  std::set<std::string> broken;
  for (const auto& [key, unit] : keys) {
    if (unit.empty()) continue;
    if (!fits(k, key)) broken.insert(unit);
    if (present(key)) members[unit].push_back(key);
  }
  std::set<std::string> left_out;
  for (const std::string& unit : broken)
    for (const std::string& key : members[unit])
      if (fits(k, key)) {
        k.mismatched_keys.push_back(key + " (not loaded: another key of " + unit +
                                    " is missing or mismatched, and they load together)");
        left_out.insert(key);
      }
  return left_out;
}

Slot parameter_slot(const std::string& key, const Parameter& p) {
  Slot s;
  s.key = key;
  s.local = p.stored().detach();
  s.global_shape = p.global_shape();
  s.dtype = p.dtype();
  if (p.is_dtensor()) s.spec = p.stored_dtensor().spec_ptr();
  return s;
}

Slot slot_like(const std::string& key, const Tensor& local, const Parameter& p) {
  Slot s;
  s.key = key;
  s.local = local.detach();
  s.global_shape = p.global_shape();
  s.dtype = local.dtype();
  if (p.is_dtensor()) {
    const DTensorSpec& ps = p.stored_dtensor().spec();
    s.spec =
        std::make_shared<const DTensorSpec>(ps.mesh, ps.placements, ps.global_shape, local.dtype());
  }
  return s;
}

Slot plain_slot(const std::string& key, const Tensor& t) {
  Slot s;
  s.key = key;
  s.local = t.detach();
  s.global_shape = t.shape();
  s.dtype = t.dtype();
  return s;
}

void get_slots(const std::vector<Slot>& slots, const StateDictOptions& options, StateDict& out) {
  NoGradGuard no_grad;
  const bool keep = !(options.full_state_dict && options.cpu_offload) || world_rank() == 0;
  for (const Slot& s : slots) {
    if (!options.full_state_dict) {
      out[s.key] = s.sharded() ? StateValue(DTensor(s.spec, s.local)) : StateValue(s.local);
      continue;
    }
    Tensor f = s.sharded() ? DTensor(s.spec, s.local).full_tensor() : s.local;
    // cpu_offload: rank 0 keeps host copies, so that a model sharded because it does not fit on
    // one device never has its whole state there (each device full tensor goes with `f`).
    if (keep) out[s.key] = options.full_state_dict && options.cpu_offload ? f.to(Device::cpu()) : f;
  }
}

IncompatibleKeys set_slots(std::vector<Slot> slots, std::vector<ScalarSlot> scalars,
                           const StateDict& state, const StateDictOptions& options,
                           const std::string& what, const std::vector<OptionalSlots>& optional) {
  NoGradGuard no_grad;
  if (options.broadcast_from_rank0) {
    TESSERA_CHECK(options.full_state_dict, what, ": broadcast_from_rank0 needs full_state_dict");
    return set_from_rank0(slots, scalars, optional, state, options, what);
  }
  IncompatibleKeys k;
  auto check = [&] {
    // Whether the ranks' dicts hold the same optional groups is checked with their keys.
    add_present(optional, present_groups(optional, state), slots, scalars);
    k = check_keys(slots, scalars, state, /*broadcast=*/false);
    if (options.strict && !k.empty()) throw Error(k.str());
  };
  // The check is agreed whatever the values are: a full dict holds plain tensors, but each rank
  // copies its own window of them, so one rank loading other keys (or throwing alone) would
  // leave a sharded parameter holding pieces of two models, or its peers waiting.
  bool collective = world_size() > 1;
  for (const Slot& s : slots)
    collective |= s.sharded();
  if (collective) {
    run_agreed(context().group, what, check);
    agree_on_keys(context().group, what, state, slots, scalars, k);
  } else {
    try {
      check();
    } catch (const Error& e) {
      fail_keys(what, e.what());
    }
  }
  for (const Slot& s : slots)
    if (fits(k, s.key)) copy_into(s, state.at(s.key));
  for (const ScalarSlot& s : scalars)
    if (fits(k, s.key) && state.count(s.key)) s.apply(state.at(s.key));
  return k;
}

}  // namespace tessera::ckpt
