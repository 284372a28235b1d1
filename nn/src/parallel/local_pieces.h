#pragma once
// The global shape of an activation the ranks hold as local pieces (a module's sharded input or
// output under tensor parallelism), for DTensor::from_local.
#include <string>

#include "tessera/dtensor/dtensor.h"

namespace tessera::detail {

// A sharded dim's global size is the sum of the ranks' piece sizes, so uneven pieces (a sequence
// of 15 over 4 ranks) give the same global shape on every rank. The pieces must be how
// torch.chunk cuts that size, the one layout a DTensor describes; every rank sees every rank's
// size, so a split that is not (3, 3, 2, 2 for 10 over 4 ranks) fails on all of them together,
// naming `what` and the sizes, instead of failing on some while the others wait in the next
// collective. So do pieces that differ in any other dim or in their number of dims.
Shape global_shape_of_pieces(const Tensor& x, const DeviceMesh& mesh, const Placements& placements,
                             const std::string& what);

}  // namespace tessera::detail
