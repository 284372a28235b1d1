#pragma once
// The safetensors format (Hugging Face's safetensors package): an 8-byte little-endian header
// length, a JSON header mapping each tensor name to {"dtype", "shape", "data_offsets"} (plus an
// optional "__metadata__" map of strings), then the tensors' bytes, row-major and contiguous.
// Reading validates everything before any tensor is made: header length within the file and the
// format's 100 MB limit, the JSON itself (no duplicate keys), unique non-empty names, known dtypes,
// shapes that match their byte ranges, ranges contiguous and exactly covering the data, bool bytes
// 0 or 1. A malformed file is an error naming the file and what is wrong, never a crash.
#include <cstddef>
#include <map>
#include <string>

#include "tessera/core/tensor.h"

namespace tessera {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};

// Writes the tensors (any strides; device tensors are copied to the host) in name order, through a
// temporary file renamed into place. Names are non-empty UTF-8; dtypes: float32 (F32), float64
// (F64), bfloat16 (BF16), float16 (F16), int64 (I64), int32 (I32), bool (BOOL).
void save_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata = {});
SafetensorsFile load_safetensors(const std::string& path);
// The same from bytes in memory; `name` stands for the file in errors.
SafetensorsFile parse_safetensors(const void* data, size_t size, const std::string& name);

}  // namespace tessera
