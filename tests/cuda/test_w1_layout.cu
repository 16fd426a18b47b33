// W1 stored concatenated ([gate; up] rows per expert) read through a TMA descriptor in the library's interleaved row
// order (src/cuda/gemm/w1_layout_sm90.cuh), for the two varlen-M reads of W1 (up-projection B [E, 2I, H]; dXe's B,
// W1 read as [E, k = 2I, n = H]):
//   host (no GPU): the descriptor CuTe builds (dims, byte strides, box: read from the encoder's report on a
//     deliberately misaligned address) and the coordinates the producer's tiling hands the copy, for whole and
//     partial tiles, address the concatenated row of every interleaved row;
//   GPU: one tile loaded by TMA from the concatenated W1 fills shared memory bit for bit like the interleaved
//     descriptor's load of the interleaved W1 (swizzle and out-of-bounds zero fill included); the whole varlen-M
//     GEMM with W1ConcatCfg on the concatenated W1 gives bitwise the interleaved GEMM's output (up-projection's
//     B [E, 2I, H] and dXe's B [E, k = 2I, n = H], uneven and empty experts, partial tiles).
//   host: the store twin that writes dW1 concatenated (W1ConcatOut): its descriptor, and the coordinates of a staged
//     box's rows (interleaved) at their concatenated rows, rows past 2I outside the j mode (clipped).
// Separate gate / up tensors (W1Layout::separate) are the same descriptor with runtime part / expert strides
// (W1Strides): host, the load and store descriptors' byte strides; GPU, the varlen-M GEMM on a gate / up pair in one
// buffer with a gap between them (a part stride other than E * I * H) gives bitwise the interleaved GEMM's output.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda/gemm/epilogue_tma_store_sm90.cuh"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/tma_encode.h"
#include "cuda/gemm/w1_layout_sm90.cuh"
#include "cuda/gpu_test_util.h"
#include "cuda/tma_report.h"
#include "sonicmoe/error.h"

