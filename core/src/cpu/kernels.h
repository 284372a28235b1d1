#pragma once
// The CPU implementation of every kernel in kernel_list.h, with the list's signatures.
#include "../kernel_list.h"

namespace tessera::kernels::cpu {

#define TESSERA_DECLARE_CPU_KERNEL(name, result, params, args) result name params;
TESSERA_KERNELS(TESSERA_DECLARE_CPU_KERNEL)
#undef TESSERA_DECLARE_CPU_KERNEL

}  // namespace tessera::kernels::cpu
