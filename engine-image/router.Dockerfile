# syntax=docker/dockerfile:1
# The vllm-stack router image: `docker build -f engine-image/router.Dockerfile -t ghcr.io/vllm-stack/router:0.1.0 .`
# (context: the repository root). Multi-stage: the build stage installs the project without extras, which
# gives the router's dependencies only (no vLLM, no torch); the runtime stage copies that virtual
# environment and runs as an unprivileged user, compatible with a read-only root filesystem. pip and
# setuptools leave the environment once it is built (the router needs neither).
# `make images` builds it here with podman from a Debian base made locally (vllm_stack_dev.images, README
# "Container images"); SOURCE_DATE_EPOCH (BuildKit and podman both take it) makes the bytecode and, with
# podman's --timestamp, the layers independent of the build's date.

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG SOURCE_DATE_EPOCH
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install . \
 && /opt/venv/bin/python -m vllm_stack_dev.protofix \
 && /opt/venv/bin/pip uninstall --yes --quiet pip setuptools \
 && /opt/venv/bin/vllm-stack --help >/dev/null

FROM ${PYTHON_IMAGE}
ARG SOURCE_DATE_EPOCH
LABEL org.opencontainers.image.title="vllm-stack router" \
      org.opencontainers.image.source="https://github.com/vllm-stack/vllm-stack" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --gid 10001 router \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin router
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TMPDIR=/tmp
USER 10001:10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
# The chart passes only arguments, so the entrypoint is the router itself.
ENTRYPOINT ["vllm-stack", "router"]
CMD ["--host", "0.0.0.0", "--port", "8000"]
