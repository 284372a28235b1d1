#include "tessera/comm/detail/progress_cpus.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "tessera/core/error.h"

namespace tessera::detail {

namespace {

// A number at `pos`, advancing past it; -1 when there is none.
long read_number(const std::string& text, size_t& pos) {
  size_t end = pos;
  while (end < text.size() && std::isdigit(static_cast<unsigned char>(text[end])))
    ++end;
  if (end == pos || end - pos > 6) return -1;
  long v = std::strtol(text.substr(pos, end - pos).c_str(), nullptr, 10);
  pos = end;
  return v;
}

}  // namespace

CpuList parse_cpu_list(const std::string& text, const std::string& what) {
  std::string s = text;
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.pop_back();
  CpuList cpus;
  size_t pos = 0;
  while (pos < s.size()) {
    const long first = read_number(s, pos);
    long last = first;
    if (first >= 0 && pos < s.size() && s[pos] == '-') {
      ++pos;
      last = read_number(s, pos);
    }
    const bool separated = pos == s.size() || (s[pos] == ',' && pos + 1 < s.size());
    TESSERA_CHECK(first >= 0 && last >= first && separated, what, ": '", text,
                  "' is not a CPU list (expected numbers and ranges such as 0-3,8,10-11)");
    for (long c = first; c <= last; ++c)
      cpus.push_back(int(c));
    if (pos < s.size()) ++pos;
  }
  std::sort(cpus.begin(), cpus.end());
  cpus.erase(std::unique(cpus.begin(), cpus.end()), cpus.end());
  return cpus;
}

std::string format_cpu_list(const CpuList& cpus) {
  std::string s;
  for (size_t i = 0; i < cpus.size();) {
    size_t j = i;
    while (j + 1 < cpus.size() && cpus[j + 1] == cpus[j] + 1)
      ++j;
    if (!s.empty()) s += ',';
    s += std::to_string(cpus[i]);
    if (j > i) {
      s += '-';
      s += std::to_string(cpus[j]);
    }
    i = j + 1;
  }
  return s;
}

CpuList progress_cpus_for(const std::vector<CpuList>& local_ranks, int me,
                          const CpuList& available) {
  TESSERA_CHECK(me >= 0 && size_t(me) < local_ranks.size(), "progress_cpus_for: local rank ", me,
                " of ", local_ranks.size());
  CpuList spare;
  for (int cpu : available) {
    const bool taken = std::any_of(local_ranks.begin(), local_ranks.end(), [&](const CpuList& r) {
      return std::binary_search(r.begin(), r.end(), cpu);
    });
    if (!taken) spare.push_back(cpu);
  }
  if (spare.empty()) return {};
  const size_t k = spare.size(), n = local_ranks.size(), m = size_t(me);
  if (k < n) return {spare[m % k]};
  return CpuList(spare.begin() + long(m * k / n), spare.begin() + long((m + 1) * k / n));
}

}  // namespace tessera::detail
