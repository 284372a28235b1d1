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
// Component by component, fnmatch on each (as PyTorch's parallelize_module): '*' any run of
// characters, '?' one, '[0-3]' / '[!0-3]' one in / not in a set. "layers.*.attention" names every
// block's attention, "w*" every w-projection, "layers.[0-1].mlp" the first two blocks' MLPs; a
// '*' never reaches across a '.'. The root's path "" matches only "".
bool module_path_matches(const std::string& pattern, const std::string& path);
// For the error of a pattern that matches nothing: the names found where the pattern stopped
// matching, which is usually where the typo is ("after 'layers.0.' there are: attention, ...").
std::string module_path_candidates(
    const std::string& pattern,
    const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules);

}  // namespace tessera