// A named namespace: nvcc's kernel stubs cannot name a kernel template inside an anonymous one.
namespace w1_layout_test {

using namespace cute;
using El = cutlass::bfloat16_t;
namespace g = sonicmoe::cuda::gemm::sm90;

struct Shape {
  int I, H, E;
};

// (n, k) of the B operand for W1 [E, 2I, H]: up-projection n = 2I, k = H; dXe (kBMN) n = H, k = 2I.
template <class Cfg>
std::pair<int, int> nk(const Shape& s) {
  return Cfg::kBMN ? std::pair{s.H, 2 * s.I} : std::pair{2 * s.I, s.H};
}

// The encoder's report of the concatenated descriptor, from an address 2 bytes off alignment (refused on the host).
template <class Cfg>
std::string concat_descriptor_report(const Shape& s) {
  alignas(16) static El buf[16];
  const auto [n, k] = nk<Cfg>(s);
  (void)g::make_tma_w1_concat<Cfg::kBMN, typename Cfg::SmemLayoutB>(buf + 1, n, k, s.E);
  return sonicmoe::testing_util::tma_encode_report("W1 concat");
}

TEST(W1ConcatLayout, DescriptorIsFourDimensional) {
  {  // up-projection: (H, part, j, E), box (BK, 2, BN / 2, 1)
    const std::string m = concat_descriptor_report<g::VarlenMMmaGatherCfg>({768, 1024, 8});
    EXPECT_NE(m.find("dims (1024, 2, 768, 8)"), std::string::npos) << m;
    EXPECT_NE(m.find("byte strides (1 element, 1572864, 2048, 3145728)"), std::string::npos) << m;
    EXPECT_NE(m.find("box (64, 2, 128, 1)"), std::string::npos) << m;
  }
  {  // dXe: (H, part, j, E), box (64, 2, BK / 2, 1) (the 128-byte swizzle cuts n into 64-wide boxes)
    const std::string m = concat_descriptor_report<g::VarlenMContiguousBknCfg>({256, 1024, 8});
    EXPECT_NE(m.find("dims (1024, 2, 256, 8)"), std::string::npos) << m;
    EXPECT_NE(m.find("byte strides (1 element, 524288, 2048, 1048576)"), std::string::npos) << m;
    EXPECT_NE(m.find("box (64, 2, 32, 1)"), std::string::npos) << m;
  }
}

// Every in-range element of tile (n_tile, kt) of expert e: the interleaved descriptor's coordinate (TMA order: the
// contiguous H index, the W1 row n', e) and the concatenated one (H index, part, j, e) name the same W1 element:
// concat row part * I + j = (n' % 2) * I + n' / 2.
template <class Cfg>
void check_tile_coordinates(const Shape& s, int n_tile, int kt, int e) {
  const auto [n, k] = nk<Cfg>(s);
  alignas(16) static El buf[16];
  auto ti = Cfg::make_tma_b(buf, n, k, s.E);
  auto tc = g::make_tma_w1_concat<Cfg::kBMN, typename Cfg::SmemLayoutB>(buf, n, k, s.E);
  // Without a GPU the driver is absent (the encoder's report is dropped): only coordinates matter.
  (void)sonicmoe::testing_util::tma_encode_report("host-only");
  auto mI = ti.get_tma_tensor(make_shape(n, k, s.E));
  auto mC = tc.get_tma_tensor(g::w1_concat_coord_shape<Cfg::kBMN>(n, k, s.E));
  auto gI = local_tile(mI(_, _, e), make_shape(Int<Cfg::BN>{}, Int<Cfg::BK>{}), make_coord(n_tile, _));
  auto gC = local_tile(mC(_, _, e), make_shape(Int<Cfg::BN>{}, Int<Cfg::BK>{}), make_coord(n_tile, _));
  auto cI = gI(_, _, kt);
  auto cC = gC(_, _, kt);
  long checked = 0;
  for (int i = 0; i < Cfg::BN; ++i)
    for (int j = 0; j < Cfg::BK; ++j) {
      auto a = cI(i, j);
      auto c = cC(i, j);
      const long col = get<0>(a), row = get<1>(a);
      if (row >= 2 * s.I || col >= s.H) continue;  // outside W1: zero-filled by both descriptors
      ++checked;
      ASSERT_EQ(get<0>(c), col) << "tile element (" << i << ", " << j << ")";
      ASSERT_EQ(get<1>(c) * s.I + get<2>(c), (row % 2) * s.I + row / 2) << "tile element (" << i << ", " << j << ")";
      ASSERT_EQ(get<3>(c), e);
    }
  EXPECT_GT(checked, 0);
}

TEST(W1ConcatLayout, TileCoordinatesAddressTheConcatenatedRows) {
  check_tile_coordinates<g::VarlenMMmaGatherCfg>({768, 1024, 8}, 1, 3, 5);
  check_tile_coordinates<g::VarlenMMmaGatherCfg>({200, 136, 3}, 1, 2, 2);   // last n tile and k tile partial
  check_tile_coordinates<g::VarlenMContiguousCfg>({96, 520, 2}, 0, 8, 1);   // BN > 2I
  check_tile_coordinates<g::VarlenMContiguousBknCfg>({256, 1024, 8}, 2, 5, 3);
  check_tile_coordinates<g::VarlenMContiguousBknCfg>({200, 520, 3}, 2, 6, 1);  // partial in n and in k
}

// ---- dW1 stored concatenated: the store twin (W1ConcatOut, the varlen-K epilogue under VarlenKConcatDCfg) ---------

// The store descriptor of dW1 [E, 2I, H] concatenated, for boxes of BR staged rows: 4 modes (H, part, j, E), box
// (64, 2, BR / 2, 1).
template <int BR>
std::string concat_store_report(const Shape& s) {
  alignas(16) static El buf[16];
  (void)g::W1ConcatOut<BR>::make(reinterpret_cast<__nv_bfloat16*>(buf + 1), 2 * s.I, s.H, s.E);
  return sonicmoe::testing_util::tma_encode_report("dW1 concat");
}

// Separate gate / up tensors: the same four modes, the part stride up - gate (here E * I * H + 64 elements, the pair
// in one buffer 128 bytes apart) and the expert stride I * H.
TEST(W1SeparateLayout, DescriptorStridesAreThePair) {
  alignas(16) static El buf[16];
  const Shape s{768, 1024, 8};
  const std::int64_t IH = static_cast<std::int64_t>(s.I) * s.H, P = s.E * IH + 64;
  (void)g::make_tma_w1_concat<false, typename g::VarlenMMmaGatherCfg::SmemLayoutB>(buf + 1, 2 * s.I, s.H, s.E,
                                                                                  {P, IH});
  std::string m = sonicmoe::testing_util::tma_encode_report("W1 separate");
  EXPECT_NE(m.find("dims (1024, 2, 768, 8)"), std::string::npos) << m;
  EXPECT_NE(m.find("byte strides (1 element, " + std::to_string(2 * P) + ", 2048, " + std::to_string(2 * IH) + ")"),
            std::string::npos) << m;
  EXPECT_NE(m.find("box (64, 2, 128, 1)"), std::string::npos) << m;
  (void)g::make_tma_w1_concat<true, typename g::VarlenMContiguousBknCfg::SmemLayoutB>(buf + 1, s.H, 2 * s.I, s.E,
                                                                                     {P, IH});
  m = sonicmoe::testing_util::tma_encode_report("W1 separate (dXe)");
  EXPECT_NE(m.find("byte strides (1 element, " + std::to_string(2 * P) + ", 2048, " + std::to_string(2 * IH) + ")"),
            std::string::npos) << m;
  (void)g::W1ConcatOut<128>::make(reinterpret_cast<__nv_bfloat16*>(buf + 1), 2 * s.I, s.H, s.E, {P, IH});
  m = sonicmoe::testing_util::tma_encode_report("dW1 separate");
  EXPECT_NE(m.find("byte strides (1 element, " + std::to_string(2 * P) + ", 2048, " + std::to_string(2 * IH) + ")"),
            std::string::npos) << m;
  EXPECT_NE(m.find("box (64, 2, 64, 1)"), std::string::npos) << m;
}

TEST(W1ConcatLayout, StoreDescriptorIsFourDimensional) {
  {  // the varlen-K kernel's D tile (BM = 128 rows)
    const std::string m = concat_store_report<128>({768, 1024, 8});
    EXPECT_NE(m.find("dims (1024, 2, 768, 8)"), std::string::npos) << m;
    EXPECT_NE(m.find("byte strides (1 element, 1572864, 2048, 3145728)"), std::string::npos) << m;
    EXPECT_NE(m.find("box (64, 2, 64, 1)"), std::string::npos) << m;
  }
  {  // the swapped kernel's D^T tile (BN = 256 D rows)
    const std::string m = concat_store_report<256>({200, 264, 3});
    EXPECT_NE(m.find("dims (264, 2, 200, 3)"), std::string::npos) << m;
    EXPECT_NE(m.find("box (64, 2, 128, 1)"), std::string::npos) << m;
  }
}

// Every element of the staged box (rows row0 .., columns c0 .., as tma_store_boxes_w1_concat tiles them) that lies in
// dW1 has the coordinate (H index, part, j, e) of its concatenated row part * I + j = (n % 2) * I + n / 2 for the
// interleaved row n = row0 + i; the elements past 2I are exactly those with j >= I (clipped by the tensor map).
template <int BR>
void check_store_coordinates(const Shape& s, int row_tile, int c0, int e) {
  alignas(16) static El buf[16];
  auto out = g::W1ConcatOut<BR>::make(reinterpret_cast<__nv_bfloat16*>(buf), 2 * s.I, s.H, s.E);
  (void)sonicmoe::testing_util::tma_encode_report("host-only");
  auto mD = out.tma.get_tma_tensor(g::w1_concat_coord_shape<false>(2 * s.I, s.H, s.E));
  auto gD = local_tile(mD(_, _, e), make_shape(Int<BR>{}, Int<64>{}), make_coord(row_tile, c0 / 64));
  long inside = 0, clipped = 0;
  for (int i = 0; i < BR; ++i)
    for (int j = 0; j < 64; ++j) {
      auto c = gD(i, j);
      const long n = static_cast<long>(row_tile) * BR + i, col = c0 + j;
      ASSERT_EQ(get<0>(c), col) << "box element (" << i << ", " << j << ")";
      ASSERT_EQ(get<3>(c), e);
      if (n < 2L * s.I) {
        ++inside;
        ASSERT_LT(get<2>(c), s.I) << "box element (" << i << ", " << j << ")";
        ASSERT_EQ(get<1>(c) * s.I + get<2>(c), (n % 2) * s.I + n / 2) << "box element (" << i << ", " << j << ")";
      } else {
        ++clipped;
        ASSERT_GE(get<2>(c), s.I) << "a row past 2I must fall outside the j mode: box element (" << i << ", " << j
                                  << ")";
      }
    }
  EXPECT_GT(inside, 0);
  if ((row_tile + 1) * BR > 2 * s.I) EXPECT_GT(clipped, 0);
}

TEST(W1ConcatLayout, StoreTileCoordinatesAddressTheConcatenatedRows) {
  check_store_coordinates<128>({768, 1024, 8}, 5, 512, 3);
  check_store_coordinates<128>({200, 264, 3}, 3, 256, 2);  // 2I = 400: the last tile holds 16 rows
  check_store_coordinates<256>({200, 264, 3}, 1, 192, 1);  // 2I = 400: the second tile holds 144 rows
  check_store_coordinates<256>({768, 1024, 8}, 2, 0, 7);
}

// ---- GPU: the two loads fill shared memory identically -------------------------------------------------------------

template <class Cfg, class TmaI, class TmaC, class CoordShape>
__global__ void load_both(const __grid_constant__ TmaI ti, const __grid_constant__ TmaC tc, int n, int k, int E,
                          CoordShape cshape, int n_tile, int kt, int e, int* mismatches) {
  extern __shared__ __align__(1024) unsigned char smem[];
  constexpr int kTile = Cfg::BN * Cfg::BK;
  El* si = reinterpret_cast<El*>(smem);
  El* sc = si + kTile;
  __shared__ alignas(8) std::uint64_t bar;
  using SL = decltype(typename Cfg::SmemLayoutB{}(_, _, 0));
  Tensor sI = make_tensor(make_smem_ptr(si), SL{});
  Tensor sC = make_tensor(make_smem_ptr(sc), SL{});
  if (threadIdx.x == 0) {
    g::TxBarrier::init(&bar, 1);
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    Tensor mI = ti.get_tma_tensor(make_shape(n, k, E));
    Tensor mC = tc.get_tma_tensor(cshape);
    Tensor gI = local_tile(mI(_, _, e), make_shape(Int<Cfg::BN>{}, Int<Cfg::BK>{}), make_coord(n_tile, _));
    Tensor gC = local_tile(mC(_, _, e), make_shape(Int<Cfg::BN>{}, Int<Cfg::BK>{}), make_coord(n_tile, _));
    auto pi = ti.get_slice(0);
    auto pc = tc.get_slice(0);
    g::TxBarrier::arrive_and_expect_tx(&bar, 2 * kTile * sizeof(El));
    copy(ti.with(bar), pi.partition_S(gI)(_, _, _, kt), pi.partition_D(sI));
    copy(tc.with(bar), pc.partition_S(gC)(_, _, _, kt), pc.partition_D(sC));
  }
  g::TxBarrier::wait(&bar, 0);
  const std::uint16_t* a = reinterpret_cast<const std::uint16_t*>(si);
  const std::uint16_t* b = reinterpret_cast<const std::uint16_t*>(sc);
  int bad = 0;
  for (int i = threadIdx.x; i < kTile; i += blockDim.x) bad += a[i] != b[i];
  if (bad) atomicAdd(mismatches, bad);
}

template <class Cfg>
void expect_same_tile(const Shape& s, int n_tile, int kt, int e) {
  const auto [n, k] = nk<Cfg>(s);
  const std::int64_t rows = 2LL * s.I, per = rows * s.H;
  // Interleaved W1 and the same values concatenated: row 2j + part of the first is row part * I + j of the second.
  std::vector<std::uint16_t> wi(per * s.E), wc(per * s.E);
  std::mt19937 rng(5);
  for (auto& v : wi) v = static_cast<std::uint16_t>(0x3c00 + rng() % 0x0400);  // distinct-ish nonzero bf16
  for (int ex = 0; ex < s.E; ++ex)
    for (std::int64_t r = 0; r < rows; ++r)
      for (int h = 0; h < s.H; ++h)
        wc[ex * per + ((r % 2) * s.I + r / 2) * s.H + h] = wi[ex * per + r * s.H + h];
  El *di = nullptr, *dc = nullptr;
  int* dbad = nullptr;
  ASSERT_EQ(cudaMalloc(&di, wi.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dc, wc.size() * 2), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&dbad, sizeof(int)), cudaSuccess);
  cudaMemcpy(di, wi.data(), wi.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dc, wc.data(), wc.size() * 2, cudaMemcpyHostToDevice);
  cudaMemset(dbad, 0, sizeof(int));
  auto ti = Cfg::make_tma_b(di, n, k, s.E);
  auto tc = g::make_tma_w1_concat<Cfg::kBMN, typename Cfg::SmemLayoutB>(dc, n, k, s.E);
  sonicmoe::cuda::tma::check_encoded("W1");
  const auto cshape = g::w1_concat_coord_shape<Cfg::kBMN>(n, k, s.E);
  auto kernel = load_both<Cfg, decltype(ti), decltype(tc), decltype(cshape)>;
  const int smem = 2 * Cfg::BN * Cfg::BK * 2 + 1024;
  ASSERT_EQ(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), cudaSuccess);
  kernel<<<1, 128, smem>>>(ti, tc, n, k, s.E, cshape, n_tile, kt, e, dbad);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  int bad = -1;
  cudaMemcpy(&bad, dbad, sizeof(int), cudaMemcpyDeviceToHost);
  EXPECT_EQ(bad, 0) << "shared-memory elements that differ between the two loads";
  cudaFree(di);
  cudaFree(dc);
  cudaFree(dbad);
}

