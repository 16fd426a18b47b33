// The in-process communicator (include/sonicmoe/ep.h): R ranks as R threads sharing host memory. A collective
// posts this rank's buffer, waits at a barrier, reads the others' buffers, and waits again before anyone reuses
// them. Sums run in rank order, so results are bitwise repeatable.
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "moe/dispatch_util.h"
#include "sonicmoe/ep.h"
#include "sonicmoe/error.h"

namespace sonicmoe {

namespace {

// Which collective a rank posted (ranks that call different collectives at the same point must not read each
// other's posts as their own: an all_reduce_sum post has no per-rank row counts).
enum class Op : int { none = 0, all_to_all_v = 1, all_reduce_sum = 2 };
const char* op_name(Op op) {
  return op == Op::all_to_all_v ? "all_to_all_v" : op == Op::all_reduce_sum ? "all_reduce_sum" : "nothing";
}

struct Post {
  Op op = Op::none;
  const void* data = nullptr;
  std::vector<std::int64_t> rows;  // all_to_all_v: rows sent to each rank
  std::size_t row_bytes = 0;
  DType dtype = DType::f32;
  std::int64_t numel = 0;
};

class Group {
 public:
  explicit Group(int size) : size_(size), posts_(static_cast<std::size_t>(size)) {}
  int size() const { return size_; }
  Post& post(int r) { return posts_[static_cast<std::size_t>(r)]; }

  void barrier() {
    std::unique_lock<std::mutex> lk(m_);
    // A rank whose fn has returned never arrives again: waiting for it would hang the group. (Checked first: when it
    // is the cause, the ranks that abort because of it must not hide it.)
    if (finished_ > 0) throw Error(finished_message());
    if (aborted_) throw Error("sonicmoe::Communicator (in-process): another rank failed; collective abandoned");
    const std::uint64_t gen = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lk, [&] { return generation_ != gen || aborted_ || finished_ > 0; });
    if (generation_ != gen) return;  // completed (a rank may have finished right after: not this barrier's concern)
    --arrived_;
    if (finished_ > 0) throw Error(finished_message());
    throw Error("sonicmoe::Communicator (in-process): another rank failed; collective abandoned");
  }
  void abort() {
    std::lock_guard<std::mutex> lk(m_);
    aborted_ = true;
    cv_.notify_all();
  }
  // Rank `r`'s fn returned normally.
  void finish(int r) {
    std::lock_guard<std::mutex> lk(m_);
    if (finished_++ == 0) first_finished_ = r;
    cv_.notify_all();
  }

 private:
  std::string finished_message() const {
    return detail::concat("sonicmoe::Communicator (in-process): rank ", first_finished_, " returned from fn without ",
                          "joining this collective (every rank must call the same collectives in the same order); ",
                          "collective abandoned");
  }

 public:

 private:
  int size_;
  std::vector<Post> posts_;
  std::mutex m_;
  std::condition_variable cv_;
  int arrived_ = 0;
  std::uint64_t generation_ = 0;
  bool aborted_ = false;
  int finished_ = 0;        // ranks whose fn has returned normally
  int first_finished_ = -1;
};

class InProcessComm final : public Communicator {
 public:
  InProcessComm(Group& g, int rank) : g_(g), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return g_.size(); }
  Device device() const override { return Device::cpu(); }

