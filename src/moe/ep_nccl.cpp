// The NCCL communicator (include/sonicmoe/ep.h), compiled when CMake found NCCL (SONICMOE_WITH_NCCL): all_to_all_v
// as grouped ncclSend / ncclRecv of bytes, all_reduce_sum as ncclAllReduce, both on the caller's stream.
#include "moe/dispatch_util.h"
#include "sonicmoe/ep.h"
#include "sonicmoe/error.h"

#ifdef SONICMOE_WITH_NCCL
#include <nccl.h>

#include <string>
#endif

namespace sonicmoe {

#ifdef SONICMOE_WITH_NCCL

namespace {

#define SONICMOE_NCCL_CHECK(call)                                                                      \
  do {                                                                                                 \
    ncclResult_t res_ = (call);                                                                        \
    if (res_ != ncclSuccess)                                                                           \
      throw ::sonicmoe::Error(std::string("NCCL error ") + ncclGetErrorString(res_) + " in " #call); \
  } while (0)

class NcclComm final : public Communicator {
 public:
  NcclComm(ncclComm_t comm, int device) : comm_(comm), device_(device) {
    SONICMOE_NCCL_CHECK(ncclCommUserRank(comm_, &rank_));
    SONICMOE_NCCL_CHECK(ncclCommCount(comm_, &size_));
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  Device device() const override { return Device::cuda(device_); }

  void all_to_all_v(const TensorView& send, const std::vector<std::int64_t>& send_rows, const TensorView& recv,
                    const std::vector<std::int64_t>& recv_rows, void* stream) override {
    SONICMOE_CHECK(static_cast<int>(send_rows.size()) == size_ && static_cast<int>(recv_rows.size()) == size_,
                   "sonicmoe::Communicator::all_to_all_v: send_rows / recv_rows have ", send_rows.size(), " / ",
                   recv_rows.size(), " entries, expected the world size ", size_);
    SONICMOE_CHECK(send.device == device() && recv.device == device() && row_bytes(send) == row_bytes(recv),
                   "sonicmoe::Communicator::all_to_all_v (NCCL): send ", send.shape_str(), " on ",
                   device_name(send.device), " and recv ", recv.shape_str(), " on ", device_name(recv.device),
                   " must be on ", device_name(device()), " with rows of one size");
    const std::size_t rb = row_bytes(send);
    cudaStream_t st = static_cast<cudaStream_t>(stream);
    SONICMOE_NCCL_CHECK(ncclGroupStart());
    std::size_t so = 0, ro = 0;
    for (int r = 0; r < size_; ++r) {
      const std::size_t sn = static_cast<std::size_t>(send_rows[static_cast<std::size_t>(r)]) * rb;
      const std::size_t rn = static_cast<std::size_t>(recv_rows[static_cast<std::size_t>(r)]) * rb;
      if (sn > 0) SONICMOE_NCCL_CHECK(ncclSend(static_cast<const char*>(send.data) + so, sn, ncclUint8, r, comm_, st));
      if (rn > 0) SONICMOE_NCCL_CHECK(ncclRecv(static_cast<char*>(recv.data) + ro, rn, ncclUint8, r, comm_, st));
      so += sn;
      ro += rn;
    }
    SONICMOE_NCCL_CHECK(ncclGroupEnd());
  }

  void all_reduce_sum(const TensorView& data, void* stream) override {
    SONICMOE_CHECK((data.dtype == DType::f32 || data.dtype == DType::i32) && data.device == device(),
                   "sonicmoe::Communicator::all_reduce_sum (NCCL): data is ", dtype_name(data.dtype), " on ",
                   device_name(data.device), ", expected f32 or i32 on ", device_name(device()));
    const ncclDataType_t t = data.dtype == DType::f32 ? ncclFloat32 : ncclInt32;
    SONICMOE_NCCL_CHECK(ncclAllReduce(data.data, data.data, static_cast<std::size_t>(data.numel()), t, ncclSum,
                                      comm_, static_cast<cudaStream_t>(stream)));
  }

 private:
  ncclComm_t comm_;
  int device_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

bool nccl_available() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(void* nccl_comm, int device_index) {
  SONICMOE_CHECK(nccl_comm != nullptr, "sonicmoe::make_nccl_communicator: argument 'nccl_comm' is null");
  return std::make_unique<NcclComm>(static_cast<ncclComm_t>(nccl_comm), device_index);
}

#else

bool nccl_available() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(void*, int) {
  throw Error("sonicmoe::make_nccl_communicator: this build of sonicmoe has no NCCL (CMake option SONICMOE_NCCL "
              "was OFF, or nccl.h / libnccl.so.2 were not found: install the nvidia-nccl-cu13 wheel or set "
              "SONICMOE_NCCL_ROOT, then reconfigure)");
}

#endif

}  // namespace sonicmoe
