// sonicmoe-bench-gemm: the grouped GEMMs (src/cuda/gemm) on the MoE shapes of bench/bench_configs.json
// against cuBLAS (a per-expert cublasGemmEx loop on pre-gathered inputs, the gather timed with it).
// Routing: per token K distinct experts drawn at random (unequal groups). CUDA events, 3 warm-up runs,
// median of 20. Data: non-zero uniform random bf16. Ours and cuBLAS outputs are compared (relative error).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_cuda.cuh"
#include "cuda/gemm/grouped_gemm.h"

namespace g = sonicmoe::cuda::gemm;
using bf = __nv_bfloat16;

#define CB(x)                                                                  \
  do {                                                                         \
    cublasStatus_t s_ = (x);                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                         \
      std::fprintf(stderr, "cuBLAS error %d at %s:%d\n", int(s_), __FILE__, __LINE__); \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

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
  CK(cudaMalloc(&p, n * sizeof(bf)));
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
double rel_diff(const bf* a, const bf* b, long n) {
  double* d;
  CK(cudaMalloc(&d, 2 * sizeof(double)));
  CK(cudaMemset(d, 0, 2 * sizeof(double)));
  diff_kernel<<<512, 256>>>(a, b, n, d);
  double h[2];
  CK(cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost));
  CK(cudaFree(d));
  return h[1] > 0 ? std::sqrt(h[0] / h[1]) : -1.0;  // -1: the cuBLAS output was all zeros
}

float median_ms(const std::function<void()>& fn, cudaStream_t s) { return sonicmoe::bench::median_ms(fn, 20, s); }

