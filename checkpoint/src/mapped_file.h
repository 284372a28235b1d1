#pragma once
// A checkpoint file mapped into memory for reading (internal to checkpoint/).
//
// Loads copy each window out of the mapping, adding its checksums in the same pass. Reading
// through HDF5 instead copies the bytes from the page cache into the tensor and then reads them
// once more for the checksums; the mapping makes verification nearly free, and windows that are
// not runs of the file (a column window) cost one strided copy instead of a read per row piece.
// The file must not shrink while mapped: reading a page past its end raises SIGBUS, so
// every range is checked against the file's size when it is mapped.
#include <cstdint>
#include <string>

namespace tessera::ckpt {

class MappedRange {
 public:
  MappedRange() = default;
  MappedRange(MappedRange&& o) noexcept;
  MappedRange& operator=(MappedRange&& o) noexcept;
  MappedRange(const MappedRange&) = delete;
  MappedRange& operator=(const MappedRange&) = delete;
  ~MappedRange();
  // The first byte of the range asked for.
  const unsigned char* data() const { return base_ + lead_; }

 private:
  friend class MappedFile;
  unsigned char* base_ = nullptr;  // page-aligned start of the mapping
  int64_t lead_ = 0;               // bytes from base_ to the range
  int64_t length_ = 0;             // of the mapping
};

// One open file: everything mapped comes from the file that was at `path` when it was opened,
// whatever is renamed over `path` later.
class MappedFile {
 public:
  // Opens `path` read-only; an error naming it when that fails.
  explicit MappedFile(const std::string& path);
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();
  int64_t size() const { return size_; }
  // An error naming the file unless `path` still names the file opened here (same device and
  // inode): after another library opened `path` by name, this says that it opened this file,
  // unless `path` was replaced and then put back in between. `when` says what just happened.
  void check_still_at_path(const std::string& when) const;
  // An error naming the file and `what` unless bytes [offset, offset + length) lie inside it.
  void check_range(int64_t offset, int64_t length, const std::string& what) const;
  // Maps bytes [offset, offset + length) and asks the kernel to read them ahead. An error naming
  // the file when the range lies past its end or the mapping fails.
  MappedRange map(int64_t offset, int64_t length, const std::string& what) const;

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
  uint64_t device_ = 0, inode_ = 0;
};

}  // namespace tessera::ckpt
