// The SSD tier of one table shard: rows that do not fit in the shard's memory budget, in files the
// native core owns under the table's ssd_data_path directories.
//
// Files: <dir>/shardrec-ssd-<table>-rank<r>-pid<p>-<n>/segment-<i>.ssd. Format (version 1). Each
// file is a segment: a 4096-byte header (magic "SHRDSSD1", version,
// floats per record, record bytes, records, the table and rank as text), then fixed-size records:
//   int64 key | uint32 checksum | uint32 reserved (0) | floats: values, then each optimizer slot
// The checksum covers the record's number, key and floats, so a record that was damaged, zeroed or
// moved within a file fails it. Counts and timestamps of SSD rows stay in the index's memory
// (eviction scans every key's timestamp; reading them from disk would read the whole tier).
//
// A segment is created with posix_fallocate, so a full disk is an error when the space is
// reserved (ENOSPC), never a SIGBUS on a later write: the next directory of ssd_data_path is tried,
// and when every one is full, the error names them. Segments are mapped (MAP_SHARED): reading and
// writing rows is a memcpy, batched per lookup and spread over threads, never a system call per
// row; the kernel writes dirty pages back in the background. The files are scratch space: a
// checkpoint saves SSD rows like any other, and the files are removed when the table goes.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "storage/row_store.h"

namespace shardrec {

// The SSD tier cannot take more rows: its share of ssd_vocabulary_size is used, or no directory of
// ssd_data_path has space. A CapacityError: the exchange's agreement round stops every rank.
class TierFullError : public CapacityError {
 public:
  using CapacityError::CapacityError;
};

// A record failed its checksum: the file is damaged.
class TierDamagedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class SsdTier {
 public:
  static constexpr int64_t kHeaderBytes = 4096;
  static constexpr int64_t kRecordHeader = 16;

  // `max_records`: this rank's share of ssd_vocabulary_size. Nothing is created on disk until the
  // first row moves down.
  SsdTier(std::string table, int rank, std::vector<std::string> dirs, int64_t max_records)
      : table_(std::move(table)), rank_(rank), dirs_(std::move(dirs)), max_records_(max_records) {
    if (dirs_.empty()) throw std::invalid_argument("the SSD tier needs at least one directory");
    full_.assign(dirs_.size(), false);
  }
  ~SsdTier() { remove_files(); }
  SsdTier(const SsdTier&) = delete;
  SsdTier& operator=(const SsdTier&) = delete;

  // Floats per record (values and every optimizer slot): fixed by the first row that moves down.
  void set_floats(int64_t floats) {
    if (!segments_.empty() && floats != floats_)
      throw std::logic_error("table '" + table_ + "': an optimizer slot was added after rows moved to the SSD tier");
    floats_ = floats;
  }
  int64_t floats() const { return floats_; }
  int64_t record_bytes() const { return kRecordHeader + floats_ * static_cast<int64_t>(sizeof(float)); }
  int64_t max_records() const { return max_records_; }
  int64_t in_use() const { return in_use_; }
  const std::vector<std::string>& files() const { return paths_; }

  // Reserves room for `n` more records (creating segments, on the next directory when one is
  // full) before anything moves: a full tier throws here, with no row moved.
  void reserve(int64_t n) {
    check_open();
    if (in_use_ + n > max_records_)
      throw TierFullError("table '" + table_ + "': its SSD tier is full on rank " + std::to_string(rank_) + " (" +
                          std::to_string(max_records_) + " rows, its share of ssd_vocabulary_size); raise "
                          "ssd_vocabulary_size or host_vocabulary_size, or evict keys");
    while (static_cast<int64_t>(free_.size()) + (capacity() - next_) < n) add_segment();
  }

  // A record reserved by reserve().
  int32_t take() {
    int32_t r;
    if (!free_.empty()) {
      r = free_.back();
      free_.pop_back();
    } else {
      if (next_ >= capacity()) reserve(1);
      r = static_cast<int32_t>(next_++);
    }
    ++in_use_;
    return r;
  }
  void release(int32_t r) {
    free_.push_back(r);
    --in_use_;
  }
  // Every record free again; the files stay (their space is reserved).
  void clear() {
    free_.clear();
    next_ = 0;
    in_use_ = 0;
  }

