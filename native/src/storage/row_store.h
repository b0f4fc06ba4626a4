// One table shard's rows, in memory the native core owns: the embedding values, one column per
// optimizer slot (each column float32 or 16-bit, row_format.h), and per-row metadata (occurrence count, last-seen timestamp, and a byte that says
// whether the row changed since the last checkpoint, for incremental saves).
//
// Each column is one reservation of address space for every row the shard may ever hold (mmap,
// MAP_NORESERVE: reserving costs no memory); rows come into use a chunk at a time, and only a chunk
// in use is written and therefore resident. Growth never moves a row: a row's address is fixed for
// the life of the store, which is what lets a TensorFlow variable's buffer be a column (the
// variable is bound to it by the op library, tf_row_store_ops.cc) while the key pipeline grows the
// shard on another thread: a kernel only ever reads rows that the pipeline handed out, and those
// were in use before the pipeline handed them out.
//
// Header-only: the pybind11 core (the key index grows the store) and the TensorFlow op library (a
// variable's buffer) both use it; the object itself is shared between them by address and kept
// alive by a reference count.
#pragma once

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "exchange/channel.h"
#include "storage/row_format.h"

namespace shardrec {

class CapacityError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a new row's values start as: the table's emb_initializer, drawn natively (scale is init_param).
struct RowInit {
  enum Kind : int32_t { kConstant = 0, kUniform = 1, kNormal = 2, kTruncatedNormal = 3 };
  int32_t kind = kConstant;
  double a = 0, b = 0;  // constant: a; uniform: [a, b); normal and truncated: mean a, stddev b
  uint64_t seed = 0;
  double scale = 1;
};

struct StoreBytes {
  uint64_t values = 0, slots = 0, metadata = 0;
};

// work(begin, end) over [0, n) on up to hardware_concurrency threads, one per `grain` items at
// least (one thread for small n): bulk row copies, which the pybind11 core runs without TensorFlow's
// thread pool.
template <typename F>
void parallel_for(int64_t n, int64_t grain, F&& work) {
  const int64_t threads = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), n / grain + 1);
  if (threads <= 1) {
    work(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int64_t t = 0; t < threads; ++t) {
    const int64_t b = t * per, e = std::min(n, b + per);
    if (b < e) pool.emplace_back([&work, b, e] { work(b, e); });
  }
  for (auto& th : pool) th.join();
}

class RowStore {
 public:
  static constexpr int kMaxColumns = 8;  // values + up to 7 optimizer slots
  static constexpr int64_t kChunkRows = 4096;

  // `rows`: every row the shard may hold (the sentinel included); memory_limit: bytes of rows in
  // use (all columns and metadata) at which growth stops, 0 for none.
  RowStore(const std::string& name, int64_t dim, int64_t rows, int64_t memory_limit, RowInit init,
           RowFormat values_format = RowFormat::kFloat32)
      : dim_(dim), rows_(rows), memory_limit_(memory_limit), init_(init) {
    if (dim < 1 || rows < 1) throw std::invalid_argument("row store: dim and rows must be >= 1");
    std::snprintf(name_, sizeof(name_), "%s", name.c_str());
    reserved_rows_ = (rows + kChunkRows - 1) / kChunkRows * kChunkRows;
    formats_[0] = values_format;
    columns_[0] = reserve(column_bytes(0));
    column_init_[0] = 0;
    n_columns_ = 1;
    counts_ = static_cast<uint32_t*>(reserve(reserved_rows_ * sizeof(uint32_t)));
    last_seen_ = static_cast<int64_t*>(reserve(reserved_rows_ * sizeof(int64_t)));
    changed_ = static_cast<uint8_t*>(reserve(reserved_rows_));
    row_keys_ = static_cast<int64_t*>(reserve(reserved_rows_ * sizeof(int64_t)));
  }

  ~RowStore() {
    for (int c = 0; c < n_columns_; ++c) {
      if (c == 0 && release_values_ != nullptr)
        release_values_(values_owner_);
      else
        munmap(columns_[c], column_bytes(c));
    }
    munmap(counts_, reserved_rows_ * sizeof(uint32_t));
    munmap(last_seen_, reserved_rows_ * sizeof(int64_t));
    munmap(changed_, reserved_rows_);
    munmap(row_keys_, reserved_rows_ * sizeof(int64_t));
  }

