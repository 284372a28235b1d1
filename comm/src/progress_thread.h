#pragma once
// The progress thread behind tessera::progress_in_background (internal to comm/).
namespace tessera::detail {

// Stops and joins the progress thread, if it runs. finalize() calls it before the backends shut
// down, so that no thread is inside a backend's polling when it ends.
void stop_progress();

}  // namespace tessera::detail
