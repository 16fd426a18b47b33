// Device kernels that turn `offsets` into the per-group problem shapes, pointers and strides of a
// CUTLASS grouped GEMM (one thread per expert), so group sizes never travel to the host.
#pragma once

#include <cute/tensor.hpp>

namespace sonicmoe::baselines::detail {

// Sets the one dynamic (leading-dimension) mode of a packed CuTe stride (M/N, K, L).
template <class Stride>
__device__ __forceinline__ Stride leading_stride(long long ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// varlen-M: group e owns rows [offsets[e], offsets[e+1]) of A and D; B[e] is [n, k] ([k, n] when kBKN).
template <class G, bool kBKN = false>
__global__ void varlen_m_setup_kernel(typename G::Arrays arr, GroupedArgs args) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= args.groups) return;
  using El = typename G::Element;
  const long long r0 = args.offsets[e];
  const int rows = args.offsets[e + 1] - args.offsets[e];
  arr.shapes[e] = cute::make_shape(rows, args.n, args.k);
  arr.ptr_a[e] = static_cast<const El*>(args.a) + r0 * args.k;
  arr.ptr_b[e] = static_cast<const El*>(args.b) + static_cast<long long>(e) * args.n * args.k;
  arr.ptr_d[e] = static_cast<El*>(args.d) + r0 * args.n;
  arr.ptr_c[e] = arr.ptr_d[e];  // never read (beta = 0)
  arr.stride_a[e] = leading_stride<typename G::StrideA>(args.k);
  arr.stride_b[e] = leading_stride<typename G::StrideB>(kBKN ? args.n : args.k);
  arr.stride_c[e] = leading_stride<typename G::StrideC>(args.n);
  arr.stride_d[e] = leading_stride<typename G::StrideD>(args.n);
}

// varlen-K: group e reduces over its rows: A = P_e^T (P rows [offsets[e], ..) of width m, M-major),
// B = Q_e (width n, N-major), D[e] [m, n]. An empty expert gets an empty problem (zeroed elsewhere).
template <class G>
__global__ void varlen_k_setup_kernel(typename G::Arrays arr, GroupedArgs args) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= args.groups) return;
  using El = typename G::Element;
  const long long r0 = args.offsets[e];
  const int rows = args.offsets[e + 1] - args.offsets[e];
  arr.shapes[e] = cute::make_shape(rows > 0 ? args.m : 0, args.n, rows);
  arr.ptr_a[e] = static_cast<const El*>(args.a) + r0 * args.m;
  arr.ptr_b[e] = static_cast<const El*>(args.b) + r0 * args.n;
  arr.ptr_d[e] = static_cast<El*>(args.d) + static_cast<long long>(e) * args.m * args.n;
  arr.ptr_c[e] = arr.ptr_d[e];
  arr.stride_a[e] = leading_stride<typename G::StrideA>(args.m);
  arr.stride_b[e] = leading_stride<typename G::StrideB>(args.n);
  arr.stride_c[e] = leading_stride<typename G::StrideC>(args.n);
  arr.stride_d[e] = leading_stride<typename G::StrideD>(args.n);
}

}  // namespace sonicmoe::baselines::detail
