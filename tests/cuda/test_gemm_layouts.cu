// Host-side checks (no GPU needed) that the hand-written shared-memory addressing of the native GEMMs' cp.async
// producers equals the swizzled layouts the wgmma descriptors and TMA use, as CuTe computes them:
//   varlen-M, gathered A (K-major, 128-byte swizzle): row r, 16-byte chunk c at r*128 + ((c ^ r%8) * 16)
//     (also the producer's Cfg::a_chunk_offset, and the MMA warps' MmaGatherLoader::slot_offset);
//   varlen-K, P and Q (M/N-major, 128-byte swizzle): chunk c of row k at (c/8)*8192 + (k/8)*1024 + (k%8)*128
//   + ((c%8) ^ (k%8)) * 16;
//   the TMA-store epilogue's staging tile (SwizzledStage): BN / 64 boxes, each CuTe's K-major SW128 layout of a
//   BM x 64 TMA box (and, transposed for the weight gradients, BM / 64 boxes of BN x 64); the consumers' staging
//   addresses split into per-thread and constant parts; the accumulating epilogue's fp32 half tile (F32Stage: four
//   128 x 32 boxes of CuTe's K-major SW128 fp32 layout).
// Also checks the shared-memory budget of every kernel variant, and that the varlen-M tile scheduler decodes every
// tile of every expert exactly once in both tile orders.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cuda/gemm/tma_store_sm90.cuh"
#include "cuda/gemm/kernel_sm90_varlen_k.cuh"
#include "cuda/gemm/kernel_sm90_varlen_m.cuh"
#include "cuda/gemm/tma_encode.h"
#include "cuda/tma_report.h"
#include "sonicmoe/error.h"

