# qgemm on an NVIDIA CUDA runtime image (the CUDA runtime, cuBLAS and NVRTC that CuPy loads).
#   docker build -t qgemm .                                    # CUDA 13: NVIDIA driver >= 580
#   docker build -t qgemm:cuda12 --build-arg CUDA=12 .         # CUDA 12: drivers 525..579
#   docker run --gpus all --shm-size=1g -p 8000:8000 -v qgemm-models:/models qgemm
# The models are not in the image: the first start writes the demo and fetches SmolLM2 and Gemma 3 into the
# /models volume (about 1 GB, once); later starts find them there.
ARG CUDA=13
ARG CUDA_IMAGE_13=nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG CUDA_IMAGE_12=nvidia/cuda:12.6.3-runtime-ubuntu24.04

# ---- build: a virtual environment with qgemm and its dependencies ----------------------------------------
FROM ubuntu:24.04 AS build
ARG CUDA
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/qgemm/.venv PATH=/opt/qgemm/.venv/bin:$PATH
WORKDIR /opt/qgemm
RUN python3 -m venv $VIRTUAL_ENV && pip install --no-cache-dir --upgrade pip
# dependencies first, in their own layer: a change to the code does not download them again
# (pyproject.toml alone: README.md, which it names, is a placeholder here, so that editing it keeps this layer)
COPY pyproject.toml ./
RUN mkdir -p app kernels models tools qgemm && touch README.md app/__init__.py kernels/__init__.py \
    models/__init__.py tools/__init__.py qgemm/__init__.py \
 && pip install --quiet --no-cache-dir ".[$( [ "$CUDA" = 12 ] && echo cuda12 || echo cuda )]" \
 && pip uninstall -y qgemm
COPY README.md ./
COPY app ./app
COPY kernels ./kernels
COPY models ./models
COPY tools ./tools
COPY qgemm ./qgemm
RUN pip install --quiet --no-cache-dir --no-deps .

# ---- run: the CUDA runtime image, the environment, no compilers -------------------------------------------
FROM ${CUDA_IMAGE_13} AS run-13
FROM ${CUDA_IMAGE_12} AS run-12
FROM run-${CUDA}
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 qgemm \
 && mkdir -p /models && chown qgemm:qgemm /models
COPY --from=build /opt/qgemm/.venv /opt/qgemm/.venv
COPY docker-entrypoint.sh /usr/local/bin/
ENV PATH=/opt/qgemm/.venv/bin:$PATH QGEMM_MODELS_DIR=/models QGEMM_CACHE_DIR=/models/.cache \
    QGEMM_HOST=0.0.0.0 QGEMM_PORT=8000 QGEMM_WRITE_DEMO=true
VOLUME ["/models"]
USER qgemm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
  CMD python3 -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"QGEMM_PORT\", \"8000\")}/healthz', timeout=4)" || exit 1
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["qgemm", "serve"]
