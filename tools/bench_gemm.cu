// sonicmoe-bench-gemm: the grouped GEMMs (src/cuda/gemm) on the MoE shapes of bench/bench_configs.json.
// varlen-M rows (up, down, dX, dgated-G) compare in one run:
//   native         our kernel; gathered rows of A are loaded in its mainloop (cp.async producers)
//   native-contig  our kernel on a pre-gathered contiguous copy of A (TMA): the cost of the fused gather
//   cutlass        CUTLASS 4.2 ptr-array grouped GEMM (cooperative 128x256, device-side group shapes), with the
//                  separate gather pass it needs when A is gathered
//   cutlass-contig the same CUTLASS kernel on contiguous A: the reference kernel of issue 3 (example 57's kernel)
//   cuBLAS         a per-expert cublasGemmEx loop on pre-gathered rows, the gather timed with it
// "eq" rows use equal group sizes (TK/E rows each), the setting of the CUTLASS reference numbers.
// Fused rows: up+act (Z and A = act(Z) in the epilogue) and dgated (dZ, s*A, <G, A> partials + reduce) against
// the unfused pipeline (gather + CUTLASS GEMM + the elementwise pass). varlen-K rows (dW1, dW2): native
// (gathered operand in the mainloop) against CUTLASS ptr-array (+ gather pass) and cuBLAS. Routing: per token K distinct experts at random (unequal groups). CUDA events,
// 3 warm-up runs, median of 20, non-zero uniform random bf16 data; outputs of native and cuBLAS are compared.
// Usage: sonicmoe-bench-gemm [config-name|all] [row-label]   (e.g. readme-default dW1, for profiling one row)
// FP8 mode: sonicmoe-bench-gemm fp8 [config-name|all]: the FP8 blockwise varlen-M GEMM (fp8_gemm.h) on the same
// shapes, operands quantised by the library's CUDA quantisers (1x128 activations, 128x128 weights) from the same
// non-zero random data: up+act (gathered X, swiglu epilogue) and down (contiguous A, store), each against the bf16
// native kernel of the same shape in the same run, and the FP8 dense peak of the card (cuBLASLt 8192^3,
// e4m3 x e4m3 -> bf16, TN). Then one line per consumer-loop variant of the FP8 kernel (bench_fp8_variants.h,
// VarlenMFp8Config's kVariant; v0 = the library's kernel): up+act and down TFLOP/s, and max |out - out_v0| /
// max |out_v0| of each: 0 expected throughout (every variant sums the same products in the same order). Last, the FP8
// weight-gradient GEMMs dW1 and dW2 (fp8_varlen_k on the per-expert 128x1 copies of their operands) against the bf16
// native varlen-K kernel on the bf16 operands.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_cuda.cuh"
#include "baselines/grouped_gemm_cutlass.h"
#include "baselines/unfused_elementwise.h"
#include "bench_fp8_variants.h"
#include "cuda/gemm/fp8_gemm.h"
#include "cuda/gemm/native_gemm.h"
#include "cuda/quant/quant.h"
#include "cuda/quant/quant_segments.h"
#include "sonicmoe/quant.h"

namespace g = sonicmoe::cuda::gemm;
namespace bl = sonicmoe::baselines;
using bf = __nv_bfloat16;

// Exits with the status, file and line when a cuBLAS call fails (CK of bench_cuda.cuh for the CUDA runtime).
inline void cublas_check(cublasStatus_t status, const char* file, int line) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  std::fprintf(stderr, "cuBLAS error %d at %s:%d\n", static_cast<int>(status), file, line);
  std::exit(1);
}
#define CB(x) cublas_check((x), __FILE__, __LINE__)

struct Config {
  const char* name;
  long T, H, I, E, K;
};
// The shapes of bench/bench_configs.json (all GLU: z_width = 2I).
const Config kConfigs[] = {
    {"readme-default", 32768, 4096, 1024, 128, 8}, {"fine-grained-256", 16384, 4096, 1024, 256, 8},
    {"olmoe-like", 32768, 2048, 1024, 64, 8},      {"coarse-8x8", 8192, 3072, 1536, 8, 8},
    {"sparse-16of256", 8192, 4096, 256, 256, 16},  {"mid-128x8", 8192, 4096, 512, 128, 8},
    {"small-k2", 8192, 1536, 1024, 32, 2},
};

bf* alloc_rand(long n, unsigned seed) {
  bf* p;
  CK(cudaMalloc(&p, std::max(n, 1L) * sizeof(bf)));
  sonicmoe::bench::fill(p, n, seed, 1.0f);
  return p;
}

__global__ void diff_kernel(const bf* a, const bf* b, long n, double* acc) {
  double num = 0, den = 0;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    double x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  atomicAdd(acc, num);
  atomicAdd(acc + 1, den);
}
// launch(acc) on a zeroed device accumulator of two T, and the two values it leaves, on the host.
template <typename T, typename Launch>
std::array<T, 2> accumulate_pair(const Launch& launch) {
  T* d;
  CK(cudaMalloc(&d, 2 * sizeof(T)));
  CK(cudaMemset(d, 0, 2 * sizeof(T)));
  launch(d);
  std::array<T, 2> h;
  CK(cudaMemcpy(h.data(), d, sizeof(h), cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  return h;
}

double rel_diff(const bf* a, const bf* b, long n) {
  const auto h = accumulate_pair<double>([&](double* d) { diff_kernel<<<512, 256>>>(a, b, n, d); });
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : -1.0;  // -1: the reference output was all zeros
}

// max |a - b| / max |b| (the FP8 variants against variant 0: same operands, so only the summation order differs).
__global__ void max_diff_kernel(const bf* a, const bf* b, long n, unsigned* acc) {
  float num = 0, den = 0;
  for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
    const float x = __bfloat162float(a[i]), y = __bfloat162float(b[i]);
    num = fmaxf(num, fabsf(x - y) == fabsf(x - y) ? fabsf(x - y) : INFINITY);  // a NaN counts as infinite
    den = fmaxf(den, fabsf(y));
  }
  atomicMax(acc, __float_as_uint(num));  // non-negative floats order as their bits
  atomicMax(acc + 1, __float_as_uint(den));
}
double max_rel_diff(const bf* a, const bf* b, long n) {
  const auto h = accumulate_pair<unsigned>([&](unsigned* d) { max_diff_kernel<<<512, 256>>>(a, b, n, d); });
  float num, den;
  std::memcpy(&num, &h[0], 4);
  std::memcpy(&den, &h[1], 4);
  return den > 0 ? num / den : -1.0;
}

float median_ms(const std::function<void()>& fn, cudaStream_t s) { return sonicmoe::bench::median_ms(fn, 20, s); }

void print_header() {
  std::printf("%-17s %-10s %7s %5s %6s | %8s %8s %8s %8s %8s | %7s %7s | %s\n", "config", "gemm", "M", "N", "K",
              "native", "nat-ctg", "cutlass", "cut-ctg", "cuBLAS", "nat/cut", "nat/cuB", "rel(native,cuBLAS)");
  std::printf("%-17s %-10s %7s %5s %6s | %8s %8s %8s %8s %8s | %7s %7s |\n", "", "", "", "", "", "TFLOP/s", "TFLOP/s",
              "TFLOP/s", "TFLOP/s", "TFLOP/s", "(ctg)", "");
}

std::string tf(double v) {
  if (v <= 0) return "-";
  char b[32];
  std::snprintf(b, sizeof b, "%.1f", v);
  return b;
}

// ---- FP8 mode -------------------------------------------------------------------------------------------------
void check_cublas(cublasStatus_t s, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) sonicmoe::bench::fail_at("cuBLASLt error " + std::to_string(int(s)), file, line);
}
#define CBL(x) check_cublas((x), __FILE__, __LINE__)

