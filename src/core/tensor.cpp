#include "sonicmoe/tensor.h"

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/device_ops.h"
#include "sonicmoe/error.h"

namespace sonicmoe {

namespace {
// Element count of `shape` and its size in bytes of `dtype`, or an Error naming the shape: a product past int64
// (or bytes past PTRDIFF_MAX, the largest object) would otherwise wrap into a small or negative size.
std::int64_t checked_numel(const TensorView& v) {
  std::int64_t n = 1;
  for (int d = 0; d < v.ndim; ++d)
    SONICMOE_CHECK(!__builtin_mul_overflow(n, v.shape[d], &n), "TensorView: shape ", v.shape_str(),
                   " has more elements than fit in int64");
  return n;
}
std::size_t checked_nbytes(const TensorView& v) {
  const std::int64_t n = checked_numel(v);
  std::int64_t b = 0;
  SONICMOE_CHECK(!__builtin_mul_overflow(n, static_cast<std::int64_t>(dtype_size(v.dtype)), &b) &&
                     b <= PTRDIFF_MAX,
                 "TensorView: shape ", v.shape_str(), " of ", dtype_name(v.dtype), " needs more than ", PTRDIFF_MAX,
                 " bytes");
  return static_cast<std::size_t>(b);
}

void fill_contiguous_strides(TensorView& v) {
  std::int64_t s = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.stride[d] = s;
    s *= v.shape[d];  // cannot wrap: set_shape checked the whole product first
  }
}
void set_shape(TensorView& v, const std::int64_t* dims, std::size_t n) {
  const int dt = static_cast<int>(v.dtype);
  SONICMOE_CHECK(dt >= 0 && dt <= static_cast<int>(DType::f16), "TensorView: dtype = ", dt,
                 " is not a DType (bf16, f32, int32, f8e4m3, f16)");
  SONICMOE_CHECK(n >= 1 && n <= static_cast<std::size_t>(kMaxDims), "TensorView: ", n,
                 " dimensions given, expected 1 to ", kMaxDims);
  v.ndim = static_cast<int>(n);
  for (std::size_t i = 0; i < n; ++i) v.shape[i] = dims[i];
  for (std::size_t i = 0; i < n; ++i)
    SONICMOE_CHECK(dims[i] >= 0, "TensorView: negative size ", dims[i], " in dimension ", i, " of shape ",
                   v.shape_str());
  checked_nbytes(v);  // every view describes addressable memory
  fill_contiguous_strides(v);
}

class DefaultAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Device device, void* stream) override {
    if (bytes == 0) return nullptr;
    if (device.is_cuda()) return devops::cuda_malloc_async(bytes, device.index, stream);
    // A direct caller may pass any size: past PTRDIFF_MAX the round-up below would wrap to a tiny block.
    SONICMOE_CHECK(bytes <= static_cast<std::size_t>(PTRDIFF_MAX), "sonicmoe: cannot allocate ", bytes,
                   " bytes of host memory (more than PTRDIFF_MAX)");
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    SONICMOE_CHECK(p != nullptr, "sonicmoe: out of host memory allocating ", bytes, " bytes");
    return p;
  }
  void deallocate(void* ptr, std::size_t, Device device, void* stream) override {
    if (!ptr) return;
    if (device.is_cuda()) devops::cuda_free_async(ptr, device.index, stream);
    else std::free(ptr);
  }
};
}  // namespace

TensorView::TensorView(void* ptr, DType dt, std::initializer_list<std::int64_t> dims, Device dev)
    : data(ptr), dtype(dt), device(dev) {
  set_shape(*this, dims.begin(), dims.size());
}

TensorView::TensorView(void* ptr, DType dt, const std::vector<std::int64_t>& dims, Device dev)
    : data(ptr), dtype(dt), device(dev) {
  set_shape(*this, dims.data(), dims.size());
}

TensorView TensorView::strided(void* ptr, DType dt, const std::vector<std::int64_t>& dims,
                               const std::vector<std::int64_t>& strides, Device dev) {
  TensorView v(ptr, dt, dims, dev);
  SONICMOE_CHECK(strides.size() == dims.size(), "TensorView::strided: ", strides.size(), " strides for ",
                 dims.size(), " dimensions");
  for (std::size_t i = 0; i < strides.size(); ++i) v.stride[i] = strides[i];
  return v;
}

std::int64_t TensorView::numel() const { return ndim == 0 ? 0 : checked_numel(*this); }

// Checked again here: `shape` is a public field, so it may have changed since the constructor.
std::size_t TensorView::nbytes() const { return ndim == 0 ? 0 : checked_nbytes(*this); }