TEST(W1ConcatLayout, GpuTmaLoadEqualsTheInterleavedLoad) {
  SONICMOE_REQUIRE_GPU();
  expect_same_tile<g::VarlenMMmaGatherCfg>({768, 1024, 4}, 1, 3, 2);
  expect_same_tile<g::VarlenMMmaGatherCfg>({200, 136, 3}, 1, 2, 2);  // partial tiles: zero fill alike
  expect_same_tile<g::VarlenMContiguousBknCfg>({256, 1024, 4}, 2, 5, 3);
  expect_same_tile<g::VarlenMContiguousBknCfg>({200, 520, 3}, 2, 6, 1);
}

// The varlen-M GEMM C = A B^T (store epilogue, contiguous A) with B = W1 interleaved under Cfg and with B = the same W1
// concatenated under W1ConcatCfg<Cfg>: bitwise equal C. sep_gap >= 0: W1 as separate gate / up tensors in one buffer,
// the up part sep_gap elements after the gate's end (part stride E * I * H + sep_gap, expert stride I * H).
template <class Cfg>
void expect_same_gemm(const Shape& s, const std::vector<int>& counts, std::int64_t sep_gap = -1) {
  const auto [n, k] = nk<Cfg>(s);
  const int E = s.E;
  std::vector<int> offsets(E + 1, 0);
  for (int e = 0; e < E; ++e) offsets[e + 1] = offsets[e] + counts[e];
  const int rows = offsets[E];
  const std::int64_t wrows = 2LL * s.I, per = wrows * s.H;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> ud(-1.0f, 1.0f);
  const bool separate = sep_gap >= 0;
  const std::int64_t part = separate ? E * per / 2 + sep_gap : 0;  // elements from the gate to the up tensor
  std::vector<El> a(static_cast<std::size_t>(rows) * k), wi(per * E), wc(separate ? part + E * per / 2 : per * E);
  for (auto& v : a) v = El(ud(rng));
  for (auto& v : wi) v = El(ud(rng));
  for (int ex = 0; ex < E; ++ex)
    for (std::int64_t r = 0; r < wrows; ++r)
      for (int h = 0; h < s.H; ++h) {
        const std::int64_t at = separate ? (r % 2) * part + (ex * s.I + r / 2) * s.H + h  // part r % 2, row r / 2
                                         : ex * per + ((r % 2) * s.I + r / 2) * s.H + h;
        wc[at] = wi[ex * per + r * s.H + h];
      }
  El *da, *dwi, *dwc, *ci, *cc;
  int* doff;
  cudaMalloc(&da, a.size() * 2);
  cudaMalloc(&dwi, wi.size() * 2);
  cudaMalloc(&dwc, wc.size() * 2);
  cudaMalloc(&ci, static_cast<std::size_t>(rows) * n * 2);
  cudaMalloc(&cc, static_cast<std::size_t>(rows) * n * 2);
  cudaMalloc(&doff, offsets.size() * sizeof(int));
  cudaMemcpy(da, a.data(), a.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dwi, wi.data(), wi.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(dwc, wc.data(), wc.size() * 2, cudaMemcpyHostToDevice);
  cudaMemcpy(doff, offsets.data(), offsets.size() * sizeof(int), cudaMemcpyHostToDevice);
  cudaMemset(ci, 0xff, static_cast<std::size_t>(rows) * n * 2);
  cudaMemset(cc, 0x7f, static_cast<std::size_t>(rows) * n * 2);
  sonicmoe::cuda::gemm::NativeVarlenM g;
  g.a = reinterpret_cast<const __nv_bfloat16*>(da);
  g.a_rows = rows;
  g.b_kn = Cfg::kBMN;
  g.offsets = doff;
  g.rows = rows;
  g.num_experts = E;
  g.n = n;
  g.k = k;
  g.b = reinterpret_cast<const __nv_bfloat16*>(dwi);
  g::launch_varlen_m<Cfg, g::EpiStoreTma>(
      g, g::EpiStoreTma::make_params(reinterpret_cast<__nv_bfloat16*>(ci), nullptr, nullptr, n, rows));
  g.b = reinterpret_cast<const __nv_bfloat16*>(dwc);
  if (separate) {
    g.b_w1_part_stride = part;
    g.b_w1_expert_stride = static_cast<std::int64_t>(s.I) * s.H;
  }
  g::launch_varlen_m<g::W1ConcatCfg<Cfg>, g::EpiStoreTma>(
      g, g::EpiStoreTma::make_params(reinterpret_cast<__nv_bfloat16*>(cc), nullptr, nullptr, n, rows));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<std::uint16_t> hi(static_cast<std::size_t>(rows) * n), hc(hi.size());
  cudaMemcpy(hi.data(), ci, hi.size() * 2, cudaMemcpyDeviceToHost);
  cudaMemcpy(hc.data(), cc, hc.size() * 2, cudaMemcpyDeviceToHost);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < hi.size(); ++i) bad += hi[i] != hc[i];
  EXPECT_EQ(bad, 0u) << "of " << hi.size() << " output elements differ";
  for (void* p : {static_cast<void*>(da), static_cast<void*>(dwi), static_cast<void*>(dwc), static_cast<void*>(ci),
                  static_cast<void*>(cc), static_cast<void*>(doff)})
    cudaFree(p);
}

