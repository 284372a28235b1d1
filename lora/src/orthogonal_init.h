#pragma once
// PEFT's orthogonal init of LoRA's A and B (init_lora_weights "orthogonal").
#include <utility>

#include "tessera/core/random.h"
#include "tessera/core/tensor.h"

namespace tessera::lora_detail {

// Q from the QR of an [r, r] normal draw, A = (G Q[0::2])^T / 10 with G [in, r/2] and
// B = H^T Q[1::2] / 10 with H [r/2, out], both normal: B A = 0 with neither zero. The global
// [r, in] and [out, r], from `gen` alone.
std::pair<Tensor, Tensor> orthogonal_init(int64_t r, int64_t in, int64_t out, Generator& gen);

}  // namespace tessera::lora_detail
