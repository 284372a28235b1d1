#pragma once
// The testing kit: reference geometry, checks that name rank and index, generators of meshes,
// placements, shapes and values, the single-rank parity runner, and checks of error messages.
// Link tessera::testing (and
// tessera::testing_main for the MPI GoogleTest main); docs/testing.md shows how to use them.
#include "tessera/testing/checks.h"
#include "tessera/testing/expect_contains.h"
#include "tessera/testing/expect_error.h"
#include "tessera/testing/generators.h"
#include "tessera/testing/geometry.h"
#include "tessera/testing/parity.h"
