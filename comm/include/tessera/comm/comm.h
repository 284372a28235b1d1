#pragma once
#include "tessera/comm/agree.h"
#include "tessera/comm/backend.h"
#include "tessera/comm/process_group.h"
#include "tessera/comm/progress.h"
#include "tessera/comm/runtime.h"
