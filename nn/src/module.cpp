#include "tessera/nn/module.h"

#include <algorithm>
#include <map>
#include <set>

#include "parallel/local_pieces.h"
#include "tessera/autograd/checkpoint.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/ops.h"
#include "tessera/core/factory.h"

namespace tessera {

Tensor Module::operator()(const Tensor& x_in) {
  // As in PyTorch, the pre-hooks there are when the call starts and the hooks there are when the
  // forward returns, each called through a copy: a hook may register more on this module (which
  // reallocates the lists); they run from the next pass over their list.
  const size_t n_pre = pre_hooks_.size();
  Tensor x = x_in;
  for (size_t i = 0; i < n_pre; ++i) {
    const ForwardPreHook h = pre_hooks_[i];
    Tensor r = h(*this, x);
    if (r.defined()) x = r;
  }
  Tensor y;
  if (activation_checkpointing_) {
    // The recomputation may come after the caller dropped the module: it holds it.
    ModulePtr self = shared_from_this();
    y = checkpoint([self](const Tensor& in) { return self->run_forward(in); }, x);
  } else {
    y = run_forward(x);
  }
  const size_t n_post = hooks_.size();
  for (size_t i = 0; i < n_post; ++i) {
    const ForwardHook h = hooks_[i];
    Tensor r = h(*this, x, y);
    if (r.defined()) y = r;
  }
  return y;
}

namespace {

// Swaps a stand-in set's parameters with the module's own for the scope of one forward: the
// forward reads the stand-ins through the module's members, and the graph it records holds their
// tensors, so their leaves accumulate the gradients. Swapping whole Parameter objects carries
// FSDP's unsharded values with them, and swapping back on every exit leaves each object, which
// optimizers and FSDP know by address, holding its own state.
class StandInScope {
 public:
  explicit StandInScope(std::vector<std::pair<Parameter*, Parameter*>> pairs)
      : pairs_(std::move(pairs)) {
    for (auto& [own, stand_in] : pairs_)
      std::swap(*own, *stand_in);
  }
  ~StandInScope() {
    for (auto& [own, stand_in] : pairs_)
      std::swap(*own, *stand_in);
  }
  StandInScope(const StandInScope&) = delete;
  StandInScope& operator=(const StandInScope&) = delete;

