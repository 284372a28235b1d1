#include "mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "tessera/core/error.h"

namespace tessera::ckpt {

MappedRange::MappedRange(MappedRange&& o) noexcept
    : base_(std::exchange(o.base_, nullptr)), lead_(o.lead_), length_(o.length_) {}

MappedRange& MappedRange::operator=(MappedRange&& o) noexcept {
  if (this != &o) {
    if (base_) ::munmap(base_, size_t(length_));
    base_ = std::exchange(o.base_, nullptr);
    lead_ = o.lead_;
    length_ = o.length_;
  }
  return *this;
}

MappedRange::~MappedRange() {
  if (base_) ::munmap(base_, size_t(length_));
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  TESSERA_CHECK(fd_ >= 0, "checkpoint '", path,
                "': cannot open it for reading: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    TESSERA_FAIL("checkpoint '", path, "': fstat failed: ", std::strerror(err));
  }
  size_ = int64_t(st.st_size);
  device_ = uint64_t(st.st_dev);
  inode_ = uint64_t(st.st_ino);
}

void MappedFile::check_still_at_path(const std::string& when) const {
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0) {
    const int err = errno;
    TESSERA_FAIL("checkpoint '", path_, "' was removed or renamed while it was being opened (",
                 when, "): ", std::strerror(err));
  }
  TESSERA_CHECK(uint64_t(st.st_dev) == device_ && uint64_t(st.st_ino) == inode_, "checkpoint '",
                path_, "' was replaced while it was being opened (", when,
                "): another file was renamed over it, so parts of the load could have come from "
                "either; load it again");
}

MappedFile::~MappedFile() {
  if (fd_ >= 0) ::close(fd_);
}

void MappedFile::check_range(int64_t offset, int64_t length, const std::string& what) const {
  TESSERA_CHECK(offset >= 0 && length >= 0 && offset + length <= size_, "checkpoint '", path_,
                "': ", what, " lies at bytes [", offset, ", ", offset + length,
                ") but the file has ", size_, " bytes (truncated?)");
}

MappedRange MappedFile::map(int64_t offset, int64_t length, const std::string& what) const {
  check_range(offset, length, what);
  MappedRange r;
  if (length == 0) return r;
  static const int64_t page = int64_t(::sysconf(_SC_PAGESIZE));
  const int64_t start = offset / page * page;
  r.lead_ = offset - start;
  r.length_ = r.lead_ + length;
  void* p = ::mmap(nullptr, size_t(r.length_), PROT_READ, MAP_SHARED, fd_, off_t(start));
  TESSERA_CHECK(p != MAP_FAILED, "checkpoint '", path_, "': mapping ", what,
                " failed: ", std::strerror(errno));
  r.base_ = static_cast<unsigned char*>(p);
  // Read-ahead of the whole range: from a disk the pages arrive while earlier ones are copied.
  ::madvise(p, size_t(r.length_), MADV_WILLNEED);
  return r;
}

}  // namespace tessera::ckpt
