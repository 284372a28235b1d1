// Module path patterns (module_path.h).
#include "tessera/nn/module_path.h"

#include <algorithm>
#include <set>

#include "tessera/nn/module.h"

namespace tessera {

namespace {

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    out.push_back(path.substr(start, dot - start));
    if (dot == std::string::npos) return out;
    start = dot + 1;
  }
}

// '*' matches any run of characters within one component (fnmatch on path atoms, as in PyTorch),
// so "layers.*.attention" names every block's attention and "w*" every w-projection, but a '*'
// never reaches across a '.'.
bool match_component(const std::string& pat, const std::string& s) {
  size_t p = 0, i = 0, star = std::string::npos, mark = 0;
  while (i < s.size()) {
    if (p < pat.size() && pat[p] == '*') {
      star = p++;
      mark = i;
    } else if (p < pat.size() && pat[p] == s[i]) {
      ++p;
      ++i;
    } else if (star != std::string::npos) {
      p = star + 1;
      i = ++mark;
    } else {
      return false;
    }
  }
  while (p < pat.size() && pat[p] == '*')
    ++p;
  return p == pat.size();
}

// How many leading components of `path` the pattern matches.
size_t matched_prefix(const std::vector<std::string>& pat, const std::vector<std::string>& path) {
  size_t k = 0;
  while (k < pat.size() && k < path.size() && match_component(pat[k], path[k]))
    ++k;
  return k;
}

// For the error of a pattern that matches nothing: the names found where the pattern stopped
// matching, which is usually where the typo is.
std::string candidates(
    const std::vector<std::string>& pat,
    const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules) {
  size_t best = 0;
  std::vector<std::vector<std::string>> paths;
  for (const auto& [path, m] : modules) {
    if (path.empty()) continue;
    paths.push_back(split_path(path));
    best = std::max(best, matched_prefix(pat, paths.back()));
  }
  std::set<std::string> seen;
  std::string names;
  for (const auto& p : paths) {
    if (p.size() != best + 1 || matched_prefix(pat, p) != best) continue;
    if (!seen.insert(p[best]).second) continue;
    names += (names.empty() ? "" : ", ") + p[best];
  }
  std::string prefix;
  for (size_t i = 0; i < best; ++i)
    prefix += pat[i] + ".";
  return "after '" + prefix + "' there are: " + (names.empty() ? "(no children)" : names);
}

}  // namespace

std::vector<std::string> split_module_path(const std::string& path) {
  return split_path(path);
}

bool module_path_matches(const std::string& pattern, const std::string& path) {
  // The root ("") is not one of its own submodules: a pattern of '*' names its children only,
  // as PyTorch's parallelize_module matches plan keys against the children.
  if (path.empty()) return pattern.empty();
  const std::vector<std::string> pat = split_path(pattern), p = split_path(path);
  return p.size() == pat.size() && matched_prefix(pat, p) == pat.size();
}

std::string module_path_candidates(
    const std::string& pattern,
    const std::vector<std::pair<std::string, std::shared_ptr<Module>>>& modules) {
  return candidates(split_path(pattern), modules);
}

}  // namespace tessera
