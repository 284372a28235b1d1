#pragma once
// One checkpointed region's saved tensors: packed (described, dropped) while its forward runs,
// recomputed all at once when the backward first needs one, handed out by index and freed as the
// region's nodes finish.
//
// What the recomputation must match, and how it is checked:
//  - the tensors the region read from outside it (its input, parameters, captured activations):
//    their versions at the end of the forward, compared before recomputing (a write since would
//    make the recomputation see other values);
//  - each saved tensor: shape, dtype and device, and, when the forward saved a tensor from
//    outside the region, the same storage (another one means the module's state changed: an
//    adapter switched, a parameter replaced; the frame holds those storages, so a replaced
//    tensor cannot vanish unnoticed);
//  - the recomputed tensors' versions when a node takes them.
// Each recomputed tensor is handed out once and then dropped by the frame: a retained graph's
// next backward recomputes again (as PyTorch does) instead of holding the region's activations
// between backwards.
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera::autograd::detail {

class CheckpointFrame : public std::enable_shared_from_this<CheckpointFrame>,
                        public tessera::detail::GeneratorObserver {
 public:
  using Fn = std::function<Tensor(const Tensor&)>;
  // `fn` is the one copy of the function the forward and the recomputation both run (generators
  // it owns are put back like any other).
  CheckpointFrame(std::shared_ptr<const Fn> fn, Tensor x);

  // The frame whose forward is running on this thread (packing), or being recomputed (keeping).
  static CheckpointFrame* packing();
  static CheckpointFrame* keeping();

  // Forward: the tensors an operation of the region reads.
  void saw_inputs(const std::vector<Tensor>& inputs, const char* node);
  // Forward: a tensor a node (`node`: its mangled type name) would save; returns its index.
  size_t pack(const Tensor& t, const char* node);
  // Recomputation: the next tensor a node saves.
  void keep(const Tensor& t);
  // Backward: tensor `id`, handed out once per recomputation (recomputing the region first when
  // it is not at hand). `node` is the asker's mangled type name, demangled only for an error.
  Tensor unpack(size_t id, const char* node);
  void release(size_t id);

  void used(const Generator& gen, uint64_t offset) override;

  // Runs the region's forward on this thread: fn(x), packing.
  Tensor run_forward();

 private:
  void recompute(const char* node);
  void check_inputs_unchanged(const char* node) const;
  void check_recomputed(const char* node) const;
  struct Packed {
    Shape shape;
    DType dtype;
    Device device;
    std::weak_ptr<StorageImpl> storage;
    Storage held;  // a tensor from outside the region (a parameter, its input): kept
    uint32_t version = 0;
    const char* node = nullptr;
  };
  struct Outside {
    std::weak_ptr<StorageImpl> storage;
    std::string shape;           // "float32 [64, 32]"
    const char* node = nullptr;  // the first to read it (mangled)
    uint32_t version = 0;        // at the end of the forward
  };
  struct Drawn {
    std::weak_ptr<tessera::detail::GeneratorHandle> gen;
    uint64_t seed, offset;  // before the region's first use
  };
  // Sets each still existing generator of `to` to its seed and offset; returns what they held.
  static std::vector<Drawn> set_generators(const std::vector<Drawn>& to);
  std::shared_ptr<const Fn> fn_;
  Tensor x_;
  CheckpointFrame* enclosing_ = nullptr;  // the region whose forward this one runs in, meanwhile
  std::vector<Drawn> generators_;
  // Storages with this serial or a later one were made inside the region (by its operations or
  // anything else it ran); older ones are what it read from outside.
  uint64_t first_serial_;
  std::map<const StorageImpl*, Outside> outside_;
  std::vector<Packed> packed_;
  std::vector<Tensor> kept_;
  std::vector<uint32_t> kept_versions_;
  std::vector<bool> released_;
};

// A node's type, readable ("tessera::autograd::LinearFn").
std::string node_name(const char* mangled);

}  // namespace tessera::autograd::detail
