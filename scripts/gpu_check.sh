#!/usr/bin/env bash
# Runs the GPU suites, the benchmarks and the PyTorch binding on an H100/H200 from prebuilt binaries in a
# folder (default dist/, filled by `scripts/gpu_check.sh --stage` on the build machine) and writes the
# logs to OUT (default ./gpu-logs). Usage:
#   bash scripts/gpu_check.sh --stage            # build machine: copy binaries + libsonicmoe.a into dist/
#   OUT=/tmp/logs bash scripts/gpu_check.sh [tests] [bench] [python] [kernels]   # GPU machine
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
DIST="${DIST:-dist}"
if [ "${1:-}" = "--stage" ]; then
  B="${BUILD:-build/default}"
  rm -rf "$DIST" && mkdir -p "$DIST"
  cp "$B"/tests/test_cuda_* "$B"/tests/test_gemm_layouts "$B"/tests/test_reference "$DIST"/ && rm -f "$DIST"/*.cmake
  cp "$B"/tools/sonicmoe-bench* "$B"/src/libsonicmoe.a "$DIST"/
  cp -L "$(g++ -print-file-name=libgomp.so.1)" "$DIST"/ 2>/dev/null || true
  du -sh "$DIST"
  exit 0
fi
OUT="${OUT:-gpu-logs}"
mkdir -p "$OUT"
export LD_LIBRARY_PATH="$ROOT/$DIST:${LD_LIBRARY_PATH:-}"
ALL="$*"
run_step() { WHAT="$1"; [ -z "$ALL" ] || [[ " $ALL " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

if run_step tests; then
  # Whole suites (each binary prints a native stack trace if it crashes).
  for t in "$DIST"/test_reference "$DIST"/test_gemm_layouts "$DIST"/test_cuda_*; do
    timeout 600 "$t" --gtest_brief=1 >"$OUT/$(basename "$t").txt" 2>&1
    rc=$?
    echo "$(basename "$t"): rc=$rc $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/$(basename "$t").txt" | tr '\n' ' ')"
  done | tee "$OUT/tests.txt"
fi
if run_step bench; then
  timeout 400 "$DIST"/sonicmoe-bench --configs-file bench/bench_configs.json --backend cuda \
    --config all --routing topk > "$OUT/bench.txt" 2>"$OUT/bench.err"
  timeout 200 "$DIST"/sonicmoe-bench --configs-file bench/bench_configs.json --backend cuda \
    --config fine-grained-256 --routing topk --routing round-nearest --routing round-up --routing round-down \
    > "$OUT/bench_round.txt" 2>>"$OUT/bench.err"
  cat "$OUT/bench.txt" "$OUT/bench_round.txt"
fi
if run_step kernels; then
  timeout 200 "$DIST"/sonicmoe-bench-routing > "$OUT/bench_routing.txt" 2>&1
  timeout 300 "$DIST"/sonicmoe-bench-gemm > "$OUT/bench_gemm.txt" 2>&1
  timeout 100 "$DIST"/sonicmoe-bench-elementwise > "$OUT/bench_elementwise.txt" 2>&1
  timeout 100 "$DIST"/sonicmoe-bench-quant > "$OUT/bench_quant.txt" 2>&1
fi
if run_step python; then
  (cd python && SONICMOE_CUDA=1 SONICMOE_PREBUILT_LIB="$ROOT/$DIST/libsonicmoe.a" MAX_JOBS=16 \
     python setup.py build_ext --inplace > "$OUT/python_build.txt" 2>&1) || tail -30 "$OUT/python_build.txt"
  PYTHONPATH="$ROOT/python" timeout 400 python -m pytest python/tests -q -rs -p no:cacheprovider > "$OUT/pytest.txt" 2>&1
  tail -15 "$OUT/pytest.txt"
  PYTHONPATH="$ROOT/python" timeout 500 python python/bench/compare.py --iters 5 --impls "${IMPLS:-ours,grouped_mm,original}" \
    --plot "$OUT/compare.png" --json "$OUT/compare.json" > "$OUT/compare.txt" 2>&1
  tail -40 "$OUT/compare.txt"
fi
