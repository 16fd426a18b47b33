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

// Group e's problem: its shape, operand pointers and leading dimensions (C aliases D: never read, beta = 0).
template <class G, class Shape>
__device__ __forceinline__ void set_group(typename G::Arrays& arr, int e, Shape shape, const typename G::Element* a,
                                          const typename G::Element* b, typename G::Element* d, int lda, int ldb,
                                          int ldd) {
  arr.shapes[e] = shape;
  arr.ptr_a[e] = a;
  arr.ptr_b[e] = b;
  arr.ptr_d[e] = d;
  arr.ptr_c[e] = d;
  arr.stride_a[e] = leading_stride<typename G::StrideA>(lda);
  arr.stride_b[e] = leading_stride<typename G::StrideB>(ldb);
  arr.stride_c[e] = leading_stride<typename G::StrideC>(ldd);
  arr.stride_d[e] = leading_stride<typename G::StrideD>(ldd);
}

// varlen-M: group e owns rows [offsets[e], offsets[e+1]) of A and D; B[e] is [n, k] ([k, n] when kBKN).
template <class G, bool kBKN>
__global__ void varlen_m_setup_kernel(typename G::Arrays arr, GroupedArgs args) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= args.groups) return;
  using El = typename G::Element;
  const long long r0 = args.offsets[e];
  set_group<G>(arr, e, cute::make_shape(args.offsets[e + 1] - args.offsets[e], args.n, args.k),
               static_cast<const El*>(args.a) + r0 * args.k,
               static_cast<const El*>(args.b) + static_cast<long long>(e) * args.n * args.k,
               static_cast<El*>(args.d) + r0 * args.n, args.k, kBKN ? args.n : args.k, args.n);
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
  set_group<G>(arr, e, cute::make_shape(rows > 0 ? args.m : 0, args.n, rows),
               static_cast<const El*>(args.a) + r0 * args.m, static_cast<const El*>(args.b) + r0 * args.n,
               static_cast<El*>(args.d) + static_cast<long long>(e) * args.m * args.n, args.m, args.n, args.n);
}

// One grouped GEMM G: its per-group arrays carved from the workspace, filled on the device by `setup`, then run.
template <class G>
void run_grouped(void (*setup)(typename G::Arrays, GroupedArgs), const GroupedArgs& args, void* ws, int sm_count,
                 cudaStream_t stream) {
  typename G::Arrays arr = G::carve(ws, args.groups);
  setup<<<(args.groups + 127) / 128, 128, 0, stream>>>(arr, args);
  SONICMOE_CUDA_CHECK_LAUNCH();
  G::run(arr, args.groups, ws, sm_count, stream);
}

}  // namespace sonicmoe::baselines::detail
