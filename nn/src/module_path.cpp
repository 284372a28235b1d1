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

// Whether c matches the bracket expression starting at pat[p] == '['; `end` gets the index after
// its ']', or stays npos when there is none.
bool match_bracket(const std::string& pat, size_t p, char c, size_t& end) {
  size_t i = p + 1;
  const bool negate = i < pat.size() && pat[i] == '!';
  if (negate) ++i;
  bool hit = false;
  for (bool first = true; i < pat.size() && (first || pat[i] != ']'); first = false) {
    if (i + 2 < pat.size() && pat[i + 1] == '-' && pat[i + 2] != ']') {
      hit = hit || (pat[i] <= c && c <= pat[i + 2]);
      i += 3;
    } else {
      hit = hit || pat[i] == c;
      ++i;
    }
  }
  end = i < pat.size() ? i + 1 : std::string::npos;
  return hit != negate;
}

// fnmatch on one path component, as PyTorch's parallelize_module matches plan keys: '*' any run of
// characters, '?' one character, '[seq]' / '[!seq]' one character in / not in seq (ranges as
// a-z); a '[' without its ']' is itself. A '*' never reaches across a '.', since components are
// matched one by one.

bool match_component(const std::string& pat, const std::string& s) {
  size_t p = 0, i = 0, star = std::string::npos, mark = 0;
  while (i < s.size()) {
    if (p < pat.size() && pat[p] == '*') {
      star = p++;
      mark = i;
      continue;
    }
    bool ok = false;
    size_t next = p + 1;
    if (p < pat.size()) {
      if (pat[p] == '?') {
        ok = true;
      } else if (pat[p] == '[') {
        size_t end = std::string::npos;
        const bool hit = match_bracket(pat, p, s[i], end);
        if (end != std::string::npos) {
          ok = hit;
          next = end;
        } else {
          ok = s[i] == '[';  // no closing ']': a plain character
        }
      } else {
        ok = pat[p] == s[i];
      }
    }
    if (ok) {
      p = next;
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
