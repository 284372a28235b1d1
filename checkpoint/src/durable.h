#pragma once
// Files that survive a crash of the machine, not only of the job: written under a temporary name
// of their own, flushed, renamed over their path, and the directory flushed, so the path holds
// either the previous file or the whole new one.
#include <string>

namespace tessera::ckpt {

// The directory holding `path` ("." for a bare file name).
std::string parent_dir(const std::string& path);
// fsync of a file or a directory; an error names it.
void fsync_path(const std::string& path, bool directory);

}  // namespace tessera::ckpt
