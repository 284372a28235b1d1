#pragma once
// A digest of a tensor's values, for ranks to compare what each holds (a global tensor every rank
// must pass alike, files every rank read for itself) without sending the values. Equal values
// give equal digests; different values differ but for a hash collision (not a cryptographic
// digest: it guards against mistakes, not against an adversary).
#include <cstdint>

#include "tessera/core/tensor.h"

namespace tessera {

// std::hash of the bytes of `t`'s elements in row-major order (a strided view gives the digest of
// its contiguous copy). `t` must be defined and on the host; its shape and dtype are not part of
// the digest, so compare them too where they may differ.
uint64_t values_digest(const Tensor& t);

}  // namespace tessera
