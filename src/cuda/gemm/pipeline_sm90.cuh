// Shared-memory stage ring of the native Hopper GEMMs: one `full` and one `empty` mbarrier per stage.
// full[s]: the producers' arrivals (one arrive_and_expect_tx by the TMA thread, plus one
// cp.async.mbarrier.arrive.noinc per gathering thread) and the TMA transaction bytes.
// empty[s]: one arrive per consumer warp once its wgmma reads of the stage are complete.
#pragma once

#include <cute/arch/copy_sm90.hpp>
#include <cute/arch/util.hpp>
#include <cutlass/arch/barrier.h>

#include <cstdint>

namespace sonicmoe::cuda::gemm::sm90 {

using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
using Barrier = cutlass::arch::ClusterBarrier;

// Position in the ring and the parity of the phase to wait for. A fresh mbarrier is in phase 0:
// waiting for parity 1 returns at once (producers start so, on `empty`), parity 0 blocks (consumers, `full`).
template <int Stages>
struct PipeState {
  int index = 0;
  std::uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++index == Stages) {
      index = 0;
      phase ^= 1u;
    }
  }
};

// A value every lane of the warp holds alike (a warp or warpgroup index), broadcast from lane 0 so that the
// compiler can prove it warp-uniform and treat the role branches on it as uniform (CUTLASS's canonical warp index
// does the same). On the H100, ncu counted the same instructions with and without it in the varlen-M kernels.
__device__ __forceinline__ int warp_uniform(int v) { return __shfl_sync(0xffffffffu, v, 0); }

// 16-byte cp.async global -> shared that reads `bytes` (0 or 16) and zero-fills the rest, L2 128-byte prefetch.
__device__ __forceinline__ void cp_async_16_zfill(std::uint32_t smem_addr, const void* gmem, int bytes) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(smem_addr), "l"(gmem), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Shared-space stores and loads at 32-bit shared addresses (cute::cast_smem_ptr_to_uint): no generic-to-shared
// address conversion per access. volatile with a memory clobber, so that they stay on their side of the
// barrier waits around them.
__device__ __forceinline__ void st_shared_u32(std::uint32_t addr, std::uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u16(std::uint32_t addr, std::uint16_t v) {
  asm volatile("st.shared.b16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(std::uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

}  // namespace sonicmoe::cuda::gemm::sm90
