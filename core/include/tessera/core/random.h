#pragma once
// Counter-based random numbers (Philox-4x32-10). A draw is addressed by (seed, offset): the
// value of logical element i depends only on (seed, offset + i), never on which process draws it
// or how many elements it draws. A shard draws exactly its window of the logical tensor and gets
// bit for bit what a single process drawing the whole tensor would hold there.
#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera {

class Generator;

namespace detail {
// Told of every draw this thread makes while set: activation checkpointing (autograd/
// checkpoint.h) notes which generators its region advanced, and from where, to put them back
// there for the recomputation.
class GeneratorObserver {
 public:
  virtual void advanced(Generator& gen, uint64_t start) = 0;

 protected:
  ~GeneratorObserver() = default;
};
extern thread_local GeneratorObserver* t_generator_observer;
uint64_t next_generator_stamp();
}  // namespace detail

class Generator {
 public:
  explicit Generator(uint64_t seed = 0) : seed_(seed), stamp_(detail::next_generator_stamp()) {}
  // A copy is a generator of its own, made now (its stamp), in the same state.
  Generator(const Generator& other)
      : seed_(other.seed_), offset_(other.offset_), stamp_(detail::next_generator_stamp()) {}
  Generator& operator=(const Generator& other) {
    seed_ = other.seed_;
    offset_ = other.offset_;
    return *this;
  }
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
    if (detail::t_generator_observer) detail::t_generator_observer->advanced(*this, start);
    return start;
  }
  // Increases with each generator made in this process (the default generator's is 0): a
  // generator made after some point cannot have been advanced before it.
  uint64_t stamp() const { return stamp_; }

 private:
  friend Generator& default_generator();
  uint64_t seed_;
  uint64_t offset_ = 0;
  uint64_t stamp_;
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