namespace {

using namespace cute;
using El = cutlass::bfloat16_t;
namespace g = sonicmoe::cuda::gemm::sm90;

// Byte offset of element (i, j, stage) in a swizzled smem layout, through a tensor on a null smem pointer
// (the path the kernels' partitions take).
template <class Layout, class T = El>
long byte_of(const Layout& layout, int i, int j, int s) {
  auto t = make_tensor(make_smem_ptr(reinterpret_cast<T*>(0)), layout);
  return static_cast<long>(reinterpret_cast<std::uintptr_t>(raw_pointer_cast(&t(i, j, s))));
}

TEST(GemmLayouts, VarlenMGatheredAMatchesSwizzledKMajor) {
  using Cfg = g::VarlenMWideGatherCfg;
  const auto L = typename Cfg::SmemLayoutA{};
  for (int s = 0; s < Cfg::Stages; ++s)
    for (int r = 0; r < Cfg::BM; ++r)
      for (int c = 0; c < Cfg::BK / 8; ++c)
        for (int e = 0; e < 8; ++e) {
          const long want = static_cast<long>(s) * Cfg::kStageBytesA + r * 128 + ((c ^ (r & 7)) << 4) + 2 * e;
          ASSERT_EQ(byte_of(L, r, 8 * c + e, s), want) << "row " << r << " chunk " << c << " stage " << s;
          ASSERT_EQ(static_cast<long>(s) * Cfg::kStageBytesA + Cfg::a_chunk_offset(r, c) + 2 * e, want);
        }
}

// The MMA warps' gather (MmaGatherLoader, kMmaGather): every (row, chunk) of the A tile written by exactly one
// consumer thread, at CuTe's address, and every row by a thread of the warp whose wgmma read it (warp w of the two
// MMA warpgroups: rows 16 w .. 16 w + 15), which is what lets a warp refill its rows without waiting for the others.
TEST(GemmLayouts, MmaGatherSlotsCoverTheTileOncePerOwningWarp) {
  using Cfg = g::VarlenMMmaGatherCfg;
  using Loader = g::MmaGatherLoader<Cfg>;
  const auto L = typename Cfg::SmemLayoutA{};
  std::vector<int> seen(Cfg::BM * Cfg::kRowChunks, 0);
  for (int ct = 0; ct < Cfg::kConsumerThreads; ++ct)
    for (int i = 0; i < Loader::kRows; ++i) {
      const int r = Loader::slot_row(ct, i), c = Loader::slot_chunk(ct);
      ASSERT_GE(r, 0);
      ASSERT_LT(r, Cfg::BM);
      EXPECT_EQ(r / 16, ct / 32) << "thread " << ct << " slot " << i << ": row " << r << " of another warp";
      EXPECT_EQ(static_cast<long>(Loader::slot_offset(ct, i)), byte_of(L, r, 8 * c, 0)) << "thread " << ct << " slot " << i;
      ++seen[r * Cfg::kRowChunks + c];
    }
  for (std::size_t j = 0; j < seen.size(); ++j) EXPECT_EQ(seen[j], 1) << "row " << j / 8 << " chunk " << j % 8;
  EXPECT_EQ(Cfg::kThreads, 384);
  EXPECT_EQ(Cfg::kGatherThreads, Cfg::kConsumerThreads);
}

// FP8 configs (mainloop_sm90_varlen_m_fp8.cuh): a stage row is 128 e4m3 = 128 bytes, so the A stage has the bf16
// stage's byte geometry: chunk c of row r at r*128 + ((c ^ r%8) * 16), byte e of the chunk at + e; and the MMA warps'
// gather slots (MmaGatherLoader, unchanged) cover the tile once, each row by its owning warp, at CuTe's address.
TEST(GemmLayouts, Fp8AStageMatchesSwizzledKMajorAndGatherSlots) {
  using Cfg = g::VarlenMFp8GatherCfg;
  using E8 = typename Cfg::Element;
  static_assert(sizeof(E8) == 1 && Cfg::kRowBytes == 128 && Cfg::kChunkElems == 16);
  const auto L = typename Cfg::SmemLayoutA{};
  for (int s = 0; s < Cfg::Stages; ++s)
    for (int r = 0; r < Cfg::BM; ++r)
      for (int c = 0; c < Cfg::kRowChunks; ++c)
        for (int e = 0; e < 16; ++e) {
          const long want = static_cast<long>(s) * Cfg::kStageBytesA + r * 128 + ((c ^ (r & 7)) << 4) + e;
          ASSERT_EQ((byte_of<decltype(L), E8>(L, r, 16 * c + e, s)), want) << "row " << r << " chunk " << c;
          ASSERT_EQ(static_cast<long>(s) * Cfg::kStageBytesA + Cfg::a_chunk_offset(r, c) + e, want);
        }
  using Loader = g::MmaGatherLoader<Cfg>;
  std::vector<int> seen(Cfg::BM * Cfg::kRowChunks, 0);
  for (int ct = 0; ct < Cfg::kConsumerThreads; ++ct)
    for (int i = 0; i < Loader::kRows; ++i) {
      const int r = Loader::slot_row(ct, i), c = Loader::slot_chunk(ct);
      EXPECT_EQ(r / 16, ct / 32) << "thread " << ct << " slot " << i << ": row " << r << " of another warp";
      EXPECT_EQ(static_cast<long>(Loader::slot_offset(ct, i)), (byte_of<decltype(L), E8>(L, r, 16 * c, 0)));
      ++seen[r * Cfg::kRowChunks + c];
    }
  for (std::size_t j = 0; j < seen.size(); ++j) EXPECT_EQ(seen[j], 1) << "row " << j / 8 << " chunk " << j % 8;
  // B's stage: K-major, the same swizzle (TMA writes it; checked for the wgmma descriptor's view).
  const auto LB = typename Cfg::SmemLayoutB{};
  for (int r = 0; r < Cfg::BN; r += 7)
    for (int k = 0; k < Cfg::BK; k += 5)
      ASSERT_EQ((byte_of<decltype(LB), E8>(LB, r, k, 1)),
                Cfg::kStageBytesB + r * 128 + (((k / 16) ^ (r & 7)) << 4) + k % 16);
}

template <class Layout>
void check_mn_major(const Layout& L, int mn, int stages, long stage_bytes) {
  for (int s = 0; s < stages; ++s)
    for (int i = 0; i < mn; ++i)
      for (int k = 0; k < 64; ++k) {
        const int c = i / 8;
        const long want = s * stage_bytes + (c / 8) * 8192 + (k / 8) * 1024 + (k % 8) * 128 +
                          (((c % 8) ^ (k % 8)) << 4) + 2 * (i % 8);
        ASSERT_EQ(byte_of(L, i, k, s), want) << "mn " << i << " k " << k << " stage " << s;
      }
}

TEST(GemmLayouts, VarlenKOperandsMatchSwizzledMnMajor) {
  using Cfg = g::VarlenKGatheredPCfg;
  check_mn_major(typename Cfg::SmemLayoutA{}, Cfg::BM, Cfg::Stages, Cfg::kStageBytesA);
  check_mn_major(typename Cfg::SmemLayoutB{}, Cfg::BN, Cfg::Stages, Cfg::kStageBytesB);
}

// Box b of SwizzledStage<BoxRows> (columns 64 b ..) is CuTe's K-major SW128 layout of a BoxRows x 64 TMA box.
template <int BoxRows>
void check_boxes(int cols) {
  using S = g::SwizzledStage<BoxRows>;
  auto box = make_tensor(make_smem_ptr(reinterpret_cast<El*>(0)), typename S::BoxLayout{});
  ASSERT_EQ(static_cast<int>(size(box)), BoxRows * S::kBoxCols);
  for (int m = 0; m < BoxRows; ++m)
    for (int n = 0; n < cols; ++n) {
      const long in_box = static_cast<long>(reinterpret_cast<std::uintptr_t>(raw_pointer_cast(&box(m, n % S::kBoxCols))));
      const long want = static_cast<long>(n / S::kBoxCols) * BoxRows * S::kBoxCols * 2 + in_box;
      ASSERT_EQ(2L * S::offset(m, n), want) << "row " << m << " column " << n;
    }
}

TEST(GemmLayouts, TransposedStagingMatchesSwizzledBoxes) {
  using Cfg = g::VarlenKGatheredPTmaQTransposedCfg;
  check_boxes<Cfg::BN>(Cfg::BM);  // D^T tile: 256 rows (the tile's columns) x 128
  EXPECT_EQ(offsetof(g::VarlenKSmem<Cfg>, d) % 1024, 0u);
}

// The accumulating varlen-K epilogue's fp32 half tile (F32Stage): box c / 32 is CuTe's K-major SW128 fp32 layout of a
// 128 x 32 TMA box; the half fits the staging tile.
TEST(GemmLayouts, F32ReduceStagingMatchesSwizzledBoxes) {
  using S = g::F32Stage;
  auto box = make_tensor(make_smem_ptr(reinterpret_cast<float*>(0)), typename S::BoxLayout{});
  ASSERT_EQ(static_cast<int>(size(box)), S::kRows * S::kBoxCols);
  for (int r = 0; r < S::kRows; ++r)
    for (int c = 0; c < S::kCols; ++c) {
      const long in_box = static_cast<long>(reinterpret_cast<std::uintptr_t>(raw_pointer_cast(&box(r, c % S::kBoxCols))));
      ASSERT_EQ(static_cast<long>(S::offset_bytes(r, c)), static_cast<long>(c / S::kBoxCols) * S::kBoxBytes + in_box)
          << "row " << r << " column " << c;
    }
  using Cfg = g::VarlenKAccumF32Cfg<g::VarlenKGatheredPTmaQTransposedCfg>;
  EXPECT_GE(sizeof(g::VarlenKSmem<Cfg>::d), static_cast<std::size_t>(S::kBoxes * S::kBoxBytes));
}

TEST(GemmLayouts, TmaStoreStagingMatchesSwizzledBoxes) {
  using Cfg = g::VarlenMContiguousCfg;
  using S = g::SwizzledStage<Cfg::BM>;
  static_assert(std::is_same_v<S, g::TmaStage>);
  check_boxes<Cfg::BM>(Cfg::BN);
  // The staging buffer holds the boxes and starts on the swizzle's 1024-byte period.
  static_assert(Cfg::BM * Cfg::kStageLd >= Cfg::BM * Cfg::BN, "staging buffer too small for the TMA boxes");
  EXPECT_EQ(offsetof(g::VarlenMSmem<Cfg>, d) % 1024, 0u);
}

// The consumers' staging stores (stage_swizzled, stage_pairs) split each accumulator pair's (row, column) into the
// thread's first pair (m0, n0) plus constants (dm, dn); the swizzled split needs n0 < 8, dm in {0, 8} and dn a multiple
// of 8; the transposed staging of the weight-gradient kernel (stage_transposed_swizzled) needs the same.
// Checked here for every consumer thread of both MMA shapes, with the accumulator coordinates CuTe gives the kernel.
template <class Cfg>
void check_staging_split() {
  using S = g::TmaStage;
  typename Cfg::TiledMma mma;
  auto acc = partition_fragment_C(mma, make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{}));
  const int vals = static_cast<int>(size(acc));
  ASSERT_EQ(vals, Cfg::BM * Cfg::BN / Cfg::kConsumerThreads);
  std::vector<int> hits(Cfg::BM * Cfg::BN, 0);
  for (int t = 0; t < Cfg::kConsumerThreads; ++t) {
    auto crd = mma.get_slice(t).partition_C(make_identity_tensor(make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{})));
    const int m0 = get<0>(crd(0)), n0 = get<1>(crd(0));
    ASSERT_LT(n0, 8) << "thread " << t;
    for (int i = 0; i < vals; i += 2) {
      const int m = get<0>(crd(i)), n = get<1>(crd(i));
      ASSERT_EQ(get<0>(crd(i + 1)), m);
      ASSERT_EQ(get<1>(crd(i + 1)), n + 1) << "a pair is two adjacent columns of one row";
      const int dm = m - m0, dn = n - n0;
      ASSERT_TRUE(dm == 0 || dm == 8) << "thread " << t << " value " << i;
      ASSERT_EQ(dn % 8, 0) << "thread " << t << " value " << i;
      ASSERT_EQ(S::thread_part(m0, n0) + S::value_part(dm, dn, m0 & 7), S::offset(m, n)) << "thread " << t;
      // the transposed staging (stage_transposed_swizzled): D^T boxes with the tile's columns as rows
      using T = g::SwizzledStage<Cfg::BN>;
      for (int c = 0; c < 2; ++c)
        ASSERT_EQ(T::offset(n0 + c, m0 + dm) + T::kBoxCols * dn, T::offset(n + c, m)) << "thread " << t;
      hits[m * Cfg::BN + n] += 1;
      hits[m * Cfg::BN + n + 1] += 1;
    }
  }
  for (int v : hits) ASSERT_EQ(v, 1) << "every tile element staged exactly once";
}

