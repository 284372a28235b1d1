#pragma once
#include "tessera/autograd/deferred_reduction.h"
#include "tessera/autograd/engine.h"
#include "tessera/autograd/function.h"
#include "tessera/autograd/grad_mode.h"
#include "tessera/autograd/gradcheck.h"
#include "tessera/autograd/node.h"
#include "tessera/autograd/ops.h"