  // Writes records[i] from the columns' rows rows[i] (key keys[i]); in parallel for large batches.
  void write(const int32_t* records, const int64_t* keys, const int32_t* rows, size_t n, float* const* columns,
             int n_columns, int64_t dim) {
    parallel_for(static_cast<int64_t>(n), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        char* rec = at(records[i]);
        std::memcpy(rec, &keys[i], 8);
        float* f = reinterpret_cast<float*>(rec + kRecordHeader);
        for (int c = 0; c < n_columns; ++c)
          std::memcpy(f + c * dim, columns[c] + static_cast<int64_t>(rows[i]) * dim, dim * sizeof(float));
        const uint32_t zero = 0, sum = checksum(records[i], rec);
        std::memcpy(rec + 8, &sum, 4);
        std::memcpy(rec + 12, &zero, 4);
      }
    });
  }

  // Reads records[i] (which must hold keys[i]) into the columns' rows rows[i].
  void read(const int32_t* records, const int64_t* keys, const int32_t* rows, size_t n, float* const* columns,
            int n_columns, int64_t dim) {
    check_open();
    verify(records, keys, n);
    parallel_for(static_cast<int64_t>(n), 4096, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const float* f = reinterpret_cast<const float*>(at(records[i]) + kRecordHeader);
        for (int c = 0; c < n_columns; ++c)
          std::memcpy(columns[c] + static_cast<int64_t>(rows[i]) * dim, f + c * dim, dim * sizeof(float));
      }
    });
  }

  // One column of records (checkpoints): out[i] = column c of records[i] / the other way round.
  void read_column(const int32_t* records, const int64_t* keys, size_t n, int c, int64_t dim, float* out) {
    check_open();
    verify(records, keys, n);
    for (size_t i = 0; i < n; ++i)
      std::memcpy(out + i * dim, at(records[i]) + kRecordHeader + c * dim * sizeof(float), dim * sizeof(float));
  }
  void write_column(const int32_t* records, const int64_t* keys, size_t n, int c, int64_t dim, const float* in) {
    check_open();
    for (size_t i = 0; i < n; ++i) {
      char* rec = at(records[i]);
      std::memcpy(rec, &keys[i], 8);
      std::memcpy(rec + kRecordHeader + c * dim * sizeof(float), in + i * dim, dim * sizeof(float));
      const uint32_t sum = checksum(records[i], rec);
      std::memcpy(rec + 8, &sum, 4);
    }
  }

  uint64_t file_bytes() const { return static_cast<uint64_t>(capacity()) * record_bytes() + segments_.size() * kHeaderBytes; }

  // At a clean shutdown: the files go; the counts stay (what the tier held when it closed), and
  // any later use is an error rather than a read of unmapped memory.
  void remove_files() {
    closed_ = true;
    for (auto& s : segments_) {
      munmap(s.base, s.bytes);
      close(s.fd);
    }
    for (const auto& p : paths_) unlink(p.c_str());
    for (const auto& d : made_dirs_) rmdir(d.c_str());
    segments_.clear();
    paths_.clear();
    made_dirs_.clear();
  }

 private:
  void check_open() const {
    if (closed_)
      throw std::logic_error("table '" + table_ + "': its SSD tier was closed (the table's files are removed at "
                             "shutdown); create the table again to use it");
  }

  struct Segment {
    int fd;
    char* base;
    int64_t bytes;
  };

  int64_t capacity() const { return static_cast<int64_t>(segments_.size()) * segment_records_; }

  char* at(int32_t record) const {
    const Segment& s = segments_[record / segment_records_];
    return s.base + kHeaderBytes + (record % segment_records_) * record_bytes();
  }

  // Segments of about 16 MiB: few files, and a full disk is found a segment ahead.
  int64_t segment_records() const {
    return std::clamp<int64_t>((16LL << 20) / record_bytes(), 256, std::max<int64_t>(256, max_records_));
  }

  void add_segment() {
    if (segments_.empty()) segment_records_ = segment_records();
    const int64_t bytes = kHeaderBytes + segment_records_ * record_bytes();
    std::string errors;
    for (size_t d = 0; d < dirs_.size(); ++d) {
      if (full_[d]) continue;
      const std::string dir = own_dir(d, errors);
      if (dir.empty()) {
        full_[d] = true;
        continue;
      }
      const std::string path = dir + "/segment-" + std::to_string(segments_.size()) + ".ssd";
      const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
      if (fd < 0) {
        errors += "; " + path + ": " + std::strerror(errno);
        full_[d] = true;
        continue;
      }
      const int err = posix_fallocate(fd, 0, bytes);
      if (err != 0) {
        close(fd);
        unlink(path.c_str());
        errors += "; " + dirs_[d] + ": " + std::strerror(err);
        full_[d] = true;
        continue;
      }
      void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (base == MAP_FAILED) {
        const int e = errno;
        close(fd);
        unlink(path.c_str());
        throw TierFullError("table '" + table_ + "': cannot map SSD file " + path + ": " + std::strerror(e));
      }
      madvise(base, bytes, MADV_RANDOM);  // rows are read one by one: readahead would read their neighbours
      write_header(static_cast<char*>(base));
      segments_.push_back(Segment{fd, static_cast<char*>(base), bytes});
      paths_.push_back(path);
      return;
    }
    std::string all;
    for (const auto& d : dirs_) all += (all.empty() ? "" : ", ") + d;
    throw TierFullError("table '" + table_ + "': no directory of ssd_data_path [" + all + "] has room for " +
                        std::to_string(bytes >> 20) + " MiB more of its SSD tier on rank " + std::to_string(rank_) +
                        " (" + std::to_string(in_use_) + " rows there now)" + errors +
                        "; free space there or add a directory to ssd_data_path");
  }

  // This rank's own directory under dirs_[d], made on first use ("" and a reason when it cannot be).
  std::string own_dir(size_t d, std::string& errors) {
    // One directory per tier object: a process may hold two tables of one name (Estimator mode
    // builds a graph for training and another for evaluation).
    static std::atomic<int> made{0};
    if (instance_ < 0) instance_ = made.fetch_add(1);
    const std::string dir = dirs_[d] + "/shardrec-ssd-" + table_ + "-rank" + std::to_string(rank_) + "-pid" +
                            std::to_string(getpid()) + "-" + std::to_string(instance_);
    struct stat st;
    if (stat(dir.c_str(), &st) == 0) return dir;
    if (mkdir(dir.c_str(), 0700) != 0) {
      errors += "; " + dir + ": " + std::strerror(errno);
      return "";
    }
    made_dirs_.push_back(dir);
    return dir;
  }

  void write_header(char* h) const {
    std::memset(h, 0, kHeaderBytes);
    std::memcpy(h, "SHRDSSD1", 8);
    const int64_t fields[4] = {1, floats_, record_bytes(), segment_records_};
    std::memcpy(h + 8, fields, sizeof(fields));
    std::snprintf(h + 64, 256, "table %s rank %d", table_.c_str(), rank_);
  }

  void verify(const int32_t* records, const int64_t* keys, size_t n) const {
    for (size_t i = 0; i < n; ++i) {
      const char* rec = at(records[i]);
      int64_t key;
      uint32_t sum;
      std::memcpy(&key, rec, 8);
      std::memcpy(&sum, rec + 8, 4);
      if (key != keys[i] || sum != checksum(records[i], rec)) {
        const int64_t seg = records[i] / segment_records_;
        throw TierDamagedError("table '" + table_ + "': SSD file " + paths_[seg] + " is damaged: record " +
                               std::to_string(records[i] % segment_records_) + " (byte " +
                               std::to_string(kHeaderBytes + (records[i] % segment_records_) * record_bytes()) +
                               ") should hold key " + std::to_string(keys[i]) + " but " +
                               (key != keys[i] ? "holds key " + std::to_string(key) : std::string("fails its checksum")) +
                               "; the rows of the SSD tier cannot be trusted: restart from the last checkpoint");
      }
    }
  }

  // 32 bits of a 64-bit multiply-xor hash of the record's number, key and floats.
  uint32_t checksum(int32_t record, const char* rec) const {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(record) * 0xff51afd7ed558ccdULL;
    auto mixin = [&h](uint64_t w) {
      h ^= w;
      h *= 0xc4ceb9fe1a85ec53ULL;
      h ^= h >> 29;
    };
    uint64_t w;
    std::memcpy(&w, rec, 8);
    mixin(w);
    const char* f = rec + kRecordHeader;
    const int64_t bytes = floats_ * static_cast<int64_t>(sizeof(float));
    int64_t i = 0;
    for (; i + 8 <= bytes; i += 8) {
      std::memcpy(&w, f + i, 8);
      mixin(w);
    }
    if (i < bytes) {
      w = 0;
      std::memcpy(&w, f + i, bytes - i);
      mixin(w);
    }
    mixin(static_cast<uint64_t>(bytes));
    return static_cast<uint32_t>(h ^ (h >> 32));
  }

  const std::string table_;
  const int rank_;
  const std::vector<std::string> dirs_;
  const int64_t max_records_;
  std::vector<bool> full_;
  bool closed_ = false;
  int instance_ = -1;
  int64_t floats_ = 0;
  int64_t segment_records_ = 0;
  std::vector<Segment> segments_;
  std::vector<std::string> paths_, made_dirs_;
  std::vector<int32_t> free_;
  int64_t next_ = 0, in_use_ = 0;
};

}  // namespace shardrec