TEST(GemmLayouts, StagingStoresSplitIntoThreadAndValueParts) {
  check_staging_split<g::VarlenMContiguousCfg>();     // 64x256 atoms
  check_staging_split<g::VarlenMWideGatherCfg>();     // 64x128 atoms
  check_staging_split<g::VarlenKGatheredPTmaQCfg>();  // weight gradients, MN-major operands
  check_staging_split<g::VarlenMFp8GatherCfg>();      // FP8: 64x128x32 e4m3 atoms (also: each thread's rows are
                                                      // m0 and m0 + 8, what mma_k_loop_promoted's scales assume)
}

// FP8 consumer loop (mma_k_loop_promoted, promote_chunk): acc is (MMA, 1, kChunks); value i of chunk c is row
// m0 + 8 * ((i >> 1) & 1) of the thread and a column of chunk c (whose B scale is block c * kAtomN / 128 of the tile).
template <class Cfg>
void check_fp8_promote_layout() {
  typename Cfg::TiledMma mma;
  auto acc = partition_fragment_C(mma, make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{}));
  static_assert(decltype(size<1>(acc))::value == 1 && decltype(size<2>(acc))::value == Cfg::kChunks);
  for (int t = 0; t < Cfg::kConsumerThreads; ++t) {
    auto crd = mma.get_slice(t).partition_C(make_identity_tensor(make_shape(Int<Cfg::BM>{}, Int<Cfg::BN>{})));
    const int m0 = get<0>(crd(0));
    for (int c = 0; c < Cfg::kChunks; ++c) {
      auto cc = crd(_, 0, c);
      for (int i = 0; i < static_cast<int>(size(cc)); ++i) {
        ASSERT_EQ(get<0>(cc(i)) - m0, 8 * ((i >> 1) & 1)) << "thread " << t << " chunk " << c << " value " << i;
        ASSERT_EQ(get<1>(cc(i)) / Cfg::kAtomN, c) << "thread " << t << " chunk " << c << " value " << i;
      }
    }
  }
}

