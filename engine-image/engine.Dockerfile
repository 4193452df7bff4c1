# syntax=docker/dockerfile:1
# The vllm-stack engine image: vLLM with LMCache, pinned to the versions the chart's defaults name (the
# `vllm/vllm-openai:v0.32.0` engine image and LMCache 0.5.6, helm/templates/_helpers.tpl), running as an
# unprivileged user. `docker build -f engine-image/engine.Dockerfile -t <registry>/vllm-stack-engine:v0.32.0 engine-image`
# then set `repository`/`tag` of a model (or of cacheserverSpec) to it. The chart runs `vllm serve ...` in
# the engine container and `lmcache_server HOST PORT` in the cache server; both are checked on PATH below.
# This image is not built in this repository's tests (its base cannot be pulled there; the test bed builds
# engine-cpu.Dockerfile instead): tests/helm/test_engine_image.py checks the pins against the chart and the
# pinned wheels' console scripts against the commands it renders.

ARG VLLM_VERSION=0.32.0
ARG LMCACHE_VERSION=0.5.6

FROM vllm/vllm-openai:v${VLLM_VERSION}
ARG VLLM_VERSION
ARG LMCACHE_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# vLLM is pinned again next to LMCache so that the resolver keeps the base image's vLLM (and its torch).
RUN python3 -m pip install "vllm==${VLLM_VERSION}" "lmcache==${LMCACHE_VERSION}" \
 && python3 -c "import importlib.metadata as m; assert m.version('vllm') == '${VLLM_VERSION}'; assert m.version('lmcache') == '${LMCACHE_VERSION}'"
RUN groupadd --gid 10001 vllm \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/vllm --shell /usr/sbin/nologin vllm \
 && mkdir -p /data && chown 10001:10001 /data
ENV HOME=/home/vllm \
    HF_HOME=/data \
    LMCACHE_TRACK_USAGE=false
USER 10001:10001
# The commands the chart renders, where it expects them (on PATH).
RUN command -v vllm && command -v lmcache_server && vllm --version
EXPOSE 8000
ENTRYPOINT ["vllm", "serve"]
