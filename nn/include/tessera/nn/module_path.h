#pragma once
// Matching dotted module paths against patterns, shared by everything that targets modules by
// name (parallelize_module's plans, LoRA's target_modules).
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace tessera {

class Module;

std::vector<std::string> split_module_path(const std::string& path);
// Component by component; '*' matches any run of characters within one component (fnmatch on
// path atoms, as in PyTorch), so "layers.*.attention" names every block's attention and "w*"
// every w-projection, but a '*' never reaches across a '.'. The root's path "" matches only "".
bool module_path_matches(const std::string& pattern, const std::string& path);
// For the error of a pattern that matches nothing: the names found where the pattern stopped
// matching, which is usually where the typo is ("after 'layers.0.' there are: attention, ...").
std::string module_path_candidates(
    const std::string& pattern,
    const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules);

}  // namespace tessera
