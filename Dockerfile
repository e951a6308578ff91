# One image for every baton role: operator, gateway, prefill ranks, decode workers.
#
# CPU (default):
#   docker build -t baton:0.1.0 .
# CUDA:
#   docker build -t baton:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ARG UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp

# CUDA bases come without Python; python:* bases already have it.
RUN if ! python3 -c "import venv, ensurepip" 2>/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv \
    && pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION}

WORKDIR /opt/baton
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY services/ services/
COPY operator/ operator/
# The shipped model (weights, config, tokenizer) lives beside the sources.
COPY models/ models/
# Editable: the shipped model and partition tables are found relative to the source tree.
RUN pip install -e . \
    && useradd --uid ${UID} --user-group --no-create-home --shell /usr/sbin/nologin baton \
    && python -m compileall -q services operator

# Non-root, and nothing here needs a writable root filesystem: caches go to $HOME=/tmp,
# an emptyDir in the pods the operator and the chart make.
USER ${UID}:${UID}
ENTRYPOINT ["baton"]
CMD ["--help"]
