#!/usr/bin/env bash
# Runs the ORIGINAL SonicMoE's own tests (its moe_test.py and count_cumsum_test.py, staged under .orig/tests by
# python/bench/stage_original.sh) against this library, on a GPU machine: `import sonicmoe` resolves to
# sonicmoe_cpp's alias modules (sonicmoe_cpp.original.install(), from a conftest.py), so every `MoE`,
# `KernelBackendMoE`, `enable_quack_gemm`, `count_cumsum` and `ActivationType` the tests use is this library's; the
# reference side of moe_test.py (kernel_backend_moe=KernelBackendMoE.torch) is sonicmoe_cpp.torch_backend. The tests'
# own assertions and tolerances are used as they are.
#
#   PYTHONPATH=python bash python/bench/run_original_tests.sh [pytest args...]     (default: both files, -q)
#
# Needs the built extension (scripts/device_build.sh) and parameterized (installed from .orig into a temp folder).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
SRC="${ORIG_SRC:-$ROOT/.orig}"
PY="${PYTHON:-python3}"
[ -f "$SRC/tests/moe_test.py" ] || { echo "run_original_tests: no moe_test.py in $SRC/tests (run stage_original.sh)" >&2; exit 1; }
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if ! "$PY" -c "import parameterized" 2>/dev/null; then
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install -q --no-deps --no-index --target "$WORK/site" \
    "$SRC"/parameterized-*.whl >&2
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p "$WORK/orig"
cp -r "$SRC/tests" "$WORK/orig/tests"
cat > "$WORK/orig/conftest.py" <<'PYEOF'
import sonicmoe_cpp.original

sonicmoe_cpp.original.install()  # `import sonicmoe` in the tests resolves to this library
PYEOF
cd "$WORK/orig"
if [ $# -eq 0 ]; then set -- ./tests/moe_test.py ./tests/count_cumsum_test.py -q; fi
"$PY" -m pytest -p no:cacheprovider "$@"
