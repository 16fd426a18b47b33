#!/usr/bin/env bash
# Builds, on a GPU machine without network, the library (OpenMP off, torch's C++ ABI), sonicmoe-bench and the
# PyTorch extension in place, from headers carried inside the repository (git-ignored):
#   .cutlass/{cute,cutlass}   the CUTLASS/CuTe headers (copy of the pinned nvidia-cutlass wheel's include/)
#   .deps/eigen3/Eigen        Eigen (copy of /usr/include/eigen3)
# or the same two folders as .carry/cutlass.tar.xz and .carry/deps.tar.xz (about 1 MB each; unpacked here).
# Usage: bash scripts/device_build.sh [build-dir]     (default build/device); then PYTHONPATH=python.
#   ALL=1 also builds the test suites and every tool (then `BUILD=<build-dir> bash scripts/gpu_check.sh --stage`);
#   EXTRA="target ..." builds those targets too (e.g. EXTRA=test_cuda_ep).
#   LIB_ONLY=1 builds the library alone (no GPU needed, only nvcc: e.g. on the development machine, about 10 minutes
#     on 2 cores; <build-dir>/src/libsonicmoe.a, about 18 MB to carry); on the GPU machine
#   PREBUILT_LIB=<build-dir>/src/libsonicmoe.a then builds only the extension against it (about 40 s instead of about
#     3 minutes; the same torch C++ ABI on both machines).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
B="${1:-build/device}"
JOBS="${JOBS:-$(nproc)}"
if [ -n "${PREBUILT_LIB:-}" ]; then
  [ -f "$PREBUILT_LIB" ] || { echo "device_build: PREBUILT_LIB=$PREBUILT_LIB is not a file" >&2; exit 1; }
  LIB="$(cd "$(dirname "$PREBUILT_LIB")" && pwd)/$(basename "$PREBUILT_LIB")"
  (cd python && SONICMOE_CUDA=1 SONICMOE_PREBUILT_LIB="$LIB" MAX_JOBS="$JOBS" \
     python3 setup.py build_ext --inplace >/dev/null)
  echo "device_build: ok (extension in python/sonicmoe_cpp, against $PREBUILT_LIB)"
  exit 0
fi
[ -d .cutlass ] || tar -xJf .carry/cutlass.tar.xz
[ -d .deps ] || tar -xJf .carry/deps.tar.xz
TESTS=OFF TARGETS=(--target sonicmoe sonicmoe-bench)
[ "${LIB_ONLY:-0}" = 1 ] && TARGETS=(--target sonicmoe)
[ -n "${EXTRA:-}" ] && TESTS=ON TARGETS+=(${EXTRA})
[ "${ALL:-0}" = 1 ] && TESTS=ON TARGETS=()
ABI=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSONICMOE_BUILD_TESTS=$TESTS -DSONICMOE_OPENMP=OFF \
  -DSONICMOE_CUTLASS_INCLUDE="$ROOT/.cutlass" -DSONICMOE_EIGEN_INCLUDE="$ROOT/.deps/eigen3" \
  -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$ABI" -DCMAKE_CUDA_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$ABI" >/dev/null
cmake --build "$B" -j "$JOBS" "${TARGETS[@]}"
[ "${LIB_ONLY:-0}" = 1 ] && { echo "device_build: ok ($B/src/libsonicmoe.a)"; exit 0; }
(cd python && SONICMOE_CUDA=1 SONICMOE_PREBUILT_LIB="$ROOT/$B/src/libsonicmoe.a" MAX_JOBS="$JOBS" \
   python3 setup.py build_ext --inplace >/dev/null)
echo "device_build: ok ($B, extension in python/sonicmoe_cpp)"