  void all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_rows, const TensorView& recv,
                    const std::vector<std::int64_t>& recv_rows, void*) override {
    const int R = size();
    SONICMOE_CHECK(static_cast<int>(send_rows.size()) == R && static_cast<int>(recv_rows.size()) == R,
                   "sonicmoe::Communicator::all_to_all_v: send_rows / recv_rows have ", send_rows.size(), " / ",
                   recv_rows.size(), " entries, expected the world size ", R);
    SONICMOE_CHECK(send.ndim >= 1 && recv.ndim == send.ndim && recv.dtype == send.dtype &&
                       row_bytes(recv) == row_bytes(send) && !send.device.is_cuda() && !recv.device.is_cuda(),
                   "sonicmoe::Communicator::all_to_all_v (in-process): send ", send.shape_str(), " and recv ",
                   recv.shape_str(), " must be host tensors with rows of one size and dtype");
    SONICMOE_CHECK(send.is_contiguous() && recv.is_contiguous() && (send.data || send.numel() == 0) &&
                       (recv.data || recv.numel() == 0),
                   "sonicmoe::Communicator::all_to_all_v (in-process): send ", send.shape_str(), " and recv ",
                   recv.shape_str(), " must be contiguous with data (rows are copied as whole byte ranges)");
    // This rank's own counts against its own buffers (another rank copies from `send` by them).
    std::int64_t send_total = 0, recv_total = 0;
    for (int r = 0; r < R; ++r) {
      const std::int64_t s = send_rows[static_cast<std::size_t>(r)], v = recv_rows[static_cast<std::size_t>(r)];
      SONICMOE_CHECK(s >= 0 && v >= 0, "sonicmoe::Communicator::all_to_all_v: send_rows[", r, "] = ", s,
                     ", recv_rows[", r, "] = ", v, ", expected >= 0");
      send_total += s;
      recv_total += v;
    }
    SONICMOE_CHECK(send_total <= send.shape[0] && recv_total <= recv.shape[0],
                   "sonicmoe::Communicator::all_to_all_v: send_rows sum to ", send_total, " for send ",
                   send.shape_str(), " and recv_rows to ", recv_total, " for recv ", recv.shape_str(),
                   ": more rows than the tensors hold");
    Post& me = g_.post(rank_);
    me.op = Op::all_to_all_v;
    me.data = send.data;
    me.rows = send_rows;
    me.row_bytes = row_bytes(send);
    me.dtype = send.dtype;
    g_.barrier();
    std::string err = mismatched_op(Op::all_to_all_v);
    std::int64_t at = 0;
    for (int src = 0; src < R && err.empty(); ++src) {
      const Post& p = g_.post(src);
      if ((p.row_bytes != me.row_bytes || p.dtype != me.dtype) && err.empty())
        err = detail::concat("sonicmoe::Communicator::all_to_all_v: rank ", src, " sends ", dtype_name(p.dtype),
                             " rows of ", p.row_bytes, " bytes, rank ", rank_, " receives ", dtype_name(me.dtype),
                             " rows of ", me.row_bytes, " bytes (the ranks passed different widths or dtypes)");
      std::int64_t off = 0;
      for (int r = 0; r < rank_; ++r) off += p.rows[static_cast<std::size_t>(r)];
      const std::int64_t n = p.rows[static_cast<std::size_t>(rank_)];
      if (n != recv_rows[static_cast<std::size_t>(src)] && err.empty())
        err = detail::concat("sonicmoe::Communicator::all_to_all_v: rank ", src, " sends ", n, " rows to rank ",
                             rank_, ", which expects ", recv_rows[static_cast<std::size_t>(src)]);
      if (!err.empty() || at + n > recv.shape[0]) {
        if (err.empty()) err = "sonicmoe::Communicator::all_to_all_v: recv has too few rows";
        continue;
      }
      if (n > 0)
        std::memcpy(static_cast<char*>(recv.data) + static_cast<std::size_t>(at) * me.row_bytes,
                    static_cast<const char*>(p.data) + static_cast<std::size_t>(off) * me.row_bytes,
                    static_cast<std::size_t>(n) * me.row_bytes);
      at += n;
    }
    g_.barrier();  // the sources may now reuse their buffers
    if (!err.empty()) throw Error(err);
  }

  void all_reduce_sum(const TensorView& data, void*) override {
    SONICMOE_CHECK((data.dtype == DType::f32 || data.dtype == DType::i32) && !data.device.is_cuda(),
                   "sonicmoe::Communicator::all_reduce_sum (in-process): data is ", dtype_name(data.dtype), " on ",
                   device_name(data.device), ", expected a host f32 or i32 tensor");
    SONICMOE_CHECK(data.ndim >= 1 && data.is_contiguous() && (data.data || data.numel() == 0),
                   "sonicmoe::Communicator::all_reduce_sum (in-process): data ", data.shape_str(),
                   " must be a contiguous tensor with data");
    Post& me = g_.post(rank_);
    me.op = Op::all_reduce_sum;
    me.data = data.data;
    me.dtype = data.dtype;
    me.numel = data.numel();
    g_.barrier();
    const std::string op_err = mismatched_op(Op::all_reduce_sum);
    const std::int64_t n = me.numel;
    bool same = op_err.empty();
    for (int r = 0; r < size(); ++r) same = same && g_.post(r).numel == n && g_.post(r).dtype == data.dtype;
    std::vector<double> acc_f;
    std::vector<std::int64_t> acc_i;
    if (same) {
      if (data.dtype == DType::f32) {
        std::vector<float> acc(static_cast<std::size_t>(n), 0.0f);
        for (int r = 0; r < size(); ++r) {  // rank order, fp32 adds: what a ring would do, but fixed
          const float* p = static_cast<const float*>(g_.post(r).data);
          for (std::int64_t i = 0; i < n; ++i) acc[static_cast<std::size_t>(i)] += p[i];
        }
        acc_f.assign(acc.begin(), acc.end());
      } else {
        acc_i.assign(static_cast<std::size_t>(n), 0);
        for (int r = 0; r < size(); ++r) {
          const std::int32_t* p = static_cast<const std::int32_t*>(g_.post(r).data);
          for (std::int64_t i = 0; i < n; ++i) acc_i[static_cast<std::size_t>(i)] += p[i];
        }
      }
    }
    g_.barrier();  // everyone has read every input
    if (!op_err.empty()) throw Error(op_err);
    SONICMOE_CHECK(same, "sonicmoe::Communicator::all_reduce_sum: the ranks passed different sizes or dtypes");
    for (std::int64_t i = 0; i < n; ++i) {
      if (data.dtype == DType::f32)
        static_cast<float*>(data.data)[i] = static_cast<float>(acc_f[static_cast<std::size_t>(i)]);
      else
        static_cast<std::int32_t*>(data.data)[i] = static_cast<std::int32_t>(acc_i[static_cast<std::size_t>(i)]);
    }
  }

 private:
  // After the first barrier: empty when every rank posted `op`, else an Error message naming a rank that did not.
  std::string mismatched_op(Op op) {
    for (int r = 0; r < size(); ++r)
      if (g_.post(r).op != op)
        return detail::concat("sonicmoe::Communicator (in-process): rank ", rank_, " called ", op_name(op),
                              " while rank ", r, " called ", op_name(g_.post(r).op),
                              " (every rank must call the same collectives in the same order)");
    return {};
  }

  Group& g_;
  int rank_;
};

}  // namespace

