# GPU image: RAPIDS (cuDF, CuPy, RMM for CUDA 12) + PyTorch + ncfcli. Its default command runs
# the test suite on the GPU:
#   docker build -t ncfcli . && docker run --rm --gpus all ncfcli
#   docker run --rm --gpus all -v $PWD/data:/data ncfcli ncf prepare ml-20m --out /data/ml-20m
ARG RAPIDS_IMAGE=rapidsai/base:25.12-cuda12-py3.12
FROM ${RAPIDS_IMAGE}

USER root
WORKDIR /opt/ncfcli
COPY pyproject.toml README.md ./
COPY ncfcli ./ncfcli
COPY tests ./tests
COPY benchmarks ./benchmarks
COPY examples ./examples

# The image's conda environment already provides the `gpu` extra's libraries (cuDF, CuPy, RMM
# for CUDA 12); installing their pip wheels on top would put a second cuDF beside the first, so
# the gpu extra is checked rather than reinstalled. torch from PyPI is a CUDA 12 build.
RUN python -c "import cudf, cupy, rmm; print('cudf', cudf.__version__, 'cupy', cupy.__version__)" \
 && pip install --no-cache-dir torch \
 && pip install --no-cache-dir -e '.[export,test]'

ENV NCF_CACHE_DIR=/data/ncf-cache
CMD ["python", "-m", "pytest", "-q"]