  RowStore(const RowStore&) = delete;
  RowStore& operator=(const RowStore&) = delete;

  void ref() { refs_.fetch_add(1, std::memory_order_relaxed); }
  void unref() {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }

  const char* name() const { return name_; }
  int64_t dim() const { return dim_; }
  int64_t rows() const { return rows_; }
  int n_columns() const { return n_columns_; }
  void* column_data(int c) const { return columns_[c]; }
  RowFormat format(int c) const { return formats_[c]; }
  // A float32 column (the SSD tier, which holds float32 rows only).
  float* column(int c) const {
    if (formats_[c] != RowFormat::kFloat32)
      throw std::logic_error(std::string("table '") + name_ + "': column " + std::to_string(c) + " is 16-bit");
    return static_cast<float*>(columns_[c]);
  }
  // Bytes of every reserved row of column c.
  size_t column_bytes(int c) const { return reserved_rows_ * dim_ * element_bytes(formats_[c]); }
  uint32_t* counts() const { return counts_; }
  int64_t* last_seen() const { return last_seen_; }
  // 1 for a row that changed since the last checkpoint (an incremental save writes those rows): set
  // by the sparse optimizers' kernels for every row they update (while tracking is on: a job with
  // incremental checkpoints) and by the key index for a row that a new key takes; cleared by a save.
  uint8_t* changed() const { return changed_; }
  uint8_t* changed_if_tracked() const { return tracking_.load(std::memory_order_relaxed) ? changed_ : nullptr; }
  void set_tracking(bool on) { tracking_.store(on, std::memory_order_relaxed); }
  // The key each memory row was taken for, kept by the key index while tracking is on, so that a
  // delta finds the keys of the changed rows without a pass over the key map. Address space is
  // reserved for every row; only the rows of a tracked table are ever written (8 bytes each).
  int64_t* row_keys() const { return row_keys_; }
  // How the optimizers' kernels write a 16-bit row back: stochastically (the default) or to the
  // nearest (the oracle tests' setting: then an update equals TensorFlow's on a 16-bit variable).
  bool stochastic_rounding() const { return stochastic_.load(std::memory_order_relaxed); }
  void set_stochastic_rounding(bool on) { stochastic_.store(on, std::memory_order_relaxed); }
  // The table's own count of updates: the rounding's seed when the graph gives no training step.
  uint64_t next_update() { return updates_.fetch_add(1, std::memory_order_relaxed); }
  // Rows in use: [0, in_use) are initialised and resident.
  int64_t in_use() const { return in_use_.load(std::memory_order_acquire); }
  int64_t memory_limit() const { return memory_limit_; }

  int64_t bytes_per_row() const {
    int64_t b = sizeof(uint32_t) + sizeof(int64_t) + sizeof(uint8_t);
    for (int c = 0; c < n_columns_; ++c) b += dim_ * element_bytes(formats_[c]);
    return b;
  }

  StoreBytes bytes() const {
    std::lock_guard<std::mutex> g(mu_);
    const uint64_t rows = in_use_.load();
    StoreBytes b;
    b.values = rows * dim_ * element_bytes(formats_[0]);
    for (int c = 1; c < n_columns_; ++c) b.slots += rows * dim_ * element_bytes(formats_[c]);
    b.metadata = rows * (sizeof(uint32_t) + sizeof(int64_t) + sizeof(uint8_t));
    return b;
  }

  // A column for an optimizer slot whose rows start at `init`; rows already in use get it now.
  int add_column(float init, RowFormat format = RowFormat::kFloat32) {
    std::lock_guard<std::mutex> g(mu_);
    if (n_columns_ == kMaxColumns)
      throw std::invalid_argument(std::string("table '") + name_ + "': at most " + std::to_string(kMaxColumns - 1) +
                                  " optimizer slot columns");
    const int c = n_columns_;
    formats_[c] = format;
    columns_[c] = reserve(column_bytes(c));
    column_init_[c] = init;
    n_columns_ = c + 1;
    fill_constant(c, 0, in_use_.load(), init);
    return c;
  }

