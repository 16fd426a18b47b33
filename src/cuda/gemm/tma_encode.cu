// The library's one encoder of TMA descriptors (see tma_encode.h for why CuTe is routed here).
#include "cuda/gemm/tma_encode.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "sonicmoe/error.h"

#ifndef CUTLASS_ENABLE_DIRECT_CUDA_DRIVER_CALL
#error "tma_encode.cu must be compiled with the definitions of src/CMakeLists.txt (see tma_encode.h)"
#endif

namespace sonicmoe::cuda::tma {
namespace {

// The failure recorded by the last encode on this thread that failed ("" when none).
std::string& pending() {
  thread_local std::string p;
  return p;
}

int element_bytes(CUtensorMapDataType t) {
  switch (t) {
    case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
    case CU_TENSOR_MAP_DATA_TYPE_UINT16:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
    case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
    case CU_TENSOR_MAP_DATA_TYPE_UINT32:
    case CU_TENSOR_MAP_DATA_TYPE_INT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
    case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
    case CU_TENSOR_MAP_DATA_TYPE_UINT64:
    case CU_TENSOR_MAP_DATA_TYPE_INT64:
    case CU_TENSOR_MAP_DATA_TYPE_FLOAT64: return 8;
    default: return 0;  // packed sub-byte types: the driver checks those
  }
}

template <typename T>
std::string list(const T* v, cuuint32_t n) {
  std::string s = "(";
  for (cuuint32_t i = 0; i < n; ++i) s += (i ? ", " : "") + std::to_string(static_cast<unsigned long long>(v[i]));
  return s + ")";
}

PFN_cuTensorMapEncodeTiled_v12000 driver_encode() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* pfn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &pfn, 12000,
                                                             cudaEnableDefault, &status);
    if (err != cudaSuccess || status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      pfn = nullptr;
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(pfn);
  }();
  return fn;
}

// The driver call needs a current context on this thread, which the runtime binds only lazily: a thread that has
// made no runtime call yet (PyTorch's autograd worker, whose tensors all came from the caching allocator's cache)
// has none, and the encode fails with CUDA_ERROR_INVALID_CONTEXT. cudaSetDevice binds the current device's primary
// context to the calling thread (CUDA 12+).
bool bind_primary_context() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaSetDevice(dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return true;
}

}  // namespace

const char* tiled_precondition_error(CUtensorMapDataType type, cuuint32_t rank, const void* address,
                                     const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                     const cuuint32_t* element_strides, CUtensorMapInterleave interleave) {
  const bool il32 = interleave == CU_TENSOR_MAP_INTERLEAVE_32B;
  const std::uintptr_t align = il32 ? 32 : 16;
  if (rank < 1 || rank > 5) return "rank must be 1 to 5";
  if (address == nullptr) return "the global address is null (an empty or unallocated tensor)";
  if (reinterpret_cast<std::uintptr_t>(address) % align != 0)
    return il32 ? "the global address is not 32-byte aligned" : "the global address is not 16-byte aligned";
  for (cuuint32_t i = 0; i < rank; ++i) {
    if (dims[i] == 0) return "a dimension is 0 (an empty tensor)";
    if (dims[i] > (cuuint64_t{1} << 32)) return "a dimension exceeds 2^32";
    if (box[i] == 0 || box[i] > 256) return "a box dimension is outside 1..256";
    if (element_strides[i] == 0 || element_strides[i] > 8) return "an element stride is outside 1..8";
  }
  for (cuuint32_t i = 0; i + 1 < rank; ++i) {
    if (strides[i] % align != 0) return "a stride (bytes) is not a multiple of 16 (rows not 16-byte aligned)";
    if (strides[i] >= (cuuint64_t{1} << 40)) return "a stride (bytes) reaches 2^40";
  }
  const int eb = element_bytes(type);
  if (eb != 0 && interleave == CU_TENSOR_MAP_INTERLEAVE_NONE && (box[0] * static_cast<cuuint64_t>(eb)) % 16 != 0)
    return "the inner box dimension is not a multiple of 16 bytes";
  return "";
}

void check_encoded(const char* what) {
  std::string& p = pending();
  if (p.empty()) return;
  std::string msg = std::string("sonicmoe: cannot build the TMA descriptor of ") + what + ": " + p;
  p.clear();
  throw Error(msg);
}

}  // namespace sonicmoe::cuda::tma

// Called by CuTe's make_tma_copy through the renaming in src/CMakeLists.txt. Never reports failure to CuTe: a failure
// is recorded for tma::check_encoded and the descriptor is zeroed (a zeroed descriptor is never launched: the launch
// sites check first).
extern "C" CUresult CUDAAPI sonicmoe_tma_encode_tiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank,
                                                      void* address, const cuuint64_t* dims,
                                                      const cuuint64_t* strides, const cuuint32_t* box,
                                                      const cuuint32_t* element_strides,
                                                      CUtensorMapInterleave interleave, CUtensorMapSwizzle swizzle,
                                                      CUtensorMapL2promotion l2, CUtensorMapFloatOOBfill oob) {
  using namespace sonicmoe::cuda::tma;
  std::string why = tiled_precondition_error(type, rank, address, dims, strides, box, element_strides, interleave);
  if (why.empty()) {
    const auto encode = driver_encode();
    if (!encode) {
      why = "the driver entry point cuTensorMapEncodeTiled is unavailable (driver older than CUDA 12?)";
    } else {
      CUresult r = encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob);
      if (r == CUDA_ERROR_INVALID_CONTEXT && bind_primary_context())
        r = encode(map, type, rank, address, dims, strides, box, element_strides, interleave, swizzle, l2, oob);
      if (r != CUDA_SUCCESS) why = "cuTensorMapEncodeTiled returned error " + std::to_string(static_cast<int>(r));
    }
  }
  if (!why.empty()) {
    // strides[] holds rank - 1 entries (the innermost stride is implicitly one element).
    pending() = why + " [address " + sonicmoe::detail::concat(address) + ", dims " + list(dims, rank) + ", byte strides (1 element, " +
                (rank > 1 ? list(strides, rank - 1).substr(1) : std::string(")")) + ", box " + list(box, rank) + "]";
    std::memset(map, 0, sizeof(*map));
  }
  return CUDA_SUCCESS;
}