// TFLOP/s of one 8192^3 e4m3 x e4m3 -> bf16 GEMM (TN, fp32 compute) through cuBLASLt on random codes (quantised
// non-zero values); fast_accum: CUBLASLT_MATMUL_DESC_FAST_ACCUM (no promotion of the tensor-core sums).
double cublaslt_fp8_dense_tflops(cudaStream_t s, bool fast_accum) {
  const long M = 8192, N = 8192, K = 8192;
  bf* x;
  CK(cudaMalloc(&x, M * K * sizeof(bf)));
  std::uint8_t *A, *B;
  bf* D;
  float *sa, *sb;
  CK(cudaMalloc(&A, M * K));
  CK(cudaMalloc(&B, N * K));
  CK(cudaMalloc(&D, M * N * sizeof(bf)));
  CK(cudaMalloc(&sa, M * (K / 128) * sizeof(float)));
  CK(cudaMalloc(&sb, N * (K / 128) * sizeof(float)));
  sonicmoe::Context ctx;
  ctx.backend = sonicmoe::Backend::cuda;
  ctx.stream = s;
  const auto dev = sonicmoe::Device::cuda();
  for (int i = 0; i < 2; ++i) {  // A, then B: rows of K codes (K-major: the TN layout FP8 cuBLASLt needs)
    sonicmoe::bench::fill(x, M * K, 21 + i, 1.0f, s);
    sonicmoe::fp8_quantize_rows(ctx, sonicmoe::TensorView(x, sonicmoe::DType::bf16, {M, K}, dev), sonicmoe::TensorView(),
                                sonicmoe::TensorView(i ? B : A, sonicmoe::DType::f8e4m3, {M, K}, dev),
                                sonicmoe::TensorView(i ? sb : sa, sonicmoe::DType::f32, {M, K / 128}, dev));
  }
  cublasLtHandle_t lt;
  CBL(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t op;
  CBL(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = CUBLAS_OP_T, tb = CUBLAS_OP_N;
  const std::int8_t fa = fast_accum ? 1 : 0;
  CBL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
  CBL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  CBL(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fa, sizeof fa));
  cublasLtMatrixLayout_t la, lb, ld;
  CBL(cublasLtMatrixLayoutCreate(&la, CUDA_R_8F_E4M3, K, M, K));  // column-major K x M, op T: M x K
  CBL(cublasLtMatrixLayoutCreate(&lb, CUDA_R_8F_E4M3, K, N, K));
  CBL(cublasLtMatrixLayoutCreate(&ld, CUDA_R_16BF, M, N, M));
  const std::size_t ws_bytes = 64u << 20;
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  cublasLtMatmulPreference_t pref;
  CBL(cublasLtMatmulPreferenceCreate(&pref));
  CBL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof ws_bytes));
  cublasLtMatmulHeuristicResult_t heur;
  int found = 0;
  CBL(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heur, &found));
  double tflops = -1;
  if (found > 0) {
    const float alpha = 1.0f, beta = 0.0f;
    const float ms = median_ms(
        [&] { CBL(cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heur.algo, ws, ws_bytes, s)); }, s);
    tflops = 2.0 * M * N * K / ms / 1e9;
  }
  CBL(cublasLtMatmulPreferenceDestroy(pref));
  CBL(cublasLtMatrixLayoutDestroy(la));
  CBL(cublasLtMatrixLayoutDestroy(lb));
  CBL(cublasLtMatrixLayoutDestroy(ld));
  CBL(cublasLtMatmulDescDestroy(op));
  CBL(cublasLtDestroy(lt));
  for (void* q : {(void*)x, (void*)A, (void*)B, (void*)D, (void*)sa, (void*)sb, ws}) CK(cudaFree(q));
  return tflops;
}

// A library context on the CUDA backend and stream s (the quantisers' calls).
sonicmoe::Context cuda_context(cudaStream_t s) {
  sonicmoe::Context ctx;
  ctx.backend = sonicmoe::Backend::cuda;
  ctx.stream = s;
  return ctx;
}

// The FP8 weight-gradient GEMMs (fp8_varlen_k) on the operands the layer gives them: each operand quantised 128x1
// per expert into its K-major copy by fp8_quantize_segment_cols (dZ and As as stored, X and dO gathered), against
// the bf16 native varlen-K kernel on the bf16 operands (rows M x N x K = tokens; rel as for the varlen-M rows). The
// copies are not timed.
void bench_fp8_wgrad(const Config& c, cudaStream_t s, const int* doff, const int* dgather, const bf* X, const bf* Aact) {
  const long TK = c.T * c.K, Z = 2 * c.I;
  bf* dZ = alloc_rand(TK * Z, 5);
  bf* dO = alloc_rand(c.T * c.H, 6);
  const sonicmoe::Context ctx = cuda_context(s);
  const auto dev = sonicmoe::Device::cuda();
  using sonicmoe::DType;
  using sonicmoe::TensorView;
  const long cap = sonicmoe::cuda::fp8_segment_block_capacity(TK, c.E);
  int* boff;
  CK(cudaMalloc(&boff, (c.E + 1) * 4));
  sonicmoe::cuda::fp8_segment_block_offsets(ctx, TensorView(const_cast<int*>(doff), DType::i32, {c.E + 1}, dev),
                                            TensorView(boff, DType::i32, {c.E + 1}, dev));
  struct Cols {
    std::uint8_t* q;
    float* sc;
    long C;
  };
  // Each copy made once, then timed alone (ms printed with the GEMM rows).
  auto quant = [&](const char* label, const bf* v, long rows, long C, const int* gidx) {
    Cols o{nullptr, nullptr, C};
    CK(cudaMalloc(&o.q, C * cap * 128));
    CK(cudaMalloc(&o.sc, cap * C * sizeof(float)));
    auto run = [&] {
      sonicmoe::cuda::fp8_quantize_segment_cols(
          ctx, TensorView(const_cast<bf*>(v), DType::bf16, {rows, C}, dev),
          gidx ? TensorView(const_cast<int*>(gidx), DType::i32, {TK}, dev) : TensorView(),
          TensorView(const_cast<int*>(doff), DType::i32, {c.E + 1}, dev), TensorView(boff, DType::i32, {c.E + 1}, dev),
          TensorView(o.q, DType::f8e4m3, {C, cap * 128}, dev), TensorView(o.sc, DType::f32, {cap, C}, dev));
    };
    const float ms = median_ms(run, s);
    // bytes: the rows read (bf16) and the codes and scales written
    const double gb = (TK * C * 2.0 + TK * C + cap * C * 4.0) / 1e9;
    std::printf("%-17s copy %-6s %6ld channels%s: %.3f ms (%.0f GB/s)\n", c.name, label, C, gidx ? ", gathered" : "", ms,
                gb / ms * 1e3);
    return o;
  };
  const Cols dzt = quant("dZ^T", dZ, TK, Z, nullptr), xt = quant("X^T", X, c.T, c.H, dgather);
  const Cols dot = quant("dO^T", dO, c.T, c.H, dgather), ast = quant("As^T", Aact, TK, c.I, nullptr);
  const long out_n = c.E * std::max(Z * c.H, c.H * c.I);
  bf *d8, *db;
  CK(cudaMalloc(&d8, out_n * sizeof(bf)));
  CK(cudaMalloc(&db, out_n * sizeof(bf)));
  auto row = [&](const char* label, const Cols& a, const Cols& b, const bf* P, const int* pg, const bf* Q,
                 const int* qg) {
    g::Fp8VarlenK k;
    k.a = a.q;
    k.a_scale = a.sc;
    k.b = b.q;
    k.b_scale = b.sc;
    k.block_offsets = boff;
    k.k_cap = cap * 128;
    k.num_experts = (int)c.E;
    k.m = (int)a.C;
    k.n = (int)b.C;
    k.stream = s;
    const long n_out = c.E * a.C * b.C;
    const double fl = 2.0 * TK * a.C * b.C;
    // Fields: p, p_rows, p_gather, q, q_rows, q_gather, d, offsets, rows, num_experts, m, n.
    bl::VarlenKParams pb{P, pg ? c.T : TK, pg, Q, qg ? c.T : TK, qg, db, doff, TK, c.E, a.C, b.C};
    pb.stream = s;
    const float b16 = median_ms([&] { bl::varlen_k_gemm(pb); }, s);
    CK(cudaMemset(d8, 0xff, n_out * sizeof(bf)));  // NaN: an element the kernel never writes shows in rel
    k.d = d8;
    const float f8 = median_ms([&] { g::fp8_varlen_k(k); }, s);
    CK(cudaStreamSynchronize(s));
    std::printf("%-17s %-10s %7ld %5ld %6ld | %9s %9s | %6s | %.2e\n", c.name, label, a.C, b.C, TK,
                tf(fl / f8 / 1e9).c_str(), tf(fl / b16 / 1e9).c_str(), tf(b16 / f8).append("x").c_str(),
                rel_diff(d8, db, n_out));
    std::fflush(stdout);
  };
  row("dW1", dzt, xt, dZ, nullptr, X, dgather);   // dW1[e] = dZ^T X[gather]
  row("dW2", dot, ast, dO, dgather, Aact, nullptr);  // dW2[e] = dO[gather]^T As
  for (const Cols& o : {dzt, xt, dot, ast}) {
    CK(cudaFree(o.q));
    CK(cudaFree(o.sc));
  }
  for (void* q : {(void*)dZ, (void*)dO, (void*)boff, (void*)d8, (void*)db}) CK(cudaFree(q));
}