TEST(W1ConcatLayout, GpuGemmEqualsTheInterleavedGemm) {
  SONICMOE_REQUIRE_GPU();
  expect_same_gemm<g::VarlenMContiguousCfg>({200, 136, 4}, {300, 0, 129, 1});       // up-projection: n = 2I = 400
  expect_same_gemm<g::VarlenMContiguousCfg>({512, 1024, 3}, {256, 513, 77});
  expect_same_gemm<g::VarlenMContiguousBknCfg>({200, 520, 4}, {130, 1, 0, 257});     // dXe: k = 2I = 400
  expect_same_gemm<g::VarlenMContiguousBknCfg>({512, 1024, 3}, {256, 300, 64});
}

TEST(W1SeparateLayout, GpuGemmEqualsTheInterleavedGemm) {
  SONICMOE_REQUIRE_GPU();
  expect_same_gemm<g::VarlenMContiguousCfg>({200, 136, 4}, {300, 0, 129, 1}, /*sep_gap=*/0);  // [2, E, I, H]
  expect_same_gemm<g::VarlenMContiguousCfg>({512, 1024, 3}, {256, 513, 77}, /*sep_gap=*/4096);
  expect_same_gemm<g::VarlenMContiguousBknCfg>({200, 520, 4}, {130, 1, 0, 257}, /*sep_gap=*/8);
  expect_same_gemm<g::VarlenMContiguousBknCfg>({512, 1024, 3}, {256, 300, 64}, /*sep_gap=*/0);
}

}  // namespace w1_layout_test
