# qgemm on an NVIDIA CUDA 13 runtime image: the CUDA runtime, cuBLAS and NVRTC that CuPy loads.
# Run with the NVIDIA container toolkit:  docker run --gpus all -p 8000:8000 qgemm
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-pip make \
 && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 qgemm
WORKDIR /opt/qgemm
COPY pyproject.toml README.md Makefile ./
COPY app ./app
COPY kernels ./kernels
COPY models ./models

# The README's install, with the CUDA extra, into a venv outside the models volume.
ENV VIRTUAL_ENV=/opt/qgemm/.venv PATH=/opt/qgemm/.venv/bin:$PATH
RUN python3 -m venv $VIRTUAL_ENV \
 && pip install --no-cache-dir --upgrade pip \
 && pip install --no-cache-dir '.[cuda]'

# Models live in a volume; the image ships the demo and SmolLM2 so that a new volume starts full.
ENV QGEMM_MODELS_DIR=/models QGEMM_HOST=0.0.0.0 QGEMM_PORT=8000
RUN mkdir -p /models && qgemm fetch && chown -R qgemm:qgemm /models
VOLUME ["/models"]

USER qgemm
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
  CMD python3 -c "import os, urllib.request; urllib.request.urlopen(f'http://127.0.0.1:{os.environ.get(\"QGEMM_PORT\", \"8000\")}/healthz', timeout=4)" || exit 1
CMD ["qgemm", "serve"]
