// A location's row, admission metadata (count, last-seen timestamp) and change flag, wherever it
// lives: a memory row in the row store, or an SSD record (ssd_rows.h; location capacity + 1 + its
// record). The index, its change tracking and its export read and write rows through it, so that
// none of them asks which tier a location is in. Not locked: the index holds its lock around every
// call.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

#include "storage/row_store.h"
#include "storage/ssd_rows.h"

namespace shardrec {

class LocatedRows {
 public:
  LocatedRows(RowStore* store, const Locations& at, const std::unique_ptr<SsdRows>& ssd)
      : store_(store), at_(at), ssd_(ssd) {}

  bool on_ssd(int32_t loc) const { return at_.on_ssd(loc); }
  RowFormat format(int c) const { return store_->format(c); }

  uint32_t& count(int32_t loc) { return at_.on_ssd(loc) ? ssd_->count(loc) : store_->counts()[loc]; }
  int64_t& ts(int32_t loc) { return at_.on_ssd(loc) ? ssd_->last_seen(loc) : store_->last_seen()[loc]; }
  uint32_t count(int32_t loc) const { return at_.on_ssd(loc) ? ssd_->count(loc) : store_->counts()[loc]; }
  int64_t ts(int32_t loc) const { return at_.on_ssd(loc) ? ssd_->last_seen(loc) : store_->last_seen()[loc]; }

  uint8_t changed(int32_t loc) const { return at_.on_ssd(loc) ? ssd_->changed(loc) : store_->changed()[loc]; }
  void set_changed(int32_t loc, uint8_t flag) {
    if (at_.on_ssd(loc))
      ssd_->changed(loc) = flag;
    else
      store_->changed()[loc] = flag;
  }

  // Column `c` of the rows at `locs` (which hold `keys`) as float32 / written from float32 `in`: SSD
  // rows are checked against their keys and checksums.
  void read(int c, const int64_t* keys, const int32_t* locs, size_t n, float* out) const {
    if (!ssd_) {
      store_->read_rows(c, locs, static_cast<int64_t>(n), out);
      return;
    }
    const int64_t dim = store_->dim();
    for (size_t i = 0; i < n; ++i) {
      if (at_.on_ssd(locs[i]))
        ssd_->read_row(c, keys[i], locs[i], out + i * dim);
      else
        store_->read_rows(c, locs + i, 1, out + i * dim);
    }
  }
  void write(int c, const int64_t* keys, const int32_t* locs, size_t n, const float* in) {
    const int64_t dim = store_->dim();
    for (size_t i = 0; i < n; ++i) {
      if (at_.on_ssd(locs[i]))
        ssd_->write_row(c, keys[i], locs[i], in + i * dim);
      else
        store_->write_rows(c, locs + i, 1, in + i * dim);
    }
  }

 private:
  RowStore* const store_;
  const Locations& at_;
  const std::unique_ptr<SsdRows>& ssd_;  // set after construction (EmbeddingIndex::set_ssd)
};

}  // namespace shardrec
