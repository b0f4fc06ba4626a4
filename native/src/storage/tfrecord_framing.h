// The record count of a TFRecord file from its framing (each record: an 8-byte little-endian
// length, its 4-byte CRC, the data, the data's 4-byte CRC), for the directory stream
// (rank_runtime/stream/tfrecord_files.py), which counts every file it hands to tf.data and checks its
// CRCs there, where the file and the record can be named (TensorFlow's reader names neither). The
// file is read through a 1 MiB window, so a file of small records costs a read per MiB, not one per record.
// The same framing in memory (frame_tfrecords: a Redis stream's packed entries, the bytes of a
// TFRecord file each) is split into its records' data, both CRCs of every record checked.
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
#include "storage/crc32c.h"

namespace shardrec {

struct TFRecordCount {
  int64_t records = 0;      // complete records before bad_offset (all of them when it is -1)
  int64_t size = 0;         // the file's bytes
  int64_t bad_offset = -1;  // where the framing stops adding up (-1: it adds up to the file's end)
  int64_t bad_length = -1;  // the length the record there claims (-1: its header is cut short)
  std::string bad_crc;      // with check_crc: "length" or "data", the CRC at bad_offset that does not match
};

// check_crc reads every record's data too (the file once through the window, both CRCs of every
// record checked), so that a damaged record is named before any of the file is handed out;
// without it only the headers are read.
inline TFRecordCount count_tfrecords(const std::string& path, bool check_crc = false) {
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
  // Makes [at, at + n) readable in the window when the file holds it (a record larger than the
  // window grows it); false on a short file.
  auto hold = [&](int64_t n) {
    if (at >= window_at && at + n <= window_at + window_len) return true;
    if (static_cast<int64_t>(window.size()) < n) window.resize(static_cast<size_t>(n));
    int64_t got = 0;
    while (got < static_cast<int64_t>(window.size()) && at + got < out.size) {
      const ssize_t r = ::pread(fd, window.data() + got, window.size() - got, at + got);
      if (r < 0) {
        if (errno == EINTR) continue;
        const int e = errno;
        ::close(fd);
        throw FileError(e, "cannot read " + path);
      }
      if (r == 0) break;
      got += r;
    }
    window_at = at;
    window_len = got;
    return at + n <= window_at + window_len;
  };
  while (at < out.size) {
    if (at + kHeader > out.size || !hold(kHeader)) {
      out.bad_offset = at;
      break;
    }
    const char* p = window.data() + (at - window_at);
    uint64_t length;
    std::memcpy(&length, p, sizeof(length));  // little-endian hosts
    if (length > static_cast<uint64_t>(out.size) || at + kFrame + static_cast<int64_t>(length) > out.size) {
      out.bad_offset = at;
      out.bad_length = static_cast<int64_t>(length);
      break;
    }
    if (check_crc) {
      const int64_t n = kFrame + static_cast<int64_t>(length);
      if (!hold(n)) {  // the file shrank under the reader
        out.bad_offset = at;
        out.bad_length = static_cast<int64_t>(length);
        break;
      }
      p = window.data() + (at - window_at);
      uint32_t length_crc, data_crc;
      std::memcpy(&length_crc, p + 8, 4);
      std::memcpy(&data_crc, p + 12 + length, 4);
      if (masked_crc32c(p, 8) != length_crc || masked_crc32c(p + 12, length) != data_crc) {
        out.bad_offset = at;
        out.bad_length = static_cast<int64_t>(length);
        out.bad_crc = masked_crc32c(p, 8) != length_crc ? "length" : "data";
        break;
      }
    }
    at += kFrame + static_cast<int64_t>(length);
    ++out.records;
  }
  ::close(fd);
  return out;
}

struct FramedRecords {
  std::vector<int64_t> starts, lengths;  // each record's data: where it starts in the blobs joined, its bytes
  std::vector<int64_t> counts;           // records of each blob
  int64_t bad_blob = -1;                 // the first blob whose framing is wrong (-1: none)
  int64_t bad_offset = -1;               // the byte of that blob where its record `counts[bad_blob]` starts
  std::string bad_reason;
};

// One blob's records appended to `out`, its first byte at `base` of the blobs joined; false (with
// the reason) at the first record whose framing or CRC is wrong.
inline bool frame_blob(const char* p, int64_t size, int64_t base, FramedRecords& out, int64_t& at,
                       std::string& why) {
  constexpr int64_t kFrame = 8 + 4 + 4;
  int64_t records = 0;
  at = 0;
  while (at < size) {
    if (size - at < 12) {
      why = "its header is cut short (" + std::to_string(size - at) + " bytes left)";
      break;
    }
    uint64_t length;
    uint32_t length_crc, data_crc;
    std::memcpy(&length, p + at, 8);
    std::memcpy(&length_crc, p + at + 8, 4);
    if (masked_crc32c(p + at, 8) != length_crc) {
      why = "the CRC of its length does not match (not TFRecord framing)";
      break;
    }
    if (length > static_cast<uint64_t>(size - at - kFrame)) {
      why = "it says " + std::to_string(length) + " bytes, past the entry's end (" + std::to_string(size) + " bytes)";
      break;
    }
    std::memcpy(&data_crc, p + at + 12 + static_cast<int64_t>(length), 4);
    if (masked_crc32c(p + at + 12, length) != data_crc) {
      why = "the CRC of its data does not match";
      break;
    }
    out.starts.push_back(base + at + 12);
    out.lengths.push_back(static_cast<int64_t>(length));
    ++records;
    at += kFrame + static_cast<int64_t>(length);
  }
  out.counts.push_back(records);
  return at == size;
}

inline FramedRecords frame_tfrecords(const std::vector<std::pair<const char*, int64_t>>& blobs) {
  FramedRecords out;
  out.counts.reserve(blobs.size());
  int64_t base = 0;
  for (size_t b = 0; b < blobs.size(); ++b) {
    int64_t at;
    if (!frame_blob(blobs[b].first, blobs[b].second, base, out, at, out.bad_reason)) {
      out.bad_blob = static_cast<int64_t>(b);
      out.bad_offset = at;
      break;
    }
    base += blobs[b].second;
  }
  return out;
}

// TFRecord framing of `records`, into `dst` (16 bytes more than each record's data).
inline void pack_tfrecords(const std::vector<std::pair<const char*, int64_t>>& records, char* dst) {
  for (const auto& [data, n] : records) {
    const uint64_t length = static_cast<uint64_t>(n);
    std::memcpy(dst, &length, 8);
    const uint32_t length_crc = masked_crc32c(dst, 8);
    std::memcpy(dst + 8, &length_crc, 4);
    std::memcpy(dst + 12, data, static_cast<size_t>(n));
    const uint32_t data_crc = masked_crc32c(data, static_cast<size_t>(n));
    std::memcpy(dst + 12 + n, &data_crc, 4);
    dst += 16 + n;
  }
}

}  // namespace shardrec
