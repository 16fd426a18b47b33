#!/usr/bin/env bash
# Installs the ORIGINAL SonicMoE staged under .orig/ (python/bench/stage_original.sh) on a machine WITHOUT network
# (the GPU machine: python3 with torch 2.11, triton, cuda-bindings, einops, numpy already there), into a folder
# of its own, and prints the line that puts it on PYTHONPATH. Nothing is installed into the system site-packages.
#
#   eval "$(bash python/bench/install_original.sh /tmp/orig_site)"     # DIR defaults to /tmp/sonicmoe_orig
#   python3 python/bench/compare.py --impls ours,original ...
#
# Two PYTHONPATH entries are needed: DIR (sonicmoe, quack, tvm_ffi, torch_c_dlpack_ext and the dist-infos) and
# DIR/nvidia_cutlass_dsl/python_packages (the `cutlass` package: the libs wheel puts it there and adds it with a
# .pth file, which Python reads only in site directories, not in a --target folder on PYTHONPATH). Export them
# (rather than editing sys.path in a script): QuACK's autotuner compiles in `python -m quack._compile_worker`
# subprocesses that inherit the environment. The DSL finds its runtime library, DIR/nvidia_cutlass_dsl/lib/
# libcute_dsl_runtime.so, by walking up from the cutlass package, so the unpacked layout must be kept as is.
#
# Only the export line goes to stdout; progress goes to stderr. Env: PYTHON (default python3), ORIG_SRC (default
# <repo>/.orig), ORIG_CHECK=1 to also import the packages afterwards (needs the GPU machine's torch).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PY="${PYTHON:-python3}"
SRC="${ORIG_SRC:-$ROOT/.orig}"
DIR="${1:-/tmp/sonicmoe_orig}"
log() { echo "== install_original: $*" >&2; }

[ -f "$SRC/cutlass_dsl_libs.tar.xz" ] || { log "no $SRC/cutlass_dsl_libs.tar.xz: run python/bench/stage_original.sh on a machine with PyPI access (and carry .orig)"; exit 1; }
if [ -f "$SRC/SHA256SUMS" ] && command -v sha256sum >/dev/null 2>&1; then
  (cd "$SRC" && sha256sum --quiet -c SHA256SUMS) >&2 || { log "checksum mismatch in $SRC"; exit 1; }
fi

mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
whls=("$SRC"/*.whl)
log "pip install --no-deps --no-index --target $DIR (${#whls[@]} wheels)"
PIP_DISABLE_PIP_VERSION_CHECK=1 "$PY" -m pip install -q --no-deps --no-index --no-compile --no-cache-dir \
  --upgrade --target "$DIR" "${whls[@]}" >&2
log "unpacking cutlass_dsl_libs.tar.xz (nvidia-cutlass-dsl-libs-base 4.4.2) into $DIR"
rm -rf "$DIR/nvidia_cutlass_dsl" "$DIR"/nvidia_cutlass_dsl_libs_base-*.dist-info
tar -xJf "$SRC/cutlass_dsl_libs.tar.xz" -C "$DIR"
[ -f "$DIR/nvidia_cutlass_dsl/lib/libcute_dsl_runtime.so" ] || { log "libcute_dsl_runtime.so missing after unpacking"; exit 1; }
[ -d "$DIR/nvidia_cutlass_dsl/python_packages/cutlass" ] || { log "cutlass package missing after unpacking"; exit 1; }

PP="$DIR:$DIR/nvidia_cutlass_dsl/python_packages"
if [ "${ORIG_CHECK:-0}" = 1 ]; then
  log "import check"
  PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}" "$PY" - >&2 <<'EOF'
import torch, cutlass, cutlass.cute, quack, sonicmoe
from sonicmoe import MoE, KernelBackendMoE, moe_TC_softmax_topk_layer, moe_general_routing_inputs
from sonicmoe.enums import ActivationType
print("torch", torch.__version__, "cutlass", cutlass.__version__, "quack", quack.__version__,
      "sonicmoe", sonicmoe.__version__, "cuda", torch.cuda.is_available())
EOF
fi
echo "export PYTHONPATH=\"$PP\${PYTHONPATH:+:\$PYTHONPATH}\""
