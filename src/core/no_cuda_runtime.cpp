#include "core/device_ops.h"
#include "sonicmoe/error.h"

namespace sonicmoe::devops {

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw Error(std::string(what) + ": sonicmoe was built without CUDA (configure with nvcc on PATH)");
}
}  // namespace

bool cuda_compiled() { return false; }
int cuda_device_count() { return 0; }
void* cuda_malloc_async(std::size_t, int, void*) { no_cuda("cuda allocation"); }
void cuda_free_async(void*, int, void*) {}
void cuda_memset_async(void*, int, std::size_t, int, void*) { no_cuda("cuda memset"); }
void cuda_memcpy(void*, const void*, std::size_t) { no_cuda("cuda copy"); }
void cuda_memcpy_async(void*, const void*, std::size_t, void*) { no_cuda("cuda copy"); }
void cuda_stream_synchronize(int, void*) { no_cuda("cuda synchronize"); }

}  // namespace sonicmoe::devops
