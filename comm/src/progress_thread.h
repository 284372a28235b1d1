#pragma once
// The progress thread behind tessera::progress_in_background (internal to comm/).
#include <vector>

namespace tessera::detail {

// Stops and joins the progress thread, if it runs. finalize() calls it before the backends shut
// down, so that no thread is inside a backend's polling when it ends.
void stop_progress();

// Where the thread will run (detail/progress_cpus.h); set by init before any work is handed over.
void set_planned_progress_cpus(std::vector<int> cpus);

}  // namespace tessera::detail
