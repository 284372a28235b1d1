#pragma once
// Ranks leaving the job. A rank that leaves (finalize(), or exit() with the at-exit finalize)
// tells every other rank how many collectives it started on each of its groups, then waits until
// every rank has left, as MPI_Finalize would. A rank waiting in a collective can then tell
// whether a member that left will ever join it: if that member started fewer collectives on the
// group than this collective's position, it never will, and the job ends now instead of at the
// collective timeout. A member that started it has done its part (MPI completes it while that
// member waits for the others to leave), so nothing is decided by a time limit.
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

// Implemented by the MPI runtime (mpi/departures.cpp): the job's ranks are MPI's, whatever backend
// a group uses, so departures travel over MPI's world.
namespace tessera::detail {

// Counts the collectives this rank starts on the group `group_id`; kept after the group is gone,
// since its count is what the other members need to hear when this rank leaves.
std::shared_ptr<std::atomic<int64_t>> register_group(uint64_t group_id);

// Looks for ranks that left; "" unless a member of the group (`world_ranks`, named `name` in the
// text) left before starting the group's collective number `seq` (0-based), in which case the
// text names that member and says why.
std::string departed_before(uint64_t group_id, const std::vector<int>& world_ranks,
                            const std::string& name, int64_t seq);

}  // namespace tessera::detail

namespace tessera::mpi {

// Collective over the world, from init() when tessera started MPI: the communicator that
// departures travel on.
void open_departures();

enum class Departure : int64_t { Finalize = 1, Exit = 2 };
// Collective over the world, from finalize() (also the one run at exit): announces this rank's
// departure, waits until every rank has announced its own, and closes the communicator. Does
// nothing when open_departures() was not called.
void depart(Departure how);

}  // namespace tessera::mpi