  // Puts rows [0, n) in use, a chunk at a time; a chunk's values are drawn and its slots filled.
  void ensure_rows(int64_t n) {
    if (n <= in_use()) return;
    std::lock_guard<std::mutex> g(mu_);
    int64_t used = in_use_.load();
    if (n <= used) return;
    if (n > rows_)
      throw CapacityError(std::string("table '") + name_ + "': row " + std::to_string(n - 1) + " is beyond its " +
                          std::to_string(rows_) + " rows");
    const int64_t target = std::min((n + kChunkRows - 1) / kChunkRows * kChunkRows, reserved_rows_);
    if (memory_limit_ > 0 && target * bytes_per_row() > memory_limit_) {
      throw CapacityError(std::string("table '") + name_ + "': its memory limit of " + std::to_string(memory_limit_) +
                          " bytes on this rank is reached (" + std::to_string(used) + " rows of " +
                          std::to_string(bytes_per_row()) + " bytes: values, optimizer slots and metadata); raise "
                          "SHARDREC_TABLE_MEMORY_LIMIT (bytes per table and rank, suffixes K/M/G) or evict keys");
    }
    for (int64_t begin = used; begin < target; begin += kChunkRows) start_chunk(begin, std::min(begin + kChunkRows, target));
    in_use_.store(target, std::memory_order_release);
  }

  // Draws the values of rows in use again and refills their slots: what a variable initializer
  // that runs again does.
  void reinitialise(int column) {
    std::lock_guard<std::mutex> g(mu_);
    const int64_t used = in_use_.load();
    if (column == 0) {
      for (int64_t begin = 0; begin < used; begin += kChunkRows) draw_values(begin, std::min(begin + kChunkRows, used));
    } else {
      fill_constant(column, 0, used, column_init_[column]);
    }
  }

  // How rows drawn from now on start (a table of fixed size that evicts: its freed rows are drawn again).
  void set_init(const RowInit& init) {
    std::lock_guard<std::mutex> g(mu_);
    init_ = init;
  }

  // A freed row taken again: fresh initial values, fresh slots and metadata. A generator that
  // costs nothing to seed: after an eviction, rows are taken again by the hundred thousand, and
  // seeding a Mersenne Twister for each cost more than the rest of the lookup.
  void reset_row(int64_t r) {
    SplitMix gen{mix(init_.seed ^ 0x5bd1e995ULL, static_cast<uint64_t>(r) + 0x9e3779b97f4a7c15ULL * (++reuse_epoch_))};
    if (formats_[0] == RowFormat::kFloat32) {
      draw(gen, static_cast<float*>(columns_[0]) + r * dim_, dim_);
    } else {
      draw(gen, scratch(dim_), dim_);
      narrow_nearest(scratch_.data(), dim_, formats_[0], at(0, r));
    }
    for (int c = 1; c < n_columns_; ++c) fill_constant(c, r, r + 1, column_init_[c]);
    counts_[r] = 0;
    last_seen_[r] = 0;
  }

  // A new key's row in a table with an SSD tier: values drawn from the key alone, so that a key
  // starts from the same values whichever row, tier or rank count it lands in.
  void reset_row_for_key(int64_t r, int64_t key) {
    for (int c = 0; c < n_columns_; ++c) fresh_row(key, c, column(c) + r * dim_);
    counts_[r] = 0;
    last_seen_[r] = 0;
  }
  // Column c of key's fresh row: its drawn values, or the slot's initial value.
  void fresh_row(int64_t key, int c, float* out) const {
    if (c > 0) {
      std::fill(out, out + dim_, column_init_[c]);
      return;
    }
    SplitMix gen{mix(init_.seed ^ 0x7f4a7c159e3779b9ULL, static_cast<uint64_t>(key))};
    draw(gen, out, dim_);
  }