 private:
  std::vector<std::pair<Parameter*, Parameter*>> pairs_;
};

}  // namespace

Tensor Module::run_forward(const Tensor& x) {
  if (!select_stand_ins_) return run_own_forward(x);
  const StandInChoice choice = select_stand_ins_();
  if (!choice.per_row) return run_with_stand_ins(choice.set, x);
  return run_per_row(*choice.per_row, x);
}

Tensor Module::run_with_stand_ins(int64_t set, const Tensor& x) {
  TESSERA_CHECK(set >= -1 && set < int64_t(stand_ins_.size()), type_name_, ": stand-in set ", set,
                " chosen, of ", stand_ins_.size());
  if (set < 0) return run_own_forward(x);
  std::vector<std::pair<Parameter*, Parameter*>> pairs;
  for (const auto& [name, stand_in] : stand_ins_[size_t(set)])
    for (auto& [own_name, own] : params_)
      if (own_name == name) pairs.emplace_back(own, stand_in);
  StandInScope scope(std::move(pairs));
  return run_own_forward(x);
}

// As PEFT's mixed batches: one run per distinct set on the rows that chose it, the outputs put
// back in the input's row order. Each row costs one run, and a row's output never depends on
// another set's values (no 0 * inf from a mask). A batch whose rows all take one set runs once.
Tensor Module::run_per_row(const std::vector<int64_t>& per_row, const Tensor& x) {
  std::vector<int64_t> sets = per_row;
  std::sort(sets.begin(), sets.end());
  sets.erase(std::unique(sets.begin(), sets.end()), sets.end());
  if (sets.size() == 1) return run_with_stand_ins(sets.front(), x);
  const auto rows = int64_t(per_row.size());
  TESSERA_CHECK(x.dim() >= 1 && x.size(0) == rows, type_name_, ": stand-in sets chosen for ", rows,
                " rows, but the input ", x.str(), " has ", x.dim() >= 1 ? x.size(0) : 0);
  std::vector<Tensor> parts;
  std::vector<int64_t> position(size_t(rows), 0);  // row r's place in the concatenated parts
  int64_t next = 0;
  for (int64_t set : sets) {
    std::vector<int64_t> mine;
    for (int64_t r = 0; r < rows; ++r)
      if (per_row[size_t(r)] == set) {
        mine.push_back(r);
        position[size_t(r)] = next++;
      }
    const Tensor index = from_vector<int64_t>(mine).to(x.device());
    Tensor part = run_with_stand_ins(set, index_select(x, 0, index));
    TESSERA_CHECK(part.dim() >= 1 && part.size(0) == int64_t(mine.size()), type_name_,
                  ": the output ", part.str(), " of ", mine.size(),
                  " rows that chose stand-in set ", set, " has not their rows");
    parts.push_back(std::move(part));
  }
  return index_select(cat(parts, 0), 0, from_vector<int64_t>(position).to(x.device()));
}

Tensor Module::run_own_forward(const Tensor& x) {
  if (!dtensor_io_) return forward(x);
  const DTensorIO& io = *dtensor_io_;
  const std::string who = io.owner.empty() ? type_name_ : io.owner;
  DTensor xd = DTensor::from_local(
      x, io.mesh, io.input_layouts,
      detail::global_shape_of_pieces(x, io.mesh, io.input_layouts, who + " input"));
  if (io.check_input) io.check_input(xd);
  if (!io.desired_input_layouts.empty()) xd = xd.redistribute(io.desired_input_layouts);
  DTensor yd = forward_dtensor(xd);
  // The output's rank is known here only; every rank holds the same global shape, so all of
  // them refuse alike, naming whose layouts they are (redistribute's error would not).
  for (const Placement& p : io.output_layouts)
    TESSERA_CHECK(!p.is_shard() || (p.dim() >= -yd.dim() && p.dim() < yd.dim()), who,
                  ": output_layouts ", placements_str(io.output_layouts), " shard dim ", p.dim(),
                  ", which the output of shape ", shape_str(yd.shape()), " does not have");
  if (!io.output_layouts.empty()) yd = yd.redistribute(io.output_layouts);
  return yd.to_local();
}

ModulePtr checkpoint(const ModulePtr& module) {
  TESSERA_CHECK(module != nullptr, "checkpoint: null module");
  module->set_activation_checkpointing(true);
  return module;
}

Tensor Module::forward(const Tensor&) {
  TESSERA_FAIL(type_name_, " has no forward(Tensor)");
}

DTensor Module::forward_dtensor(const DTensor& x) {
  TESSERA_FAIL(type_name_, " does not support DTensor inputs (got ", x.str(),
               "); no parallel style applies to it");
}

void Module::check_new_name(const std::string& name) const {
  TESSERA_CHECK(!name.empty() && name.find('.') == std::string::npos, type_name_,
                ": invalid member name '", name, "'");
  for (const auto& p : params_)
    TESSERA_CHECK(p.first != name, type_name_, ": '", name, "' registered twice");
  for (const auto& b : buffers_)
    TESSERA_CHECK(b.first != name, type_name_, ": '", name, "' registered twice");
  for (const auto& c : children_)
    TESSERA_CHECK(c.first != name, type_name_, ": '", name, "' registered twice");
}

void Module::register_parameter(const std::string& name, Parameter* slot) {
  check_new_name(name);
  params_.emplace_back(name, slot);
}

void Module::register_buffer(const std::string& name, Tensor* slot) {
  check_new_name(name);
  buffers_.emplace_back(name, slot);
}

void Module::add_child(const std::string& name, ModuleSlot slot) {
  check_new_name(name);
  children_.emplace_back(name, std::move(slot));
}

void Module::register_fixed_module(const std::string& name, ModulePtr module, std::string remedy) {
  TESSERA_CHECK(module != nullptr, type_name_, ": fixed child '", name, "' is null");
  ModuleSlot s;
  s.get = [module]() { return module; };
  s.set = [type = type_name_, name, remedy = std::move(remedy)](ModulePtr) {
    TESSERA_FAIL("replace_submodule: '", name, "' is part of ", type, " and cannot be replaced; ",
                 remedy);
  };
  add_child(name, std::move(s));
}

std::vector<std::pair<std::string, ModulePtr>> Module::named_children() {
  std::vector<std::pair<std::string, ModulePtr>> out;
  for (auto& [name, slot] : children_)
    if (ModulePtr m = slot.get()) out.emplace_back(name, m);
  return out;
}

namespace {

// Walks the module tree depth first; with `seen`, a module reached again (registered under a
// second name) is skipped with everything below it, as PyTorch's named_modules does.
void walk_modules(const ModulePtr& m, const std::string& prefix, std::set<const Module*>* seen,
                  std::vector<std::pair<std::string, ModulePtr>>& out) {
  if (seen != nullptr && !seen->insert(m.get()).second) return;
  out.emplace_back(prefix, m);
  for (auto& [name, child] : m->named_children())
    walk_modules(child, prefix.empty() ? name : prefix + "." + name, seen, out);
}

// The members `list` picks (params_ or buffers_) of this module, or of every module below it,
// under their full names. With remove_duplicate a tensor already listed is skipped: two slots
// holding one tensor (weights tied by assignment) are one parameter, however many Parameter
// objects or names refer to it.
template <class Slot, class Modules, class List>
std::vector<std::pair<std::string, Slot*>> named_members(const Modules& modules,
                                                         bool remove_duplicate, List&& list,
                                                         const Tensor& (*tensor_of)(const Slot&)) {
  std::vector<std::pair<std::string, Slot*>> out;
  std::set<const TensorImpl*> seen;
  for (auto& [prefix, m] : modules)
    for (auto& [name, slot] : list(*m)) {
      if (!tensor_of(*slot).defined()) continue;
      if (remove_duplicate && !seen.insert(tensor_of(*slot).impl()).second) continue;
      out.emplace_back(prefix.empty() ? name : prefix + "." + name, slot);
    }
  return out;
}

const Tensor& stored_of(const Parameter& p) {
  return p.stored();
}
const Tensor& buffer_of(const Tensor& t) {
  return t;
}

}  // namespace

std::vector<std::pair<std::string, ModulePtr>> Module::named_modules(bool remove_duplicate) {
  TESSERA_CHECK(!weak_from_this().expired(), type_name_,
                ": modules must be created with std::make_shared (names, parameters and state "
                "dicts walk the module tree through shared pointers)");
  std::vector<std::pair<std::string, ModulePtr>> out;
  std::set<const Module*> seen;
  walk_modules(shared_from_this(), "", remove_duplicate ? &seen : nullptr, out);
  return out;
}

std::vector<std::pair<std::string, Parameter*>> Module::named_parameters(bool recurse,
                                                                         bool remove_duplicate) {
  auto params = [](Module & m) -> auto& {
    return m.params_;
  };
  if (!recurse)
    return named_members<Parameter>(std::vector<std::pair<std::string, Module*>>{{"", this}},
                                    remove_duplicate, params, &stored_of);
  return named_members<Parameter>(named_modules(remove_duplicate), remove_duplicate, params,
                                  &stored_of);
}

std::vector<Parameter*> Module::parameters(bool recurse) {
  std::vector<Parameter*> out;
  for (auto& [n, p] : named_parameters(recurse))
    out.push_back(p);
  return out;
}

std::vector<std::pair<std::string, Tensor*>> Module::named_buffers(bool recurse,
                                                                   bool remove_duplicate) {
  auto buffers = [](Module & m) -> auto& {
    return m.buffers_;
  };
  if (!recurse)
    return named_members<Tensor>(std::vector<std::pair<std::string, Module*>>{{"", this}},
                                 remove_duplicate, buffers, &buffer_of);
  return named_members<Tensor>(named_modules(remove_duplicate), remove_duplicate, buffers,
                               &buffer_of);
}

ModulePtr Module::get_submodule(const std::string& path) {
  if (path.empty()) return shared_from_this();
  size_t dot = path.find('.');
  std::string head = path.substr(0, dot);
  for (auto& [name, child] : named_children()) {
    if (name != head) continue;
    return dot == std::string::npos ? child : child->get_submodule(path.substr(dot + 1));
  }
  std::string known;
  for (auto& [name, c] : named_children())
    known += (known.empty() ? "" : ", ") + name;
  TESSERA_FAIL(type_name_, " has no child '", head, "' (children: ", known, ")");
}

void Module::replace_submodule(const std::string& path, ModulePtr module) {
  size_t dot = path.rfind('.');
  ModulePtr parent =
      dot == std::string::npos ? shared_from_this() : get_submodule(path.substr(0, dot));
  std::string leaf = dot == std::string::npos ? path : path.substr(dot + 1);
  for (auto& [name, slot] : parent->children_) {
    if (name != leaf) continue;
    slot.set(std::move(module));
    return;
  }
  TESSERA_FAIL("replace_submodule: ", parent->type_name_, " has no child '", leaf, "'");
}

void Module::add_module(const std::string& name, ModulePtr module) {
  TESSERA_CHECK(module != nullptr, type_name_, ".add_module('", name, "'): null module");
  auto held = std::make_shared<ModulePtr>(std::move(module));
  ModuleSlot s;
  s.get = [held]() { return *held; };
  s.set = [held, name](ModulePtr m) {
    TESSERA_CHECK(m != nullptr, "replace_submodule: null module for '", name, "'");
    *held = std::move(m);
  };
  add_child(name, std::move(s));
  added_children_.push_back(name);
}

void Module::delete_module(const std::string& name) {
  auto added = std::find(added_children_.begin(), added_children_.end(), name);
  const bool child = std::any_of(children_.begin(), children_.end(),
                                 [&](const auto& c) { return c.first == name; });
  TESSERA_CHECK(child, type_name_, ".delete_module: no child '", name, "'");
  TESSERA_CHECK(added != added_children_.end(), type_name_, ".delete_module: '", name,
                "' is one of its own members, which its forward uses; only children add_module "
                "added can be removed");
  added_children_.erase(added);
  children_.erase(std::find_if(children_.begin(), children_.end(),
                               [&](const auto& c) { return c.first == name; }));
}

void Module::set_parameter_stand_ins(std::vector<StandInSet> sets,
                                     std::function<StandInChoice()> select) {
  TESSERA_CHECK(select != nullptr, type_name_, ": stand-in parameters need a selector");
  for (size_t k = 0; k < sets.size(); ++k)
    for (const auto& [name, stand_in] : sets[k]) {
      auto own = std::find_if(params_.begin(), params_.end(),
                              [&](const auto& p) { return p.first == name; });
      TESSERA_CHECK(own != params_.end() && own->second->defined(), type_name_, ": stand-in set ",
                    k, " names '", name, "', which is none of its parameters");
      TESSERA_CHECK(stand_in != nullptr && stand_in->defined() &&
                        stand_in->global_shape() == own->second->global_shape() &&
                        stand_in->dtype() == own->second->dtype(),
                    type_name_, ": stand-in set ", k, " for '", name, "' is ",
                    stand_in && stand_in->defined() ? stand_in->str() : std::string("undefined"),
                    ", where the parameter is ", own->second->str());
    }
  stand_ins_ = std::move(sets);
  select_stand_ins_ = std::move(select);
}

void Module::clear_parameter_stand_ins() {
  stand_ins_.clear();
  select_stand_ins_ = nullptr;
}

void Module::train(bool on) {
  for (auto& [n, m] : named_modules())
    m->training_ = on;
}

void Module::register_forward_pre_hook(ForwardPreHook hook) {
  pre_hooks_.push_back(std::move(hook));
}
void Module::register_forward_hook(ForwardHook hook) {
  hooks_.push_back(std::move(hook));
}

void Module::copy_hooks_from(const Module& other) {
  pre_hooks_.insert(pre_hooks_.end(), other.pre_hooks_.begin(), other.pre_hooks_.end());
  hooks_.insert(hooks_.end(), other.hooks_.begin(), other.hooks_.end());
}

Module& Module::to(Device device) {
  auto params = named_parameters(true, /*remove_duplicate=*/false);
  // Refused before anything moves: a distributed parameter found midway left the members before
  // it on `device` and the rest where they were.
  for (auto& [name, p] : params)
    TESSERA_CHECK(!p->is_dtensor() || p->stored().device() == device, type_name_, ".to(",
                  device.str(), "): ", name, " is ", p->str(),
                  ": a distributed parameter lives on its mesh's device type; move the module "
                  "before parallelize_module or fully_shard (nothing was moved)");
  // Every slot, not the deduplicated lists: a tensor held by several Parameters or buffers (tied
  // weights) is moved once and the moved tensor given to each of them, which keeps them tied.
  std::map<const TensorImpl*, Parameter*> moved_params;
  for (auto& [name, p] : params) {
    auto [it, first] = moved_params.emplace(p->stored().impl(), p);
    if (first)
      p->to(device);
    else if (!p->stored().is_same(it->second->stored()))
      *p = *it->second;
  }
  std::map<const TensorImpl*, Tensor*> moved_buffers;
  for (auto& [name, b] : named_buffers(true, /*remove_duplicate=*/false)) {
    auto [it, first] = moved_buffers.emplace(b->impl(), b);
    if (first)
      *b = b->to(device);
    else
      *b = *it->second;
  }
  return *this;
}

void Module::zero_grad(bool set_to_none) {
  for (Parameter* p : parameters())
    p->zero_grad(set_to_none);
}

}  // namespace tessera
