// The precision gate of issue 27 (cosine >= 0.997, relative RMS error < 7.6%) as the FP8 layer suites check and print
// it (CPU: test_fp8_layer.cpp, GPU: cuda/test_fp8_layer_cuda.cpp): a metric, the bound it is held to, one item of a
// gate line.
#pragma once

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace sonicmoe::testing_util {

struct GateMetric {
  double cosine, rel_rms;
};

struct GateBound {
  double min_cosine, max_rel_rms;
  const char* why;  // nullptr: the gate itself
};
constexpr GateBound kGate{0.997, 0.076, nullptr};

// Appends "  <what> cos <cosine> rrms <rel_rms>%" to line; where hold, expects m within b (the failure names the
// problem, the metric and b's reason) and appends " <what>" to missed if m misses the gate itself.
inline void gate_item(const std::string& name, const char* what, const GateMetric& m, const GateBound& b, bool hold,
                      std::string& line, std::string& missed) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "  %s cos %.5f rrms %.2f%%", what, m.cosine, 100 * m.rel_rms);
  line += buf;
  if (!hold) return;
  EXPECT_GE(m.cosine, b.min_cosine) << name << " " << what << (b.why ? std::string(": ") + b.why : "");
  EXPECT_LT(m.rel_rms, b.max_rel_rms) << name << " " << what << (b.why ? std::string(": ") + b.why : "");
  if (m.cosine < kGate.min_cosine || m.rel_rms >= kGate.max_rel_rms) missed += std::string(" ") + what;
}

}  // namespace sonicmoe::testing_util
