#pragma once
// The one header a user includes.
#include "tessera/autograd/autograd.h"
#include "tessera/comm/comm.h"
#include "tessera/core/core.h"
#include "tessera/dtensor/device_mesh.h"
#include "tessera/dtensor/dtensor.h"
#include "tessera/dtensor/nn_ops.h"
#include "tessera/dtensor/ops.h"
#include "tessera/dtensor/random.h"
#include "tessera/dtensor/redistribute.h"
#include "tessera/fsdp/fully_shard.h"
#include "tessera/nn/nn.h"
#include "tessera/nn/parallel/parallelize.h"
