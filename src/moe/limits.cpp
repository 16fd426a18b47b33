// The layer's size limits: the int32 index contract and the memory footprint of forward / backward, counted from
// the buffers src/moe/layer.cpp allocates, so that a problem too large fails with an Error before any allocation.
#include "moe/limits.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <initializer_list>

#include "core/check.h"
#include "cuda/gemm/heuristics.h"
#include "moe/fp8_weights.h"

namespace sonicmoe::limits {

namespace {

// Bytes of a buffer of `dims` elements of `elem` bytes each, overflow-checked.
std::int64_t buf(std::initializer_list<std::int64_t> dims, std::int64_t elem, const char* what) {
  std::int64_t b = elem;
  for (std::int64_t d : dims) b = checked_mul(b, d, what);
  return b;
}
std::int64_t sum(std::initializer_list<std::int64_t> terms) {
  std::int64_t s = 0;
  for (std::int64_t t : terms) s = checked_add(s, t, "memory estimate (bytes)");
  return s;
}

// The layer's buffers in bytes, grouped by when they are alive (the order of src/moe/layer.cpp).
struct Footprint {
  std::int64_t routing = 0;              // route(): logits, top-K, pair arrays, metadata (kept in the saved state)
  std::int64_t z = 0;                    // Z [N, z_width] (saved; scratch in inference)
  std::int64_t a = 0, y = 0;             // forward scratch: A [N, I], Y [N, H]
  std::int64_t out = 0;                  // output [T, H]
  std::int64_t dscore_dw2 = 0;           // backward, first: dscore [N], dw2 [E, H, I], db2 [E, H]
  std::int64_t dscore = 0;               // dscore [N] alone (the FP8 backward makes dw2 later)
  std::int64_t dz = 0, as = 0, dxe = 0;  // backward scratch of steps 7-10
  std::int64_t dx = 0;                   // dx [T, H]
  std::int64_t dw1 = 0;                  // dw1 [E, z_width, H], db1 [E, z_width]
  std::int64_t router = 0;               // step 11: dlogits [T, E] (scratch) and drouter [E, H]
  // fp8_blockwise (the cuda FP8 layer's buffers, src/cuda/fp8/fp8_layer.cu; z above is then the saved FP8 Z):
  std::int64_t xq = 0;                   // X or dO quantised 1x128 once a token: [T, H] codes + scales
  std::int64_t x_up = 0;                 // the up-projection's X operand: [N, H] in the routing's order, or xq
  std::int64_t aq = 0, dzq = 0;          // A [N, I] and dZ [N, z_width] quantised 1x128
  std::int64_t w1q = 0, w2q = 0;         // W1, W2 quantised 128x128 (codes + scales); a transposed copy is as large
  std::int64_t w2q_t = 0;                // W2's transposed copy where the backward reads it (fp8_backward_reads_w2_t)
  std::int64_t partial = 0;              // dgated's per-(row, N tile) score partials
  // FP8 weight gradients (weight_grad_precision fp8_blockwise): the two K-major 128x1 copies of step 8 (dO, As) and
  // of step 9 (dZ, X), each expert's rows in whole 128-column blocks (src/cuda/quant/quant_segments.h)
  std::int64_t wg2 = 0, wg1 = 0;
};

// K-major FP8 copies of `channels` channels over N rows in E expert segments: codes and one f32 scale per channel
// a 128-row block, (ceil(N / 128) + E) blocks; and the block offsets.
std::int64_t fp8_segment_bytes(std::int64_t N, std::int64_t E, std::int64_t channels, const char* what) {
  const std::int64_t blocks = (N + 127) / 128 + E;
  return sum({buf({channels, blocks, 128}, 1, what), buf({blocks, channels}, 4, what), buf({E + 1}, 4, "E+1")});
}

// An FP8 1x128 operand [rows, cols]: codes and one f32 scale per 128 columns.
std::int64_t fp8_rows_bytes(std::int64_t rows, std::int64_t cols, const char* what) {
  return sum({buf({rows, cols}, 1, what), buf({rows, (cols + 127) / 128}, 4, what)});
}

std::int64_t route_bytes(const MoEConfig& c, std::int64_t T, std::int64_t N, RoutingMode mode) {
  const std::int64_t E = c.num_experts, K = c.top_k;
  // counts, offsets, pair / gather / rev, token_offsets, aux_loss; on the cuda backend they share one block with
  // the counting kernels' per-block counts (at most 1024 blocks of E ints, a block per 8 tokens or fewer; kept with
  // the metadata) and each array rounded up to 256 bytes (src/cuda/routing/metadata.cu, ArrayPack)
  const std::int64_t count_blocks = std::min<std::int64_t>(1024, (std::max(T, N) + 7) / 8);
  const std::int64_t meta = sum({buf({E}, 4, "E"), buf({E + 1}, 4, "E+1"), buf({3, N}, 4, "3*N"),
                                 buf({T + 1}, 4, "T+1"), 4, buf({count_blocks, E}, 4, "metadata block counts"),
                                 8 * 256});
  if (mode == RoutingMode::general) return sum({meta, buf({3, N}, 4, "3*N (pair arrays)")});
  const std::int64_t router = sum({buf({T, E}, 4, "T*E (logits)"), buf({2, T, K}, 4, "2*T*K (top-K)"),
                                   buf({E}, 4, "E (counts)")});
  if (mode == RoutingMode::topk) return sum({meta, router, buf({N}, 4, "N (pair_token)")});
  // Token rounding: four pair arrays, and ~9 bytes per (token, expert) of ranking scratch (the reference's
  // softmax probabilities, slot map and keep flags; the cuda workspace is of the same order).
  return sum({meta, router, buf({4, N}, 4, "4*N (pair arrays)"), buf({9, T, E}, 1, "9*T*E (rounding scratch)")});
}

Footprint footprint(const MoEConfig& c, std::int64_t T, std::int64_t N, DType dt, RoutingMode mode) {
  const std::int64_t E = c.num_experts, H = c.hidden_size, I = c.intermediate_size, ZW = c.z_width();
  const std::int64_t s = static_cast<std::int64_t>(dtype_size(dt));
  Footprint f;
  f.routing = route_bytes(c, T, N, mode);
  f.z = buf({N, ZW}, s, "N*z_width (Z)");
  f.a = buf({N, I}, s, "N*I (A)");
  f.y = buf({N, H}, s, "N*H (Y)");
  f.out = buf({T, H}, s, "T*H (output)");
  f.dscore = buf({N}, 4, "N (dscore)");
  f.dscore_dw2 = sum({f.dscore, buf({E, H, I}, s, "E*H*I (dw2)"), c.add_bias ? buf({E, H}, s, "E*H (db2)") : 0});
  f.dz = f.z;
  f.as = f.a;
  f.dxe = f.y;
  f.dx = f.out;
  f.dw1 = sum({buf({E, ZW, H}, s, "E*z_width*H (dw1)"), c.add_bias ? buf({E, ZW}, s, "E*z_width (db1)") : 0});
  if (mode != RoutingMode::general) f.router = sum({buf({T, E}, 4, "T*E (dlogits)"), buf({E, H}, s, "E*H (drouter)")});
  if (c.precision == Precision::fp8_blockwise) {
    f.z = fp8_rows_bytes(N, ZW, "N*z_width (Z in FP8)");
    f.xq = fp8_rows_bytes(T, H, "T*H (X or dO in FP8)");
    // X in the routing's row order for the wide up-projection tile (heuristics.h, fp8_up_in_place), else once a token
    f.x_up = cuda::gemm::fp8_up_in_place(ZW) ? fp8_rows_bytes(N, H, "N*H (X's rows in FP8)") : f.xq;
    f.aq = fp8_rows_bytes(N, I, "N*I (A in FP8)");
    f.dzq = fp8_rows_bytes(N, ZW, "N*z_width (dZ in FP8)");
    f.w1q = sum({buf({E, ZW, H}, 1, "E*z_width*H (W1 in FP8)"), buf({E, ZW / 128, H / 128}, 4, "W1's scales")});
    f.w2q = sum({buf({E, H, I}, 1, "E*H*I (W2 in FP8)"), buf({E, H / 128, I / 128}, 4, "W2's scales")});
    f.w2q_t = fp8_backward_reads_w2_t(c) ? f.w2q : 0;
    f.partial = buf({N, (I + 63) / 64}, 4, "N*I/64 (dgated partials: one per row and N tile of 64 or more)");
    if (c.weight_grad_precision == Precision::fp8_blockwise) {
      f.wg2 = sum({fp8_segment_bytes(N, E, H, "H*N (dO^T in FP8)"), fp8_segment_bytes(N, E, I, "I*N (As^T in FP8)")});
      f.wg1 = sum({fp8_segment_bytes(N, E, ZW, "z_width*N (dZ^T in FP8)"), fp8_segment_bytes(N, E, H, "H*N (X^T in FP8)")});
    }
  }
  return f;
}

// The fp8_blockwise passes, the cuda FP8 layer's buffers (src/cuda/fp8/fp8_layer.cu; the CPU reference holds fp32
// dequantised copies of its operands on top: the host guard is a lower bound there).
// Forward beyond the routing and the saved FP8 Z: W1 quantised with X's codes and A (bf16; step 4), and a bf16 Z
// where the training forward quantises Z after the GEMM (gemm::fp8_z_in_epilogue false) until Z is quantised; A with
// Aq, W2 quantised with Aq and Y (step 5), Y with the output. The training forward's transposed copies (its saved
// state, w_saved: W1^T, and W2^T where the backward reads it) are counted from the start (W2^T is made at step 5: an
// upper bound before).
// Backward beyond the saved state: dscore; the transposed weights are the saved state's (or the caller's), or, when
// the backward quantises them itself, both copies at once (the normal ones dropped at once) and the transposed ones
// through steps 7-10; dZ in bf16 (step 7 reads the saved FP8 Z itself) through step 9, dZq through step 10a; As with
// dOq and the partials (step 7), As with dW2 (step 8; and FP8 weight gradients' copies of dO and As); dX with dXe
// (step 10a), then with dW1 (step 9; and the copies of dZ and X); step 11 after the FP8 buffers are gone.
std::int64_t fp8_forward_scratch(const Footprint& f, std::int64_t z_bf16) {
  return std::max({sum({f.w1q, f.x_up, z_bf16, f.a}), sum({f.a, f.aq}), sum({f.w2q, f.aq, f.y}), sum({f.y, f.out})});
}
std::int64_t fp8_saved_weights(const Footprint& f) { return sum({f.w1q, f.w2q_t}); }
std::int64_t fp8_backward_peak(const Footprint& f, std::int64_t z_bf16, bool quantises) {
  const std::int64_t w = quantises ? sum({f.w1q, f.w2q}) : 0;
  const std::int64_t dw2 = f.dscore_dw2 - f.dscore;
  const std::int64_t steps_7_9 = std::max({sum({f.dzq, f.as, f.xq, f.partial}), sum({f.dzq, f.as, dw2, f.wg2}),
                                           sum({dw2, f.dx, f.dxe, f.dzq}), sum({dw2, f.dx, f.dw1, f.wg1})});
  return sum({f.dscore, std::max({sum({w, w}), sum({w, z_bf16, steps_7_9}), sum({dw2, f.dx, f.dw1, f.router})})});
}

// Peak of backward_steps (src/moe/layer.cpp) beyond the saved state: dZ with AS, then with dX and dXe, then with dX
// and dW1; then step 11 once dZ is gone. Without dZ's buffer when it is written over Z (the consuming overload).
std::int64_t backward_peak(const Footprint& f, bool reuse_z) {
  const std::int64_t dz = reuse_z ? 0 : f.dz;
  const std::int64_t steps_7_10 = std::max({f.as, sum({f.dx, f.dxe}), sum({f.dx, f.dw1})});
  return sum({f.dscore_dw2, std::max(sum({dz, steps_7_10}), sum({f.dx, f.dw1, f.router}))});
}

// Reads the first unsigned number after `key` in a /proc or /sys text file; false when absent.
bool read_number(const char* path, const char* key, unsigned long long* out) {
  std::FILE* f = std::fopen(path, "r");  // stdio, not iostreams: see the note in sonicmoe/error.h
  if (!f) return false;
  char line[256];
  bool found = false;
  const std::size_t n = std::strlen(key);
  while (!found && std::fgets(line, sizeof line, f))
    if (std::strncmp(line, key, n) == 0) found = std::sscanf(line + n, " %llu", out) == 1;
  std::fclose(f);
  return found;
}

}  // namespace

std::int64_t max_pairs(const MoEConfig& cfg, std::int64_t T, const RoutingSpec& spec) {
  if (spec.mode == RoutingMode::general) {
    SONICMOE_CHECK(spec.token.given() && spec.token.ndim == 1, "sonicmoe: general routing needs spec.token, int32 [N] ",
                   "(its length is the number of pairs N), got shape ", spec.token.shape_str());
    return spec.token.shape[0];
  }
  const std::int64_t topk = checked_mul(T, cfg.top_k, "T*K (pairs)");
  if (spec.mode == RoutingMode::topk || spec.mode == RoutingMode::round_down) return topk;
  SONICMOE_CHECK(spec.tile >= 1, "sonicmoe: spec.tile = ", spec.tile, ", expected >= 1");
  // An expert keeps at most T rows, and rounding adds fewer than `tile` rows to its top-K count.
  const std::int64_t all = checked_mul(T, cfg.num_experts, "T*E (pairs)");
  const std::int64_t extra = cfg.num_experts * std::min(spec.tile - 1, T);  // <= all: cannot overflow
  return topk > all - extra ? all : topk + extra;
}

void check_index_limits(const char* fn, const MoEConfig& cfg, std::int64_t T, std::int64_t N, const char* n_desc) {
  SONICMOE_CHECK(T <= kMaxRows, "sonicmoe::", fn, ": T = ", T, " tokens exceeds the limit of ", kMaxRows,
                 " (the kernels index rows with int32)");
  SONICMOE_CHECK(N <= kMaxRows, "sonicmoe::", fn, ": the number of (token, expert) pairs N = ", n_desc, " = ", N,
                 " exceeds the limit of ", kMaxRows, " (the kernels index rows with int32; T = ", T,
                 ", K = ", cfg.top_k, ", E = ", cfg.num_experts, ")");
  // With rows <= kMaxRows and widths <= kMaxDim (validate_config), every element offset (row * width, at most
  // 2^62) fits the kernels' int64 offsets; the GEMM tile counts (int) stay far below 2^31 for any buffer that fits
  // in memory (a tile covers 128 x 256 elements).
}

const char* pairs_desc(RoutingMode mode) {
  if (mode == RoutingMode::general) return "spec.token's length";
  if (mode == RoutingMode::topk || mode == RoutingMode::round_down) return "T*K";
  return "T*K + E*(tile-1) at most (token rounding)";
}

std::size_t routing_bytes(const MoEConfig& cfg, std::int64_t T, std::int64_t N, RoutingMode mode) {
  return static_cast<std::size_t>(route_bytes(cfg, T, N, mode));
}

std::size_t layer_bytes(const MoEConfig& cfg, std::int64_t T, std::int64_t N, DType dtype, RoutingMode mode,
                        MemoryPass pass, bool reuse_z, bool fp8_backward_quantises) {
  const Footprint f = footprint(cfg, T, N, dtype, mode);
  std::int64_t b = 0;
  if (cfg.precision == Precision::fp8_blockwise) {
    const std::int64_t z_bf16 = buf({N, cfg.z_width()}, static_cast<std::int64_t>(dtype_size(dtype)), "N*z_width (Z)");
    const std::int64_t saved = sum({f.routing, f.z, fp8_saved_weights(f)});  // the training forward's state
    const std::int64_t z_pass = cuda::gemm::fp8_z_in_epilogue() ? 0 : z_bf16;
    const std::int64_t bwd = fp8_backward_peak(f, z_bf16, fp8_backward_quantises);
    switch (pass) {
      case MemoryPass::forward: b = sum({saved, fp8_forward_scratch(f, z_pass)}); break;
      case MemoryPass::inference: b = sum({f.routing, fp8_forward_scratch(f, 0)}); break;
      case MemoryPass::backward: b = bwd; break;
      case MemoryPass::forward_backward: b = sum({saved, std::max(fp8_forward_scratch(f, z_pass), sum({f.out, bwd}))});
        break;
    }
    return static_cast<std::size_t>(b);
  }
  const std::int64_t fwd_peak = sum({f.y, std::max(f.a, f.out)});  // Y with A, then Y with the output
  switch (pass) {
    case MemoryPass::forward: b = sum({f.routing, f.z, fwd_peak}); break;
    case MemoryPass::inference:  // Z is scratch: Z with A, A with Y, Y with the output
      b = sum({f.routing, std::max({sum({f.z, f.a}), sum({f.a, f.y}), sum({f.y, f.out})})});
      break;
    case MemoryPass::backward: b = backward_peak(f, reuse_z); break;
    case MemoryPass::forward_backward:
      b = sum({f.routing, f.z, std::max(fwd_peak, sum({f.out, backward_peak(f, reuse_z)}))});
      break;
  }
  return static_cast<std::size_t>(b);
}

std::size_t available_host_memory() {
  unsigned long long kb = 0, v = 0;
  std::size_t avail = SIZE_MAX;
  if (read_number("/proc/meminfo", "MemAvailable:", &kb)) {
    avail = static_cast<std::size_t>(kb) * 1024;
  } else {
    const long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (pages > 0 && page > 0) avail = static_cast<std::size_t>(pages) * static_cast<std::size_t>(page);
  }
  // A container's cgroup (v2) limit binds before the host's memory: its room is the limit less what is in use,
  // not counting inactive page cache, which the kernel reclaims first.
  unsigned long long limit = 0, used = 0;
  if (read_number("/sys/fs/cgroup/memory.max", "", &limit) && read_number("/sys/fs/cgroup/memory.current", "", &used)) {
    if (read_number("/sys/fs/cgroup/memory.stat", "inactive_file", &v)) used -= std::min(used, v);
    avail = std::min<std::size_t>(avail, limit > used ? limit - used : 0);
  }
  // An address-space limit (ulimit -v) binds too: the room is the limit less the address space already mapped.
  struct rlimit as {};
  if (getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    unsigned long long vm_kb = 0;
    read_number("/proc/self/status", "VmSize:", &vm_kb);
    const unsigned long long mapped = vm_kb * 1024;
    avail = std::min<std::size_t>(avail, as.rlim_cur > mapped ? as.rlim_cur - mapped : 0);
  }
  return avail;
}

void check_host_memory(const char* fn, const MoEConfig& cfg, std::int64_t T, std::size_t need, const char* what) {
  const std::size_t avail = available_host_memory();
  const double gib = 1024.0 * 1024.0 * 1024.0;
  SONICMOE_CHECK(need <= avail, "sonicmoe::", fn, ": not enough host memory: T = ", T, ", H = ", cfg.hidden_size,
                 ", I = ", cfg.intermediate_size, ", E = ", cfg.num_experts, ", K = ", cfg.top_k, " needs about ",
                 need, " bytes (", static_cast<double>(need) / gib, " GiB) for ", what, ", but ", avail, " bytes (",
                 static_cast<double>(avail) / gib, " GiB) are available; use a smaller T or fewer experts/sizes");
}

}  // namespace sonicmoe::limits

