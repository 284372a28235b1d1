#include "agreement.h"

#include <algorithm>

#include "tessera/comm/agree.h"
#include "tessera/comm/runtime.h"

namespace tessera::detail {

namespace {

// Field separators that no shape, dtype or mesh text contains.
constexpr char kFieldSep = '\x1e';
constexpr char kValueSep = '\x1f';
constexpr char kMessageSep = '\n';
constexpr size_t kMaxMessages = 4;

std::string encode(const CallDescription& desc) {
  std::string s;
  for (const auto& [name, value] : desc) {
    s += name;
    s += kValueSep;
    s += value;
    s += kFieldSep;
  }
  return s;
}

CallDescription decode(const std::string& s) {
  CallDescription desc;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t end = s.find(kFieldSep, pos);
    const size_t mid = s.find(kValueSep, pos);
    if (end == std::string::npos || mid == std::string::npos || mid > end) break;
    desc.emplace_back(s.substr(pos, mid - pos), s.substr(mid + 1, end - mid - 1));
    pos = end + 1;
  }
  return desc;
}

std::vector<std::string> split_messages(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    size_t end = s.find(kMessageSep, pos);
    if (end == std::string::npos) end = s.size();
    if (end > pos) out.push_back(s.substr(pos, end - pos));
    pos = end + 1;
  }
  return out;
}

// "ranks 0 and 3 differ in dtype (rank 0: float64, rank 3: float32)", lower rank first, so that
// both ranks of a differing pair write the same text and it is reported once.
std::string difference(int rank_a, const std::string& name, const std::string& a, int rank_b,
                       const std::string& b) {
  if (rank_b < rank_a) return difference(rank_b, name, b, rank_a, a);
  // Appended piece by piece: GCC 12 warns (-Wrestrict) on "literal" + std::string.
  std::string s = "ranks ";
  for (const std::string& piece :
       {std::to_string(rank_a), std::string(" and "), std::to_string(rank_b),
        std::string(" differ in "), name, std::string(" (rank "), std::to_string(rank_a),
        std::string(": "), a, std::string(", rank "), std::to_string(rank_b), std::string(": "), b,
        std::string(")")})
    s += piece;
  return s;
}

// The differences between this rank's description and the other members' of `pg`.
std::vector<std::string> differences(const ProcessGroupPtr& pg, const CallDescription& mine) {
  const std::vector<std::string> all = all_gather_strings(pg, encode(mine));
  std::vector<std::string> found;
  const int me = pg->world_ranks()[size_t(pg->rank())];
  for (int r = 0; r < pg->size(); ++r) {
    const CallDescription theirs = decode(all[size_t(r)]);
    if (r == pg->rank() || theirs == mine) continue;
    const int other = pg->world_ranks()[size_t(r)];
    for (size_t f = 0; f < std::max(theirs.size(), mine.size()); ++f) {
      const std::string name = f < mine.size() ? mine[f].first : theirs[f].first;
      const std::string a = f < mine.size() ? mine[f].second : "nothing";
      const std::string b = f < theirs.size() ? theirs[f].second : "nothing";
      if (a != b) found.push_back(difference(me, name, a, other, b));
    }
  }
  return found;
}

void add_unique(std::vector<std::string>& list, const std::string& msg) {
  if (std::find(list.begin(), list.end(), msg) == list.end()) list.push_back(msg);
}

// Groups whose collectives reach every rank of the mesh when run one after the other, each on
// the previous one's result: the world when the mesh spans it, else one per mesh dim.
std::vector<ProcessGroupPtr> covering_groups(const DeviceMesh& mesh) {
  if (mesh.size() == world_size()) return {world_group()};
  std::vector<ProcessGroupPtr> groups;
  for (int64_t m = 0; m < mesh.ndim(); ++m)
    groups.push_back(mesh.host_group(m));
  return groups;
}

}  // namespace

std::string mesh_description(const DeviceMesh& mesh) {
  std::string s = mesh.str();
  s += " over world ranks [";
  for (size_t i = 0; i < mesh.world_ranks().size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(mesh.world_ranks()[i]);
  }
  return s + "]";
}

void agree_on_call(const DeviceMesh& mesh, const std::string& context, const CallDescription& desc,
                   const std::string& error, const std::string& hint) {
  const std::vector<ProcessGroupPtr> groups = covering_groups(mesh);
  std::vector<std::string> messages;
  if (!error.empty()) {
    std::string e = error;
    std::replace(e.begin(), e.end(), kMessageSep, ' ');
    messages.push_back(e);
  }
  // Two ranks that differ have neighbours along some mesh dim that differ, so every difference
  // is seen by some rank; the second pass spreads what was seen to all.
  for (const ProcessGroupPtr& g : groups)
    for (const std::string& m : differences(g, desc))
      add_unique(messages, m);
  const size_t local = messages.size();
  for (const ProcessGroupPtr& g : groups)
    for (const std::string& text :
         all_gather_strings(g, join(messages, std::string(1, kMessageSep))))
      for (const std::string& m : split_messages(text))
        add_unique(messages, m);
  if (messages.empty()) return;
  // Whether some ranks' descriptions differ (not only local errors), seen here or elsewhere.
  bool differ = local > (error.empty() ? 0 : 1);
  for (const std::string& m : messages)
    differ = differ || m.compare(0, 6, "ranks ") == 0;
  std::sort(messages.begin(), messages.end());
  const size_t total = messages.size();
  if (total > kMaxMessages) messages.resize(kMaxMessages);
  std::string all = context;
  all += ": ";
  all += join(messages, "; ");
  if (total > kMaxMessages) {
    all += "; and ";
    all += std::to_string(total - kMaxMessages);
    all += " more";
  }
  if (!hint.empty()) {
    all += " (";
    all += hint;
    all += ")";
  }
  // The capped list may not show this rank's own inputs; say them.
  if (differ) {
    all += "; rank ";
    all += std::to_string(world_rank());
    all += " passes";
    for (size_t f = 0; f < desc.size(); ++f) {
      all += f ? ", " : " ";
      all += desc[f].first;
      all += ' ';
      all += desc[f].second;
    }
  }
  throw Error(all);
}

}  // namespace tessera::detail
