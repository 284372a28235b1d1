#include "lm/corpus.h"

#include <algorithm>

namespace lm {

namespace {

// Draws from the counter-based generator so the corpus is the same on every machine.
class Picker {
 public:
  explicit Picker(uint64_t seed) : gen_(seed) {}
  size_t pick(size_t n) {
    tessera::Tensor u = tessera::rand({1}, gen_, tessera::DType::Float64);
    return std::min(n - 1, size_t(u.item<double>() * double(n)));
  }
  template <class T>
  const T& one_of(const std::vector<T>& v) {
    return v[pick(v.size())];
  }

 private:
  tessera::Generator gen_;
};

const std::vector<std::string> kDeterminers = {"the", "a", "every", "one", "that"};
const std::vector<std::string> kAdjectives = {"small", "quick",  "old",   "green",
                                              "quiet", "bright", "heavy", "lazy"};
const std::vector<std::string> kNouns = {"cat",  "dog",   "bird",  "river", "house",
                                         "tree", "child", "stone", "ship",  "garden"};
const std::vector<std::string> kVerbs = {"sees",    "finds",  "follows", "watches",
                                         "carries", "leaves", "meets",   "hears"};
const std::vector<std::string> kPlaces = {"near the hill", "by the sea", "in the morning",
                                          "under the bridge", "after the rain"};

std::string noun_phrase(Picker& p) {
  std::string s = p.one_of(kDeterminers) + " ";
  if (p.pick(2) == 0) s += p.one_of(kAdjectives) + " ";
  return s + p.one_of(kNouns);
}

std::string sentence(Picker& p, Corpus::Style style) {
  std::string s = noun_phrase(p) + " " + p.one_of(kVerbs) + " " + noun_phrase(p);
  if (p.pick(3) == 0) s += " " + p.one_of(kPlaces);
  if (style == Corpus::Style::Reversed) {
    std::vector<std::string> words;
    for (size_t at = 0; at <= s.size();) {
      const size_t space = std::min(s.find(' ', at), s.size());
      words.push_back(s.substr(at, space - at));
      at = space + 1;
    }
    s.clear();
    for (size_t i = words.size(); i-- > 0;)
      s += words[i] + (i ? " " : "");
    return s + ". ";
  }
  s[0] = char(std::toupper(s[0]));
  return s + ". ";
}

// Every character the grammar can produce, so that every corpus has the same alphabet.
std::string grammar_alphabet() {
  std::string s = ". ";
  for (const auto* list : {&kDeterminers, &kAdjectives, &kNouns, &kVerbs, &kPlaces})
    for (const std::string& w : *list)
      s += w;
  for (const std::string& d : kDeterminers)
    s += char(std::toupper(d[0]));
  return s;
}

}  // namespace

Corpus::Corpus(int64_t chars, uint64_t seed, Style style) {
  Picker p(seed);
  while (int64_t(text_.size()) < chars)
    text_ += sentence(p, style);
  alphabet_ = grammar_alphabet();
  std::sort(alphabet_.begin(), alphabet_.end());
  alphabet_.erase(std::unique(alphabet_.begin(), alphabet_.end()), alphabet_.end());
  ids_.reserve(text_.size());
  for (char c : text_)
    ids_.push_back(int64_t(alphabet_.find(c)));
}

std::string Corpus::decode(const std::vector<int64_t>& ids) const {
  std::string s;
  for (int64_t i : ids)
    s += alphabet_[size_t(i)];
  return s;
}

Corpus::Batch Corpus::batch(int64_t step, int64_t global_batch, int64_t seq, int64_t row_begin,
                            int64_t row_end, uint64_t seed) const {
  TESSERA_CHECK(size() > seq + 1, "corpus of ", size(), " tokens is too short for sequences of ",
                seq);
  TESSERA_CHECK(0 <= row_begin && row_begin <= row_end && row_end <= global_batch, "batch rows [",
                row_begin, ", ", row_end, ") outside a global batch of ", global_batch);
  // Positions for the whole global batch come from (seed, step), so every rank agrees on them.
  tessera::Generator gen(seed ^ 0x5eedc0de);
  gen.set_offset(uint64_t(step) * uint64_t(global_batch));
  tessera::Tensor u = tessera::rand({global_batch}, gen, tessera::DType::Float64);
  const double* up = u.data<double>();
  const int64_t rows = row_end - row_begin;
  Batch b{tessera::empty({rows, seq}, tessera::DType::Int64),
          tessera::empty({rows, seq}, tessera::DType::Int64)};
  int64_t* in = b.inputs.data<int64_t>();
  int64_t* tg = b.targets.data<int64_t>();
  const int64_t span = size() - seq - 1;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t pos = std::min(span - 1, int64_t(up[row_begin + r] * double(span)));
    for (int64_t t = 0; t < seq; ++t) {
      in[r * seq + t] = ids_[size_t(pos + t)];
      tg[r * seq + t] = ids_[size_t(pos + t + 1)];
    }
  }
  return b;
}

}  // namespace lm