bool TensorView::is_contiguous() const {
  std::int64_t s = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && stride[d] != s) return false;
    s *= shape[d];
  }
  return true;
}

std::string TensorView::shape_str() const {
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

Allocator* default_allocator() {
  static DefaultAllocator a;
  return &a;
}

Tensor Tensor::empty(const std::vector<std::int64_t>& shape, DType dtype, Device device, Allocator* alloc,
                     void* stream) {
  if (!alloc) alloc = default_allocator();
  Tensor t;
  t.view_ = TensorView(nullptr, dtype, shape, device);
  std::size_t bytes = t.view_.nbytes();
  void* p = alloc->allocate(bytes, device, stream);
  // A custom allocator that fails by returning null would otherwise hand out a tensor every write segfaults on.
  SONICMOE_CHECK(p != nullptr || bytes == 0, "Tensor::empty: the allocator returned a null pointer for ", bytes,
                 " bytes (", t.view_.shape_str(), " ", dtype_name(dtype), " on ", device_name(device), ")");
  t.view_.data = p;
  t.storage_ = std::shared_ptr<void>(p, [alloc, bytes, device, stream](void* q) {
    alloc->deallocate(q, bytes, device, stream);
  });
  return t;
}

Tensor Tensor::zeros(const std::vector<std::int64_t>& shape, DType dtype, Device device, Allocator* alloc,
                     void* stream) {
  Tensor t = empty(shape, dtype, device, alloc, stream);
  if (t.nbytes() == 0) return t;
  if (device.is_cuda()) devops::cuda_memset_async(t.data(), 0, t.nbytes(), device.index, stream);
  else std::memset(t.data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::to(Device device) const {
  std::vector<std::int64_t> shape(view_.shape.begin(), view_.shape.begin() + view_.ndim);
  Tensor t = empty(shape, view_.dtype, device);
  copy(t.view(), view_);
  return t;
}

Tensor Tensor::carve(std::size_t byte_offset, const std::vector<std::int64_t>& shape, DType dtype) const {
  Tensor t = *this;
  t.view_ = TensorView(static_cast<char*>(view_.data) + byte_offset, dtype, shape, view_.device);
  SONICMOE_CHECK(byte_offset % dtype_size(dtype) == 0, "Tensor::carve: offset ", byte_offset,
                 " bytes is not aligned to ", dtype_size(dtype), "-byte elements");
  SONICMOE_CHECK(byte_offset <= nbytes() && t.view_.nbytes() <= nbytes() - byte_offset, "Tensor::carve: ",
                 t.view_.shape_str(), " at byte ", byte_offset, " overruns the ", nbytes(), "-byte tensor");
  return t;
}

Tensor Tensor::reshape(const std::vector<std::int64_t>& shape) const {
  Tensor t = *this;
  t.view_ = TensorView(view_.data, view_.dtype, shape, view_.device);
  SONICMOE_CHECK(t.view_.numel() == view_.numel(), "Tensor::reshape: ", view_.shape_str(), " has ", view_.numel(),
                 " elements, ", t.view_.shape_str(), " needs ", t.view_.numel());
  return t;
}

namespace {
void check_copy(const TensorView& dst, const TensorView& src) {
  SONICMOE_CHECK(dst.dtype == src.dtype, "copy: dtype ", dtype_name(src.dtype), " into ", dtype_name(dst.dtype));
  bool same = dst.ndim == src.ndim;
  for (int d = 0; same && d < dst.ndim; ++d) same = dst.shape[d] == src.shape[d];
  SONICMOE_CHECK(same, "copy: shape ", src.shape_str(), " into ", dst.shape_str());
  SONICMOE_CHECK(dst.is_contiguous() && src.is_contiguous(), "copy: both views must be contiguous");
  SONICMOE_CHECK(dst.numel() == 0 || (dst.data != nullptr && src.data != nullptr), "copy: ",
                 dst.data ? "src" : "dst", " has a null data pointer for ", dst.numel(), " elements");
}
}  // namespace

void copy(const TensorView& dst, const TensorView& src) {
  check_copy(dst, src);
  if (src.nbytes() == 0) return;
  if (!dst.device.is_cuda() && !src.device.is_cuda()) std::memcpy(dst.data, src.data, src.nbytes());
  else devops::cuda_memcpy(dst.data, src.data, src.nbytes());
}

void copy_async(const TensorView& dst, const TensorView& src, void* stream) {
  check_copy(dst, src);
  if (src.nbytes() == 0) return;
  if (!dst.device.is_cuda() && !src.device.is_cuda()) std::memcpy(dst.data, src.data, src.nbytes());
  else devops::cuda_memcpy_async(dst.data, src.data, src.nbytes(), stream);
}

}  // namespace sonicmoe
