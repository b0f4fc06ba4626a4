// Checkpoint arrays written straight from the row store to disk: numpy's .npy format (version
// 1.0, C order, the header byte for byte as numpy writes it, so numpy and sparse_checkpoint.py
// read it), written in chunks with its CRC-32 (zlib's, as Python's zlib.crc32) computed on the
// way, then fsync'ed. A save therefore never holds a column in memory: the rows of a table that
// lives mostly on SSD go from their records into the file a chunk at a time.
#pragma once

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

namespace shardrec {

// An I/O error of a checkpoint file; Python sees an OSError with its errno (module.cpp).
class FileError : public std::system_error {
 public:
  FileError(int e, const std::string& what) : std::system_error(e, std::generic_category(), what) {}
};

struct FileDigest {
  uint64_t bytes = 0;  // header and data
  uint32_t crc = 0;    // CRC-32 of the whole file
};

// numpy 1.26's format.py: the header dict, spaces that let the first axis grow to 21 digits, then
// padding to a multiple of 64 bytes (a whole 64 when already aligned) and a newline.
inline std::string npy_header(const std::string& descr, const std::vector<int64_t>& shape) {
  std::string dims;
  for (size_t i = 0; i < shape.size(); ++i) dims += (i ? ", " : "") + std::to_string(shape[i]);
  if (shape.size() == 1) dims += ",";
  std::string dict = "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + dims + "), }";
  if (!shape.empty()) dict.append(21 - std::to_string(shape[0]).size(), ' ');
  const size_t kPrefix = 10, kAlign = 64;
  const size_t unpadded = dict.size() + 1;
  dict.append(kAlign - (kPrefix + unpadded) % kAlign, ' ');
  dict += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(dict.size() & 0xff);
  out += static_cast<char>(dict.size() >> 8);
  return out + dict;
}

class ArrayFileWriter {
 public:
  ArrayFileWriter(std::string path, const std::string& header) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot create the file");
    write(header.data(), header.size());
  }
  ArrayFileWriter(const ArrayFileWriter&) = delete;
  ArrayFileWriter& operator=(const ArrayFileWriter&) = delete;
  ~ArrayFileWriter() {
    if (fd_ >= 0) ::close(fd_);
  }

  void write(const void* data, size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    digest_.crc = static_cast<uint32_t>(crc32_z(digest_.crc, p, n));
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        fail("cannot write");
      }
      p += w;
      n -= static_cast<size_t>(w);
      digest_.bytes += static_cast<uint64_t>(w);
    }
  }

  // Closed; what the manifest records of the file. Not flushed: the checkpoint writer flushes a
  // shard's files together before its manifest (rank_runtime/formats/sparse_checkpoint.py), one journal
  // commit for them all instead of one per file.
  FileDigest finish() {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("cannot close");
    return digest_;
  }

 private:
  [[noreturn]] void fail(const char* what) const {
    const int e = errno;
    throw FileError(e, path_ + ": " + what);
  }

  std::string path_;
  int fd_ = -1;
  FileDigest digest_;
};

}  // namespace shardrec
