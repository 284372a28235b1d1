#pragma once
// Counter-based random numbers (Philox-4x32-10). A draw is addressed by (seed, offset): the
// value of logical element i depends only on (seed, offset + i), never on which process draws it
// or how many elements it draws. A shard draws exactly its window of the logical tensor and gets
// bit for bit what a single process drawing the whole tensor would hold there.
#include <cstdint>
#include <memory>

#include "tessera/core/tensor.h"

namespace tessera {

class Generator;

namespace detail {
// Where a generator lives: made when something must follow it (a checkpointed region that drew
// from it), moved along with it, gone with it, so a follower never writes to a generator that
// was moved away (a vector of them that grew) or destroyed.
struct GeneratorHandle {
  Generator* at;
};

// Told of every draw this thread makes while set, and of every copy of a generator's state (a
// copy made inside a region draws what its source would): activation checkpointing (autograd/
// checkpoint.h) notes which generators its region used, and from where, to put them back there
// for the recomputation.
class GeneratorObserver {
 public:
  virtual void used(const Generator& gen, uint64_t offset) = 0;

 protected:
  ~GeneratorObserver() = default;
};
extern thread_local GeneratorObserver* t_generator_observer;
}  // namespace detail

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed) {}
  // A copy is a generator of its own in the same state.
  Generator(const Generator& other) : seed_(other.seed_), offset_(other.offset_) { other.copied(); }
  Generator& operator=(const Generator& other) {
    other.copied();
    seed_ = other.seed_;
    offset_ = other.offset_;
    return *this;
  }
  // Moving carries the handle to the new place; assigning keeps this one's.
  Generator(Generator&& other) noexcept
      : seed_(other.seed_), offset_(other.offset_), handle_(std::move(other.handle_)) {
    if (handle_) handle_->at = this;
  }
  Generator& operator=(Generator&& other) noexcept {
    seed_ = other.seed_;
    offset_ = other.offset_;
    return *this;
  }
  ~Generator() = default;

  uint64_t seed() const { return seed_; }
  uint64_t offset() const { return offset_; }
  void set_offset(uint64_t offset) { offset_ = offset; }
  void manual_seed(uint64_t seed) {
    seed_ = seed;
    offset_ = 0;
  }
  // Reserves n logical elements; returns the offset the draw starts at.
  uint64_t advance(uint64_t n) {
    uint64_t start = offset_;
    offset_ += n;
    if (detail::t_generator_observer) detail::t_generator_observer->used(*this, start);
    return start;
  }
  // A handle that follows this generator while it exists (made on first call).
  std::weak_ptr<detail::GeneratorHandle> handle() const {
    if (!handle_) handle_ = std::make_shared<detail::GeneratorHandle>(const_cast<Generator*>(this));
    return handle_;
  }

 private:
  void copied() const {
    if (detail::t_generator_observer) detail::t_generator_observer->used(*this, offset_);
  }
  uint64_t seed_;
  uint64_t offset_ = 0;
  mutable std::shared_ptr<detail::GeneratorHandle> handle_;
};

// The process-wide generator used when none is given.
Generator& default_generator();
void manual_seed(uint64_t seed);

// Where a local tensor sits inside the logical tensor a draw addresses. A whole tensor is the
// window with global_shape == local shape and a zero offset.
struct RandomWindow {
  Shape global_shape;
  Shape global_offset;
};

enum class RandomKind : uint8_t { Uniform, Normal, Bernoulli };

// Fills `out` (any float dtype, any strides) with the window of the logical draw that starts at
// stream offset `base` under `seed`. Uniform: [a, b). Normal: mean a, std b. Bernoulli: 1 with
// probability a, else 0.
void philox_fill(Tensor& out, RandomKind kind, double a, double b, uint64_t seed, uint64_t base,
                 const RandomWindow& window);

// What every fill checks before it draws, so that a refused call leaves the generator where it
// was: a floating dtype; uniform: finite bounds with low <= high; normal: std >= 0 (PyTorch's
// checks). `op` names the call in the error.
void check_random_fill(DType dtype, RandomKind kind, double a, double b, const char* op);

// Whole-tensor draws that consume numel() elements of `gen`.
Tensor rand(const Shape& shape, Generator& gen, DType dtype = DType::Float32);
Tensor randn(const Shape& shape, Generator& gen, DType dtype = DType::Float32);
Tensor& uniform_(Tensor& t, double low, double high, Generator& gen);
Tensor& normal_(Tensor& t, double mean, double std, Generator& gen);

// Fans from a weight's logical shape ([out, in, ...]); for a shard, pass the global shape.
struct Fans {
  int64_t fan_in;
  int64_t fan_out;
};
Fans compute_fans(const Shape& global_shape);

enum class FanMode : uint8_t { FanIn, FanOut };
// PyTorch's kaiming_uniform_ with leaky_relu gain sqrt(2 / (1 + a^2)); the default a = 0 is
// torch.nn.init's (bound sqrt(6 / fan_in)), a = sqrt(5) nn.Linear's initialisation.
double kaiming_uniform_bound(const Shape& global_shape, double a, FanMode mode);
Tensor& kaiming_uniform_(Tensor& t, Generator& gen, double a = 0.0, FanMode mode = FanMode::FanIn);
double xavier_uniform_bound(const Shape& global_shape, double gain);
Tensor& xavier_uniform_(Tensor& t, Generator& gen, double gain = 1.0);

}  // namespace tessera
