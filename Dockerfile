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

# The image's conda environment already provides the `gpu` extra's libraries (cuDF, CuPy, RMM);
# installing their pip wheels on top would put a second cuDF beside the first, so they are
# checked, not reinstalled. torch is pinned with its CUDA tag (`+cu126`), which only the
# PyTorch index has, so pip cannot fall back to another build; the last line fails the build
# if torch's CUDA major differs from CuPy's (the image's).
RUN python -c "import cudf, cupy, rmm; print('cudf', cudf.__version__, 'cupy', cupy.__version__, 'rmm', rmm.__version__)" \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}+${TORCH_CUDA}" \
        --extra-index-url "https://download.pytorch.org/whl/${TORCH_CUDA}" \
 && pip install --no-cache-dir -e '.[export,test]' \
 && python -c "import cupy, torch; image = cupy.cuda.runtime.runtimeGetVersion() // 1000; got = int(torch.version.cuda.split('.')[0]); print('torch', torch.__version__, 'CUDA', torch.version.cuda, '; CuPy CUDA', image); assert got == image, f'torch is built for CUDA {got}, the image has CUDA {image}'"

ENV NCF_CACHE_DIR=/data/ncf-cache
CMD ["python", "-m", "pytest", "-q"]
