// The record count of a TFRecord file from its framing alone (each record: an 8-byte little-endian
// length, its 4-byte CRC, the data, the data's 4-byte CRC), for the directory stream
// (rank_runtime/stream/tfrecord_files.py), which counts every file it hands to tf.data. Headers are
// read through a 1 MiB window, so a file of small records costs a read per MiB, not one per record.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "storage/array_file.h"

namespace shardrec {

struct TFRecordCount {
  int64_t records = 0;      // complete records before bad_offset (all of them when it is -1)
  int64_t size = 0;         // the file's bytes
  int64_t bad_offset = -1;  // where the framing stops adding up (-1: it adds up to the file's end)
  int64_t bad_length = -1;  // the length the record there claims (-1: its header is cut short)
};

inline TFRecordCount count_tfrecords(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw FileError(errno, "cannot open " + path);
  TFRecordCount out;
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    throw FileError(e, "cannot stat " + path);
  }
  out.size = static_cast<int64_t>(st.st_size);
  constexpr int64_t kWindow = 1 << 20, kHeader = 8, kFrame = 8 + 4 + 4;
  std::vector<char> window(kWindow);
  int64_t window_at = 0, window_len = 0, at = 0;
  while (at < out.size) {
    if (at < window_at || at + kHeader > window_at + window_len) {
      const ssize_t got = ::pread(fd, window.data(), kWindow, at);
      if (got < 0) {
        const int e = errno;
        ::close(fd);
        throw FileError(e, "cannot read " + path);
      }
      window_at = at;
      window_len = got;
    }
    if (at + kHeader > out.size || at + kHeader > window_at + window_len) {
      out.bad_offset = at;
      break;
    }
    uint64_t length;
    std::memcpy(&length, window.data() + (at - window_at), sizeof(length));  // little-endian hosts
    if (length > static_cast<uint64_t>(out.size) || at + kFrame + static_cast<int64_t>(length) > out.size) {
      out.bad_offset = at;
      out.bad_length = static_cast<int64_t>(length);
      break;
    }
    at += kFrame + static_cast<int64_t>(length);
    ++out.records;
  }
  ::close(fd);
  return out;
}

}  // namespace shardrec