int main(int argc, char** argv) {
  std::string only = argc > 1 ? argv[1] : "";
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("GPU: %s (%d SMs)\n", prop.name, prop.multiProcessorCount);
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasHandle_t h;
  CB(cublasCreate(&h));
  CB(cublasSetStream(h, s));
  std::printf("%-17s %-9s %6s %6s %7s | %9s %9s %9s | %9s %9s | %s\n", "config", "gemm", "M/N", "N", "K",
              "coop", "pingpong", "cuBLAS", "best/cuB", "rows", "rel(ours,cuBLAS)");
  std::printf("%-17s %-9s %6s %6s %7s | %9s %9s %9s |\n", "", "", "", "", "", "TFLOP/s", "TFLOP/s", "TFLOP/s");
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
    bf* Aact = alloc_rand(TK * c.I, 4);   // A (down-proj input), also As (dW2 operand)
    bf* dZ = alloc_rand(TK * Z, 5);       // dZ (dW1 operand)
    bf* dO = alloc_rand(c.T * c.H, 6);
    long out_elems = std::max({TK * Z, TK * c.H, c.E * Z * c.H, c.E * c.H * c.I});
    long gbuf_elems = TK * c.H;
    bf *out1, *out2, *gbuf;
    CK(cudaMalloc(&out1, out_elems * sizeof(bf)));
    CK(cudaMalloc(&out2, out_elems * sizeof(bf)));
    CK(cudaMalloc(&gbuf, gbuf_elems * sizeof(bf)));
    void* ws = nullptr;
    std::size_t ws_bytes = 0;
    auto ensure_ws = [&](std::size_t need) {
      if (need > ws_bytes) {
        if (ws) CK(cudaFree(ws));
        CK(cudaMalloc(&ws, need));
        ws_bytes = need;
      }
    };
    const float one = 1.0f, zero = 0.0f;

    // varlen-M: C[r] = A[g(r)] B[e]^T; cuBLAS: gather then one cublasGemmEx per expert.
    auto bench_m = [&](const char* label, const bf* A, const int* gidx, const bf* B, long N, long Kd) {
      g::VarlenMParams p;
      p.a = A;
      p.a_rows = gidx ? c.T : TK;
      p.gather = gidx;
      p.b = B;
      p.c = out1;
      p.offsets = doff;
      p.rows = TK;
      p.num_experts = c.E;
      p.n = N;
      p.k = Kd;
      p.stream = s;
      float ms[2];
      for (int sc = 0; sc < 2; ++sc) {
        p.schedule = sc ? g::Schedule::pingpong : g::Schedule::cooperative;
        ensure_ws(g::varlen_m_workspace_bytes(p));
        p.workspace = ws;
        p.workspace_bytes = ws_bytes;
        ms[sc] = median_ms([&] { g::varlen_m_gemm(p); }, s);
      }
      auto cub = [&] {
        const bf* src = A;
        if (gidx) {
          g::gather_rows(A, gidx, TK, Kd, nullptr, gbuf, s);
          src = gbuf;
        }
        for (int e = 0; e < c.E; ++e) {
          int m = off[e + 1] - off[e];
          if (!m) continue;
          CB(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)N, m, (int)Kd, &one, B + (long)e * N * Kd, CUDA_R_16BF,
                          (int)Kd, src + (long)off[e] * Kd, CUDA_R_16BF, (int)Kd, &zero, out2 + (long)off[e] * N,
                          CUDA_R_16BF, (int)N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
      };
      float mc = median_ms(cub, s);
      g::varlen_m_gemm(p);
      CK(cudaStreamSynchronize(s));
      double rel = rel_diff(out1, out2, TK * N);
      double fl = 2.0 * TK * N * Kd;
      double tc = fl / ms[0] / 1e9, tp = fl / ms[1] / 1e9, tb = fl / mc / 1e9;
      std::printf("%-17s %-9s %6ld %6ld %7ld | %9.1f %9.1f %9.1f | %9.2f %9ld | %.2e\n", c.name, label, TK, N, Kd, tc,
                  tp, tb, std::max(tc, tp) / tb, TK, rel);
    };
    // varlen-K: D[e] = P[gp]^T Q[gq]; cuBLAS: gathers then one cublasGemmEx per expert.
    auto bench_k = [&](const char* label, const bf* P, const int* pg, long M, const bf* Q, const int* qg, long N) {
      g::VarlenKParams p;
      p.p = P;
      p.p_rows = pg ? c.T : TK;
      p.p_gather = pg;
      p.q = Q;
      p.q_rows = qg ? c.T : TK;
      p.q_gather = qg;
      p.d = out1;
      p.offsets = doff;
      p.rows = TK;
      p.num_experts = c.E;
      p.m = M;
      p.n = N;
      p.stream = s;
      ensure_ws(g::varlen_k_workspace_bytes(p));
      p.workspace = ws;
      p.workspace_bytes = ws_bytes;
      float mo = median_ms([&] { g::varlen_k_gemm(p); }, s);
      auto cub = [&] {
        const bf *pp = P, *qq = Q;
        if (pg) {
          g::gather_rows(P, pg, TK, M, nullptr, gbuf, s);
          pp = gbuf;
        }
        if (qg) {
          g::gather_rows(Q, qg, TK, N, nullptr, gbuf, s);
          qq = gbuf;
        }
        for (int e = 0; e < c.E; ++e) {
          int k = off[e + 1] - off[e];
          CB(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_T, (int)N, (int)M, k, &one, qq + (long)off[e] * N, CUDA_R_16BF,
                          (int)N, pp + (long)off[e] * M, CUDA_R_16BF, (int)M, &zero, out2 + (long)e * M * N,
                          CUDA_R_16BF, (int)N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        }
      };
      float mc = median_ms(cub, s);
      g::varlen_k_gemm(p);
      CK(cudaStreamSynchronize(s));
      double rel = rel_diff(out1, out2, c.E * M * N);
      double fl = 2.0 * TK * M * N;
      double to = fl / mo / 1e9, tb = fl / mc / 1e9;
      std::printf("%-17s %-9s %6ld %6ld %7ld | %9.1f %9s %9.1f | %9.2f %9ld | %.2e\n", c.name, label, M, N, TK, to, "-",
                  tb, to / tb, TK, rel);
    };
    bench_m("up", X, dgather, W1, Z, c.H);          // Z = X[gather] W1^T, N = 2I, K = H
    bench_m("down", Aact, nullptr, W2, c.H, c.I);   // Y = A W2^T, N = H, K = I
    bench_k("dW1", dZ, nullptr, Z, X, dgather, c.H);   // dW1[e] = dZ^T X[gather]  (2I x H)
    bench_k("dW2", dO, dgather, c.H, Aact, nullptr, c.I);  // dW2[e] = dO[gather]^T As  (H x I)
    std::fflush(stdout);
    for (void* q : {(void*)X, (void*)W1, (void*)W2, (void*)Aact, (void*)dZ, (void*)dO, (void*)out1, (void*)out2,
                    (void*)gbuf, (void*)doff, (void*)dgather, ws})
      CK(cudaFree(q));
  }
  CB(cublasDestroy(h));
  return 0;
}
