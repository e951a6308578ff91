# One image for every baton role: operator, gateway, prefill ranks, decode workers.
#
# CPU (default):
#   docker build -t baton:0.1.0 .
# CUDA:
#   docker build -t baton:0.1.0-cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
# Without a Docker daemon, `make image` builds it with buildah; `make image-check` builds it
# and runs baton inside it (docs/operations.md, "Building the image").
ARG BASE_IMAGE=python:3.11-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A directory (or URL) of wheels to take torch itself from instead of TORCH_INDEX_URL; empty =
# the index. `make image TORCH_WHEELS=DIR` mounts DIR here for the build; nothing is copied in.
ARG TORCH_FIND_LINKS=
ARG TORCH_VERSION=2.13.0
# 1 = add NIXL, the KV data plane for RDMA clusters (spec.kvTransport: nixl), ~220 MB; its
# declared dependencies would pull a CUDA build of torch, so it goes in without them.
ARG NIXL=0
ARG UID=10001

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/tmp

# CUDA and bare Debian bases come without Python; python:* bases have it. None has
# redis-server, which `baton up` starts for its routing state, or the C++ compiler that
# builds baton's CPU kernels (below).
RUN packages=""; \
    python3 -c "import venv, ensurepip" 2>/dev/null || packages="python3 python3-venv"; \
    python3 -c "import sysconfig, os, sys; sys.exit(not os.path.exists(sysconfig.get_paths()['include'] + '/Python.h'))" \
        || packages="$packages python3-dev"; \
    command -v redis-server >/dev/null || packages="$packages redis-server"; \
    command -v g++ >/dev/null || packages="$packages g++"; \
    if [ -n "$packages" ]; then \
        apt-get update && apt-get install -y --no-install-recommends $packages \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

# From a wheel directory take only torch, then its dependencies from PyPI: PyPI's own torch
# is the CUDA build, gigabytes, and must not win the resolution.
RUN if [ -n "${TORCH_FIND_LINKS}" ]; then \
        pip install --no-index --no-deps --find-links ${TORCH_FIND_LINKS} torch==${TORCH_VERSION} \
        && pip install torch==${TORCH_VERSION}; \
    else \
        pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION}; \
    fi

WORKDIR /opt/baton
COPY pyproject.toml README.md requirements-nixl.txt ./
COPY proto/ proto/
COPY services/ services/
COPY operator/ operator/
# The shipped model (weights, config, tokenizer) lives beside the sources.
COPY models/ models/
# Editable: the shipped model and partition tables are found relative to the source tree.
RUN pip install -e ".[structured,tracing]" \
    && if [ "${NIXL}" = 1 ]; then pip install --no-deps -r requirements-nixl.txt; fi \
    && useradd --uid ${UID} --user-group --no-create-home --shell /usr/sbin/nologin baton \
    && python -m compileall -q services operator

# baton's CPU kernels, compiled once here: the pods' root filesystem is read-only, and a
# build at start would cost each pod ~30 s (services/baton/kernels/cpu.py).
ENV BATON_KERNEL_DIR=/opt/baton/kernels
# Every instruction set's module (AVX2, AVX-512, AVX-512 with BF16), for whichever x86 CPU a
# pod lands on (elsewhere the pods run torch's kernels, as on an x86 CPU without AVX2); a
# kernel that does not compile fails the image build.
RUN if [ "$(uname -m)" = x86_64 ]; then \
        python -c "from baton.kernels.cpu import build; build('${BATON_KERNEL_DIR}')"; \
    fi

# Non-root, and nothing here needs a writable root filesystem: caches go to $HOME=/tmp,
# an emptyDir in the pods the operator and the chart make.
USER ${UID}:${UID}
ENTRYPOINT ["baton"]
CMD ["--help"]
