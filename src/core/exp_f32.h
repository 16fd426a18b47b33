// exp(x) for the router softmaxes, bitwise identical on the host (CPU reference) and the GPU: Cody-Waite
// range reduction and a degree-6 polynomial written with explicit fmaf (no compiler contraction, no
// libm), so the routing that depends on comparing probabilities (top-K scores, token rounding's ranks)
// is the same on both backends. Relative error ~1 ulp; inputs below -86 give 0 (results stay normal).
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define SONICMOE_HD __host__ __device__
#else
#define SONICMOE_HD
#endif

namespace sonicmoe {

SONICMOE_HD inline float exp_f32(float x) {
  if (!(x >= -86.0f)) return 0.0f;  // also NaN -> 0 (logits are checked finite before)
  if (x > 88.0f) x = 88.0f;
  const float n = rintf(x * 1.44269504088896341f);
  float r = fmaf(n, -0.693145751953125f, x);  // ln2 split: hi part exact in few bits
  r = fmaf(n, -1.428606765330187045e-06f, r);
  float p = 1.9875691500e-4f;
  p = fmaf(p, r, 1.3981999507e-3f);
  p = fmaf(p, r, 8.3334519073e-3f);
  p = fmaf(p, r, 4.1665795894e-2f);
  p = fmaf(p, r, 1.6666665459e-1f);
  p = fmaf(p, r, 5.0000001201e-1f);
  const float r2 = r * r;
  float y = fmaf(p, r2, r);
  y = y + 1.0f;
  return ldexpf(y, static_cast<int>(n));
}

}  // namespace sonicmoe
