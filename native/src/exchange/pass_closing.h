// How a channel's pass ends when a session closes while the ranks' prefetches stand at different
// rounds (issue 75). A step limit (the Estimator's max_steps, a StopAtStepHook) stops a session
// before its data ends and leaves each rank's prefetch wherever it was: one rank may have begun
// the status round of a batch that another rank's prefetch, cancelled by its own close first,
// never begins. Without an answer that round waits for the channel's timeout, the session's close
// waits for that round, and the other rank runs on into its next collective and fails there.
//
// No collective at the close (ranks close their sessions at their own moments, and a rank may have
// left): each close of a session on a channel starts a new epoch there, and every status word
// carries its epoch and round (rounds begun in that epoch). At its close a rank sends every peer
// the word "closed after c rounds of epoch e", once its own round, if one is under way, has ended
// (sent earlier, the word would meet that round's later words at a peer). A peer waiting in round
// c + 1 of epoch e for this rank's status gets that word instead: the round ends on every rank
// that began it, with PeerClosedError, which does not stop the channel (the next session runs),
// and those ranks begin no round until their own close. Every other word of an earlier epoch (a
// close word nobody waited for, the status of a round that a close word ended) is dropped by the
// next pass's first round. Every rank closes the same sessions (as it runs the same steps), so
// epochs agree. A rank that left the job (leave()) ends every round it would be in, with an error
// that stops the channel.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "exchange/channel_comm.h"
#include "exchange/round_status.h"

namespace shardrec {

// A round that cannot run because a session closed: this rank's (its prefetch asks after the
// close), or a peer's (that peer will not begin this round). Not an ExchangeError: the channel
// runs again in the next session.
class PassClosedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};
// The round that a peer's word ended: it says which ranks closed.
class PeerClosedError : public PassClosedError {
 public:
  using PassClosedError::PassClosedError;
};

// The epoch and round of a status word (round_status.h).
struct RoundId {
  int64_t epoch;
  int64_t round;
};

class PassClosing {
 public:
  // Before this rank's round: its epoch and round, or PassClosedError while a session's close
  // (this rank's own, or a peer's that ended the last round) holds the channel.
  RoundId begin_round(const std::string& channel) {
    std::lock_guard<std::mutex> g(mu_);
    if (closing_ || peer_closed_)
      throw PassClosedError("key exchange '" + channel + "': " +
                            (closing_ ? "this rank's session is closing" : "a peer's session closed during this pass") +
                            "; no round begins until the next session");
    in_round_ = true;
    return RoundId{epoch_, ++round_};
  }
  // The round is over (done, or failed). Returns the close word to send now, if the session
  // closed during the round: sent earlier, it would meet the round's later words at a peer.
  const RankStatus* end_round() {
    std::lock_guard<std::mutex> g(mu_);
    in_round_ = false;
    return closing_ && !said_ ? say() : nullptr;
  }
  // A peer's word for this rank's round: its session closed before it began that round.
  void peer_closed() {
    std::lock_guard<std::mutex> g(mu_);
    peer_closed_ = true;
  }
  // The session closes: no round begins any more. Returns the word to send every peer now, or
  // nullptr while a round is under way (end_round() returns it then).
  const RankStatus* close() {
    std::lock_guard<std::mutex> g(mu_);
    closing_ = true;
    said_ = false;
    return in_round_ ? nullptr : say();
  }
  bool closing() {
    std::lock_guard<std::mutex> g(mu_);
    return closing_;
  }
  // The closed session's threads are gone: rounds may begin again. Returns the close word if no
  // round's end has said it (a round still under way, which will find the next epoch's words).
  const RankStatus* reopen() {
    std::lock_guard<std::mutex> g(mu_);
    const RankStatus* word = closing_ && !said_ ? say() : nullptr;
    closing_ = peer_closed_ = false;
    return word;
  }

