# syntax=docker/dockerfile:1
# GPU image, one CUDA major throughout (CUDA 12): RAPIDS 25.12 for CUDA 12 (cuDF, CuPy, RMM),
# PyTorch 2.13's CUDA 12.6 build, ncfcli. Its default command runs the test suite on the GPU:
#   docker build -t ncfcli . && docker run --rm --gpus all ncfcli
#   docker run --rm --gpus all -v $PWD/data:/data ncfcli ncf prepare ml-20m --out /data/ml-20m
#   docker run --rm --gpus all -v $PWD/out:/out ncfcli bash benchmarks/device_check.sh /out
# Why these builds: a bare `pip install torch` now brings torch's CUDA 13 build (it needs an
# R580+ driver) into this CUDA 12 image, whose RAPIDS packages pin cuda-python < 13. Torch
# 2.13 ships CUDA 12.6 and 13.0 builds (pytorch/pytorch RELEASE.md); cu126 is its CUDA 12 one.
# It runs on drivers from R525 (CUDA 12 minor-version compatibility) and has kernels up to
# Hopper (sm_90), not Blackwell: on Blackwell use RAPIDS cuda13 + torch cu130 instead
# (--build-arg RAPIDS_IMAGE=rapidsai/base:25.12-cuda13-py3.12 --build-arg TORCH_CUDA=cu130).
# How each step is reasoned, with its sources: docs/gpu.md ("The image").
ARG RAPIDS_IMAGE=rapidsai/base:25.12-cuda12-py3.12
FROM ${RAPIDS_IMAGE}
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu126

USER root
WORKDIR /opt/ncfcli
COPY pyproject.toml README.md ./
COPY ncfcli ./ncfcli
COPY tests ./tests
COPY benchmarks ./benchmarks
COPY examples ./examples
COPY docs ./docs

# 1. The image's conda environment already provides the `gpu` extra's libraries (cuDF, CuPy,
#    RMM); installing their pip wheels on top would put a second cuDF beside the first, so they
#    are checked, not reinstalled.
# 2. torch comes from the PyTorch index alone (--index-url, not --extra-index-url): pip never
#    sees PyPI's torch, whose plain 2.13.0 is the CUDA 13 build. The `+cu126` pin then cannot
#    be met by anything else; the index also serves torch's own dependencies.
# 3. ncfcli is installed under a constraint that holds torch at that exact build, so no
#    dependency of ncfcli or its extras can swap it for PyPI's: pip fails instead.
# 4. One CUDA runtime: torch's wheel loads libcudart.so.12 from the nvidia-cuda-runtime-cu12
#    wheel (12.6 for cu126), the conda packages from the environment's lib (the image's newest
#    12.x). The loader keeps the first library of a soname it loads, so whichever of torch and
#    cuDF is imported first would decide for both, and a library built with a newer 12.x than
#    the runtime loaded can miss symbols. A CUDA 12 runtime runs code built with any older
#    12.x, so the wheel's copy is pointed at the environment's (when both exist): every
#    process then loads the same, newest runtime, in either order.
# 5. The check, in both import orders: one libcudart in the process, at least as new as the
#    CUDA torch was built with, and torch's CUDA major equal to CuPy's.
RUN <<'EOF'
set -eu
python -c "import cudf, cupy, rmm; print('cudf', cudf.__version__, 'cupy', cupy.__version__, 'rmm', rmm.__version__)"
pip install --no-cache-dir "torch==${TORCH_VERSION}+${TORCH_CUDA}" \
    --index-url "https://download.pytorch.org/whl/${TORCH_CUDA}"
echo "torch==${TORCH_VERSION}+${TORCH_CUDA}" >/opt/ncfcli/torch-constraint.txt
pip install --no-cache-dir -c /opt/ncfcli/torch-constraint.txt -e '.[export,test]'
env_rt=$(python -c "import glob, sys; print(next(iter(sorted(glob.glob(sys.prefix + '/lib/libcudart.so.[0-9]*'))), ''))")
wheel_rt=$(python -c "import glob, site; print(' '.join(p for d in site.getsitepackages() for p in glob.glob(d + '/nvidia/cuda_runtime/lib/libcudart.so.[0-9]*')))")
if [ -n "$env_rt" ]; then
  for rt in $wheel_rt; do ln -sf "$(readlink -f "$env_rt")" "$rt"; done
fi
cat >/tmp/one_cudart.py <<'PY'
import ctypes, os, sys
for name in sys.argv[1:]:
    __import__(name)
paths = {os.path.realpath(line.split()[-1]) for line in open("/proc/self/maps") if "libcudart.so" in line}
assert len(paths) <= 1, f"two CUDA runtimes loaded after importing {sys.argv[1:]}: {sorted(paths)}"
import cupy, torch
got = int(torch.version.cuda.split(".")[0])
image = cupy.cuda.runtime.runtimeGetVersion() // 1000
assert got == image, f"torch is built for CUDA {got}, the image has CUDA {image}"
if paths:
    v = ctypes.c_int()
    ctypes.CDLL(paths.pop()).cudaRuntimeGetVersion(ctypes.byref(v))
    need = tuple(map(int, torch.version.cuda.split(".")[:2]))
    assert (v.value // 1000, v.value % 1000 // 10) >= need, f"CUDA runtime {v.value} < torch's {need}"
print("torch", torch.__version__, "CUDA", torch.version.cuda, "; CuPy CUDA", image, "; runtime", sys.argv[1:], "ok")
PY
python /tmp/one_cudart.py torch cudf cupy
python /tmp/one_cudart.py cudf cupy torch
rm /tmp/one_cudart.py
EOF

ENV NCF_CACHE_DIR=/data/ncf-cache
CMD ["python", "-m", "pytest", "-q"]
