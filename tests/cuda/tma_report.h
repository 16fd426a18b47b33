// What the TMA encoder reports for the descriptors made since the last check (tests of the host-side refusals).
#pragma once

#include <string>

#include "cuda/gemm/tma_encode.h"
#include "sonicmoe/error.h"

namespace sonicmoe::testing_util {

// The sonicmoe::Error message of tma::check_encoded(what) (which consumes the pending failure), or "" if none.
inline std::string tma_encode_report(const char* what) {
  try {
    cuda::tma::check_encoded(what);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace sonicmoe::testing_util
