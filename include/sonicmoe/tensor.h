// Non-owning tensor views (what every entry point takes) and a small owning Tensor (what entry points
// return: outputs, saved state, gradients). Strides are in elements, as in PyTorch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "sonicmoe/types.h"

namespace sonicmoe {

constexpr int kMaxDims = 4;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<std::int64_t, kMaxDims> shape{};
  std::array<std::int64_t, kMaxDims> stride{};
  Device device{};

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* ptr, DType dt, std::initializer_list<std::int64_t> dims, Device dev = Device::cpu());
  TensorView(void* ptr, DType dt, const std::vector<std::int64_t>& dims, Device dev = Device::cpu());
  // A view with explicit strides (elements).
  static TensorView strided(void* ptr, DType dt, const std::vector<std::int64_t>& dims,
                            const std::vector<std::int64_t>& strides, Device dev = Device::cpu());

  // Optional arguments (biases, the router weight under general routing) are "not given" when ndim == 0.
  bool given() const { return ndim > 0; }
  std::int64_t size(int d) const { return shape[d]; }
  // Both throw Error naming the shape when the count (or bytes, past PTRDIFF_MAX) does not fit: never wrap.
  std::int64_t numel() const;
  std::size_t nbytes() const;
  bool is_contiguous() const;
  std::string shape_str() const;  // "[4, 64, 32]"

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Where device memory comes from. The default CPU allocator is aligned malloc; the default CUDA one is
// stream-ordered cudaMallocAsync (so forward/backward stay capturable in a CUDA graph). The PyTorch
// binding installs one backed by torch's caching allocator.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes, Device device, void* stream) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes, Device device, void* stream) = 0;
};
Allocator* default_allocator();

// Owning, reference-counted tensor: contiguous, freed through the allocator that made it.
class Tensor {
 public:
  Tensor() = default;
  static Tensor empty(const std::vector<std::int64_t>& shape, DType dtype, Device device = Device::cpu(),
                      Allocator* alloc = nullptr, void* stream = nullptr);
  // Filled with zeros (memset / cudaMemsetAsync on `stream`).
  static Tensor zeros(const std::vector<std::int64_t>& shape, DType dtype, Device device = Device::cpu(),
                      Allocator* alloc = nullptr, void* stream = nullptr);

  bool defined() const { return static_cast<bool>(storage_) || view_.ndim > 0; }
  const TensorView& view() const { return view_; }
  operator TensorView() const { return view_; }  // NOLINT: views are what every entry point takes
  void* data() const { return view_.data; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(view_.data); }
  DType dtype() const { return view_.dtype; }
  Device device() const { return view_.device; }
  int ndim() const { return view_.ndim; }
  std::int64_t size(int d) const { return view_.shape[d]; }
  std::int64_t numel() const { return view_.numel(); }
  std::size_t nbytes() const { return view_.nbytes(); }

  // Same storage, new shape of equal element count (e.g. [T, K] -> [T*K]).
  Tensor reshape(const std::vector<std::int64_t>& shape) const;
  // A contiguous tensor of `shape` and `dtype` that starts `byte_offset` bytes into this one's memory and
  // shares (keeps alive) its storage: one allocation carved into several arrays. Bounds and alignment checked.
  Tensor carve(std::size_t byte_offset, const std::vector<std::int64_t>& shape, DType dtype) const;
  // Copy to another device (tests, CLIs): synchronous cudaMemcpy; synchronise the producing stream first.
  Tensor to(Device device) const;

 private:
  std::shared_ptr<void> storage_;
  TensorView view_;
};

// Copies between views of equal shape and dtype on any devices (contiguous only). Synchronous.
void copy(const TensorView& dst, const TensorView& src);
// Same, ordered on `stream` (cudaMemcpyAsync) when either side is on a GPU; a plain memcpy otherwise.
void copy_async(const TensorView& dst, const TensorView& src, void* stream);

}  // namespace sonicmoe
