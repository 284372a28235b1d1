#pragma once
// The one header a user includes.
#include "tessera/autograd/autograd.h"
#include "tessera/core/core.h"
