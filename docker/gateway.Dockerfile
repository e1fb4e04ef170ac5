# syntax=docker/dockerfile:1
# The HTTP gateway: no GPU, no model weights of its own (it reads the tokenizer from the
# shared model cache). Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t splitflash-gateway .
FROM python:3.11-slim

# GATEWAY_TORCH=cpu installs the CPU torch wheel (~200 MB) because splitflash.protocol.tensors
# imports torch at module level today; set it to "none" once the gateway's import graph is
# torch-free (it only sends control messages, never tensors).
ARG GATEWAY_TORCH=cpu
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SPLITFLASH_CACHE=/models

WORKDIR /app

# Dependencies first, in their own layer, so a code change does not reinstall them.
COPY docker/requirements-gateway.txt /tmp/requirements-gateway.txt
RUN pip install -r /tmp/requirements-gateway.txt \
    && if [ "$GATEWAY_TORCH" = "cpu" ]; then \
         pip install --index-url "$TORCH_CPU_INDEX" "torch>=2.4,<2.15"; \
       fi

COPY pyproject.toml README.md* ./
COPY splitflash ./splitflash
# --no-deps: pyproject.toml lists the whole model stack (torch with CUDA, triton), which the
# gateway must not pull in; its real needs were installed above.
RUN pip install --no-deps . \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin splitflash \
    && mkdir -p /models && chown splitflash:splitflash /models

USER splitflash
EXPOSE 8000

# No curl in the slim image: the stdlib does the HTTP GET (non-2xx raises -> exit 1).
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import urllib.request as u; u.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# The tokenizer lives in the model file: pull a named model into the volume first.
CMD ["sh", "-c", "case \"${SPLITFLASH_TARGET:-smollm2-135m}\" in */*) ;; *) splitflash models pull \"${SPLITFLASH_TARGET:-smollm2-135m}\" || exit 1 ;; esac; exec splitflash serve gateway"]