  // Batches whose rows a lookup kernel has read, per key-pipeline channel: the
  // op library's row gather reports each batch's ticket (embedding_index.h's pins). Once batch t
  // of a channel is read, the batches before it are done: the session ran their steps.
  void note_gathered(Channel channel, uint32_t ticket) {
    std::atomic<uint32_t>& g = gathered_[index_of(channel)];
    uint32_t seen = g.load(std::memory_order_relaxed);
    while (ticket > seen && !g.compare_exchange_weak(seen, ticket, std::memory_order_release)) {
    }
  }
  uint32_t gathered(Channel channel) const { return gathered_[index_of(channel)].load(std::memory_order_acquire); }

  // A table of fixed size takes TensorFlow's initial values as they are: the values column becomes
  // `values` (all rows() rows, owned by the caller until release(owner) is called), so that neither
  // a copy nor TensorFlow's freed initializer output (which its allocator keeps) costs memory. Every
  // row is in use from here on; the last row, the sentinel, is zeroed.
  using Release = void (*)(void*);
  void adopt_values(float* values, Release release, void* owner) {
    if (formats_[0] != RowFormat::kFloat32) throw std::logic_error("a 16-bit values column cannot adopt float32 values");
    ensure_rows(rows_);
    std::lock_guard<std::mutex> g(mu_);
    if (release_values_ != nullptr)
      release_values_(values_owner_);
    else
      munmap(columns_[0], column_bytes(0));
    columns_[0] = values;
    release_values_ = release;
    values_owner_ = owner;
    std::memset(values + (rows_ - 1) * dim_, 0, dim_ * sizeof(float));
  }

  // A fixed table's initial values (all rows() rows, float32) into a 16-bit values column, each to
  // the nearest: the float32 column adopts TensorFlow's buffer instead (adopt_values).
  void narrow_values(const float* values) {
    ensure_rows(rows_);
    std::lock_guard<std::mutex> g(mu_);
    parallel(rows_ - 1, [&](int64_t b, int64_t e) { narrow_nearest(values + b * dim_, (e - b) * dim_, formats_[0], at(0, b)); });
    std::memset(at(0, rows_ - 1), 0, dim_ * element_bytes(formats_[0]));
  }

  // Where row r of column c starts.
  void* at(int c, int64_t r) const {
    return static_cast<char*>(columns_[c]) + r * dim_ * element_bytes(formats_[c]);
  }

