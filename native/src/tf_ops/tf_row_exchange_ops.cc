// The row all-to-all of a lookup (owners send the rows their requesters asked for) and, as its
// gradient, the same exchange of gradients back: MPI on a communicator of the lookup's own (one
// for rows, one for gradients), not through Horovod's background negotiation, which cost a 2-rank
// step a third of its time. The splits are what the key exchange already decided: a rank sends
// splits[r] rows to rank r; how many it receives from each is exchanged first, point to point, so
// that a rank that never arrives is named.
//
// The wire dtype (attr `wire`): float32, or bfloat16 / float16, each value rounded to nearest even
// before it is sent and widened back on arrival (this rank's own block too, so that a row reads
// the same whichever rank owns it): half the bytes, for tables that opt in
// (create_table(exchange_dtype=)), as TorchRec's quantized communications do.
//
// An async kernel: the exchange waits on a thread of the kernel's own, never on one of
// TensorFlow's (with one inter-op thread, two lookups whose exchanges the ranks reached in another
// order would otherwise wait for each other for ever). Every wait is bound by the exchange timeout.
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "exchange/channel_comm.h"
#include "storage/row_format.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace shardrec {
namespace {

// Exchange name ("<table>/<feature>/<channel>#<n>", "... gradients") -> its communicator's Fortran
// handle. rank_runtime registers them when the pipeline starts, in the same order on every rank
// (sorted by name), so that two ranks that built their lookups in another order still pair them.
std::mutex comms_mu;
std::unordered_map<std::string, int64_t>& comms() {
  static auto* registered = new std::unordered_map<std::string, int64_t>();
  return *registered;
}

// Bytes each exchange name sent to other ranks (its own block is a copy), for benchmarks and
// logs: what crossed the network. Never freed, as the kernels that count into them may outlive a
// session.
std::atomic<int64_t>* bytes_sent(const std::string& exchange) {
  static auto* counters = new std::unordered_map<std::string, std::atomic<int64_t>*>();
  auto& counter = (*counters)[exchange];
  if (counter == nullptr) counter = new std::atomic<int64_t>(0);
  return counter;
}

// One thread running the exchanges of one kernel, in the order they were asked for.
class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void run(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> g(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

using tensorflow::AsyncOpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::errors::InvalidArgument;

class RowAlltoallOp : public AsyncOpKernel {
 public:
  explicit RowAlltoallOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("exchange", &exchange_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("timeout_s", &timeout_s_));
    std::string wire;
    OP_REQUIRES_OK(ctx, ctx->GetAttr("wire", &wire));
    OP_REQUIRES(ctx, wire == "float32" || wire == "bfloat16" || wire == "float16",
                InvalidArgument("wire must be float32, bfloat16 or float16, got '", wire, "'"));
    wire_ = wire == "bfloat16" ? RowFormat::kBFloat16 : wire == "float16" ? RowFormat::kFloat16 : RowFormat::kFloat32;
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    if (!ensure_comm()) {
      ctx->SetStatus(tensorflow::errors::FailedPrecondition(
          "row exchange '", exchange_, "' has no communicator in this process: start the key pipeline "
          "(start_asc_pipeline() or modify_graph_and_start_emb_cache()) before running the graph, in the process "
          "that built it"));
      done();
      return;
    }
    const Tensor& rows = ctx->input(0);
    const int world = comm_->world();
    OP_REQUIRES_ASYNC(ctx, rows.dims() == 2, InvalidArgument("rows must be 2-D, got ", rows.shape().DebugString()),
                      done);
    for (int i : {1, 2}) {
      const Tensor& splits = ctx->input(i);
      OP_REQUIRES_ASYNC(ctx, splits.dims() == 1 && splits.dim_size(0) == world,
                        InvalidArgument(i == 1 ? "send_splits" : "recv_splits", " must hold one count per rank (",
                                        world, "), got ", splits.shape().DebugString()),
                        done);
      auto s = splits.flat<int32_t>();
      int64_t total = 0;
      for (int r = 0; r < world; ++r) {
        OP_REQUIRES_ASYNC(ctx, s(r) >= 0, InvalidArgument("a negative split: ", s(r)), done);
        total += s(r);
      }
      OP_REQUIRES_ASYNC(ctx, total * rows.dim_size(1) < INT32_MAX,
                        InvalidArgument("a row exchange of 2^31 floats or more; use smaller batches"), done);
      if (i == 1)
        OP_REQUIRES_ASYNC(ctx, total == rows.dim_size(0),
                          InvalidArgument("send_splits add up to ", total, " rows, rows has ", rows.dim_size(0)), done);
    }
    worker_.run([this, ctx, done = std::move(done)] {
      try {
        exchange(ctx);
      } catch (const ExchangeError& e) {
        ctx->SetStatus(tensorflow::errors::DeadlineExceeded(e.what()));
      }
      done();
    });
  }

 private:
  // The communicator registered under this kernel's exchange name, found once (false: none yet).
  bool ensure_comm() {
    std::lock_guard<std::mutex> g(comms_mu);
    if (comm_) return true;
    auto it = comms().find(exchange_);
    if (it == comms().end()) return false;
    comm_ = std::make_unique<ChannelComm>(MPI_Comm_f2c(static_cast<MPI_Fint>(it->second)), exchange_, timeout_s_,
                                          "row exchange");
    sent_ = bytes_sent(exchange_);
    return true;
  }

  // Both sides' counts come with the batch's routing, so the rows go at once, point to point.
  void exchange(OpKernelContext* ctx) {
    const Tensor& rows = ctx->input(0);
    auto send = ctx->input(1).flat<int32_t>();
    auto recv = ctx->input(2).flat<int32_t>();
    const int world = comm_->world();
    const int64_t dim = rows.dim_size(1);
    std::vector<int> scount(world), sdispl(world + 1, 0), rcount(world), rdispl(world + 1, 0);
    for (int r = 0; r < world; ++r) {
      scount[r] = static_cast<int>(send(r) * dim);
      rcount[r] = static_cast<int>(recv(r) * dim);
      sdispl[r + 1] = sdispl[r] + scount[r];
      rdispl[r + 1] = rdispl[r] + rcount[r];
    }
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({rdispl[world] / std::max<int64_t>(dim, 1), dim}), &out));
    const float* from = rows.flat<float>().data();
    float* to = out->flat<float>().data();
    int64_t value_bytes = sizeof(float);
    if (wire_ == RowFormat::kFloat32) {
      comm_->exchange_blocks(from, scount.data(), sdispl.data(), to, rcount.data(), rdispl.data(), "rows");
    } else {
      // Buffers of the kernel's own, reused step after step (one exchange at a time runs on its worker).
      send_bits_.resize(static_cast<size_t>(sdispl[world]));
      recv_bits_.resize(static_cast<size_t>(rdispl[world]));
      if (wire_ == RowFormat::kBFloat16) {
        for (size_t i = 0; i < send_bits_.size(); ++i) send_bits_[i] = row_format::float_to_bf16(from[i]);
      } else {
        for (size_t i = 0; i < send_bits_.size(); ++i) send_bits_[i] = row_format::float_to_half(from[i]);
      }
      comm_->exchange_blocks(send_bits_.data(), scount.data(), sdispl.data(), recv_bits_.data(), rcount.data(),
                             rdispl.data(), "rows");
      if (wire_ == RowFormat::kBFloat16) {
        for (size_t i = 0; i < recv_bits_.size(); ++i) to[i] = row_format::bf16_to_float(recv_bits_[i]);
      } else {
        for (size_t i = 0; i < recv_bits_.size(); ++i) to[i] = row_format::half_to_float(recv_bits_[i]);
      }
      value_bytes = sizeof(uint16_t);
    }
    sent_->fetch_add(static_cast<int64_t>(sdispl[world] - scount[comm_->rank()]) * value_bytes);
  }