namespace sonicmoe {

std::size_t moe_memory_estimate(const MoEConfig& cfg, std::int64_t T, DType dtype, const RoutingSpec& spec,
                                MemoryPass pass) {
  validate_config(cfg);
  SONICMOE_CHECK(T >= 1, "sonicmoe::moe_memory_estimate: T = ", T, ", expected T >= 1");
  SONICMOE_CHECK(is_16bit_float(dtype) || dtype == DType::f32, "sonicmoe::moe_memory_estimate: dtype ",
                 dtype_name(dtype), ", expected bf16, f16 or f32");
  SONICMOE_CHECK(spec.mode == RoutingMode::topk || spec.mode == RoutingMode::general || is_token_rounding(spec.mode),
                 "sonicmoe::moe_memory_estimate: spec.mode = ", static_cast<int>(spec.mode),
                 " is not a RoutingMode (topk, general, round_down, round_up, round_nearest)");
  const int p = static_cast<int>(pass);
  SONICMOE_CHECK(p >= static_cast<int>(MemoryPass::forward) && p <= static_cast<int>(MemoryPass::inference),
                 "sonicmoe::moe_memory_estimate: pass = ", p,
                 " is not a MemoryPass (forward, backward, forward_backward, inference)");
  const std::int64_t N = limits::max_pairs(cfg, T, spec);
  limits::check_index_limits("moe_memory_estimate", cfg, T, N, limits::pairs_desc(spec.mode));
  return limits::layer_bytes(cfg, T, N, dtype, spec.mode, pass, /*reuse_z=*/false);
}

}  // namespace sonicmoe