TEST(GemmLayouts, Fp8PromotionRowsAndChunksOfEveryVariant) {
  check_fp8_promote_layout<g::VarlenMFp8Config<true, 0>>();
  check_fp8_promote_layout<g::VarlenMFp8Config<true, 1>>();
  check_fp8_promote_layout<g::VarlenMFp8Config<true, 2>>();
  check_fp8_promote_layout<g::VarlenMFp8Config<false, 3>>();
  check_staging_split<g::VarlenMFp8Config<true, 1>>();
  check_staging_split<g::VarlenMFp8Config<true, 2>>();
  check_staging_split<g::VarlenMFp8Config<true, 3>>();
  const int e_max = sonicmoe::cuda::gemm::kNativeMaxExperts;
  using Bn256 = g::VarlenMFp8Config<true, 2>;
  using Bn256Split = g::VarlenMFp8Config<true, 3>;
  EXPECT_LE(g::varlen_m_smem_bytes<Bn256>(e_max), 227u * 1024);
  EXPECT_LE(g::varlen_m_smem_bytes<Bn256Split>(e_max), 227u * 1024);
}

TEST(GemmLayouts, SharedMemoryFitsEveryVariant) {
  constexpr std::size_t kMax = 227 * 1024;
  using Contiguous = g::VarlenMContiguousCfg;
  using Gathered = g::VarlenMWideGatherBknCfg;
  const int e_max = sonicmoe::cuda::gemm::kNativeMaxExperts;
  EXPECT_LE(g::varlen_m_smem_bytes<Contiguous>(e_max), kMax);
  EXPECT_LE(g::varlen_m_smem_bytes<Gathered>(e_max), kMax);
  EXPECT_LE(g::varlen_m_smem_bytes<g::VarlenMFp8GatherCfg>(e_max), kMax);
  EXPECT_LE(g::varlen_m_smem_bytes<g::VarlenMFp8ContiguousCfg>(e_max), kMax);
  EXPECT_EQ(offsetof(g::VarlenMSmem<g::VarlenMFp8GatherCfg>, d) % 1024, 0u);
  EXPECT_LE(sizeof(g::VarlenKSmem<g::VarlenKGatheredPCfg>) + 1024, kMax);
  EXPECT_LE(sizeof(g::VarlenKSmem<g::VarlenKContiguousPCfg>) + 1024, kMax);
  EXPECT_LE(sizeof(g::VarlenKSmem<g::VarlenKGatheredPTmaQCfg>) + 1024, kMax);
  EXPECT_LE(sizeof(g::VarlenKSmem<g::VarlenKGatheredPTmaQTransposedCfg>) + 1024, kMax);
  // The staged store's tile starts on the swizzle's 1024-byte period.
  EXPECT_EQ(offsetof(g::VarlenKSmem<g::VarlenKGatheredPCfg>, d) % 1024, 0u);
  // The gathered A tile is exactly covered by the producer threads' chunks.
  using Cfg = g::VarlenMWideGatherCfg;
  EXPECT_EQ(Cfg::kProducerThreads * (Cfg::BM * Cfg::kRowChunks / Cfg::kProducerThreads), Cfg::BM * Cfg::kRowChunks);
}

