// An Allocator that counts live and peak bytes of the layer's own allocations (forwarding to default_allocator()),
// for the tests that hold moe_memory_estimate against the measured peak (CPU and GPU).
#pragma once

#include <algorithm>
#include <cstddef>
#include <mutex>

#include "sonicmoe/tensor.h"

namespace sonicmoe::testing_util {

class CountingAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Device d, void* s) override {
    std::lock_guard<std::mutex> g(mu_);
    live_ += bytes;
    peak_ = std::max(peak_, live_);
    return default_allocator()->allocate(bytes, d, s);
  }
  void deallocate(void* p, std::size_t bytes, Device d, void* s) override {
    std::lock_guard<std::mutex> g(mu_);
    live_ -= bytes;
    default_allocator()->deallocate(p, bytes, d, s);
  }
  std::size_t live_ = 0, peak_ = 0;

 private:
  std::mutex mu_;
};

}  // namespace sonicmoe::testing_util
