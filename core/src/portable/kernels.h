#pragma once
// Private to core: device kernels written once for any device that runs a loop body per element
// and a BLAS gemm. An executor supplies both:
//
//   struct Exec {
//     // f(i) for every i in [0, n), in any order and in parallel (functors write disjoint
//     // elements).
//     template <class F>
//     static void for_each(const char* op, Device device, int64_t n, const F& f);
//     // f(row, team) for every row in [0, rows), each row shared by a team of lanes
//     // (launch.h: launch_rows).
//     template <class F>
//     static void for_each_row(const char* op, Device device, int64_t rows, const F& f);
//     // One column-major strided-batched gemm (linalg.h).
//     static void gemm(const char* op, Device device, const GemmCall& call);
//   };
//
// cuda/kernels.cu instantiates the kernels with a CUDA launch (one thread per element, a block
// per row) and cuBLAS; emulated_kernels.cpp with a host loop (a row's lanes as host threads) and
// a reference gemm over a stand-in device's memory, which is how a machine without a GPU tests
// everything here but the launch, the block's own combining and cuBLAS.
#include "../kernel_table.h"
#include "attention.h"
#include "composite.h"
#include "elementwise.h"
#include "linalg.h"
#include "nn.h"
#include "reduce.h"
#include "vocab.h"

namespace tessera::kernels::portable {

// Puts every device kernel into `table`'s slots; the others stay as they were.
template <class Exec>
void fill_device_table(registry::KernelTable& table) {
  Elementwise<Exec>::fill_table(table);
  Linalg<Exec>::fill_table(table);
  Reduce<Exec>::fill_table(table);
  Nn<Exec>::fill_table(table);
  Attention<Exec>::fill_table(table);
  Vocab<Exec>::fill_table(table);
  table.cat = &cat;
  table.stack = &stack;
  table.embedding = &embedding;
  table.embedding_backward = &embedding_backward;
  table.linear = &linear;
  table.sum_to_shape = &sum_to_shape;
}

}  // namespace tessera::kernels::portable
