# kvcached-serve container image. Multi-stage: build a venv, copy it into a
# clean runtime image that runs as a non-root user.
#
#   docker build -t kvcached:0.1.0 .
#   podman build --format docker -t kvcached:0.1.0 .     # docker format keeps HEALTHCHECK
#   docker run -d --name kvcached --runtime nvidia --gpus all \
#       -v /run/kvcached:/run/kvcached -p 127.0.0.1:9461:9461 kvcached:0.1.0
#
# Build arguments: PYTHON_IMAGE (the base of both stages: any Debian-like
# image with python3 and its venv module). Behind a TLS-intercepting proxy,
# give pip the proxy's CA bundle as a build secret:
#   --secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt
#
# The GPU driver is not in the image: the NVIDIA container runtime mounts the
# host's libcuda.so.1 and libnvidia-ml.so.1 and the /dev/nvidia* nodes, as
# selected by NVIDIA_VISIBLE_DEVICES / NVIDIA_DRIVER_CAPABILITIES
# (compute: CUDA driver API; utility: NVML for the device-memory metrics).
# KVCACHED_BACKEND=cuda: without a usable driver the daemon exits (status 1)
# and says why; `-e KVCACHED_BACKEND=auto` (or host) allows serving host
# memory (memfd pages) instead.
# See docs/operations.md ("Container and Kubernetes") for what is tested.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# The control socket's relay (kvcached_service/server/transports/relay.c) is compiled:
# a C compiler in the build stage only (the runtime stage gets the venv).
RUN command -v cc >/dev/null \
 || { apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; }
RUN python3 -m venv /opt/kvcached
COPY pyproject.toml setup.py README.md ./
COPY kvcached_service ./kvcached_service
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/kvcached/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/kvcached/bin/pip install --no-cache-dir . \
 && /opt/kvcached/bin/kvcached-serve --version

FROM ${PYTHON_IMAGE} AS runtime
ARG KVCACHED_UID=10001
ARG KVCACHED_GID=2000
LABEL org.opencontainers.image.title="kvcached-serve" \
      org.opencontainers.image.description="Per-host GPU memory daemon for KV caches" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    PATH=/opt/kvcached/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVCACHED_SOCKET=/run/kvcached/kvcached.sock \
    KVCACHED_METRICS_ADDRESS=0.0.0.0:9461 \
    KVCACHED_BACKEND=cuda \
    PROMETHEUS_DISABLE_CREATED_SERIES=true
# The group owns the socket directory and sockets: client containers join it
# (supplementalGroups / --group-add 2000) to reach the daemon.
RUN groupadd --system --gid ${KVCACHED_GID} kvcached-clients \
 && useradd --system --uid ${KVCACHED_UID} --gid ${KVCACHED_GID} --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin kvcached \
 && install -d -o ${KVCACHED_UID} -g ${KVCACHED_GID} -m 0750 /run/kvcached
COPY --from=build /opt/kvcached /opt/kvcached
USER ${KVCACHED_UID}:${KVCACHED_GID}
VOLUME ["/run/kvcached"]
EXPOSE 9461
# Through the gRPC health service on the control socket (grpc.health.v1).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["kvcachedctl", "health", "--timeout", "3"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvcached-serve"]
CMD ["--socket", "/run/kvcached/kvcached.sock", "--socket-mode", "0660", "--socket-group", "2000", "--metrics-address", "0.0.0.0:9461", "--channel-ops-only"]
