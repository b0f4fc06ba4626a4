// The collectives of one key-exchange channel, each bound by a deadline: no rank waits for ever
// for a peer that died, hangs, or runs another number of batches. Status rounds are point to
// point (every rank sends its words to every peer), so a rank that times out knows, and names,
// exactly which peers never arrived; the bulk rounds that follow are non-blocking collectives.
// After a timeout the channel is unusable (a collective cannot be withdrawn): every later call
// raises the same error.
#pragma once

#include <mpi.h>
#include <sys/prctl.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace shardrec {

class ExchangeError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ExchangeTimeout : public ExchangeError {
 public:
  using ExchangeError::ExchangeError;
};

// A request that MPI failed (a communicator whose errors return instead of ending the job):
// `index` is its place among the requests waited for.
class RequestFailed : public ExchangeError {
 public:
  RequestFailed(size_t index, const std::string& what) : ExchangeError(what), index(index) {}
  size_t index;
};

class ChannelComm {
 public:
  // `kind` names the exchange in errors: the key exchange of a channel, or the row exchange of a lookup.
  ChannelComm(MPI_Comm comm, std::string channel, double timeout_s, std::string kind = "key exchange")
      : comm_(comm), channel_(std::move(channel)), kind_(std::move(kind)), timeout_s_(timeout_s) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &world_);
  }

  int rank() const { return rank_; }
  int world() const { return world_; }
  const std::string& channel() const { return channel_; }
  double timeout_s() const { return timeout_s_; }
  void set_timeout(double s) { timeout_s_ = s; }
  const std::string& broken() const { return broken_; }
  // Time spent inside MPI waiting for this channel's rounds, all calls together.
  uint64_t ns_waiting() const { return ns_waiting_; }

  // Every rank's `mine`, a struct of int64 words (a round's status), by rank.
  template <typename Words>
  std::vector<Words> gather_words(const Words& mine, const std::string& what) {
    static_assert(std::is_standard_layout_v<Words> && sizeof(Words) % sizeof(int64_t) == 0,
                  "a status is a struct of int64 words");
    std::vector<Words> all(static_cast<size_t>(world_));
    gather_status(reinterpret_cast<const int64_t*>(&mine), static_cast<int>(sizeof(Words) / sizeof(int64_t)),
                  reinterpret_cast<int64_t*>(all.data()), what);
    return all;
  }

  // Every rank's `n` words into all[r * n .. r * n + n). `what` names the round in errors.
  void gather_status(const int64_t* mine, int n, int64_t* all, const std::string& what) {
    check_usable();
    for (int i = 0; i < n; ++i) all[static_cast<size_t>(rank_) * n + i] = mine[i];
    if (world_ == 1) return;
    std::vector<MPI_Request> recv, send;
    std::vector<int> peers;
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      peers.push_back(r);
      recv.emplace_back();
      MPI_Irecv(all + static_cast<size_t>(r) * n, n, MPI_INT64_T, r, kStatusTag, comm_, &recv.back());
    }
    for (int r : peers) {
      send.emplace_back();
      MPI_Isend(mine, n, MPI_INT64_T, r, kStatusTag, comm_, &send.back());
    }
    if (!wait(recv)) {
      std::string missing;
      for (size_t i = 0; i < recv.size(); ++i) {
        if (recv[i] == MPI_REQUEST_NULL) continue;
        missing += (missing.empty() ? "" : ", ") + std::to_string(peers[i]);
        MPI_Cancel(&recv[i]);
        MPI_Request_free(&recv[i]);
      }
      for (auto& s : send) if (s != MPI_REQUEST_NULL) MPI_Request_free(&s);
      fail_timeout(what, "rank(s) " + missing + " did not arrive");
    }
    if (!wait(send)) {
      for (auto& s : send) if (s != MPI_REQUEST_NULL) MPI_Request_free(&s);
      fail_timeout(what, "a peer did not take this rank's status");
    }
  }

  // Rank `peer`'s next status words (one that gather_words took was for an earlier round).
  template <typename Words>
  Words receive_words(int peer, const std::string& what) {
    check_usable();
    Words w;
    std::vector<MPI_Request> one(1);
    MPI_Irecv(reinterpret_cast<int64_t*>(&w), static_cast<int>(sizeof(Words) / sizeof(int64_t)), MPI_INT64_T, peer,
              kStatusTag, comm_, &one[0]);
    if (!wait(one)) {
      MPI_Cancel(&one[0]);
      MPI_Request_free(&one[0]);
      fail_timeout(what, "rank(s) " + std::to_string(peer) + " did not arrive");
    }
    return w;
  }

  // This rank's `n` words to every peer, for their next status round, without waiting: the words
  // must stay alive (the caller keeps them) and the requests are released at once.
  void post_status(const int64_t* words, int n) {
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      MPI_Request req;
      MPI_Isend(words, n, MPI_INT64_T, r, kStatusTag, comm_, &req);
      MPI_Request_free(&req);
    }
  }

  void alltoall(const int32_t* send, int32_t* recv, int n, const std::string& what) {
    check_usable();
    MPI_Request req;
    MPI_Ialltoall(send, n, MPI_INT32_T, recv, n, MPI_INT32_T, comm_, &req);
    finish_collective(req, what);
  }

  // int64, int32 or float elements; counts and displacements in elements.
  template <typename T>
  void alltoallv(const T* send, const int* scount, const int* sdispl, T* recv, const int* rcount, const int* rdispl,
                 const std::string& what) {
    static_assert(std::is_same_v<T, int64_t> || std::is_same_v<T, int32_t> || std::is_same_v<T, float>,
                  "alltoallv takes int64, int32 or float elements");
    const MPI_Datatype type = std::is_same_v<T, int64_t>   ? MPI_INT64_T
                              : std::is_same_v<T, int32_t> ? MPI_INT32_T
                                                           : MPI_FLOAT;
    check_usable();
    MPI_Request req;
    MPI_Ialltoallv(send, scount, sdispl, type, recv, rcount, rdispl, type, comm_, &req);
    finish_collective(req, what);
  }

  // Blocks of values (float32, or 16-bit floats as their raw bits: a row exchange's wire dtype) to
  // and from every peer, point to point, with the counts both sides already know (a lookup's row
  // exchange: the key exchange decided them), so no counts round goes first. Counts and
  // displacements in values; this rank's own block is copied. A peer whose block does not arrive
  // in time is named, and so is one that sends another count than expected (more comes back as
  // MPI's truncation error: the row communicators return errors, world.py). Neither can happen
  // while the ranks run the same batch's routing.
  template <typename T>
  void exchange_blocks(const T* send, const int* scount, const int* sdispl, T* recv, const int* rcount,
                       const int* rdispl, const std::string& what) {
    static_assert(std::is_same_v<T, float> || std::is_same_v<T, uint16_t>, "float32 or 16-bit values");
    const MPI_Datatype type = std::is_same_v<T, float> ? MPI_FLOAT : MPI_UINT16_T;
    check_usable();
    if (scount[rank_] != rcount[rank_])
      throw ExchangeError(where(what) + "this rank sends itself " +
                          std::to_string(scount[rank_]) + " values but expects " + std::to_string(rcount[rank_]));
    if (scount[rank_] > 0)
      std::memcpy(recv + rdispl[rank_], send + sdispl[rank_], sizeof(T) * static_cast<size_t>(scount[rank_]));
    if (world_ == 1) return;
    std::vector<MPI_Request> recv_reqs, send_reqs;
    std::vector<int> peers;
    for (int r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      peers.push_back(r);
      recv_reqs.emplace_back();
      MPI_Irecv(recv + rdispl[r], rcount[r], type, r, kBlockTag, comm_, &recv_reqs.back());
    }
    for (int r : peers) {
      send_reqs.emplace_back();
      MPI_Isend(send + sdispl[r], scount[r], type, r, kBlockTag, comm_, &send_reqs.back());
    }
    std::vector<MPI_Status> statuses(recv_reqs.size());
    bool arrived = false;
    try {
      arrived = wait(recv_reqs, &statuses);
    } catch (const RequestFailed& e) {
      throw ExchangeError(where(what) + "rank " + std::to_string(peers[e.index]) +
                          " sent more than the " + std::to_string(rcount[peers[e.index]]) +
                          " values this rank expected (" + e.what() + "; the ranks disagree on the batch's routing)");
    }
    if (!arrived) {
      std::string missing;
      for (size_t i = 0; i < recv_reqs.size(); ++i)
        if (recv_reqs[i] != MPI_REQUEST_NULL) missing += (missing.empty() ? "" : ", ") + std::to_string(peers[i]);
      fail_timeout(what, "rank(s) " + missing + " did not send theirs");
    }
    for (size_t i = 0; i < peers.size(); ++i) {
      int got = 0;
      MPI_Get_count(&statuses[i], type, &got);
      if (got != rcount[peers[i]])
        throw ExchangeError(where(what) + "rank " + std::to_string(peers[i]) + " sent " +
                            std::to_string(got) + " values, this rank expected " + std::to_string(rcount[peers[i]]) +
                            " (the ranks disagree on the batch's routing)");
    }
    if (!wait(send_reqs)) fail_timeout(what, "a peer did not take this rank's block");
  }

  // Every rank's string, in rank order (used to name what differs between ranks).
  std::vector<std::string> gather_strings(const std::string& mine, const std::string& what) {
    std::vector<int64_t> lengths(world_);
    const int64_t len = static_cast<int64_t>(mine.size());
    gather_status(&len, 1, lengths.data(), what);
    std::vector<int> counts(world_), displs(world_ + 1, 0);
    for (int r = 0; r < world_; ++r) {
      counts[r] = static_cast<int>(lengths[r]);
      displs[r + 1] = displs[r] + counts[r];
    }
    std::string all(static_cast<size_t>(displs[world_]), '\0');
    if (world_ > 1) {
      MPI_Request req;
      MPI_Iallgatherv(mine.data(), static_cast<int>(mine.size()), MPI_CHAR, &all[0], counts.data(), displs.data(),
                      MPI_CHAR, comm_, &req);
      finish_collective(req, what);
    } else {
      all = mine;
    }
    std::vector<std::string> out;
    for (int r = 0; r < world_; ++r) out.push_back(all.substr(displs[r], counts[r]));
    return out;
  }

 private:
  static constexpr int kStatusTag = 0x5d1;
  static constexpr int kBlockTag = 0x5d2;

  void check_usable() const {
    if (!broken_.empty()) throw ExchangeTimeout(broken_);
  }

  void finish_collective(MPI_Request& req, const std::string& what) {
    std::vector<MPI_Request> one{req};
    if (!wait(one))
      fail_timeout(what, "every rank passed this batch's status round, so a rank stopped (died or hung) since");
  }

  // "<kind> '<channel>' (rank r of n), <what>: ", how every error of this channel begins.
  std::string where(const std::string& what) const {
    return kind_ + " '" + channel_ + "' (rank " + std::to_string(rank_) + " of " + std::to_string(world_) + "), " +
           what + ": ";
  }

  [[noreturn]] void fail_timeout(const std::string& what, const std::string& who) {
    broken_ = where(what) + who + " within " + std::to_string(static_cast<int>(timeout_s_)) +
              " s (SHARDREC_EXCHANGE_TIMEOUT_S). Every rank must run the same number of batches on this channel: "
              "check that the other ranks are alive and run the same script (an evaluation on one rank only, or a "
              "rank that stopped, leaves the others waiting). This channel is stopped; restart the job";
    throw ExchangeTimeout(broken_);
  }

  // Polls until every request completes (true) or the deadline passes (false; the requests
  // that completed are MPI_REQUEST_NULL). Between polls the thread sleeps, in steps that grow from
  // a few microseconds to kMaxNapUs: a rank's core is shared by its step, its key
  // pipeline and its exchanges, and a sleeping waiter leaves the core to them, while the wake-up
  // (a sleeper's) takes the core back at once from a busy sibling thread, which a spinning or
  // yielding waiter does not (bench/scaling.py measured both).
  bool wait(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>* statuses = nullptr) {
    if (reqs.empty()) return true;
    const auto start = std::chrono::steady_clock::now();
    struct Account {
      std::chrono::steady_clock::time_point start;
      uint64_t& total;
      ~Account() {
        total += static_cast<uint64_t>(
            std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
      }
    } account{start, ns_waiting_};
    precise_naps();
    const auto deadline = start + std::chrono::microseconds(static_cast<int64_t>(timeout_s_ * 1e6));
    int done = 0;
    std::chrono::microseconds nap(0);
    std::vector<MPI_Status> own(statuses ? 0 : reqs.size());
    MPI_Status* st = statuses ? statuses->data() : own.data();
    for (int spin = 0;; ++spin) {
      if (MPI_Testall(static_cast<int>(reqs.size()), reqs.data(), &done, st) != MPI_SUCCESS) throw_failed(reqs, st);
      if (done) return true;
      if (spin < kSpins) continue;
      if (std::chrono::steady_clock::now() > deadline) {
        // Testall leaves requests alone unless all complete: find the ones still pending.
        for (auto& r : reqs) {
          int flag = 0;
          if (r != MPI_REQUEST_NULL) MPI_Test(&r, &flag, MPI_STATUS_IGNORE);
        }
        return false;
      }
      nap = std::min(std::chrono::microseconds(kMaxNapUs), nap + std::chrono::microseconds(kNapStepUs));
      std::this_thread::sleep_for(nap);
    }
  }

  // The first request MPI failed, with MPI's words for it.
  [[noreturn]] static void throw_failed(const std::vector<MPI_Request>& reqs, const MPI_Status* st) {
    for (size_t i = 0; i < reqs.size(); ++i) {
      const int code = st[i].MPI_ERROR;
      if (code == MPI_SUCCESS || code == MPI_ERR_PENDING) continue;
      char text[MPI_MAX_ERROR_STRING];
      int len = 0;
      MPI_Error_string(code, text, &len);
      throw RequestFailed(i, std::string(text, static_cast<size_t>(len)));
    }
    throw RequestFailed(0, "MPI failed a request of this round");
  }

  // Linux lets a sleep overrun by the thread's timer slack (50 us by default): the naps above are
  // shorter than that.
  static void precise_naps() {
    thread_local bool set = false;
    if (!set) {
      prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
      set = true;
    }
  }

  // A few polls first (a peer that is already there answers within microseconds); then naps of
  // 5, 10, ... up to 50 us: tried against naps that grow with the time already waited (capped at
  // 50 or 200 us) and against 20 / 100 / 200 us caps, none better beyond the run-to-run spread.
  static constexpr int kSpins = 16;
  static constexpr int kNapStepUs = 5;
  static constexpr int kMaxNapUs = 50;

  MPI_Comm comm_;
  std::string channel_;
  std::string kind_;
  double timeout_s_;
  int rank_ = 0;
  int world_ = 1;
  std::string broken_;
  uint64_t ns_waiting_ = 0;
};

}  // namespace shardrec