// The varlen-M scheduler (its decoding runs on the host too): over t = 0 .. total() - 1, every (expert, M tile,
// N tile) of the experts' rows exactly once, with the right row count; M-tile major keeps an M tile's N tiles
// consecutive, N-tile major an N tile's M tiles. The prefix is built as VarlenMScheduler::build does on the device.
void check_scheduler_cover(const std::vector<int>& offsets, int n_tiles, bool raster_n) {
  constexpr int BM = 128;
  const int E = static_cast<int>(offsets.size()) - 1;
  std::vector<int> prefix(E + 1, 0);
  std::map<std::tuple<int, int, int>, int> want;  // (expert, row0, n_tile) -> rows
  for (int e = 0; e < E; ++e) {
    const int m_tiles = (offsets[e + 1] - offsets[e] + BM - 1) / BM;
    prefix[e + 1] = prefix[e] + m_tiles * n_tiles;
    for (int m = 0; m < m_tiles; ++m)
      for (int nt = 0; nt < n_tiles; ++nt)
        want[{e, offsets[e] + m * BM, nt}] = std::min(BM, offsets[e + 1] - offsets[e] - m * BM);
  }
  const g::VarlenMScheduler<BM> sched{offsets.data(), prefix.data(), E, n_tiles, raster_n};
  ASSERT_EQ(sched.total(), static_cast<int>(want.size()));
  std::map<std::tuple<int, int, int>, int> seen;
  g::VarlenTile prev{};
  for (int t = 0; t < sched.total(); ++t) {
    const g::VarlenTile tile = sched.at(t);
    const auto key = std::make_tuple(tile.expert, tile.row0, tile.n_tile);
    ASSERT_TRUE(want.count(key)) << "tile " << t << ": expert " << tile.expert << " row0 " << tile.row0 << " n_tile "
                                 << tile.n_tile << " does not exist";
    EXPECT_EQ(tile.rows, want[key]) << "tile " << t;
    EXPECT_EQ(++seen[key], 1) << "tile " << t << " decoded twice";
    if (t > 0 && tile.expert == prev.expert) {  // the order inside an expert
      if (raster_n)
        EXPECT_TRUE(tile.n_tile == prev.n_tile ? tile.row0 == prev.row0 + BM : tile.n_tile == prev.n_tile + 1);
      else
        EXPECT_TRUE(tile.row0 == prev.row0 ? tile.n_tile == prev.n_tile + 1 : tile.row0 == prev.row0 + BM);
    }
    prev = tile;
  }
  EXPECT_EQ(seen.size(), want.size());
}

