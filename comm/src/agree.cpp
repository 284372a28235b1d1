#include "tessera/comm/agree.h"

#include <exception>

#include "tessera/core/factory.h"

namespace tessera {

std::string current_error_text() {
  std::string text;
  try {
    throw;
  } catch (const std::exception& e) {
    text = e.what();
  } catch (...) {
    text = "unknown exception";
  }
  const std::string mark = "[rank ";
  if (error_rank() >= 0 && text.compare(0, mark.size(), mark) != 0)
    text = mark + std::to_string(error_rank()) + "] " + text;
  return text;
}

void run_agreed(const ProcessGroupPtr& pg, const std::string& context,
                const std::function<void()>& f) {
  std::string error;
  try {
    f();
  } catch (...) {
    error = current_error_text();
  }
  agree(pg, context, error);
}

std::vector<std::string> all_gather_strings(const ProcessGroupPtr& pg, const std::string& text) {
  const int n = pg->size();
  Tensor mine = full({1}, double(text.size()), DType::Int64);
  Tensor lengths = empty({n}, DType::Int64);
  pg->all_gather_into_tensor(lengths, mine)->wait();
  const std::vector<int64_t> len = lengths.to_vector<int64_t>();
  std::vector<std::string> texts(static_cast<size_t>(n));
  bool any = false;
  for (int64_t l : len)
    any |= l > 0;
  if (!any) return texts;
  // The texts travel as one int32 per byte: small, and no dtype games with raw bytes.
  std::vector<int32_t> bytes(text.begin(), text.end());
  Tensor in = from_vector<int32_t>(bytes, {int64_t(bytes.size())});
  std::vector<Tensor> out;
  for (int r = 0; r < n; ++r)
    out.push_back(empty({len[size_t(r)]}, DType::Int32));
  pg->all_gather(out, in)->wait();
  for (int r = 0; r < n; ++r) {
    const std::vector<int32_t> c = out[size_t(r)].to_vector<int32_t>();
    texts[size_t(r)].assign(c.begin(), c.end());
  }
  return texts;
}

void agree(const ProcessGroupPtr& pg, const std::string& context, const std::string& error) {
  std::string all;
  int failed = 0;
  for (const std::string& msg : all_gather_strings(pg, error)) {
    if (msg.empty()) continue;
    if (++failed > 4) continue;  // the first few say enough
    all += (all.empty() ? "" : "; ") + msg;
  }
  if (failed == 0) return;
  if (failed > 4) all += "; and " + std::to_string(failed - 4) + " more ranks failed";
  throw Error(context + ": " + all);
}

}  // namespace tessera
