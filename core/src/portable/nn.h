#pragma once
// Private to core: the nn kernels on devices (see kernels.h for executors), one file per concept:
// softmax and log-softmax (softmax.h), RMSNorm and LayerNorm (norm.h), cross-entropy
// (cross_entropy.h), rotary embedding (rope.h), dropout (dropout.h), and the row gather/scatter
// under embedding (index_ops.h). The checks are the CPU's (nn_checks.h), and so is each formula
// and its precision.
#include "../kernel_table.h"
#include "cross_entropy.h"
#include "dropout.h"
#include "index_ops.h"
#include "norm.h"
#include "rope.h"
#include "softmax.h"

namespace tessera::kernels::portable {

template <class Exec>
struct Nn {
  static void fill_table(registry::KernelTable& table) {
    Softmax<Exec>::fill_table(table);
    Norm<Exec>::fill_table(table);
    CrossEntropy<Exec>::fill_table(table);
    Rope<Exec>::fill_table(table);
    Dropout<Exec>::fill_table(table);
    IndexOps<Exec>::fill_table(table);
  }
};

}  // namespace tessera::kernels::portable
