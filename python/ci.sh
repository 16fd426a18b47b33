#!/usr/bin/env bash
# CI for the PyTorch binding (CPU machine): install torch if missing, build sonicmoe_cpp, run pytest.
# Usage (from anywhere): bash python/ci.sh        Env: PYTHON (default python3), SONICMOE_CUDA (default 0 here:
# the CPU machine cannot run the cuda backend, and skipping the CUTLASS kernels keeps the build short).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# CMake, Ninja, Eigen (and the CUTLASS headers) as for the C++ build, when missing.
if ! command -v cmake >/dev/null 2>&1 || [ ! -f /usr/include/eigen3/Eigen/Dense ]; then
  bash scripts/install_deps.sh
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "== python/ci.sh: installing torch==2.11.0"
  "$PY" -m pip install -q torch==2.11.0
fi
# Build-time and test-time helpers (setuptools' bdist_wheel needs 'wheel' without build isolation).
for mod in wheel pytest numpy; do
  "$PY" -c "import $mod" >/dev/null 2>&1 || "$PY" -m pip install -q "$mod"
done

echo "== python/ci.sh: building sonicmoe_cpp (SONICMOE_CUDA=${SONICMOE_CUDA:-0})"
SONICMOE_CUDA="${SONICMOE_CUDA:-0}" MAX_JOBS="${MAX_JOBS:-2}" \
  "$PY" -m pip install -q --no-build-isolation ./python

echo "== python/ci.sh: pytest python/tests"
# A fresh inductor cache: torch's FX-graph cache does not key on a custom op's schema, so graphs compiled against an
# earlier sonicmoe_cpp (e.g. a backward with fewer state arguments) would be replayed against this one.
TORCHINDUCTOR_CACHE_DIR="$(mktemp -d)"
export TORCHINDUCTOR_CACHE_DIR
set +e
# Run from the repository root so that the installed package (with its _C extension) is imported, not the
# source folder python/sonicmoe_cpp.
"$PY" -m pytest python/tests -q -p no:cacheprovider
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "python/ci.sh: pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
