#!/usr/bin/env bash
# Stages the ORIGINAL SonicMoE (PyPI `sonic-moe`) and the packages it needs beyond what the GPU machine's image
# already has, as files under .orig/ at the repository root (git-ignored), so that a GPU machine WITHOUT network
# can install it (python/bench/install_original.sh) and python/bench/compare.py can run it side by side.
#
# Run from anywhere on a machine WITH PyPI access:   bash python/bench/stage_original.sh
#
# Result (about 57 MiB in all):
#   .orig/sonic_moe-0.1.2.post1-py3-none-any.whl                     the original (pure Python: CuTe DSL + Triton)
#   .orig/quack_kernels-0.4.1-py3-none-any.whl                        its grouped GEMMs (pure Python)
#   .orig/nvidia_cutlass_dsl-4.4.2-py3-none-any.whl                   metadata only (depends on -libs-base)
#   .orig/apache_tvm_ffi-0.1.15.post2-cp312-...manylinux_2_28_x86_64.whl
#   .orig/torch_c_dlpack_ext-0.1.5-cp312-...manylinux_2_28_x86_64.whl
#   .orig/cutlass_dsl_libs.tar.xz                                     nvidia-cutlass-dsl-libs-base 4.4.2, unpacked
#                                                                     (the wheel is 74 MB; xz brings it to ~52 MB)
#   .orig/parameterized-0.9.0-py2.py3-none-any.whl                    what the original's tests import
#   .orig/tests/{__init__,test_commons,moe_test,count_cumsum_test}.py the original's tests (run_original_tests.sh)
#   .orig/SHA256SUMS
# The versions are pinned: sonic-moe 0.1.2.post1 requires nvidia-cutlass-dsl==4.4.2 exactly.
# Not staged (already in the GPU image): torch 2.11 (sonic-moe's metadata says torch<=2.9.1; installed with
# --no-deps, so nothing enforces it), triton, cuda-bindings (the `cuda.bindings` module the DSL imports),
# einops, numpy, typing-extensions, packaging.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
DEST="$ROOT/.orig"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# CPython 3.12 on x86-64 Linux, as on the GPU machine. pip matches each manylinux tag exactly, so list several;
# the pure-Python wheels (py3-none-any) resolve under these flags too.
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64)
SMALL=(sonic-moe==0.1.2.post1 quack-kernels==0.4.1 nvidia-cutlass-dsl==4.4.2 apache-tvm-ffi==0.1.15.post2
       torch-c-dlpack-ext==0.1.5 parameterized==0.9.0)
# The original's own tests (not in its wheel), from its repository at a pinned commit of the 0.1.2 line, for
# python/bench/run_original_tests.sh (they run against this library there; they are not part of this repository).
TESTS_COMMIT=8565e849c08082e12dbeb7a9de035108a60fe1b2
TESTS=(__init__.py test_commons.py moe_test.py count_cumsum_test.py)
LIBS=nvidia-cutlass-dsl-libs-base==4.4.2

mkdir -p "$DEST"
grep -qx '/.orig/' .gitignore 2>/dev/null || echo '/.orig/' >> .gitignore

for spec in "${SMALL[@]}"; do
  echo "== stage_original: $spec"
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$DEST" "$spec"
done

# The CuTe DSL compiler and runtime (two large .so files): unpack the wheel and re-pack it with xz. Its layout is
# kept as is (nvidia_cutlass_dsl/{lib,include,python_packages}, its dist-info and .pth): the DSL finds
# lib/libcute_dsl_runtime.so by walking up from python_packages/cutlass/base_dsl/env_manager.py.
if [ ! -f "$DEST/cutlass_dsl_libs.tar.xz" ]; then
  TMP="$(mktemp -d)"
  trap 'rm -rf "$TMP"' EXIT
  echo "== stage_original: $LIBS (download, unpack, re-pack with xz: a few minutes)"
  "$PY" -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/whl" "$LIBS"
  whl=$(ls "$TMP"/whl/nvidia_cutlass_dsl_libs_base-4.4.2-*.whl)
  mkdir -p "$TMP/unpacked"
  "$PY" -m zipfile -e "$whl" "$TMP/unpacked"
  chmod +x "$TMP"/unpacked/nvidia_cutlass_dsl/lib/*.so "$TMP"/unpacked/nvidia_cutlass_dsl/python_packages/cutlass/_mlir/_mlir_libs/*.so
  tar -C "$TMP/unpacked" -cf - . | xz -9 -T2 > "$DEST/cutlass_dsl_libs.tar.xz.part"
  mv "$DEST/cutlass_dsl_libs.tar.xz.part" "$DEST/cutlass_dsl_libs.tar.xz"
  rm -f "$whl"   # the 74 MB wheel itself is not kept
fi

mkdir -p "$DEST/tests"
for f in "${TESTS[@]}"; do
  echo "== stage_original: tests/$f at $TESTS_COMMIT"
  curl -fsSL "https://raw.githubusercontent.com/Dao-AILab/sonic-moe/$TESTS_COMMIT/tests/$f" -o "$DEST/tests/$f"
done

(cd "$DEST" && sha256sum -- *.whl cutlass_dsl_libs.tar.xz > SHA256SUMS)
echo "== stage_original: done"
ls -l "$DEST"
du -sh "$DEST"
