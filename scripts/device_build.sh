#!/usr/bin/env bash
# Builds, on a GPU machine without network, the library (OpenMP off, torch's C++ ABI), sonicmoe-bench and the
# PyTorch extension in place, from headers carried inside the repository (git-ignored):
#   .cutlass/{cute,cutlass}   the CUTLASS/CuTe headers (copy of the pinned nvidia-cutlass wheel's include/)
#   .deps/eigen3/Eigen        Eigen (copy of /usr/include/eigen3)
# or the same two folders as .carry/cutlass.tar.xz and .carry/deps.tar.xz (about 1 MB each; unpacked here).
# Usage: bash scripts/device_build.sh [build-dir]     (default build/device); then PYTHONPATH=python.
#   ALL=1 also builds the test suites and every tool (then `BUILD=<build-dir> bash scripts/gpu_check.sh --stage`);
#   EXTRA="target ..." builds those targets too (e.g. EXTRA=test_cuda_ep).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
B="${1:-build/device}"
JOBS="${JOBS:-$(nproc)}"
[ -d .cutlass ] || tar -xJf .carry/cutlass.tar.xz
[ -d .deps ] || tar -xJf .carry/deps.tar.xz
TESTS=OFF TARGETS=(--target sonicmoe sonicmoe-bench)
[ -n "${EXTRA:-}" ] && TESTS=ON TARGETS+=(${EXTRA})
[ "${ALL:-0}" = 1 ] && TESTS=ON TARGETS=()
ABI=$(python3 -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSONICMOE_BUILD_TESTS=$TESTS -DSONICMOE_OPENMP=OFF \
  -DSONICMOE_CUTLASS_INCLUDE="$ROOT/.cutlass" -DSONICMOE_EIGEN_INCLUDE="$ROOT/.deps/eigen3" \
  -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$ABI" -DCMAKE_CUDA_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$ABI" >/dev/null
cmake --build "$B" -j "$JOBS" "${TARGETS[@]}"
(cd python && SONICMOE_CUDA=1 SONICMOE_PREBUILT_LIB="$ROOT/$B/src/libsonicmoe.a" MAX_JOBS="$JOBS" \
   python3 setup.py build_ext --inplace >/dev/null)
echo "device_build: ok ($B, extension in python/sonicmoe_cpp)"