 private:
  // "Closed after round_ rounds of this epoch", kept alive while its sends may be in flight; the
  // next epoch starts.
  const RankStatus* say() {
    said_ = true;
    RankStatus& word = words_.emplace_back(RankStatus::session_closed(epoch_, round_));
    if (words_.size() > kKept) words_.pop_front();  // long sent: MPI has copied it out by now
    ++epoch_;
    round_ = 0;
    return &word;
  }

  // Words said at closes: a few sessions' worth.
  static constexpr size_t kKept = 64;
  std::mutex mu_;  // the prefetch thread's rounds and the closing thread
  int64_t epoch_ = 0, round_ = 0;
  bool in_round_ = false;
  bool closing_ = false;
  bool said_ = false;
  bool peer_closed_ = false;
  std::deque<RankStatus> words_;
};

// Every peer's word for round `id`: words of earlier epochs are dropped (the peer's next word
// follows); one of a later epoch, or of another round, means the ranks are out of step.
inline void drop_earlier_words(ChannelComm& comm, std::vector<RankStatus>& all, RoundId id) {
  for (int r = 0; r < comm.world(); ++r) {
    while (all[r].epoch < id.epoch) all[r] = comm.receive_words<RankStatus>(r, "status round");
    const RankStatus& w = all[r];
    if (w.signature == RankStatus::kLeft) continue;
    const bool closed = w.signature == RankStatus::kSessionClosed;
    if (w.epoch > id.epoch || (closed ? w.round >= id.round : w.round != id.round))
      throw ExchangeError("key exchange '" + comm.channel() + "' (rank " + std::to_string(comm.rank()) + "): rank " +
                          std::to_string(r) + " is at session " + std::to_string(w.epoch) + ", round " +
                          std::to_string(w.round) + ", this rank at session " + std::to_string(id.epoch) +
                          ", round " + std::to_string(id.round) + "; the ranks are out of step (every rank must "
                          "run and close the same sessions): restart the job");
  }
}

// A rank that left the job (its process exited, leave()) holds a part of every table that it can
// no longer serve: a pass without it would look up nothing there and report a result over part
// of the data. Every rank still in the round gets this in the same round.
inline void throw_if_a_rank_left(const ChannelComm& comm, const std::vector<RankStatus>& all) {
  std::string left;
  for (int r = 0; r < comm.world(); ++r)
    if (all[r].signature == RankStatus::kLeft) left += (left.empty() ? "" : ", ") + std::to_string(r);
  if (left.empty()) return;
  throw ExchangeError("key exchange '" + comm.channel() + "' (rank " + std::to_string(comm.rank()) + " of " +
                      std::to_string(comm.world()) + "): rank(s) " + left +
                      " left the job (the process exited) while this rank still runs a pass on this channel. "
                      "Every rank holds a part of every sharded table, so a pass (an evaluation above all) needs "
                      "every rank: run it on every rank, each with its own shard of the data (an empty one "
                      "takes part too), and let each rank exit only after the last pass");
}

// Peers whose session closed before they began this round (batch `batch` of the channel): it ends
// here on every rank that began it, and the channel runs again in the next session.
inline void throw_if_a_session_closed(const ChannelComm& comm, PassClosing& pass, const std::vector<RankStatus>& all,
                                      uint64_t batch) {
  std::string closed;
  for (int r = 0; r < comm.world(); ++r)
    if (all[r].signature == RankStatus::kSessionClosed) closed += (closed.empty() ? "" : ", ") + std::to_string(r);
  if (closed.empty()) return;
  pass.peer_closed();
  throw PeerClosedError("key exchange '" + comm.channel() + "' (rank " + std::to_string(comm.rank()) + " of " +
                        std::to_string(comm.world()) + "): rank(s) " + closed + " closed their session before "
                        "beginning this round (batch " + std::to_string(batch) + " of the channel). If this rank's "
                        "session is closing too (a step limit: its prefetch had begun one batch more), this ends the "
                        "pass and nobody reads it; otherwise the ranks ran different numbers of batches: every rank "
                        "must run the same passes, each on its own shard of the data");
}

}  // namespace shardrec
