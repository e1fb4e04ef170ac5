# syntax=docker/dockerfile:1
# The draft and verify workers: one image, SPLITFLASH_SERVICE (draft | verify) picks the role.
# Build from the repository root:
#   CUDA (default): docker build -f docker/worker.Dockerfile -t splitflash-worker:cuda .
#   CPU:            docker build -f docker/worker.Dockerfile --build-arg VARIANT=cpu \
#                     -t splitflash-worker:cpu .
ARG VARIANT=cuda
# Python 3.11 with torch + triton built for CUDA 12.4 (sm_90 Hopper and older).
ARG CUDA_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
ARG CPU_IMAGE=python:3.11-slim

FROM ${CUDA_IMAGE} AS base-cuda
# Triton compiles its small C launcher with the system compiler on first use; the runtime
# image has none.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

FROM ${CPU_IMAGE} AS base-cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# The CPU wheel first, so `pip install .` below finds torch satisfied and does not fetch
# the CUDA build (gigabytes) from PyPI.
RUN pip install --no-cache-dir --index-url "$TORCH_CPU_INDEX" "torch>=2.4,<2.15"

FROM base-${VARIANT} AS worker
ARG VARIANT
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITFLASH_CACHE=/models \
    SPLITFLASH_VERIFY_DEVICE=${VARIANT} \
    SPLITFLASH_DRAFT_DEVICE=${VARIANT} \
    SPLITFLASH_TARGET=smollm2-135m \
    SPLITFLASH_SERVICE=verify \
    HOME=/home/splitflash

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY splitflash ./splitflash
RUN pip install . \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin splitflash \
    && mkdir -p /models && chown splitflash:splitflash /models

# Triton and torch caches live in $HOME, writable by this user.
USER splitflash
# ZeroMQ: 5555 verify, 5556 draft (also the verify->draft data plane); metrics: 9101 draft,
# 9102 verify.
EXPOSE 5555 5556 9101 9102

# `splitflash health` sends a ZeroMQ Hello/Heartbeat to this container's service.
# Long start period: a worker loads (and may pull) its model before it answers.
HEALTHCHECK --interval=15s --timeout=10s --start-period=300s --retries=3 \
    CMD splitflash health "$SPLITFLASH_SERVICE"

# A named model is pulled into the /models volume first (idempotent, sha256-checked; a path
# is used as it is). exec: `docker stop` (SIGTERM) reaches the worker itself.
CMD ["sh", "-c", "case \"$SPLITFLASH_TARGET\" in */*) ;; *) splitflash models pull \"$SPLITFLASH_TARGET\" || exit 1 ;; esac; exec splitflash serve \"$SPLITFLASH_SERVICE\""]
