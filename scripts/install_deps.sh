#!/usr/bin/env bash
# Installs what building sonicmoe needs on a fresh Debian/Ubuntu machine (run as root, or with sudo
# available): compilers and CMake tooling from apt, the CUTLASS/CuTe headers from the PyPI wheel
# nvidia-cutlass at the version pinned in third_party/CUTLASS_VERSION. The CUDA toolkit (nvcc) is
# expected on PATH already; without it the CPU backend alone is built.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo"; fi

need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
[ -f /usr/include/eigen3/Eigen/Dense ] || need_apt+=(libeigen3-dev)
[ -d /usr/include/gtest ] || need_apt+=(libgtest-dev)
[ -d /usr/include/gmock ] || need_apt+=(libgmock-dev)
command -v python3 >/dev/null 2>&1 || need_apt+=(python3 python3-pip)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "install_deps: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

version="$(head -n1 "$here/third_party/CUTLASS_VERSION")"
have="$(python3 -c 'import importlib.metadata as m; print(m.version("nvidia-cutlass"))' 2>/dev/null || true)"
if [ "$have" != "$version" ]; then
  echo "install_deps: pip install nvidia-cutlass==$version (headers only, --no-deps)"
  python3 -m pip install -q --no-deps --disable-pip-version-check "nvidia-cutlass==$version" ||
    python3 -m pip install -q --no-deps --disable-pip-version-check --break-system-packages "nvidia-cutlass==$version"
fi
echo "install_deps: ok (cmake $(cmake --version | head -n1 | awk '{print $3}'), nvcc: $(command -v nvcc || echo none), cutlass $version)"
