// The CUDA FP8 quantisers (src/cuda/quant/) against the CPU reference, bitwise (codes and scales), at awkward sizes
// (rows not a multiple of 128, K = 128k + 64, E = 3, empty inputs), bf16 and f32 inputs, values of every magnitude,
// NaN / inf blocks; outputs are poisoned first so an element left unwritten fails. Argument checks of the cuda
// backend. Skips without a GPU.
#include <cuda_runtime.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/fp8_e4m3.h"
#include "error_of.h"
#include "fp8_test_data.h"
#include "cuda/gpu_test_util.h"
#include "cuda/quant/quant.h"
#include "sonicmoe/quant.h"

namespace {

using namespace sonicmoe;
using sonicmoe::testing::bitwise_equal;
using testing_util::error_of;
using testing_util::fp8_test_input;
using testing_util::set_value;

Context gpu(cudaStream_t stream = nullptr) {
  Context c;
  c.backend = Backend::cuda;
  c.stream = stream;
  return c;
}
const Context kCpu{};

// A device tensor of `shape` filled with the byte 0xcd (not a code or scale any quantiser writes).
Tensor poisoned(const std::vector<std::int64_t>& shape, DType dt) {
  Tensor t = Tensor::empty(shape, dt, Device::cuda());
  if (t.nbytes()) EXPECT_EQ(cudaMemset(t.data(), 0xcd, t.nbytes()), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // done before a kernel on a non-blocking stream writes it
  return t;
}

// Index of the first differing byte, for the failure message.
std::string first_difference(const Tensor& a_dev, const Tensor& b) {
  Tensor a = a_dev.to(Device::cpu());
  const auto* pa = static_cast<const std::uint8_t*>(a.data());
  const auto* pb = static_cast<const std::uint8_t*>(b.data());
  for (std::size_t i = 0; i < b.nbytes(); ++i)
    if (pa[i] != pb[i]) {
      std::ostringstream s;
      s << "first difference at byte " << i << ": gpu " << int(pa[i]) << ", cpu " << int(pb[i]);
      return s.str();
    }
  return "equal";
}
#define EXPECT_SAME(gpu_t, cpu_t, what) \
  EXPECT_TRUE(bitwise_equal(gpu_t, cpu_t)) << what << ": " << first_difference(gpu_t, cpu_t)

std::string dims(DType dt, std::initializer_list<std::int64_t> d) {
  std::string s = dtype_name(dt);
  for (std::int64_t v : d) s += " " + std::to_string(v);
  return s;
}

// NaN, +inf and -inf at a few positions of x (a host tensor of n elements).
void add_non_finite(const Tensor& x, std::int64_t n) {
  if (n < 3) return;
  set_value(x, n / 3, std::numeric_limits<float>::quiet_NaN());
  set_value(x, n / 2, std::numeric_limits<float>::infinity());
  set_value(x, n - 1, -std::numeric_limits<float>::infinity());
}

void check_rows(DType dt, std::int64_t T, std::int64_t K, const std::vector<std::int32_t>* idx, bool non_finite,
                std::uint32_t seed, cudaStream_t stream = nullptr) {
  SCOPED_TRACE(dims(dt, {T, K}) + (idx ? " gathered" : "") + (non_finite ? " non-finite" : ""));
  Tensor x = fp8_test_input({T, K}, dt, seed);
  if (non_finite) add_non_finite(x, T * K);
  const std::int64_t M = idx ? static_cast<std::int64_t>(idx->size()) : T, nb = fp8_num_blocks(K);
  Tensor rows;
  if (idx) {
    rows = Tensor::empty({M}, DType::i32);
    if (M > 0) std::memcpy(rows.data(), idx->data(), M * 4);
  }
  Tensor q = Tensor::empty({M, K}, DType::f8e4m3), s = Tensor::empty({M, nb}, DType::f32);
  fp8_quantize_rows(kCpu, x, rows, q, s);
  Tensor qd = poisoned({M, K}, DType::f8e4m3), sd = poisoned({M, nb}, DType::f32);
  // The device inputs outlive the kernel (their stream-ordered frees run on the legacy stream, not on `stream`).
  Tensor xd = x.to(Device::cuda()), rows_d = idx ? rows.to(Device::cuda()) : Tensor{};
  fp8_quantize_rows(gpu(stream), xd, rows_d, qd, sd);
  if (stream) ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_SAME(qd, q, "q");
  EXPECT_SAME(sd, s, "scale");
}

void check_cols(DType dt, std::int64_t M, std::int64_t K, bool non_finite, std::uint32_t seed) {
  SCOPED_TRACE(dims(dt, {M, K}) + (non_finite ? " non-finite" : ""));
  Tensor x = fp8_test_input({M, K}, dt, seed);
  if (non_finite) add_non_finite(x, M * K);
  const std::int64_t nb = fp8_num_blocks(M);
  Tensor qt = Tensor::empty({K, M}, DType::f8e4m3), st = Tensor::empty({K, nb}, DType::f32);
  fp8_quantize_cols_transposed(kCpu, x, qt, st);
  Tensor qd = poisoned({K, M}, DType::f8e4m3), sd = poisoned({K, nb}, DType::f32);
  fp8_quantize_cols_transposed(gpu(), x.to(Device::cuda()), qd, sd);
  EXPECT_SAME(qd, qt, "q_t");
  EXPECT_SAME(sd, st, "scale_t");
}

void check_blocks(DType dt, std::int64_t E, std::int64_t N, std::int64_t K, bool with_t, bool non_finite,
                  std::uint32_t seed) {
  SCOPED_TRACE(dims(dt, {E, N, K}) + (with_t ? " with q_t" : "") + (non_finite ? " non-finite" : ""));
  Tensor w = fp8_test_input({E, N, K}, dt, seed);
  if (non_finite) add_non_finite(w, E * N * K);
  const std::int64_t nbn = fp8_num_blocks(N), nbk = fp8_num_blocks(K);
  Tensor q = Tensor::empty({E, N, K}, DType::f8e4m3), qt = Tensor::empty({E, K, N}, DType::f8e4m3);
  Tensor s = Tensor::empty({E, nbn, nbk}, DType::f32);
  fp8_quantize_blocks(kCpu, w, q, qt, s);
  Tensor qd = poisoned({E, N, K}, DType::f8e4m3), qtd = poisoned({E, K, N}, DType::f8e4m3),
         sd = poisoned({E, nbn, nbk}, DType::f32);
  fp8_quantize_blocks(gpu(), w.to(Device::cuda()), qd, with_t ? TensorView(qtd) : TensorView{}, sd);
  EXPECT_SAME(qd, q, "q");
  EXPECT_SAME(sd, s, "scale");
  if (with_t) EXPECT_SAME(qtd, qt, "q_t");
}

// check(dt, rows, cols, flag, seed) for bf16 and f32 over every shape with flag false, then the first shape with flag
// true; the seed counts up from `seed` + 1.
template <class Check>
void over_dtypes_and_shapes(std::uint32_t seed, const std::vector<std::pair<std::int64_t, std::int64_t>>& shapes,
                            Check&& check) {
  for (DType dt : {DType::bf16, DType::f32}) {
    for (auto [rows, cols] : shapes) check(dt, rows, cols, false, ++seed);
    check(dt, shapes[0].first, shapes[0].second, true, ++seed);
  }
}

TEST(CudaQuant, RowsMatchReferenceBitwise) {
  SONICMOE_REQUIRE_GPU();
  over_dtypes_and_shapes(10, {{333, 448}, {1, 16}, {130, 128}, {257, 2064}, {0, 448}, {4, 0}, {3000, 320}},
                         [](DType dt, std::int64_t T, std::int64_t K, bool non_finite, std::uint32_t seed) {
                           check_rows(dt, T, K, nullptr, non_finite, seed);
                         });
}

// fp8_dequantize_rows to bf16: bitwise the CPU's (a partial block, a scale that is not a power of two), NaN where the
// CPU has NaN (NaN blocks; the two backends' NaN bit patterns differ).
TEST(CudaQuant, DequantiseRowsMatchReferenceBitwise) {
  SONICMOE_REQUIRE_GPU();
  const std::int64_t M = 300, K = 128 * 3 + 16;
  Tensor x = fp8_test_input({M, K}, DType::bf16, 31);
  add_non_finite(x, M * K);
  Tensor q = Tensor::empty({M, K}, DType::f8e4m3), s = Tensor::empty({M, 4}, DType::f32);
  fp8_quantize_rows(kCpu, x, {}, q, s);
  s.ptr<float>()[5] *= 0.7f;
  Tensor out = Tensor::empty({M, K}, DType::bf16), od = poisoned({M, K}, DType::bf16);
  fp8_dequantize_rows(kCpu, q, s, out);
  fp8_dequantize_rows(gpu(), q.to(Device::cuda()), s.to(Device::cuda()), od);
  const Tensor oh = od.to(Device::cpu());
  std::int64_t nans = 0;
  for (std::int64_t i = 0; i < M * K; ++i) {
    const bf16 g = oh.ptr<const bf16>()[i], c = out.ptr<const bf16>()[i];
    const bool gn = std::isnan(bf16_to_float(g)), cn = std::isnan(bf16_to_float(c));
    ASSERT_EQ(gn, cn) << "element " << i;
    nans += cn;
    if (!cn) ASSERT_EQ(std::memcmp(&g, &c, sizeof(bf16)), 0) << "element " << i;
  }
  EXPECT_GT(nans, 0) << "the NaN blocks";
}

TEST(CudaQuant, GatheredRowsMatchReferenceBitwise) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(5);
  std::vector<std::int32_t> idx(515);
  for (auto& i : idx) i = static_cast<std::int32_t>(rng() % 100);  // repeats, any order
  for (DType dt : {DType::bf16, DType::f32}) {
    check_rows(dt, 100, 448, &idx, false, 21);
    check_rows(dt, 100, 448, &idx, true, 22);
    std::vector<std::int32_t> none;
    check_rows(dt, 100, 448, &none, false, 23);
  }
}

// fp8_quantize_rows_scatter (the FP8 up-projection's X in the routing's row order): row rev[p] of each pair p of
// token t holds the CPU quantiser's blocks of x[t], bitwise; pairs without a row (rev -1) write nothing, and rows
// no pair names (a capacity's dropped rows) keep their poison. Tokens with 0-3 pairs, rows in a shuffled order,
// K = 3 * 128 + 64 (a partial block), non-finite blocks.
TEST(CudaQuant, ScatteredRowsMatchReferenceBitwise) {
  SONICMOE_REQUIRE_GPU();
  std::mt19937 rng(7);
  const std::int64_t T = 101, K = 448, nb = fp8_num_blocks(K);
  Tensor x = fp8_test_input({T, K}, DType::bf16, 51);
  add_non_finite(x, T * K);
  std::vector<std::int32_t> toff(T + 1, 0), pair_token;
  for (std::int64_t t = 0; t < T; ++t) {
    const int n = static_cast<int>(rng() % 4);
    for (int k = 0; k < n; ++k) pair_token.push_back(static_cast<std::int32_t>(t));
    toff[t + 1] = toff[t] + n;
  }
  const std::int64_t P = static_cast<std::int64_t>(pair_token.size()), N = P + 9;  // 9 rows no pair names
  std::vector<std::int32_t> row_of(N);
  for (std::int64_t r = 0; r < N; ++r) row_of[r] = static_cast<std::int32_t>(r);
  std::shuffle(row_of.begin(), row_of.end(), rng);
  std::vector<std::int32_t> rev(P), token_of_row(N, -1);
  for (std::int64_t p = 0; p < P; ++p) {
    rev[p] = p % 7 == 3 ? -1 : row_of[p];  // every 7th pair dropped
    if (rev[p] >= 0) token_of_row[rev[p]] = pair_token[p];
  }
  auto i32 = [](const std::vector<std::int32_t>& v) {
    Tensor t = Tensor::empty({static_cast<std::int64_t>(v.size())}, DType::i32);
    if (!v.empty()) std::memcpy(t.data(), v.data(), v.size() * 4);
    return t;
  };
  Tensor qd = poisoned({N, K}, DType::f8e4m3), sd = poisoned({N, nb}, DType::f32);
  Tensor xd = x.to(Device::cuda()), toff_d = i32(toff).to(Device::cuda()), rev_d = i32(rev).to(Device::cuda());
  cuda::fp8_quantize_rows_scatter(gpu(), xd, toff_d, rev_d, qd, sd);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Tensor q = qd.to(Device::cpu()), s = sd.to(Device::cpu());
  Tensor qr = Tensor::empty({T, K}, DType::f8e4m3), sr = Tensor::empty({T, nb}, DType::f32);
  fp8_quantize_rows(kCpu, x, {}, qr, sr);
  std::int64_t written = 0;
  for (std::int64_t r = 0; r < N; ++r) {
    const std::int32_t t = token_of_row[r];
    const auto* qrow = q.ptr<std::uint8_t>() + r * K;
    const auto* srow = s.ptr<float>() + r * nb;
    if (t < 0) {  // untouched
      for (std::int64_t c = 0; c < K; ++c) ASSERT_EQ(qrow[c], 0xcd) << "row " << r << " written";
      continue;
    }
    ++written;
    ASSERT_EQ(std::memcmp(qrow, qr.ptr<std::uint8_t>() + t * K, K), 0) << "row " << r << " (token " << t << ")";
    ASSERT_EQ(std::memcmp(srow, sr.ptr<float>() + t * nb, nb * 4), 0) << "scales of row " << r;
  }
  EXPECT_GT(written, T);
}

TEST(CudaQuant, RowsOnAStreamOfTheCaller) {
  SONICMOE_REQUIRE_GPU();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  check_rows(DType::bf16, 777, 1088, nullptr, false, 31, stream);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The GPU cannot validate row indices without a host sync: one outside x becomes a NaN row.
TEST(CudaQuant, GatheredRowOutsideInputIsNaN) {
  SONICMOE_REQUIRE_GPU();
  const std::int64_t T = 8, K = 200 + 56;
  Tensor x = fp8_test_input({T, K}, DType::bf16, 41);
  Tensor rows = Tensor::empty({3}, DType::i32);
  rows.ptr<std::int32_t>()[0] = 2, rows.ptr<std::int32_t>()[1] = -1, rows.ptr<std::int32_t>()[2] = 8;
  Tensor qd = poisoned({3, K}, DType::f8e4m3), sd = poisoned({3, 2}, DType::f32);
  fp8_quantize_rows(gpu(), x.to(Device::cuda()), rows.to(Device::cuda()), qd, sd);
  Tensor q = qd.to(Device::cpu()), s = sd.to(Device::cpu());
  for (std::int64_t r = 1; r < 3; ++r) {
    for (std::int64_t c = 0; c < K; ++c) ASSERT_EQ(q.ptr<std::uint8_t>()[r * K + c], fp8::kE4m3NaN);
    for (int b = 0; b < 2; ++b) {
      EXPECT_EQ(fp8::float_bits(s.ptr<float>()[r * 2 + b]), fp8::kScaleNaNBits);
    }
  }
  Tensor qr = Tensor::empty({1, K}, DType::f8e4m3), sr = Tensor::empty({1, 2}, DType::f32);
  Tensor x2 = Tensor::empty({1, K}, DType::bf16);
  std::memcpy(x2.data(), x.ptr<bf16>() + 2 * K, K * 2);
  fp8_quantize_rows(kCpu, x2, {}, qr, sr);
  EXPECT_EQ(std::memcmp(q.data(), qr.data(), K), 0);
}

TEST(CudaQuant, ColumnsTransposedMatchReferenceBitwise) {
  SONICMOE_REQUIRE_GPU();
  over_dtypes_and_shapes(50, {{208, 448}, {16, 16}, {1040, 336}, {4112, 16}, {0, 64}, {128, 320}, {2000, 1024}},
                         check_cols);
}

TEST(CudaQuant, WeightBlocksMatchReferenceBitwise) {
  SONICMOE_REQUIRE_GPU();
  std::uint32_t seed = 70;
  for (DType dt : {DType::bf16, DType::f32}) {
    for (bool with_t : {true, false}) {
      check_blocks(dt, 3, 208, 448, with_t, false, ++seed);
      check_blocks(dt, 3, 128, 128, with_t, false, ++seed);
      check_blocks(dt, 1, 16, 16, with_t, false, ++seed);
      check_blocks(dt, 2, 400, 320, with_t, false, ++seed);
      check_blocks(dt, 0, 128, 256, with_t, false, ++seed);
      check_blocks(dt, 3, 208, 448, with_t, true, ++seed);
    }
  }
}

TEST(CudaQuant, ArgumentErrorsOfTheCudaBackend) {
  SONICMOE_REQUIRE_GPU();
  using ::testing::HasSubstr;
  Tensor x = Tensor::zeros({4, 200}, DType::bf16, Device::cuda());
  Tensor q = poisoned({4, 200}, DType::f8e4m3), s = poisoned({4, 2}, DType::f32);
  EXPECT_THAT(error_of([&] { fp8_quantize_rows(gpu(), x, {}, q, s); }),
              ::testing::AllOf(HasSubstr("K (x's row length) = 200"), HasSubstr("multiple of 16")));
  Tensor x2 = Tensor::zeros({4, 256}, DType::bf16, Device::cuda());
  Tensor q2 = poisoned({4, 256}, DType::f8e4m3), s2 = poisoned({4, 2}, DType::f32);
  Tensor q_host = Tensor::empty({4, 256}, DType::f8e4m3);
  EXPECT_THAT(error_of([&] { fp8_quantize_rows(gpu(), x2, {}, q_host, s2); }),
              ::testing::AllOf(HasSubstr("argument 'q'"), HasSubstr("is on cpu")));
  Tensor big = Tensor::zeros({1, 264}, DType::bf16, Device::cuda());
  TensorView shifted(static_cast<char*>(big.data()) + 16, DType::bf16, {1, 256}, Device::cuda());
  TensorView x_misaligned(static_cast<char*>(big.data()) + 2, DType::bf16, {1, 256}, Device::cuda());
  Tensor q1 = poisoned({1, 256}, DType::f8e4m3), s1 = poisoned({1, 2}, DType::f32);
  fp8_quantize_rows(gpu(), shifted, {}, q1, s1);  // 16-byte aligned view: accepted
  EXPECT_THAT(error_of([&] { fp8_quantize_rows(gpu(), x_misaligned, {}, q1, s1); }),
              ::testing::AllOf(HasSubstr("argument 'x'"), HasSubstr("16-byte aligned")));
  Tensor xt = Tensor::zeros({200, 256}, DType::f32, Device::cuda());
  Tensor qt = poisoned({256, 200}, DType::f8e4m3), st = poisoned({256, 2}, DType::f32);
  EXPECT_THAT(error_of([&] { fp8_quantize_cols_transposed(gpu(), xt, qt, st); }),
              HasSubstr("M (q_t's row length) = 200"));
  Tensor w = Tensor::zeros({2, 200, 256}, DType::bf16, Device::cuda());
  Tensor qw = poisoned({2, 200, 256}, DType::f8e4m3), qwt = poisoned({2, 256, 200}, DType::f8e4m3),
         sw = poisoned({2, 2, 2}, DType::f32);
  fp8_quantize_blocks(gpu(), w, qw, {}, sw);  // N = 200 is fine without the transposed copy
  EXPECT_THAT(error_of([&] { fp8_quantize_blocks(gpu(), w, qw, qwt, sw); }),
              HasSubstr("N (q_t's row length) = 200"));
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