  std::string exchange_;
  float timeout_s_ = 0;
  RowFormat wire_ = RowFormat::kFloat32;
  std::vector<uint16_t> send_bits_, recv_bits_;
  std::unique_ptr<ChannelComm> comm_;
  std::atomic<int64_t>* sent_ = nullptr;
  Worker worker_;
};

}  // namespace
}  // namespace shardrec

extern "C" {
// `handle`: the communicator's Fortran handle (mpi4py's py2f), portable across MPI implementations.
__attribute__((visibility("default"))) int shardrec_comm_register(const char* exchange, int64_t handle) {
  std::lock_guard<std::mutex> g(shardrec::comms_mu);
  shardrec::comms()[exchange] = handle;
  return 0;
}

// Bytes the row exchange named `exchange` has sent to other ranks in this process (0: none yet).
__attribute__((visibility("default"))) int64_t shardrec_exchange_bytes_sent(const char* exchange) {
  std::lock_guard<std::mutex> g(shardrec::comms_mu);
  return shardrec::bytes_sent(exchange)->load();
}
}

REGISTER_OP("ShardrecRowAlltoall")
    .Input("rows: float")
    .Input("send_splits: int32")
    .Input("recv_splits: int32")
    .Output("out: float")
    .Attr("exchange: string")
    .Attr("timeout_s: float")
    .Attr("gradient: string = ''")  // the exchange of its gradient (read by the Python gradient); '': none
    .Attr("wire: string = 'float32'")  // float32, bfloat16 or float16: the values' dtype on the wire
    .SetIsStateful()
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      tensorflow::shape_inference::ShapeHandle rows;
      TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 2, &rows));
      c->set_output(0, c->Matrix(c->UnknownDim(), c->Dim(rows, 1)));
      return tensorflow::OkStatus();
    })
    .Doc("Sends send_splits[r] rows to rank r and receives recv_splits[r] rows from it on the communicator "
         "registered as `exchange`; out: the rows received, by rank.");

REGISTER_KERNEL_BUILDER(Name("ShardrecRowAlltoall").Device(tensorflow::DEVICE_CPU), shardrec::RowAlltoallOp);