void run_in_process(int world_size, const std::function<void(Communicator&)>& fn) {
  SONICMOE_CHECK(world_size >= 1, "sonicmoe::run_in_process: world_size = ", world_size, ", expected >= 1");
  SONICMOE_CHECK(static_cast<bool>(fn), "sonicmoe::run_in_process: argument 'fn' is empty (no function to run)");
  Group group(world_size);
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(world_size));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(world_size));
  std::string spawn_error;
  for (int r = 0; r < world_size; ++r) {
    try {
      threads.emplace_back([&, r] {
        InProcessComm comm(group, r);
        try {
          fn(comm);
          group.finish(r);
        } catch (...) {
          errors[static_cast<std::size_t>(r)] = std::current_exception();
          group.abort();
        }
      });
    } catch (const std::exception& e) {  // out of threads: the started ranks must not wait for the missing ones
      spawn_error = detail::concat("sonicmoe::run_in_process: world_size = ", world_size, ": could not start the ",
                                   "thread of rank ", r, " (", e.what(), ")");
      group.abort();
      break;
    }
  }
  for (auto& t : threads) t.join();
  if (!spawn_error.empty()) throw Error(spawn_error);
  // The first failure that is not a consequence of another rank's: "collective abandoned" (the group aborted), or
  // the EP layer's "refused their arguments" (another rank refused its own, and its error names them).
  std::exception_ptr first;
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const Error& ex) {
      const std::string what = ex.what();
      if (what.find("collective abandoned") == std::string::npos &&
          what.find("refused their arguments") == std::string::npos) {
        first = e;
        break;
      }
      if (!first) first = e;
    } catch (...) {
      first = e;
      break;
    }
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace sonicmoe