TEST(GemmLayouts, SchedulerDecodesEveryTileOnce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    const int E = 1 + static_cast<int>(rng() % 13);
    std::vector<int> offsets(E + 1, 0);
    for (int e = 0; e < E; ++e) {
      const int kind = static_cast<int>(rng() % 4);  // empty, under a tile, a few tiles, whole tiles
      const int rows = kind == 0 ? 0
                       : kind == 1 ? 1 + static_cast<int>(rng() % 127)
                       : kind == 2 ? static_cast<int>(rng() % 600)
                                   : 128 * static_cast<int>(rng() % 9);
      offsets[e + 1] = offsets[e] + rows;
    }
    for (int n_tiles = 1; n_tiles <= 5; ++n_tiles)
      for (bool raster_n : {false, true}) {
        SCOPED_TRACE("trial " + std::to_string(trial) + ", n_tiles " + std::to_string(n_tiles) +
                     (raster_n ? ", N-tile major" : ", M-tile major"));
        check_scheduler_cover(offsets, n_tiles, raster_n);
      }
  }
}

// A descriptor that cannot be built becomes sonicmoe::Error at the launch site's check, naming the tensor, its
// address, dims and strides; CuTe's own failure path (std::cerr + assert) is never reached. These preconditions are
// checked on the host before the driver is asked, so no GPU is needed.
std::string encode_error(const void* ptr, int rows, int k) {
  using Cfg = g::VarlenMContiguousCfg;
  (void)Cfg::make_tma_a(reinterpret_cast<const El*>(ptr), rows, k);
  return sonicmoe::testing_util::tma_encode_report("A");
}