  // out[i] = column[rows[i]] as float32; in[i] -> column[rows[i]], 16-bit columns to the nearest:
  // parallel over rows.
  template <typename Index>
  void read_rows(int c, const Index* rows, int64_t n, float* out) const {
    parallel(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) widen(at(c, static_cast<int64_t>(rows[i])), formats_[c], dim_, out + i * dim_);
    });
  }
  template <typename Index>
  void write_rows(int c, const Index* rows, int64_t n, const float* in) {
    parallel(n, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) narrow_nearest(in + i * dim_, dim_, formats_[c], at(c, static_cast<int64_t>(rows[i])));
    });
  }

 private:
  static uint64_t mix(uint64_t a, uint64_t b) {
    uint64_t z = a * 0x9e3779b97f4a7c15ULL + b;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }

  float* scratch(int64_t n) const {
    if (static_cast<int64_t>(scratch_.size()) < n) scratch_.resize(n);
    return scratch_.data();
  }

  void* reserve(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw CapacityError(std::string("table '") + name_ + "': cannot reserve " + std::to_string(bytes >> 20) +
                          " MiB of address space for its rows (" + std::strerror(errno) +
                          "); set SHARDREC_TABLE_MEMORY_LIMIT (bytes per table and rank) to what the table may use");
    }
    return p;
  }

  void start_chunk(int64_t begin, int64_t end) {
    draw_values(begin, end);
    for (int c = 1; c < n_columns_; ++c) fill_constant(c, begin, end, column_init_[c]);
    std::memset(counts_ + begin, 0, (end - begin) * sizeof(uint32_t));
    std::memset(last_seen_ + begin, 0, (end - begin) * sizeof(int64_t));
    std::memset(changed_ + begin, 0, end - begin);
  }

  // A chunk's values depend on the seed and the chunk's place alone, so a shard that grows draws
  // the same rows whatever order its chunks come into use in.
  void draw_values(int64_t begin, int64_t end) {
    end = std::min(end, rows_);  // an adopted values column holds rows() rows, no more
    if (begin >= end) return;
    std::mt19937_64 gen(mix(init_.seed, static_cast<uint64_t>(begin / kChunkRows)));
    const int64_t n = (end - begin) * dim_;
    if (formats_[0] == RowFormat::kFloat32) {
      draw(gen, static_cast<float*>(at(0, begin)), n);
    } else {
      std::vector<float> drawn(n);  // a chunk at a time: rare enough to allocate
      draw(gen, drawn.data(), n);
      narrow_nearest(drawn.data(), n, formats_[0], at(0, begin));
    }
    // The last row is the sentinel, which stays zero (what a key without a row reads).
    if (end == rows_) std::memset(at(0, rows_ - 1), 0, dim_ * element_bytes(formats_[0]));
  }

  // splitmix64 as a UniformRandomBitGenerator.
  struct SplitMix {
    using result_type = uint64_t;
    uint64_t state;
    static constexpr result_type min() { return 0; }
    static constexpr result_type max() { return UINT64_MAX; }
    result_type operator()() {
      uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      return z ^ (z >> 31);
    }
  };

  template <typename Gen>
  void draw(Gen& gen, float* out, int64_t n) const {
    switch (init_.kind) {
      case RowInit::kUniform: {
        std::uniform_real_distribution<double> d(init_.a, init_.b);
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(d(gen) * init_.scale);
        break;
      }
      case RowInit::kNormal: {
        std::normal_distribution<double> d(init_.a, init_.b);
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(d(gen) * init_.scale);
        break;
      }
      case RowInit::kTruncatedNormal: {
        // As TensorFlow's: draws further than two standard deviations from the mean are drawn again.
        std::normal_distribution<double> d(0.0, 1.0);
        for (int64_t i = 0; i < n; ++i) {
          double x;
          do x = d(gen);
          while (std::fabs(x) > 2.0);
          out[i] = static_cast<float>((init_.a + init_.b * x) * init_.scale);
        }
        break;
      }
      default:
        std::fill(out, out + n, static_cast<float>(init_.a * init_.scale));
    }
  }

  void fill_constant(int c, int64_t begin, int64_t end, float value) {
    if (formats_[c] == RowFormat::kFloat32) {
      std::fill(static_cast<float*>(at(c, begin)), static_cast<float*>(at(c, end)), value);
      return;
    }
    uint16_t v16;
    narrow_nearest(&value, 1, formats_[c], &v16);
    std::fill(static_cast<uint16_t*>(at(c, begin)), static_cast<uint16_t*>(at(c, end)), v16);
  }

  template <typename F>
  static void parallel(int64_t n, F&& work) {
    parallel_for(n, 16384, work);
  }

  char name_[128];
  const int64_t dim_;
  const int64_t rows_;
  int64_t reserved_rows_;
  const int64_t memory_limit_;
  RowInit init_;
  void* columns_[kMaxColumns] = {};
  RowFormat formats_[kMaxColumns] = {};
  // A freed row's draw for a 16-bit values column, before it is narrowed (the index's lock held).
  mutable std::vector<float> scratch_;
  float column_init_[kMaxColumns] = {};
  int n_columns_ = 0;
  uint32_t* counts_ = nullptr;
  int64_t* last_seen_ = nullptr;
  uint8_t* changed_ = nullptr;
  int64_t* row_keys_ = nullptr;
  std::atomic<bool> tracking_{false};
  std::atomic<bool> stochastic_{true};
  std::atomic<uint64_t> updates_{0};
  std::atomic<int64_t> in_use_{0};
  std::atomic<int> refs_{1};
  std::atomic<uint32_t> gathered_[kChannels] = {};
  uint64_t reuse_epoch_ = 0;
  Release release_values_ = nullptr;
  void* values_owner_ = nullptr;
  mutable std::mutex mu_;
};

}  // namespace shardrec
