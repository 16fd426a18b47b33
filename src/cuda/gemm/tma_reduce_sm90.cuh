// The fp32 TMA reduce-add of the accumulating varlen-K epilogue (VarlenKAccumF32Cfg, epilogue_sm90_varlen_k.cuh):
// D += the staged tile, element by element in the memory system (cp.reduce.async.bulk.tensor ... .add, one fp32 add per
// element, round to nearest), issued by one thread while the consumers go on to the next tile's K loop. The staging
// tile (the kernel's 64 KB output buffer) holds half an output tile at a time: four TMA boxes of 128 rows x 32 floats
// in the 128-byte swizzle. The tensor map is 3-D, D [E, rows, cols], so each expert's own rows and columns clip the
// boxes (partial tiles need no other path).
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include <cstdint>

namespace sonicmoe::cuda::gemm::sm90 {

// Byte offset of element (r, c) of a staged half tile (r < 128, c < 128): box c / 32 (16 KB), row r at 128 bytes,
// its 16-byte chunk (c % 32) / 4 at chunk ((c % 32) / 4) ^ (r % 8). Box b is CuTe's K-major SW128 fp32 atom tiled
// over (128, 32) (checked by test_gemm_layouts). A warp's float2 stores (8 rows x 4 lanes of one column group) and
// scalar transposed ones (4 rows x 8 lanes) fill whole 128-byte wavefronts.
struct F32Stage {
  static constexpr int kRows = 128, kBoxCols = 32, kCols = 128, kBoxes = kCols / kBoxCols;
  static constexpr int kBoxBytes = kRows * kBoxCols * 4;
  __host__ __device__ static constexpr int offset_bytes(int r, int c) {
    return (c / kBoxCols) * kBoxBytes + r * 128 + ((((c % kBoxCols) >> 2) ^ (r & 7)) << 4) + (c & 3) * 4;
  }
  using BoxLayout = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<float>{},
                                                 cute::make_shape(cute::Int<kRows>{}, cute::Int<kBoxCols>{})));
};

// The reduce-add tensor map over D [E, rows, cols] (row-major per expert), in boxes of F32Stage.
inline auto make_tma_reduce_f32(const float* d, int rows, int cols, int num_experts) {
  using namespace cute;
  auto g = make_tensor(make_gmem_ptr(d), make_shape(rows, cols, num_experts),
                       make_stride(static_cast<std::int64_t>(cols), _1{}, static_cast<std::int64_t>(rows) * cols));
  return make_tma_copy(SM90_TMA_REDUCE_ADD{}, g, F32Stage::BoxLayout{});
}

// Where the reduce-add goes: the tensor map and the shape it was made for.
struct TmaReduceF32 {
  decltype(make_tma_reduce_f32(nullptr, 1, 8, 1)) tma;
  int rows = 0, cols = 0, num_experts = 0;
  static TmaReduceF32 make(const float* d, int rows, int cols, int num_experts) {
    return {make_tma_reduce_f32(d, rows, cols, num_experts), rows, cols, num_experts};
  }
};

__device__ __forceinline__ void st_shared_f32x2(std::uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b));
}
__device__ __forceinline__ void st_shared_f32(std::uint32_t addr, float a) {
  asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(addr), "f"(a));
}

// One thread: the staged half tile (rows row0 .. row0 + 127, columns col0 .. col0 + 127 of expert e) added into D by
// F32Stage::kBoxes reduce-adds, committed as one bulk group (wait with cute::tma_store_wait). Rows and columns past
// the expert's are clipped by the tensor map.
__device__ __forceinline__ void tma_reduce_half_f32(const TmaReduceF32& out, int e, int row0, int col0,
                                                    const void* st) {
  using namespace cute;
  Tensor mD = out.tma.get_tma_tensor(make_shape(out.rows, out.cols, out.num_experts));
  Tensor mDe = mD(_, _, e);
  auto cta = out.tma.get_slice(0);
#pragma unroll
  for (int b = 0; b < F32Stage::kBoxes; ++b) {
    const int c0 = col0 + b * F32Stage::kBoxCols;
    if (c0 >= out.cols) break;
    Tensor gD = local_tile(domain_offset(make_coord(row0, c0), mDe),
                           make_shape(Int<F32Stage::kRows>{}, Int<F32Stage::kBoxCols>{}), make_coord(0, 0));
    Tensor sD = make_tensor(make_smem_ptr(reinterpret_cast<const float*>(static_cast<const char*>(st) +
                                                                         b * F32Stage::kBoxBytes)),
                            F32Stage::BoxLayout{});
    copy(out.tma, cta.partition_S(sD), cta.partition_D(gD));
  }
  tma_store_arrive();
}

}  // namespace sonicmoe::cuda::gemm::sm90