TEST(TmaEncode, MisalignedAddressIsAnErrorNamingTheTensor) {
  alignas(16) static El buf[64 * 64 + 8];
  const std::string msg = encode_error(buf + 1, 64, 64);  // 2 bytes past a 16-byte boundary
  EXPECT_NE(msg.find("TMA descriptor of A"), std::string::npos) << msg;
  EXPECT_NE(msg.find("not 16-byte aligned"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dims (64, 64)"), std::string::npos) << msg;
  sonicmoe::cuda::tma::check_encoded("nothing pending");  // the failure was consumed: no second report
}

TEST(TmaEncode, NullAddressAndRowStrideAreErrors) {
  EXPECT_NE(encode_error(nullptr, 64, 64).find("null"), std::string::npos);
  alignas(16) static El buf[64 * 68];
  const std::string msg = encode_error(buf, 64, 60);  // 120-byte rows: not a multiple of 16
  EXPECT_NE(msg.find("multiple of 16"), std::string::npos) << msg;
}

TEST(TmaEncode, PreconditionsOfTheDriver) {
  namespace t = sonicmoe::cuda::tma;
  alignas(16) static El buf[16];
  const cuuint64_t dims[2] = {64, 32}, strides[1] = {128}, huge_dims[2] = {64, (cuuint64_t{1} << 32) + 1},
                   odd_strides[1] = {120}, far_strides[1] = {cuuint64_t{1} << 40};
  const cuuint32_t box[2] = {64, 16}, big_box[2] = {512, 16}, narrow_box[2] = {4, 16}, es[2] = {1, 1};
  const auto bf = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
  const auto none = CU_TENSOR_MAP_INTERLEAVE_NONE;
  EXPECT_STREQ(t::tiled_precondition_error(bf, 2, buf, dims, strides, box, es, none), "");
  EXPECT_STRNE(t::tiled_precondition_error(bf, 0, buf, dims, strides, box, es, none), "");
  EXPECT_STRNE(t::tiled_precondition_error(bf, 2, buf, huge_dims, strides, box, es, none), "");
  EXPECT_STRNE(t::tiled_precondition_error(bf, 2, buf, dims, odd_strides, box, es, none), "");
  EXPECT_STRNE(t::tiled_precondition_error(bf, 2, buf, dims, far_strides, box, es, none), "");
  EXPECT_STRNE(t::tiled_precondition_error(bf, 2, buf, dims, strides, big_box, es, none), "");
  EXPECT_STRNE(t::tiled_precondition_error(bf, 2, buf, dims, strides, narrow_box, es, none), "");
  const cuuint64_t zero_dims[2] = {64, 0};
  EXPECT_STRNE(t::tiled_precondition_error(bf, 2, buf, zero_dims, strides, box, es, none), "");
}

}  // namespace
