// What each training step changed in an index, so that a checkpoint of step T can be taken as of
// step T exactly although the input pipeline has looked up (counted, admitted, evicted for)
// batches T, T+1, ... already: each change records the key's state before it, and undo() replays
// the steps >= T backwards. A bounded number of steps is kept; a save further behind is not exact,
// and says so. Not thread-safe: the owning EmbeddingIndex holds its lock.
#pragma once

#include <climits>
#include <cstdint>
#include <deque>
#include <stdexcept>
#include <unordered_map>
#include <vector>

namespace shardrec {

// A key's state as a checkpoint holds it: its row (-1: still counting), count and last-seen timestamp.
struct KeyState {
  int32_t row;
  uint32_t count;
  int64_t ts;
};
using KeyStates = std::unordered_map<int64_t, KeyState>;

class StepJournal {
 public:
  enum class Was : uint8_t { kAbsent, kPending, kRow };
  struct Change {
    int64_t key;
    int64_t ts;
    uint32_t count;
    int32_t row;  // kRow in an eviction: the row held back
    Was was;
  };
  // Steps ahead of training a checkpoint can be taken back from: input pipelines prefetch a few batches.
  static constexpr size_t kSteps = 64;

  // Step `step` begins (before its eviction and lookups); `newest` is the newest timestamp before it.
  void begin(int64_t step, int64_t newest) {
    if (!steps_.empty() && steps_.back().step >= step) steps_.clear();  // the steps started again (restore)
    while (steps_.size() >= kSteps) {
      dropped_upto_ = steps_.front().step;
      retire_oldest();
    }
    // A retired step's buffers, kept: a fresh megabyte a step cost page faults on every batch.
    Step s;
    if (!spare_.empty()) {
      s = std::move(spare_.back());
      spare_.pop_back();
    }
    s.step = step;
    s.newest_before = newest;
    s.evicted.clear();
    s.looked_up.clear();
    steps_.push_back(std::move(s));
  }
  // Where the current step's changes go (null before the first step).
  std::vector<Change>* looked_up() { return steps_.empty() ? nullptr : &steps_.back().looked_up; }
  std::vector<Change>* evicted() { return steps_.empty() ? nullptr : &steps_.back().evicted; }

  // Training passed every step < trained_step: their changes are needed no more.
  void retire_before(int64_t trained_step) {
    while (!steps_.empty() && steps_.front().step < trained_step) retire_oldest();
  }
  void clear() {
    steps_.clear();
    dropped_upto_ = INT64_MIN;
  }
  // Whether undo(step) gives the state of `step` exactly.
  bool reaches(int64_t step) const { return dropped_upto_ < step; }

  // Takes the steps >= `step` back from `rows` (keys with a row) and `pending` (keys counting), in
  // reverse: each step's lookups, then its eviction, which came first. Returns the newest timestamp
  // as of `step` (`newest` when no step is undone). partial: `rows` holds some of the keys only (a
  // delta's changed keys); a lookup of another key is not taken back (that key is not saved).
  int64_t undo(int64_t step, KeyStates& rows, KeyStates& pending, int64_t newest, bool partial = false) const {
    for (auto j = steps_.rbegin(); j != steps_.rend() && j->step >= step; ++j) {
      for (auto c = j->looked_up.rbegin(); c != j->looked_up.rend(); ++c) {
        if (c->was == Was::kRow) {
          const auto e = rows.find(c->key);
          if (e == rows.end()) {
            if (partial) continue;
            throw std::logic_error("the step journal names a key that the index does not hold");
          }
          e->second.count = c->count;
          e->second.ts = c->ts;
          continue;
        }
        rows.erase(c->key);
        pending.erase(c->key);
        if (c->was == Was::kPending) pending[c->key] = KeyState{-1, c->count, c->ts};
      }
      for (auto c = j->evicted.rbegin(); c != j->evicted.rend(); ++c)
        (c->was == Was::kRow ? rows : pending)[c->key] = KeyState{c->row, c->count, c->ts};
      newest = j->newest_before;
    }
    return newest;
  }

 private:
  struct Step {
    int64_t step = 0;
    int64_t newest_before = -1;
    std::vector<Change> evicted, looked_up;
  };
  void retire_oldest() {
    if (spare_.size() < 2) spare_.push_back(std::move(steps_.front()));
    steps_.pop_front();
  }

  std::deque<Step> steps_;
  std::vector<Step> spare_;
  int64_t dropped_upto_ = INT64_MIN;
};

}  // namespace shardrec
