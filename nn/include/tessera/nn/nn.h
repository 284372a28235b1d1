#pragma once
#include "tessera/nn/dropout.h"
#include "tessera/nn/layers.h"
#include "tessera/nn/loss.h"
#include "tessera/nn/module.h"
#include "tessera/nn/optim.h"
#include "tessera/nn/parameter.h"
#include "tessera/nn/transformer.h"
