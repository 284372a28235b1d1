// read_adapter and write_adapter: an adapter's values as global tensors under PEFT's keys.
#include <algorithm>
#include <set>

#include "saved_module.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"
#include "tessera/core/factory.h"
#include "tessera/core/kernels/views.h"
#include "tessera/lora/lora_model.h"

namespace tessera {

namespace {

// One parameter write_adapter fills from a global tensor.
struct Target {
  std::string key;
  Parameter* param;
  Shape shape;         // global, unpadded
  int64_t padded_dim;  // -1: not padded (DoRA's magnitude)
  int64_t r;           // what is used of the padded dim: the module's r, or the token count
};

// Refuses `tensors` unless they hold exactly `want`'s keys in their global shapes, naming every
// key missing, unexpected or mis-shaped (a local shard's shape named as such).
void check_values(const std::string& name, const std::vector<Target>& want,
                  const std::map<std::string, Tensor>& tensors) {
  std::vector<std::string> missing, unexpected, mismatched;
  std::set<std::string> known;
  for (const Target& t : want) {
    known.insert(t.key);
    auto it = tensors.find(t.key);
    if (it == tensors.end()) {
      missing.push_back(t.key);
      continue;
    }
    const Tensor& v = it->second;
    if (v.defined() && v.shape() == t.shape) continue;
    std::string why = t.key + " (expected the global shape " + shape_str(t.shape) + ", got " +
                      (v.defined() ? shape_str(v.shape()) : std::string("undefined"));
    // This rank's piece of the unpadded matrix, had a local shard been passed.
    Shape local = t.param->stored().shape();
    if (t.padded_dim >= 0) local[size_t(t.padded_dim)] = std::min(local[size_t(t.padded_dim)], t.r);
    if (v.defined() && t.param->is_dtensor() && v.shape() == local)
      why += ", the shape of this rank's shard: a local piece cannot stand for the global tensor";
    mismatched.push_back(why + ")");
  }
  for (const auto& [k, v] : tensors)
    if (!known.count(k)) unexpected.push_back(k);
  TESSERA_CHECK(missing.empty() && unexpected.empty() && mismatched.empty(), "LoRA write_adapter '",
                name, "': ", missing.empty() ? "" : "missing keys: " + join(missing) + "; ",
                unexpected.empty() ? "" : "unexpected keys: " + join(unexpected) + "; ",
                mismatched.empty() ? "" : "mis-shaped keys: " + join(mismatched));
}

}  // namespace

std::map<std::string, Tensor> LoraModel::read_adapter(const std::string& name) {
  const Adapter& a = find(name, "read_adapter");
  NoGradGuard no_grad;
  std::map<std::string, Tensor> out;
  for (size_t i : a.layers) {
    auto& [path, l] = layers_[i];
    const int64_t r = a.config.rank_for(path);
    out[path + "." + l->adapter_key(true)] =
        kernels::narrow(l->lora_A(a.slot).full(), 0, 0, r).contiguous();
    out[path + "." + l->adapter_key(false)] =
        kernels::narrow(l->lora_B(a.slot).full(), 1, 0, r).contiguous();
    // PEFT's key: its ".weight" dropped, as PEFT's files have it.
    if (a.config.use_dora)
      out[path + ".lora_magnitude_vector"] = l->lora_magnitude_vector(a.slot).full();
  }
  for (const auto& [key, p] : saved_parameters(a))
    out[key] = p->full();
  size_t t = 0;
  for (const auto& [key, p] : token_parameters(a))
    out[key] = kernels::narrow(p->full(), 0, 0, int64_t(a.tokens[t++].second.size())).contiguous();
  return out;
}

void LoraModel::write_adapter(const std::string& name,
                              const std::map<std::string, Tensor>& tensors) {
  const Adapter& a = find(name, "write_adapter");
  // unmerge_adapter subtracts scale B A from the values the adapter then holds: new values would
  // leave the difference in the base weight.
  TESSERA_CHECK(!merged(a), "LoRA write_adapter '", name,
                "': the adapter is merged into the base weights; call unmerge_adapter(\"", name,
                "\") first");
  std::vector<Target> want;
  for (size_t i : a.layers) {
    auto& [path, l] = layers_[i];
    const int64_t r = a.config.rank_for(path);
    want.push_back(
        {path + "." + l->adapter_key(true), &l->lora_A(a.slot), {r, l->lora_in()}, 0, r});
    want.push_back(
        {path + "." + l->adapter_key(false), &l->lora_B(a.slot), {l->lora_out(), r}, 1, r});
    if (a.config.use_dora)
      want.push_back({path + ".lora_magnitude_vector",
                      &l->lora_magnitude_vector(a.slot),
                      {l->lora_out()},
                      -1,
                      r});
  }
  for (const auto& [key, p] : saved_parameters(a))
    want.push_back({key, p, p->global_shape(), -1, 0});
  size_t t = 0;
  for (const auto& [key, p] : token_parameters(a)) {
    const int64_t n = int64_t(a.tokens[t++].second.size());
    want.push_back({key, p, {n, p->global_shape()[1]}, 0, n});
  }
  // Every key checked before anything is written, and on every rank alike: a map that is wrong
  // on some ranks only (read from a node-local file) would leave those ranks' windows unwritten
  // while the others go on into their next collectives with theirs.
  auto check = [&] { check_values(name, want, tensors); };
  if (world_size() > 1)
    run_agreed(world_group(), "LoRA write_adapter '" + name + "'", check);
  else
    check();
  NoGradGuard no_grad;
  for (const Target& t : want) {
    if (t.padded_dim < 0) {
      t.param->copy_from_full(tensors.at(t.key).to(t.param->dtype()).contiguous());
      continue;
    }
    Tensor full = zeros(t.param->global_shape(), t.param->dtype());
    kernels::narrow(full, t.padded_dim, 0, t.r).copy_(tensors.at(t.key).to(t.param->dtype()));
    t.param->copy_from_full(full);
  }
}

}  // namespace tessera
