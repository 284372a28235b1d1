#pragma once
// One checkpointed region's saved tensors: packed (described, dropped) while its forward runs,
// recomputed all at once when the backward first needs one, handed out by index and freed as the
// region's nodes finish.
#include <functional>
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
  explicit CheckpointFrame(std::function<void()> recompute);

  // The frame whose forward is running on this thread (packing), or being recomputed (keeping).
  static CheckpointFrame* packing();
  static CheckpointFrame* keeping();

  // Forward: a tensor a node would save; returns its index.
  size_t pack(const Tensor& t);
  // Recomputation: the next tensor a node saves.
  void keep(const Tensor& t);
  // Backward: tensor `id` (recomputing the region first if needed). `node` names the asker.
  Tensor unpack(size_t id, const std::string& node);
  void release(size_t id);

  void advanced(Generator& gen, uint64_t start) override;

  // Scopes of the region's forward and of its recomputation on this thread.
  class Forward {
   public:
    explicit Forward(CheckpointFrame& frame);
    ~Forward();

   private:
    tessera::detail::GeneratorObserver* observer_;
  };

 private:
  void recompute(const std::string& node);
  void check_recomputed(const std::string& node) const;
  struct Packed {
    Shape shape;
    DType dtype;
    std::weak_ptr<StorageImpl> storage;
    uint32_t version = 0;
  };
  std::function<void()> recompute_;
  uint64_t stamp_;  // generators made after the region began are its own: made again alike
  std::vector<std::pair<Generator*, uint64_t>> generators_;  // where each stood before the region
  std::vector<Packed> packed_;
  std::vector<Tensor> kept_;
  std::vector<uint32_t> kept_versions_;
  std::vector<bool> released_;
  bool recomputed_ = false;
};

}  // namespace tessera::autograd::detail
