// Grouped GEMM engine (src/cuda/gemm): varlen-M (contiguous and gathered A, bias, row scale, both schedules)
// and varlen-K (weight gradients, gathered P, empty experts) against fp64 CPU loops on the same bf16 inputs.
// Outputs are NaN-poisoned before every run; rows past offsets[E] must stay untouched.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <random>
#include <tuple>
#include <vector>

#include "baselines/grouped_gemm_cutlass.h"
#include "cuda/gpu_test_util.h"
#include "cuda/gemm/native_gemm.h"
#include "sonicmoe/error.h"

namespace {

namespace bl = sonicmoe::baselines;
using bl::Schedule;
using bf = __nv_bfloat16;

#define CK(x) ASSERT_EQ((x), cudaSuccess)

std::vector<bf> random_bf16(std::size_t n, std::mt19937& rng, float lo = -1.0f, float hi = 1.0f) {
  return sonicmoe::testing::random_nonzero_bf16<bf>(n, rng, lo, hi, [](float f) { return __float2bfloat16(f); });
}

template <class T>
struct Dev {
  T* p = nullptr;
  std::size_t n = 0;
  explicit Dev(std::size_t count) : n(count) {
    if (cudaMalloc(&p, (count ? count : 1) * sizeof(T)) != cudaSuccess) p = nullptr;
  }
  Dev(const std::vector<T>& h) : Dev(h.size()) {
    if (p && !h.empty()) cudaMemcpy(p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  ~Dev() { cudaFree(p); }
  std::vector<T> host() const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
  void poison() { cudaMemset(p, 0xFF, n * sizeof(T)); }  // 0xFFFF is a bf16 NaN
};

std::vector<int> make_offsets(const std::vector<int>& counts) {
  std::vector<int> off(counts.size() + 1, 0);
  for (std::size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

double f(bf x) { return static_cast<double>(__bfloat162float(x)); }

// ||got - ref|| / ||ref|| over the compared entries; any non-finite value gives +inf.
struct ErrAcc {
  double num = 0, den = 0;
  bool finite = true;
  void add(double got, double ref) {
    if (!std::isfinite(got)) finite = false;
    num += (got - ref) * (got - ref);
    den += ref * ref;
  }
  double rel() const { return finite ? std::sqrt(num / (den > 0 ? den : 1)) : INFINITY; }
};

// E group sizes drawn in [0, max], each 0 where a first draw falls below empty_below.
std::vector<int> random_counts(std::mt19937& rng, int E, int max, int empty_below) {
  std::uniform_int_distribution<int> cd(0, max);
  std::vector<int> counts(E);
  for (auto& x : counts) x = cd(rng) < empty_below ? 0 : cd(rng);
  return counts;
}

// Runs a GEMM of the baseline harness with the workspace it asks for.
template <class Params>
void run_with_workspace(Params p, std::size_t (*workspace_bytes)(const Params&), void (*gemm)(const Params&)) {
  const std::size_t bytes = workspace_bytes(p);
  Dev<char> ws(bytes);
  p.workspace = ws.p;
  p.workspace_bytes = bytes;
  gemm(p);
}

struct MCase {
  std::vector<int> counts;
  int extra_rows;  // capacity past offsets[E]
  int n, k;
  bool gather, bias, scale;
  Schedule schedule;
  bool b_kn = false;  // B stored [E, k, n]
};

void run_varlen_m(const MCase& c, unsigned seed) {
  std::mt19937 rng(seed);
  const int E = static_cast<int>(c.counts.size());
  const std::vector<int> off = make_offsets(c.counts);
  const int valid = off[E], rows = valid + c.extra_rows;
  const int a_rows = c.gather ? rows / 2 + 3 : rows;
  std::vector<bf> a = random_bf16(static_cast<std::size_t>(a_rows) * c.k, rng);
  std::vector<bf> b = random_bf16(static_cast<std::size_t>(E) * c.n * c.k, rng);
  std::vector<bf> bias = random_bf16(static_cast<std::size_t>(E) * c.n, rng);
  std::vector<float> scale(rows);
  std::vector<int> gather(rows);
  std::uniform_real_distribution<float> sd(0.1f, 1.0f);
  std::uniform_int_distribution<int> gd(0, a_rows - 1);
  for (int r = 0; r < rows; ++r) {
    scale[r] = sd(rng);
    gather[r] = gd(rng);
  }
  Dev<bf> da(a), db(b), dbias(bias), dc(static_cast<std::size_t>(rows) * c.n);
  Dev<float> dscale(scale);
  Dev<int> doff(off), dgather(gather);
  dc.poison();

  // a, a_rows, gather, b, bias, row_scale, c, offsets, rows, num_experts, n, k, b_kn, schedule
  run_with_workspace(bl::VarlenMParams{da.p, a_rows, c.gather ? dgather.p : nullptr, db.p, c.bias ? dbias.p : nullptr,
                                       c.scale ? dscale.p : nullptr, dc.p, doff.p, rows, E, c.n, c.k, c.b_kn,
                                       c.schedule},
                     bl::varlen_m_workspace_bytes, bl::varlen_m_gemm);
  CK(cudaDeviceSynchronize());
  const std::vector<bf> got = dc.host();

  ErrAcc err;
  for (int e = 0; e < E; ++e)
    for (int r = off[e]; r < off[e + 1]; ++r) {
      const bf* arow = a.data() + static_cast<std::size_t>(c.gather ? gather[r] : r) * c.k;
      for (int j = 0; j < c.n; ++j) {
        const bf* be = b.data() + static_cast<std::size_t>(e) * c.n * c.k;
        double acc = 0;
        for (int q = 0; q < c.k; ++q)
          acc += f(arow[q]) * f(c.b_kn ? be[static_cast<std::size_t>(q) * c.n + j] : be[static_cast<std::size_t>(j) * c.k + q]);
        if (c.bias) acc += f(bias[static_cast<std::size_t>(e) * c.n + j]);
        if (c.scale) acc *= scale[r];
        err.add(f(got[static_cast<std::size_t>(r) * c.n + j]), acc);
      }
    }
  EXPECT_LT(err.rel(), 8e-3) << "varlen-M relative error";
  // Rows past offsets[E] are untouched (still the NaN poison).
  for (std::size_t i = static_cast<std::size_t>(valid) * c.n; i < got.size(); ++i)
    ASSERT_TRUE(std::isnan(f(got[i]))) << "row " << i / c.n << " past offsets[E] was written";
}

struct KCase {
  std::vector<int> counts;
  int m, n;
  bool gather;     // P rows gathered
  bool q_gather = false;
  Schedule schedule = Schedule::native;
  int extra_rows = 0;  // capacity past offsets[E]: NaN in a contiguous operand (rows a capacity dropped)
};

void run_varlen_k(const KCase& c, unsigned seed) {
  std::mt19937 rng(seed);
  const int E = static_cast<int>(c.counts.size());
  const std::vector<int> off = make_offsets(c.counts);
  const int valid = off[E], rows = valid + c.extra_rows;
  const int p_rows = c.gather ? rows / 2 + 5 : rows;
  const int q_rows = c.q_gather ? rows / 3 + 2 : rows;
  std::vector<bf> P = random_bf16(static_cast<std::size_t>(p_rows) * c.m, rng);
  std::vector<bf> Q = random_bf16(static_cast<std::size_t>(q_rows) * c.n, rng);
  // Rows past offsets[E] of a contiguous operand hold NaN: no row there may enter a sum.
  const bf nan = __float2bfloat16(NAN);
  if (!c.gather) std::fill(P.begin() + static_cast<std::size_t>(valid) * c.m, P.end(), nan);
  if (!c.q_gather) std::fill(Q.begin() + static_cast<std::size_t>(valid) * c.n, Q.end(), nan);
  std::vector<int> gather(rows), qgather(rows);
  std::uniform_int_distribution<int> gd(0, p_rows - 1), qd(0, q_rows - 1);
  for (auto& g : gather) g = gd(rng);
  for (auto& g : qgather) g = qd(rng);
  Dev<bf> dp(P), dq(Q), dd(static_cast<std::size_t>(E) * c.m * c.n);
  Dev<int> doff(off), dgather(gather), dqgather(qgather);
  dd.poison();

  // p, p_rows, p_gather, q, q_rows, q_gather, d, offsets, rows, num_experts, m, n, schedule
  run_with_workspace(bl::VarlenKParams{dp.p, p_rows, c.gather ? dgather.p : nullptr, dq.p, q_rows,
                                       c.q_gather ? dqgather.p : nullptr, dd.p, doff.p, rows, E, c.m, c.n, c.schedule},
                     bl::varlen_k_workspace_bytes, bl::varlen_k_gemm);
  CK(cudaDeviceSynchronize());
  const std::vector<bf> got = dd.host();

  ErrAcc err;
  std::vector<double> acc(static_cast<std::size_t>(c.m) * c.n);
  for (int e = 0; e < E; ++e) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int r = off[e]; r < off[e + 1]; ++r) {
      const bf* prow = P.data() + static_cast<std::size_t>(c.gather ? gather[r] : r) * c.m;
      const bf* qrow = Q.data() + static_cast<std::size_t>(c.q_gather ? qgather[r] : r) * c.n;
      for (int i = 0; i < c.m; ++i) {
        const double pi = f(prow[i]);
        for (int j = 0; j < c.n; ++j) acc[static_cast<std::size_t>(i) * c.n + j] += pi * f(qrow[j]);
      }
    }
    const bf* de = got.data() + static_cast<std::size_t>(e) * c.m * c.n;
    if (c.counts[e] == 0) {
      for (std::size_t i = 0; i < acc.size(); ++i) ASSERT_EQ(f(de[i]), 0.0) << "empty expert " << e << " not zero";
      continue;
    }
    for (std::size_t i = 0; i < acc.size(); ++i) err.add(f(de[i]), acc[i]);
  }
  EXPECT_LT(err.rel(), 8e-3) << "varlen-K relative error";
}

const Schedule kAllSchedules[] = {Schedule::native, Schedule::cutlass_cooperative, Schedule::cutlass_pingpong};
const char* name_of(Schedule s) {
  switch (s) {
    case Schedule::native: return "native";
    case Schedule::cutlass_cooperative: return "cutlass_cooperative";
    case Schedule::cutlass_pingpong: break;
  }
  return "cutlass_pingpong";
}
// The kernels without a ping-pong flavour: varlen-K and B stored [E, k, n].
const std::vector<Schedule> kNoPingpong = {Schedule::native, Schedule::cutlass_cooperative};

// Runs f(s) for each schedule of `schedules`, the schedule named in any failure.
template <class Schedules, class F>
void for_each_schedule(const Schedules& schedules, F&& f) {
  for (Schedule s : schedules) {
    SCOPED_TRACE(name_of(s));
    f(s);
  }
}

TEST(CudaGemm, VarlenMContiguousUnevenAndEmptyGroups) {
  SONICMOE_REQUIRE_GPU();
  for_each_schedule(kAllSchedules, [&](Schedule s) {
    run_varlen_m({{0, 1, 130, 7, 0, 300}, 17, 136, 72, false, false, false, s}, 1);
    run_varlen_m({{257, 0, 129, 64, 3}, 0, 256, 512, false, false, false, s}, 2);
  });
}

TEST(CudaGemm, VarlenMAlignmentEdges) {
  SONICMOE_REQUIRE_GPU();
  for_each_schedule(kAllSchedules, [&](Schedule s) {
    // (n, k, gathered, seed); the last: N tiles 256+256+8, gathered
    for (auto [n, k, gathered, seed] : {std::tuple{8, 8, false, 3}, {264, 8, false, 4}, {8, 1032, false, 5},
                                        {520, 72, true, 31}})
      run_varlen_m({{5, 200, 0, 33}, 9, n, k, gathered, false, false, s}, seed);
  });
}

TEST(CudaGemm, VarlenMBiasAndRowScale) {
  SONICMOE_REQUIRE_GPU();
  for_each_schedule(kAllSchedules, [&](Schedule s) {
    for (auto [bias, scale, seed] : {std::tuple{true, false, 6}, {true, true, 7}, {false, true, 8}})
      run_varlen_m({{3, 0, 150, 77}, 11, 120, 64, false, bias, scale, s}, seed);
  });
}

TEST(CudaGemm, VarlenMGathered) {
  SONICMOE_REQUIRE_GPU();
  for_each_schedule(kAllSchedules, [&](Schedule s) {
    run_varlen_m({{0, 1, 130, 7, 0, 300}, 13, 256, 128, true, false, false, s}, 9);
    run_varlen_m({{100, 2, 0, 501}, 0, 136, 512, true, true, true, s}, 10);
  });
}

// B stored [E, k, n] (the dX = dZ W1 and dgated G = dO W2 operands), contiguous and gathered A.
TEST(CudaGemm, VarlenMTransposedB) {
  SONICMOE_REQUIRE_GPU();
  for_each_schedule(kNoPingpong, [&](Schedule s) {
    run_varlen_m({{0, 1, 130, 7, 0, 300}, 13, 264, 200, false, false, false, s, true}, 22);
    run_varlen_m({{100, 2, 0, 501}, 0, 136, 512, false, true, true, s, true}, 23);
  });
  run_varlen_m({{100, 2, 0, 501}, 5, 520, 136, true, false, false, Schedule::native, true}, 24);
}

TEST(CudaGemm, VarlenMManyExperts) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(11);
  const std::vector<int> counts = random_counts(rng, 64, 90, 8);
  std::uniform_int_distribution<int> cd(0, 90);
  for_each_schedule(kAllSchedules, [&](Schedule s) {
    run_varlen_m({counts, 5, 512, 256, true, false, false, s}, 12);
    run_varlen_m({counts, 5, 512, 256, false, false, false, s}, 13);
  });
  // Many experts and many persistent tiles per CTA (E = 300, a few thousand rows, K = 3 k-tiles).
  std::vector<int> big(300);
  for (auto& x : big) x = cd(rng) < 20 ? 0 : 3 * cd(rng);
  run_varlen_m({big, 3, 264, 136, true, true, true, Schedule::native}, 25);
  run_varlen_m({big, 3, 264, 136, false, true, false, Schedule::native}, 27);
}

// The native kernels walk an expert's tiles N-tile major below kNativeRasterMRows mean rows an expert and M-tile
// major from there on (no GPU needed: a host-side choice).
TEST(CudaGemm, TileOrderFollowsMeanRowsPerExpert) {
  if (std::getenv("SONICMOE_NATIVE_RASTER")) GTEST_SKIP() << "SONICMOE_NATIVE_RASTER overrides the heuristic";
  namespace g = sonicmoe::cuda::gemm;
  g::NativeVarlenM a;
  a.num_experts = 128;
  a.rows = 128 * 2048;  // readme-default
  EXPECT_TRUE(g::native_raster_n(a));
  a.rows = 128 * g::kNativeRasterMRows - 1;
  EXPECT_TRUE(g::native_raster_n(a));
  a.rows = 128 * g::kNativeRasterMRows;
  EXPECT_FALSE(g::native_raster_n(a));
  a.num_experts = 8;
  a.rows = 8 * 8192;  // coarse-8x8
  EXPECT_FALSE(g::native_raster_n(a));
  // The FP8 gathered kernels (128-wide tile): dgated M-tile major at any size, the up-projection from
  // kFp8GatherRasterMRows mean rows.
  a.num_experts = 128;
  a.rows = 128 * 512;  // fine-grained-256's mean
  EXPECT_FALSE(g::native_raster_n(a, g::RasterRule::fp8_gathered_dgated));
  EXPECT_TRUE(g::native_raster_n(a, g::RasterRule::fp8_gathered));
  EXPECT_TRUE(g::native_raster_n(a, g::RasterRule::by_mean_rows));
  a.rows = 128 * g::kFp8GatherRasterMRows;
  EXPECT_FALSE(g::native_raster_n(a, g::RasterRule::fp8_gathered));
  EXPECT_TRUE(g::native_raster_n(a, g::RasterRule::by_mean_rows));
}

// Experts long enough for the M-tile-major order (the other cases' shapes take the N-tile-major one): an empty expert,
// partial last M tiles, N tiles 256 + 8; gathered A, contiguous A with bias and row scale, B stored [E, k, n].
TEST(CudaGemm, VarlenMLongExpertsMTileMajor) {
  SONICMOE_REQUIRE_GPU();
  const std::vector<int> counts{3001, 0, 6145, 4099, 4000};
  run_varlen_m({counts, 7, 264, 72, true, false, false, Schedule::native}, 41);
  run_varlen_m({counts, 7, 264, 72, false, true, true, Schedule::native}, 42);
  run_varlen_m({counts, 7, 136, 200, true, false, false, Schedule::native, true}, 43);
}

TEST(CudaGemm, VarlenKWithEmptyExperts) {
  SONICMOE_REQUIRE_GPU();
  for_each_schedule(kNoPingpong, [&](Schedule sc) {
    run_varlen_k({{0, 1, 130, 7, 0, 300}, 72, 136, false, false, sc}, 14);
    run_varlen_k({{0, 1, 130, 7, 0, 300}, 256, 128, true, false, sc}, 15);
    run_varlen_k({{64, 0, 513}, 8, 8, false, false, sc}, 16);
    run_varlen_k({{0, 0}, 128, 128, false, false, sc}, 17);           // no rows at all: all zeros
    run_varlen_k({{0, 9, 200, 0, 65}, 136, 264, false, true, sc}, 20);  // gathered Q (the dW1 shape)
    run_varlen_k({{0, 9, 200, 0, 65}, 264, 136, true, true, sc}, 28);   // both gathered
  });
}

TEST(CudaGemm, VarlenKManyExperts) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(18);
  const std::vector<int> counts = random_counts(rng, 32, 200, 20);
  for_each_schedule(kNoPingpong, [&](Schedule sc) {
    run_varlen_k({counts, 384, 256, true, false, sc}, 19);
  });
  // Long per-expert reductions (many k-tiles, partial last tile) with M and N not multiples of the tile.
  run_varlen_k({{700, 0, 1029, 64}, 200, 520, true, false, Schedule::native}, 29);
  run_varlen_k({{700, 0, 1029, 64}, 520, 200, false, true, Schedule::native}, 30);
  // Gathered Q only, >= 1024 rows per expert on average: the swapped kernel (D^T computed, stored transposed).
  run_varlen_k({{3000, 0, 1500, 77}, 136, 264, false, true, Schedule::native}, 31);
  run_varlen_k({{2100, 2600, 0}, 520, 200, false, true, Schedule::native}, 32);
  // Swapped, every tile full (TMA store of the transposed staging tile), an empty expert in the middle.
  run_varlen_k({{1500, 0, 2000}, 256, 512, false, true, Schedule::native}, 33);
}

// Rows past offsets[E] (a capacity's dropped rows, which nobody writes) hold NaN in the contiguous operands: the k-tile
// running past each expert's last row must not read them into the sum, for every kernel variant: contiguous P
// (dW1's shape), gathered P with Q by TMA (dW2's), both contiguous, and the swapped dW1 (from 1024 rows an expert).
TEST(CudaGemm, VarlenKNeverSumsRowsPastOffsets) {
  SONICMOE_REQUIRE_GPU();
  run_varlen_k({{0, 9, 200, 0, 65}, 136, 264, false, true, Schedule::native, 77}, 41);
  run_varlen_k({{0, 9, 200, 0, 65}, 264, 136, true, false, Schedule::native, 77}, 42);
  run_varlen_k({{130, 0, 7}, 128, 256, false, false, Schedule::native, 100}, 43);
  run_varlen_k({{1100, 1300}, 256, 128, false, true, Schedule::native, 90}, 44);
  run_varlen_k({{1100, 1300}, 128, 256, true, false, Schedule::native, 90}, 45);
}

// Group sizes live on the device only: one captured graph replays correctly after offsets change.
TEST(CudaGemm, GraphCaptureReplaysWithNewOffsets) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(21);
  const int E = 4, rows = 512, a_rows = 300, n = 128, k = 64;
  std::vector<bf> a = random_bf16(static_cast<std::size_t>(a_rows) * k, rng);
  std::vector<bf> b = random_bf16(static_cast<std::size_t>(E) * n * k, rng);
  std::vector<int> gather(rows);
  std::uniform_int_distribution<int> gd(0, a_rows - 1);
  for (auto& g : gather) g = gd(rng);
  Dev<bf> da(a), db(b), dc(static_cast<std::size_t>(rows) * n);
  Dev<int> doff(std::vector<int>(E + 1, 0)), dgather(gather);
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  bl::VarlenMParams p{da.p, a_rows, dgather.p, db.p, nullptr, nullptr, dc.p, doff.p, rows, E, n, k};
  p.stream = s;
  const std::size_t ws_bytes = bl::varlen_m_workspace_bytes(p);
  Dev<char> ws(ws_bytes);
  p.workspace = ws.p;
  p.workspace_bytes = ws_bytes;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  bl::varlen_m_gemm(p);
  CK(cudaStreamEndCapture(s, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  for (const std::vector<int>& counts : {std::vector<int>{10, 0, 200, 33}, std::vector<int>{300, 5, 0, 100}}) {
    const std::vector<int> off = make_offsets(counts);
    CK(cudaMemcpy(doff.p, off.data(), off.size() * sizeof(int), cudaMemcpyHostToDevice));
    dc.poison();
    CK(cudaGraphLaunch(exec, s));
    CK(cudaStreamSynchronize(s));
    const std::vector<bf> got = dc.host();
    ErrAcc err;
    for (int e = 0; e < E; ++e)
      for (int r = off[e]; r < off[e + 1]; ++r)
        for (int j = 0; j < n; ++j) {
          double acc = 0;
          for (int q = 0; q < k; ++q)
            acc += f(a[static_cast<std::size_t>(gather[r]) * k + q]) * f(b[(static_cast<std::size_t>(e) * n + j) * k + q]);
          err.add(f(got[static_cast<std::size_t>(r) * n + j]), acc);
        }
    EXPECT_LT(err.rel(), 8e-3);
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(s));
}

TEST(CudaGemm, RejectsUnsupportedShapes) {
  SONICMOE_REQUIRE_GPU();
  Dev<bf> a(4096), b(4096), c(4096);
  Dev<int> off(std::vector<int>{0, 4});
  // a, a_rows, gather, b, bias, row_scale, c, offsets, rows, num_experts, n, k (not a multiple of 8)
  bl::VarlenMParams p{a.p, 0, nullptr, b.p, nullptr, nullptr, c.p, off.p, 4, 1, 16, 12};
  try {
    bl::varlen_m_gemm(p);
    FAIL() << "k = 12 accepted";
  } catch (const sonicmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("k must be"), std::string::npos) << e.what();
  }
  p.k = 16;
  p.n = 20;
  EXPECT_THROW(bl::varlen_m_gemm(p), sonicmoe::Error);
  p.n = 16;
  p.a = a.p + 1;  // misaligned
  try {
    bl::varlen_m_gemm(p);
    FAIL() << "misaligned a accepted";
  } catch (const sonicmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("a must be 16-byte aligned"), std::string::npos) << e.what();
  }
  p.a = a.p;
  p.workspace_bytes = 0;
  EXPECT_EQ(bl::varlen_m_workspace_bytes(p), 0u);  // the native kernel needs none
  p.schedule = Schedule::cutlass_cooperative;  // the CUTLASS path does: too small is refused
  try {
    bl::varlen_m_gemm(p);
    FAIL() << "workspace_bytes = 0 accepted by the CUTLASS path";
  } catch (const sonicmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace_bytes is 0"), std::string::npos) << e.what();
  }
  p.schedule = Schedule::cutlass_pingpong;
  p.b_kn = true;
  try {
    bl::varlen_m_gemm(p);
    FAIL() << "b_kn accepted by cutlass_pingpong";
  } catch (const sonicmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("b_kn is not supported"), std::string::npos) << e.what();
  }

  // p, p_rows, p_gather, q, q_rows, q_gather, d, offsets, rows, num_experts, m, n (not a multiple of 8)
  bl::VarlenKParams k{a.p, 0, nullptr, b.p, 0, nullptr, c.p, off.p, 4, 1, 16, 4};
  try {
    bl::varlen_k_gemm(k);
    FAIL() << "n = 4 accepted";
  } catch (const sonicmoe::Error& e) {
    EXPECT_NE(std::string(e.what()).find("n must be"), std::string::npos) << e.what();
  }
}

}  // namespace