// ds of each row (the sum of its N tiles' partials) on the host, from ds_partial [n_tiles, rows].
std::vector<double> row_sums(const float* partial, int n_tiles, long rows) {
  std::vector<float> h(static_cast<std::size_t>(n_tiles) * rows);
  CK(cudaMemcpy(h.data(), partial, h.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<double> ds(rows, 0.0);
  for (int t = 0; t < n_tiles; ++t)
    for (long r = 0; r < rows; ++r) ds[r] += h[static_cast<std::size_t>(t) * rows + r];
  return ds;
}
double rel_rms(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den > 0 ? std::sqrt(num / den) : -1.0;
}
bool same_bytes(const void* a, const void* b, std::size_t n) {
  std::vector<unsigned char> ha(n), hb(n);
  CK(cudaMemcpy(ha.data(), a, n, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hb.data(), b, n, cudaMemcpyDeviceToHost));
  return std::memcmp(ha.data(), hb.data(), n) == 0;
}

// The FP8 layer's step 7 (swiglu): (a) the FP8 dgated GEMM it runs (dO 1x128 and W2^T 128x128 in FP8, 128 x 128
// tile), (b) the bf16 dgated kernel (dO and W2 in bf16) with the same FP8 epilogue (bf16_varlen_m_dgated_fp8z, the
// layer's default: MoEConfig::dgated_precision bf16), (c) the bf16
// dgated kernel with its own epilogue on Z dequantised to bf16: (b) must equal (c) bitwise (dZ, s*A, ds partials), and
// (b)'s dZ codes the quantiser's on its bf16 dZ. Precision: ds (per row) and dZ of (a) and (b) against (d), the bf16
// dgated on the unquantised Z.
template <class QuantRows, class Fp8Args, class Bf16Args>
void bench_fp8_dgated(const Config& c, cudaStream_t s, const sonicmoe::Context& ctx, const int* doff,
                      const int* dgather, const bf* W1, const bf* W2, QuantRows&& quant_rows, Fp8Args&& fp8_args,
                      Bf16Args&& bf16_args) {
  using sonicmoe::DType;
  using sonicmoe::TensorView;
  const auto dev = sonicmoe::Device::cuda();
  const long TK = c.T * c.K, Z = 2 * c.I;
  bf* dO = alloc_rand(c.T * c.H, 6);
  bf* Zb = alloc_rand(TK * Z, 7);
  std::uint8_t *doq, *zq;
  float *dos, *zs;
  quant_rows(dO, c.T, c.H, &doq, &dos);
  quant_rows(Zb, TK, Z, &zq, &zs);
  bf* zdq;
  CK(cudaMalloc(&zdq, TK * Z * sizeof(bf)));
  sonicmoe::fp8_dequantize_rows(ctx, TensorView(zq, DType::f8e4m3, {TK, Z}, dev),
                                TensorView(zs, DType::f32, {TK, Z / 128}, dev), TensorView(zdq, DType::bf16, {TK, Z}, dev));
  sonicmoe::MoEConfig cfg;
  cfg.num_experts = c.E;
  cfg.top_k = c.K;
  cfg.hidden_size = c.H;
  cfg.intermediate_size = c.I;
  cfg.precision = sonicmoe::Precision::fp8_blockwise;
  cfg.dgated_precision = sonicmoe::Precision::fp8_blockwise;  // W2^T is made for the FP8 dgated GEMM only
  sonicmoe::MoEWeights w;
  w.w1 = TensorView(const_cast<bf*>(W1), DType::bf16, {c.E, Z, c.H}, dev);
  w.w2 = TensorView(const_cast<bf*>(W2), DType::bf16, {c.E, c.H, c.I}, dev);
  const sonicmoe::Fp8ExpertWeights wq = sonicmoe::fp8_quantize_expert_weights(ctx, cfg, w, /*transposed=*/true);
  std::vector<float> hs(TK);
  std::vector<int> hp(TK);
  std::mt19937 rng(99);
  std::uniform_real_distribution<float> u(0.05f, 1.0f);
  for (long r = 0; r < TK; ++r) {
    hs[r] = u(rng);
    hp[r] = static_cast<int>(r);
  }
  float* score;
  int* pair;
  CK(cudaMalloc(&score, TK * sizeof(float)));
  CK(cudaMalloc(&pair, TK * sizeof(int)));
  CK(cudaMemcpy(score, hs.data(), TK * sizeof(float), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(pair, hp.data(), TK * sizeof(int), cudaMemcpyHostToDevice));
  struct Out {
    bf *dz, *as;
    std::uint8_t* q;
    float *sc, *part;
  };
  const int nt8 = g::fp8_dgated_n_tiles(static_cast<int>(c.I)), ntb = g::native_dgated_n_tiles(static_cast<int>(c.I));
  auto out = [&](int nt) {
    Out o;
    CK(cudaMalloc(&o.dz, TK * Z * sizeof(bf)));
    CK(cudaMalloc(&o.as, TK * c.I * sizeof(bf)));
    CK(cudaMalloc(&o.q, TK * Z));
    CK(cudaMalloc(&o.sc, TK * (Z / 128) * sizeof(float)));
    CK(cudaMalloc(&o.part, nt * TK * sizeof(float)));
    CK(cudaMemset(o.dz, 0xff, TK * Z * sizeof(bf)));  // poisoned: what a kernel never writes stays NaN
    CK(cudaMemset(o.part, 0xff, nt * TK * sizeof(float)));
    return o;
  };
  Out oa = out(nt8), ob = out(ntb), oc = out(ntb), od = out(ntb);
  const g::Fp8VarlenM p8 = fp8_args(doq, dos, c.T, dgather, wq.w2_t.ptr<std::uint8_t>(), wq.w2_scale_t.ptr<float>(),
                                    c.I, c.H);
  g::NativeVarlenM pb = bf16_args(dO, c.T, dgather, W2, c.I, c.H);
  pb.b_kn = true;
  const auto act = sonicmoe::Activation::swiglu;
  const float ta = median_ms([&] {
    g::fp8_varlen_m_dgated(p8, act, g::Fp8ZIn{zq, zs}, score, pair, g::Fp8ZOut{oa.dz, oa.q, oa.sc}, oa.as, oa.part);
  }, s);
  const float tb = median_ms([&] {
    g::bf16_varlen_m_dgated_fp8z(pb, act, g::Fp8ZIn{zq, zs}, score, pair, g::Fp8ZOut{ob.dz, ob.q, ob.sc}, ob.as,
                                 ob.part);
  }, s);
  const float tc = median_ms([&] { g::native_varlen_m_dgated(pb, act, zdq, score, pair, oc.dz, oc.as, oc.part); }, s);
  g::native_varlen_m_dgated(pb, act, Zb, score, pair, od.dz, od.as, od.part);
  CK(cudaStreamSynchronize(s));
  // (b)'s codes against the quantiser on (b)'s bf16 dZ (into (c)'s code buffers, no longer needed)
  sonicmoe::fp8_quantize_rows(ctx, TensorView(ob.dz, DType::bf16, {TK, Z}, dev), TensorView(),
                              TensorView(oc.q, DType::f8e4m3, {TK, Z}, dev),
                              TensorView(oc.sc, DType::f32, {TK, Z / 128}, dev));
  CK(cudaStreamSynchronize(s));
  const bool same = same_bytes(ob.dz, oc.dz, TK * Z * sizeof(bf)) && same_bytes(ob.as, oc.as, TK * c.I * sizeof(bf)) &&
                    same_bytes(ob.part, oc.part, ntb * TK * sizeof(float));
  const bool codes = same_bytes(ob.q, oc.q, TK * Z) && same_bytes(ob.sc, oc.sc, TK * (Z / 128) * sizeof(float));
  const std::vector<double> dsd = row_sums(od.part, ntb, TK);
  const double fl = 2.0 * TK * c.I * c.H;
  std::printf("%-17s dgated: fp8 %s | bf16+fp8 epilogue %s | bf16 %s TFLOP/s (M %ld N %ld K %ld); (b) == (c) bitwise: "
              "%s, (b) codes: %s; vs bf16 on unquantised Z: ds rel RMS fp8 %.2e / bf16+fp8 epilogue %.2e, dZ %.2e / %.2e\n",
              c.name, tf(fl / ta / 1e9).c_str(), tf(fl / tb / 1e9).c_str(), tf(fl / tc / 1e9).c_str(), TK, (long)c.I,
              (long)c.H, same ? "yes" : "NO", codes ? "yes" : "NO", rel_rms(row_sums(oa.part, nt8, TK), dsd),
              rel_rms(row_sums(ob.part, ntb, TK), dsd), rel_diff(oa.dz, od.dz, TK * Z), rel_diff(ob.dz, od.dz, TK * Z));
  std::fflush(stdout);
  for (const Out& o : {oa, ob, oc, od})
    for (void* q : {(void*)o.dz, (void*)o.as, (void*)o.q, (void*)o.sc, (void*)o.part}) CK(cudaFree(q));
  for (void* q : {(void*)dO, (void*)Zb, (void*)doq, (void*)zq, (void*)dos, (void*)zs, (void*)zdq, (void*)score,
                  (void*)pair})
    CK(cudaFree(q));
}

// The FP8 layer's two up-projections (heuristics.h, fp8_up_in_place), Z in FP8 as the training forward writes it:
// X quantised once per token (into the caller's xq, xs) + the gathering kernel (128 x 128) against X quantised into
// the routing's row order (fp8_quantize_rows_scatter) + the contiguous kernel (128 x 256); codes, Z and A checked
// bitwise between the two.
template <class Fp8Args>
void bench_fp8_up_in_place(const Config& c, cudaStream_t s, const sonicmoe::Context& ctx, const std::vector<int>& off,
                           const std::vector<std::vector<int>>& by_e, const int* dgather, const bf* X,
                           std::uint8_t* xq, float* xs, const std::uint8_t* w1q, const float* w1s,
                           Fp8Args&& fp8_args) {
  using sonicmoe::DType;
  using sonicmoe::TensorView;
  const auto dev = sonicmoe::Device::cuda();
  const long TK = c.T * c.K, Z = 2 * c.I, nb = c.H / 128;
  // The routing's pairs in token order: token t's rows (token_offsets, rev), as the layer's metadata holds them.
  std::vector<std::vector<int>> rows_of(c.T);
  for (long e = 0; e < c.E; ++e)
    for (std::size_t i = 0; i < by_e[e].size(); ++i) rows_of[by_e[e][i]].push_back(off[e] + static_cast<int>(i));
  std::vector<int> toff(c.T + 1, 0), rev;
  rev.reserve(TK);
  for (long t = 0; t < c.T; ++t) {
    toff[t + 1] = toff[t] + static_cast<int>(rows_of[t].size());
    rev.insert(rev.end(), rows_of[t].begin(), rows_of[t].end());
  }
  int *dtoff, *drev;
  std::uint8_t *xg, *xr, *zq[2];
  float *xgs, *xrs, *zs[2];
  bf* a[2];
  CK(cudaMalloc(&dtoff, toff.size() * 4));
  CK(cudaMalloc(&drev, TK * 4));
  CK(cudaMemcpy(dtoff, toff.data(), toff.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(drev, rev.data(), TK * 4, cudaMemcpyHostToDevice));
  for (auto* q : {&xg, &xr}) CK(cudaMalloc(q, TK * c.H));
  for (auto* q : {&xgs, &xrs}) CK(cudaMalloc(q, TK * nb * 4));
  for (int i = 0; i < 2; ++i) {
    CK(cudaMalloc(&zq[i], TK * Z));
    CK(cudaMalloc(&zs[i], TK * (Z / 128) * 4));
    CK(cudaMalloc(&a[i], TK * c.I * sizeof(bf)));
    CK(cudaMemset(a[i], 0xff, TK * c.I * sizeof(bf)));
  }
  const TensorView xv(const_cast<bf*>(X), DType::bf16, {c.T, c.H}, dev);
  auto q_view = [&](std::uint8_t* q, long M) { return TensorView(q, DType::f8e4m3, {M, c.H}, dev); };
  auto s_view = [&](float* sc, long M) { return TensorView(sc, DType::f32, {M, nb}, dev); };
  const float tq_tok =
      median_ms([&] { sonicmoe::fp8_quantize_rows(ctx, xv, TensorView(), q_view(xq, c.T), s_view(xs, c.T)); }, s);
  const float tq_scat = median_ms([&] {
    sonicmoe::cuda::fp8_quantize_rows_scatter(ctx, xv, TensorView(dtoff, DType::i32, {c.T + 1}, dev),
                                              TensorView(drev, DType::i32, {TK}, dev), q_view(xr, TK), s_view(xrs, TK));
  }, s);
  // the gathering quantiser's rows, for the bitwise check of the scattered ones
  sonicmoe::fp8_quantize_rows(ctx, xv, TensorView(const_cast<int*>(dgather), DType::i32, {TK}, dev), q_view(xg, TK),
                              s_view(xgs, TK));
  const g::Fp8VarlenM pg = fp8_args(xq, xs, c.T, dgather, w1q, w1s, Z, c.H);
  const g::Fp8VarlenM pc = fp8_args(xr, xrs, TK, nullptr, w1q, w1s, Z, c.H);
  const auto act = sonicmoe::Activation::swiglu;
  auto up = [&](const g::Fp8VarlenM& p, int i) {
    g::fp8_varlen_m_activation(p, act, nullptr, g::Fp8ZOut{nullptr, zq[i], zs[i]}, a[i]);
  };
  const float t_g = median_ms([&] { up(pg, 0); }, s), t_c = median_ms([&] { up(pc, 1); }, s);
  CK(cudaStreamSynchronize(s));
  // where the in-place kernel's time goes: without Z (inference: A only), with Z in bf16 (by TMA) instead of codes
  const float t_c_a = median_ms([&] { g::fp8_varlen_m_activation(pc, act, nullptr, g::Fp8ZOut{}, a[1]); }, s);
  bf* zb;
  CK(cudaMalloc(&zb, TK * Z * sizeof(bf)));
  const float t_c_zb = median_ms([&] { g::fp8_varlen_m_activation(pc, act, nullptr, g::Fp8ZOut{zb}, a[1]); }, s);
  const float t_g_a = median_ms([&] { g::fp8_varlen_m_activation(pg, act, nullptr, g::Fp8ZOut{}, a[0]); }, s);
  CK(cudaStreamSynchronize(s));
  CK(cudaFree(zb));
  up(pg, 0);
  up(pc, 1);
  CK(cudaStreamSynchronize(s));
  const bool codes_eq = same_bytes(xg, xr, TK * c.H) && same_bytes(xgs, xrs, TK * nb * 4);
  const bool out_eq = same_bytes(zq[0], zq[1], TK * Z) && same_bytes(zs[0], zs[1], TK * (Z / 128) * 4) &&
                      same_bytes(a[0], a[1], TK * c.I * sizeof(bf));
  const double fl = 2.0 * TK * Z * c.H;
  std::printf("%-17s up in place: quantise %.3f + GEMM %.3f ms (%s TF/s) = %.3f ms | gathered: quantise %.3f + GEMM "
              "%.3f ms (%s TF/s) = %.3f ms | %.2fx | codes bitwise %s, Z and A bitwise %s\n",
              c.name, tq_scat, t_c, tf(fl / t_c / 1e9).c_str(), tq_scat + t_c, tq_tok, t_g, tf(fl / t_g / 1e9).c_str(),
              tq_tok + t_g, (tq_tok + t_g) / (tq_scat + t_c), codes_eq ? "yes" : "NO", out_eq ? "yes" : "NO");
  std::printf("%-17s up GEMM alone, TF/s: in place A only %s, in place Z bf16 + A %s, in place Z codes + A %s | "
              "gathered A only %s, gathered Z codes + A %s\n", c.name, tf(fl / t_c_a / 1e9).c_str(),
              tf(fl / t_c_zb / 1e9).c_str(), tf(fl / t_c / 1e9).c_str(), tf(fl / t_g_a / 1e9).c_str(),
              tf(fl / t_g / 1e9).c_str());
  std::fflush(stdout);
  for (void* q : {(void*)dtoff, (void*)drev, (void*)xg, (void*)xgs, (void*)xr, (void*)xrs, (void*)zq[0], (void*)zq[1],
                  (void*)zs[0], (void*)zs[1], (void*)a[0], (void*)a[1]})
    CK(cudaFree(q));
}

// The FP8 up+act and down rows of one config against the bf16 native kernel of the same shape.
void bench_fp8_config(const Config& c, cudaStream_t s) {
  const long TK = c.T * c.K, Z = 2 * c.I;
  std::mt19937 rng(1234);  // the routing of the bf16 mode: K distinct experts per token
  std::vector<std::vector<int>> by_e(c.E);
  std::vector<int> pick(c.E);
  for (int e = 0; e < c.E; ++e) pick[e] = e;
  for (long t = 0; t < c.T; ++t)
    for (int k = 0; k < c.K; ++k) {
      std::uniform_int_distribution<int> d(k, (int)c.E - 1);
      std::swap(pick[k], pick[d(rng)]);
      by_e[pick[k]].push_back((int)t);
    }
  std::vector<int> off(c.E + 1, 0), gather;
  gather.reserve(TK);
  for (int e = 0; e < c.E; ++e) {
    off[e + 1] = off[e] + (int)by_e[e].size();
    gather.insert(gather.end(), by_e[e].begin(), by_e[e].end());
  }
  int *doff, *dgather;
  CK(cudaMalloc(&doff, off.size() * 4));
  CK(cudaMalloc(&dgather, TK * 4));
  CK(cudaMemcpy(doff, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dgather, gather.data(), TK * 4, cudaMemcpyHostToDevice));
  bf* X = alloc_rand(c.T * c.H, 1);
  bf* W1 = alloc_rand(c.E * Z * c.H, 2);
  bf* W2 = alloc_rand(c.E * c.H * c.I, 3);
  bf* Aact = alloc_rand(TK * c.I, 4);
  bf *z, *a, *y, *ref;  // ref: the bf16 kernel's output, for the sanity column rel(fp8, bf16)
  CK(cudaMalloc(&z, TK * Z * sizeof(bf)));
  CK(cudaMalloc(&a, TK * c.I * sizeof(bf)));
  CK(cudaMalloc(&y, TK * c.H * sizeof(bf)));
  CK(cudaMalloc(&ref, TK * std::max(Z, c.H) * sizeof(bf)));
  // FP8 operands by the library's CUDA quantisers.
  const sonicmoe::Context ctx = cuda_context(s);
  const auto dev = sonicmoe::Device::cuda();
  using sonicmoe::DType;
  using sonicmoe::TensorView;
  auto quant_rows = [&](const bf* x, long R, long Kd, std::uint8_t** q, float** sc) {
    CK(cudaMalloc(q, R * Kd));
    CK(cudaMalloc(sc, R * (Kd / 128) * sizeof(float)));
    sonicmoe::fp8_quantize_rows(ctx, TensorView(const_cast<bf*>(x), DType::bf16, {R, Kd}, dev), TensorView(),
                                TensorView(*q, DType::f8e4m3, {R, Kd}, dev),
                                TensorView(*sc, DType::f32, {R, Kd / 128}, dev));
  };
  auto quant_blocks = [&](const bf* w, long N, long Kd, std::uint8_t** q, float** sc) {
    const long nb = (N + 127) / 128;
    CK(cudaMalloc(q, c.E * N * Kd));
    CK(cudaMalloc(sc, c.E * nb * (Kd / 128) * sizeof(float)));
    sonicmoe::fp8_quantize_blocks(ctx, TensorView(const_cast<bf*>(w), DType::bf16, {c.E, N, Kd}, dev),
                                  TensorView(*q, DType::f8e4m3, {c.E, N, Kd}, dev), TensorView(),
                                  TensorView(*sc, DType::f32, {c.E, nb, Kd / 128}, dev));
  };
  std::uint8_t *xq, *w1q, *aq, *w2q;
  float *xs, *w1s, *as, *w2s;
  quant_rows(X, c.T, c.H, &xq, &xs);
  quant_blocks(W1, Z, c.H, &w1q, &w1s);
  quant_rows(Aact, TK, c.I, &aq, &as);
  quant_blocks(W2, c.H, c.I, &w2q, &w2s);
  CK(cudaStreamSynchronize(s));

  // The fields the FP8 and the bf16 varlen-M arguments share: A's rows and gather, the expert offsets, N and K.
  auto varlen_args = [&](auto p, long a_rows, const int* gidx, long N, long Kd) {
    p.a_rows = a_rows;
    p.gather = gidx;
    p.offsets = doff;
    p.rows = TK;
    p.num_experts = (int)c.E;
    p.n = (int)N;
    p.k = (int)Kd;
    p.stream = s;
    return p;
  };
  auto fp8_args = [&](const std::uint8_t* A, const float* A_s, long a_rows, const int* gidx, const std::uint8_t* B,
                      const float* B_s, long N, long Kd) {
    g::Fp8VarlenM p;
    p.a = A;
    p.a_scale = A_s;
    p.b = B;
    p.b_scale = B_s;
    return varlen_args(p, a_rows, gidx, N, Kd);
  };
  auto bf16_args = [&](const bf* A, long a_rows, const int* gidx, const bf* B, long N, long Kd) {
    g::NativeVarlenM p;
    p.a = A;
    p.b = B;
    return varlen_args(p, a_rows, gidx, N, Kd);
  };
  // rel: ||fp8 - bf16|| / ||bf16|| of the outputs (the FP8 quantisation error of random data: a few 1e-2).
  auto line = [&](const char* label, long N, long Kd, float f8, float b16, double rel) {
    const double fl = 2.0 * TK * N * Kd;
    std::printf("%-17s %-10s %7ld %5ld %6ld | %9s %9s | %6s | %.2e\n", c.name, label, TK, N, Kd,
                tf(fl / f8 / 1e9).c_str(), tf(fl / b16 / 1e9).c_str(), tf(b16 / f8).append("x").c_str(), rel);
    std::fflush(stdout);
  };
  {  // up-projection: Z = X[gather] W1^T, A = swiglu(Z)
    const g::Fp8VarlenM p8 = fp8_args(xq, xs, c.T, dgather, w1q, w1s, Z, c.H);
    const g::NativeVarlenM pb = bf16_args(X, c.T, dgather, W1, Z, c.H);
    const float f8 = median_ms([&] { g::fp8_varlen_m_activation(p8, sonicmoe::Activation::swiglu, nullptr, g::Fp8ZOut{z}, a); }, s);
    const float b16 =
        median_ms([&] { g::native_varlen_m_activation(pb, sonicmoe::Activation::swiglu, nullptr, ref, a); }, s);
    CK(cudaStreamSynchronize(s));
    line("up+act", Z, c.H, f8, b16, rel_diff(z, ref, TK * Z));
  }
  {  // down-projection: Y = A W2^T (contiguous A)
    const g::Fp8VarlenM p8 = fp8_args(aq, as, TK, nullptr, w2q, w2s, c.H, c.I);
    const g::NativeVarlenM pb = bf16_args(Aact, TK, nullptr, W2, c.H, c.I);
    const float f8 = median_ms([&] { g::fp8_varlen_m_store(p8, y, nullptr, nullptr); }, s);
    const float b16 = median_ms([&] { g::native_varlen_m_store(pb, ref, nullptr, nullptr); }, s);
    CK(cudaStreamSynchronize(s));
    line("down", c.H, c.I, f8, b16, rel_diff(y, ref, TK * c.H));
  }
  bench_fp8_up_in_place(c, s, ctx, off, by_e, dgather, X, xq, xs, w1q, w1s, fp8_args);
  bench_fp8_dgated(c, s, ctx, doff, dgather, W1, W2, quant_rows, fp8_args, bf16_args);
  {  // the consumer-loop variants (bench_fp8_variants.h): each against variant 0's output (z0, y0)
    const g::Fp8VarlenM pu = fp8_args(xq, xs, c.T, dgather, w1q, w1s, Z, c.H);
    const g::Fp8VarlenM pd = fp8_args(aq, as, TK, nullptr, w2q, w2s, c.H, c.I);
    bf *z0, *y0;
    CK(cudaMalloc(&z0, TK * Z * sizeof(bf)));
    CK(cudaMalloc(&y0, TK * c.H * sizeof(bf)));
    const double fu = 2.0 * TK * Z * c.H, fd = 2.0 * TK * c.H * c.I;
    std::printf("%-17s %-14s | %9s %10s | %9s %10s\n", "variant", "", "up+act", "maxrel(v0)", "down", "maxrel(v0)");
    for (int v = 0; v < sonicmoe::bench::kFp8Variants; ++v) {
      bf* zo = v == 0 ? z0 : z;
      bf* yo = v == 0 ? y0 : y;
      CK(cudaMemset(zo, 0xff, TK * Z * sizeof(bf)));  // NaN: an element a variant never writes shows as inf
      CK(cudaMemset(yo, 0xff, TK * c.H * sizeof(bf)));
      const float tu = median_ms([&] { sonicmoe::bench::fp8_variant_activation(v, pu, zo, a); }, s);
      const float td = median_ms([&] { sonicmoe::bench::fp8_variant_store(v, pd, yo); }, s);
      CK(cudaStreamSynchronize(s));
      const double du = max_rel_diff(zo, z0, TK * Z), dd = max_rel_diff(yo, y0, TK * c.H);
      std::printf("%-17s %-14s | %9s %10.2e | %9s %10.2e\n", c.name, sonicmoe::bench::kFp8VariantNames[v],
                  tf(fu / tu / 1e9).c_str(), du, tf(fd / td / 1e9).c_str(), dd);
      std::fflush(stdout);
    }
    CK(cudaFree(z0));
    CK(cudaFree(y0));
  }
  bench_fp8_wgrad(c, s, doff, dgather, X, Aact);
  for (void* q : {(void*)X, (void*)W1, (void*)W2, (void*)Aact, (void*)z, (void*)a, (void*)y, (void*)ref, (void*)xq,
                  (void*)xs, (void*)w1q, (void*)w1s, (void*)aq, (void*)as, (void*)w2q, (void*)w2s, (void*)doff,
                  (void*)dgather})
    CK(cudaFree(q));
}

int run_fp8(const std::string& only, cudaStream_t s) {
  std::printf("%-17s %-10s %7s %5s %6s | %9s %9s | %6s | %s\n", "config", "gemm", "M", "N", "K", "fp8", "bf16", "speedup",
              "rel(fp8,bf16)");
  std::printf("%-17s %-10s %7s %5s %6s | %9s %9s | %6s |\n", "", "", "", "", "", "TFLOP/s", "TFLOP/s", "");
  for (const Config& c : kConfigs)
    if (only.empty() || only == c.name) bench_fp8_config(c, s);
  std::printf("fp8 dense peak (cuBLASLt 8192^3): %s TFLOP/s (fast accumulation; %s TFLOP/s with promoted sums)\n",
              tf(cublaslt_fp8_dense_tflops(s, true)).c_str(), tf(cublaslt_fp8_dense_tflops(s, false)).c_str());
  return 0;
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "fp8") {
    std::string only = argc > 2 ? argv[2] : "";
    if (only == "all") only.clear();
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    std::printf("GPU: %s (%d SMs), FP8 mode\n", prop.name, prop.multiProcessorCount);
    cudaStream_t s;
    CK(cudaStreamCreate(&s));
    const int rc = run_fp8(only, s);
    CK(cudaStreamDestroy(s));
    return rc;
  }
  std::string only = argc > 1 ? argv[1] : "";
  if (only == "all") only.clear();
  const std::string only_row = argc > 2 ? argv[2] : "";
  auto want = [&](const char* label) { return only_row.empty() || only_row == label; };
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("GPU: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h;
  CB(cublasCreate(&h));
  CB(cublasSetStream(h, s));
  print_header();
  for (const Config& c : kConfigs) {
    if (!only.empty() && only != c.name) continue;
    const long TK = c.T * c.K, Z = 2 * c.I;
    // Random top-K routing: K distinct experts per token.
    std::mt19937 rng(1234);
    std::vector<std::vector<int>> by_e(c.E);
    std::vector<int> pick(c.E);
    for (int e = 0; e < c.E; ++e) pick[e] = e;
    for (long t = 0; t < c.T; ++t) {
      for (int k = 0; k < c.K; ++k) {
        std::uniform_int_distribution<int> d(k, (int)c.E - 1);
        std::swap(pick[k], pick[d(rng)]);
        by_e[pick[k]].push_back((int)t);
      }
    }
    std::vector<int> off(c.E + 1, 0), off_eq(c.E + 1, 0), gather, pair(TK);
    gather.reserve(TK);
    for (int e = 0; e < c.E; ++e) {
      off[e + 1] = off[e] + (int)by_e[e].size();
      off_eq[e + 1] = (int)(TK * (e + 1) / c.E);
      gather.insert(gather.end(), by_e[e].begin(), by_e[e].end());
    }
    for (long r = 0; r < TK; ++r) pair[r] = (int)r;  // any permutation of the pairs serves the benchmark
    int *doff, *doff_eq, *dgather, *dpair;
    CK(cudaMalloc(&doff, off.size() * 4));
    CK(cudaMalloc(&doff_eq, off.size() * 4));
    CK(cudaMalloc(&dgather, TK * 4));
    CK(cudaMalloc(&dpair, TK * 4));
    CK(cudaMemcpy(doff, off.data(), off.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(doff_eq, off_eq.data(), off.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dgather, gather.data(), TK * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dpair, pair.data(), TK * 4, cudaMemcpyHostToDevice));
    float* dscore_pair;
    CK(cudaMalloc(&dscore_pair, TK * 4));
    sonicmoe::bench::fill(dscore_pair, TK, 11, 1.0f);

    bf* X = alloc_rand(c.T * c.H, 1);
    bf* W1 = alloc_rand(c.E * Z * c.H, 2);
    bf* W2 = alloc_rand(c.E * c.H * c.I, 3);
    bf* Aact = alloc_rand(TK * c.I, 4);  // A (down-proj input), also As (dW2 operand)
    bf* dZ = alloc_rand(TK * Z, 5);      // dZ (dW1 / dX operand), also Z (dgated input)
    bf* dO = alloc_rand(c.T * c.H, 6);
    const long out_elems = std::max({TK * Z, TK * c.H, c.E * Z * c.H, c.E * c.H * c.I});
    bf *out1, *out2, *out3, *gbuf;
    CK(cudaMalloc(&out1, out_elems * sizeof(bf)));
    CK(cudaMalloc(&out2, out_elems * sizeof(bf)));
    CK(cudaMalloc(&out3, TK * std::max(c.I, Z) * sizeof(bf)));
    CK(cudaMalloc(&gbuf, TK * std::max(c.H, 3 * c.I) * sizeof(bf)));
    float* partial;
    CK(cudaMalloc(&partial, (long)g::native_dgated_n_tiles((int)c.I) * TK * sizeof(float)));
    void* ws = nullptr;
    std::size_t ws_bytes = 0;
    // Gives p (VarlenMParams or VarlenKParams) the shared workspace, grown to `need` bytes.
    auto with_ws = [&](auto& p, std::size_t need) {
      if (need > ws_bytes) {
        if (ws) CK(cudaFree(ws));
        CK(cudaMalloc(&ws, need));
        ws_bytes = need;
      }
      p.workspace = ws;
      p.workspace_bytes = ws_bytes;
    };
    const float one = 1.0f, zero = 0.0f;

    auto params_m = [&](const bf* A, const int* gidx, const bf* B, bool b_kn, long N, long Kd, const int* offs,
                        bl::Schedule sc, bf* C) {
      // TK rows in E groups by offs (on the device), on stream s. Fields: a, a_rows, gather, b, bias, row_scale, c,
      // offsets, rows, num_experts, n, k, b_kn, schedule.
      bl::VarlenMParams p{A, gidx ? c.T : TK, gidx, B, nullptr, nullptr, C, offs, TK, c.E, N, Kd, b_kn, sc};
      p.stream = s;
      with_ws(p, bl::varlen_m_workspace_bytes(p));
      return p;
    };
    auto time_m = [&](const bl::VarlenMParams& p) { return median_ms([&] { bl::varlen_m_gemm(p); }, s); };
    auto row = [&](const char* label, long M, long N, long Kd, double fl, float nat, float nat_ctg, float cut,
                   float cut_ctg, float cub, double rel) {
      auto t = [&](float ms) { return ms > 0 ? fl / ms / 1e9 : 0.0; };
      const double ref = t(cut_ctg > 0 ? cut_ctg : cut);
      std::printf("%-17s %-10s %7ld %5ld %6ld | %8s %8s %8s %8s %8s | %7s %7s | %s\n", c.name, label, M, N, Kd,
                  tf(t(nat)).c_str(), tf(t(nat_ctg)).c_str(), tf(t(cut)).c_str(), tf(t(cut_ctg)).c_str(),
                  tf(t(cub)).c_str(), ref > 0 && nat > 0 ? tf(100 * t(nat) / ref).append("%").c_str() : "-",
                  cub > 0 && nat > 0 ? tf(100 * t(nat) / t(cub)).append("%").c_str() : "-",
                  rel >= 0 ? (std::to_string(rel)).c_str() : "-");
      std::fflush(stdout);
    };
    // cuBLAS: gather (if any) then one cublasGemmEx per expert; B [E, N, K] (or [E, K, N] when b_kn).
    auto cublas_m = [&](const bf* A, const int* gidx, const bf* B, bool b_kn, long N, long Kd, bf* C) {
      const bf* src = A;
      if (gidx) {
        bl::gather_rows(A, gidx, TK, Kd, nullptr, gbuf, s);
        src = gbuf;
      }
      for (int e = 0; e < c.E; ++e) {
        int m = off[e + 1] - off[e];
        if (!m) continue;
        CB(cublasGemmEx(h, b_kn ? CUBLAS_OP_N : CUBLAS_OP_T, CUBLAS_OP_N, (int)N, m, (int)Kd, &one,
                        B + (long)e * N * Kd, CUDA_R_16BF, b_kn ? (int)N : (int)Kd, src + (long)off[e] * Kd,
                        CUDA_R_16BF, (int)Kd, &zero, C + (long)off[e] * N, CUDA_R_16BF, (int)N, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT));
      }
    };
    // varlen-M GEMM in all variants.
    auto bench_m = [&](const char* label, const bf* A, const int* gidx, const bf* B, bool b_kn, long N, long Kd) {
      const float nat = time_m(params_m(A, gidx, B, b_kn, N, Kd, doff, bl::Schedule::native, out1));
      float nat_ctg = -1, cut_ctg = -1;
      if (gidx) {
        bl::gather_rows(A, gidx, TK, Kd, nullptr, gbuf, s);
        nat_ctg = time_m(params_m(gbuf, nullptr, B, b_kn, N, Kd, doff, bl::Schedule::native, out2));
        cut_ctg = time_m(params_m(gbuf, nullptr, B, b_kn, N, Kd, doff, bl::Schedule::cutlass_cooperative, out2));
      }
      const float cut = time_m(params_m(A, gidx, B, b_kn, N, Kd, doff, bl::Schedule::cutlass_cooperative, out2));
      const float cub = median_ms([&] { cublas_m(A, gidx, B, b_kn, N, Kd, out2); }, s);
      bl::varlen_m_gemm(params_m(A, gidx, B, b_kn, N, Kd, doff, bl::Schedule::native, out1));
      CK(cudaStreamSynchronize(s));
      const double rel = rel_diff(out1, out2, TK * N);
      row(label, TK, N, Kd, 2.0 * TK * N * Kd, nat, nat_ctg, cut, cut_ctg, cub, rel);
    };
    // Equal group sizes, contiguous A: native against the CUTLASS reference kernel.
    auto bench_eq = [&](const char* label, const bf* A, const bf* B, long N, long Kd) {
      const float nat = time_m(params_m(A, nullptr, B, false, N, Kd, doff_eq, bl::Schedule::native, out1));
      const float cut = time_m(params_m(A, nullptr, B, false, N, Kd, doff_eq, bl::Schedule::cutlass_cooperative, out2));
      CK(cudaStreamSynchronize(s));
      const double rel = rel_diff(out1, out2, TK * N);
      row(label, TK, N, Kd, 2.0 * TK * N * Kd, nat, -1, cut, -1, -1, rel);
    };
    // Fused up-projection (Z, A) against gather + CUTLASS GEMM + activation pass.
    auto bench_up_act = [&]() {
      g::NativeVarlenM a = bl::native_args(params_m(X, dgather, W1, false, Z, c.H, doff, bl::Schedule::native, out1));
      const float nat = median_ms([&] { g::native_varlen_m_activation(a, sonicmoe::Activation::swiglu, nullptr, out1, out3); }, s);
      bl::VarlenMParams pc = params_m(X, dgather, W1, false, Z, c.H, doff, bl::Schedule::cutlass_cooperative, out2);
      const float unf = median_ms(
          [&] {
            bl::varlen_m_gemm(pc);
            bl::activation_forward(sonicmoe::Activation::swiglu, out2, gbuf, TK, c.I, doff, (int)c.E, s);
          },
          s);
      CK(cudaStreamSynchronize(s));
      const double rel = rel_diff(out3, gbuf, TK * c.I);  // A of the fused kernel vs A of the unfused pipeline
      row("up+act", TK, Z, c.H, 2.0 * TK * Z * c.H, nat, -1, unf, -1, -1, -1);
      std::printf("%-17s %-10s   (fused vs unfused A: rel %.2e; 'cutlass' = gather + CUTLASS + activation pass)\n",
                  "", "", rel);
    };
    // Fused dgated (G staged in shared memory; dZ, s*A, score partials, reduce) against gather + CUTLASS G +
    // the dgated pass.
    auto bench_dgated = [&]() {
      g::NativeVarlenM a = bl::native_args(params_m(dO, dgather, W2, true, c.I, c.H, doff, bl::Schedule::native, out1));
      float* ds1 = reinterpret_cast<float*>(out3);
      const int nt = g::native_dgated_n_tiles((int)c.I);
      const float nat = median_ms(
          [&] {
            g::native_varlen_m_dgated(a, sonicmoe::Activation::swiglu, dZ, dscore_pair, dpair, out1, out2, partial);
            g::dgated_score_reduce(partial, nt, TK, dpair, doff, (int)c.E, nullptr, nullptr, nullptr, c.H, ds1, s);
          },
          s);
      bl::VarlenMParams pc = params_m(dO, dgather, W2, true, c.I, c.H, doff, bl::Schedule::cutlass_cooperative, gbuf);
      bf* dz2 = gbuf + TK * c.I;  // gbuf holds TK * max(H, 3I) elements
      const float unf = median_ms(
          [&] {
            bl::varlen_m_gemm(pc);
            bl::dgated_elementwise(sonicmoe::Activation::swiglu, gbuf, dZ, dscore_pair, dpair, nullptr,
                                               nullptr, nullptr, dz2, nullptr, ds1 + TK, TK, c.H, c.I, doff, (int)c.E,
                                               s);
          },
          s);
      CK(cudaStreamSynchronize(s));
      const double rel = rel_diff(out1, dz2, TK * Z);  // dZ fused vs unfused
      row("dgated", TK, c.I, c.H, 2.0 * TK * c.I * c.H, nat, -1, unf, -1, -1, -1);
      std::printf("%-17s %-10s   (fused vs unfused dZ: rel %.2e; 'cutlass' = gather + CUTLASS + dgated pass)\n",
                  "", "", rel);
    };
    // varlen-K: D[e] = P[gp]^T Q[gq]; cuBLAS: gathers then one cublasGemmEx per expert.
    auto bench_k = [&](const char* label, const bf* P, const int* pg, long M, const bf* Q, const int* qg, long N) {
      // Fields: p, p_rows, p_gather, q, q_rows, q_gather, d, offsets, rows, num_experts, m, n.
      bl::VarlenKParams p{P, pg ? c.T : TK, pg, Q, qg ? c.T : TK, qg, out1, doff, TK, c.E, M, N};
      p.stream = s;
      const float mn = median_ms([&] { bl::varlen_k_gemm(p); }, s);  // native: no workspace
      p.schedule = bl::Schedule::cutlass_cooperative;
      with_ws(p, bl::varlen_k_workspace_bytes(p));
      const float mo = median_ms([&] { bl::varlen_k_gemm(p); }, s);
      p.schedule = bl::Schedule::native;
      auto cub = [&] {
        const bf *pp = P, *qq = Q;
        if (pg) {
          bl::gather_rows(P, pg, TK, M, nullptr, gbuf, s);
          pp = gbuf;
        }
        if (qg) {
          bl::gather_rows(Q, qg, TK, N, nullptr, gbuf, s);
          qq = gbuf;
        }
        for (int e = 0; e < c.E; ++e) {
          int k = off[e + 1] - off[e];
          CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)N, (int)M, k, &one, qq + (long)off[e] * N, CUDA_R_16BF,
                          (int)N, pp + (long)off[e] * M, CUDA_R_16BF, (int)M, &zero, out2 + (long)e * M * N,
                          CUDA_R_16BF, (int)N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
      };
      const float mc = median_ms(cub, s);
      bl::varlen_k_gemm(p);
      CK(cudaStreamSynchronize(s));
      const double rel = rel_diff(out1, out2, c.E * M * N);
      row(label, M, N, TK, 2.0 * TK * M * N, mn, -1, mo, -1, mc, rel);
    };
    if (want("up") || want("up-eq")) bench_m("up", X, dgather, W1, false, Z, c.H);  // Z = X[gather] W1^T
    if (want("up-eq")) bench_eq("up-eq", gbuf, W1, Z, c.H);          // equal groups, contiguous rows
    if (want("down")) bench_m("down", Aact, nullptr, W2, false, c.H, c.I);  // Y = A W2^T: N = H, K = I
    if (want("down-eq")) bench_eq("down-eq", Aact, W2, c.H, c.I);
    if (want("dX")) bench_m("dX", dZ, nullptr, W1, true, c.H, Z);  // dXe = dZ W1: N = H, K = 2I, B [E, K, N]
    if (want("dgated-G")) bench_m("dgated-G", dO, dgather, W2, true, c.I, c.H);  // G = dO[gather] W2
    if (want("up+act")) bench_up_act();
    if (want("dgated")) bench_dgated();
    if (want("dW1")) bench_k("dW1", dZ, nullptr, Z, X, dgather, c.H);       // dW1[e] = dZ^T X[gather]
    if (want("dW2")) bench_k("dW2", dO, dgather, c.H, Aact, nullptr, c.I);  // dW2[e] = dO[gather]^T As
    for (void* q : {(void*)X, (void*)W1, (void*)W2, (void*)Aact, (void*)dZ, (void*)dO, (void*)out1, (void*)out2,
                    (void*)out3, (void*)gbuf, (void*)partial, (void*)doff, (void*)doff_eq, (void*)dgather,
                    (void*)dpair, (void*)dscore_pair, ws})
      CK(cudaFree(q));
    ws = nullptr;
    ws_bytes = 0;
  }
  CB(cublasDestroy(h));
  return 0;
}
