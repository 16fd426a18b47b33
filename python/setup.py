"""Builds sonicmoe_cpp: the C++ library (CMake, static libsonicmoe.a) and the torch extension linked to it.

    pip install --no-build-isolation ./python      # from the repository root

Environment:
    SONICMOE_CUDA   auto (default: CUDA when nvcc is found and torch has CUDA), 1 (force), 0 (CPU only)
    SONICMOE_ROOT   the repository root (default: the parent folder of this file)
    MAX_JOBS        parallel build jobs (default: number of cores)
    SONICMOE_CUTLASS_INCLUDE  folder holding cute/ and cutlass/ (passed to CMake; default: the nvidia-cutlass wheel)
    SONICMOE_PREBUILT_LIB     path of a libsonicmoe.a already built by the C++ build (same SONICMOE_CUDA
                              setting, configured with -DSONICMOE_OPENMP=OFF): skip CMake and link it
    SONICMOE_CMAKE_ARGS       extra CMake arguments (space separated)

Without the 'wheel' package (or offline), build in place instead:
    cd python && python setup.py build_ext --inplace && cd .. && export PYTHONPATH=$PWD/python
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

HERE = Path(__file__).resolve().parent
os.chdir(HERE)  # sources are given relative to this folder
ROOT = Path(os.environ.get("SONICMOE_ROOT", HERE.parent)).resolve()
if not (ROOT / "CMakeLists.txt").exists() or not (ROOT / "include" / "sonicmoe" / "moe.h").exists():
    sys.exit(f"sonicmoe_cpp: {ROOT} is not the sonicmoe repository root; set SONICMOE_ROOT")


def _find_nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc:
        return nvcc
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda/bin/nvcc"
    return None


def _want_cuda():
    flag = os.environ.get("SONICMOE_CUDA", "auto").lower()
    nvcc = _find_nvcc()
    if flag in ("0", "off", "false", "no"):
        return False, None
    if flag in ("1", "on", "true", "yes"):
        if not nvcc:
            sys.exit("sonicmoe_cpp: SONICMOE_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        return True, nvcc
    return (nvcc is not None and torch.version.cuda is not None), nvcc


WITH_CUDA, NVCC = _want_cuda()
if WITH_CUDA:
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")  # Hopper; also avoids torch probing for a GPU
JOBS = os.environ.get("MAX_JOBS", str(os.cpu_count() or 2))
ABI = int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))


class CMakeThenExtension(BuildExtension):
    """Configures and builds the static library with CMake in the build temp dir, then links the extension."""

    def build_extensions(self):
        prebuilt = os.environ.get("SONICMOE_PREBUILT_LIB")
        if prebuilt:
            if not Path(prebuilt).is_file():
                sys.exit(f"sonicmoe_cpp: SONICMOE_PREBUILT_LIB={prebuilt} is not a file")
            for ext in self.extensions:
                ext.extra_objects = [str(Path(prebuilt).resolve())] + list(ext.extra_objects or [])
            super().build_extensions()
            return
        cmake_dir = Path(self.build_temp).resolve() / ("sonicmoe-cmake-cuda" if WITH_CUDA else "sonicmoe-cmake-cpu")
        cmake_dir.mkdir(parents=True, exist_ok=True)
        args = [
            "cmake", "-S", str(ROOT), "-B", str(cmake_dir),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DSONICMOE_BUILD_TESTS=OFF", "-DSONICMOE_BUILD_TOOLS=OFF",
            "-DSONICMOE_OPENMP=OFF",  # torch brings its own OpenMP runtime; two in one process can crash
            f"-DSONICMOE_CUDA={'ON' if WITH_CUDA else 'OFF'}",
            f"-DPython3_EXECUTABLE={sys.executable}",
            # The library passes std::string and friends across its API: it must use torch's libstdc++ ABI.
            f"-DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI={ABI}",
            f"-DCMAKE_CUDA_FLAGS=-D_GLIBCXX_USE_CXX11_ABI={ABI}",
        ]
        if WITH_CUDA:
            args.append(f"-DCMAKE_CUDA_COMPILER={NVCC}")
            if os.environ.get("SONICMOE_CUTLASS_INCLUDE"):
                args.append(f"-DSONICMOE_CUTLASS_INCLUDE={os.environ['SONICMOE_CUTLASS_INCLUDE']}")
        args += os.environ.get("SONICMOE_CMAKE_ARGS", "").split()
        if shutil.which("ninja") and not (cmake_dir / "CMakeCache.txt").exists():
            args += ["-G", "Ninja"]
        subprocess.check_call(args)
        subprocess.check_call(["cmake", "--build", str(cmake_dir), "--target", "sonicmoe", "-j", JOBS])
        lib = cmake_dir / "src" / "libsonicmoe.a"
        if not lib.exists():
            sys.exit(f"sonicmoe_cpp: {lib} was not built")
        for ext in self.extensions:
            ext.extra_objects = [str(lib)] + list(ext.extra_objects or [])
        super().build_extensions()


define_macros = [("SONICMOE_WITH_CUDA", "1")] if WITH_CUDA else []
common = dict(
    sources=["csrc/sonicmoe_ops.cpp"],
    include_dirs=[str(ROOT / "include")],
    define_macros=define_macros,
    extra_compile_args={"cxx": ["-O2", "-std=c++17"]} if WITH_CUDA else ["-O2", "-std=c++17"],
    extra_link_args=["-lcublas", "-lcudart"] if WITH_CUDA else [],
)
if WITH_CUDA:
    ext = CUDAExtension("sonicmoe_cpp._C", **common)
else:
    ext = CppExtension("sonicmoe_cpp._C", **common)

setup(
    name="sonicmoe_cpp",
    version="0.1.0",
    description="PyTorch binding of sonicmoe (SonicMoE MoE layers: CPU reference and Hopper CUDA backends)",
    packages=find_packages(include=["sonicmoe_cpp", "sonicmoe_cpp.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": CMakeThenExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    zip_safe=False,
)
