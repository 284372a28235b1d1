#pragma once
// A character-level corpus generated deterministically from a small grammar (no download), and
// the batches a training step reads from it. Every rank generates the same corpus; each
// data-parallel rank takes its own rows of the global batch.
#include <string>
#include <vector>

#include "tessera/tessera.h"

namespace lm {

class Corpus {
 public:
  // Plain: sentences such as "The quick cat sees a river. ". Reversed: the same grammar with
  // each sentence's words in reverse order and no capital ("river a sees cat quick the. "): a
  // different text over the same characters, for fine-tuning a model trained on the plain one.
  enum class Style { Plain, Reversed };
  // About `chars` characters of sentences drawn with `seed`. The alphabet is the grammar's, the
  // same for every corpus.
  Corpus(int64_t chars, uint64_t seed, Style style = Style::Plain);
  int64_t vocab_size() const { return int64_t(alphabet_.size()); }
  int64_t size() const { return int64_t(ids_.size()); }
  const std::string& text() const { return text_; }
  std::string decode(const std::vector<int64_t>& ids) const;

  struct Batch {
    tessera::Tensor inputs;   // int64 [rows, seq]
    tessera::Tensor targets;  // int64 [rows, seq]: inputs shifted by one
  };
  // Rows [row_begin, row_end) of the global batch of step `step` (global_batch rows, each a
  // window at a position drawn from (seed, step)).
  Batch batch(int64_t step, int64_t global_batch, int64_t seq, int64_t row_begin, int64_t row_end,
              uint64_t seed) const;

 private:
  std::string text_;
  std::string alphabet_;
  std::vector<int64_t> ids_;
};

}  // namespace lm
