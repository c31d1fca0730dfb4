# syntax=docker/dockerfile:1
# The image deploy/kubernetes/ runs (ENTRYPOINT vlserve; the role is the first argument; without one it serves the
# demo model on 0.0.0.0:8000):
#   docker build -t vlserve:latest .                              # CPU
#   docker build --build-arg VARIANT=cuda -t vlserve:cuda .       # CUDA (components/gpu uses this tag)
#   docker run --rm -p 8000:8000 vlserve:latest                   # then http://127.0.0.1:8000
# CUDA_INDEX picks torch's CUDA build; it must suit the nodes' driver. BuildKit (docker's default builder) builds
# only the base the VARIANT names.
ARG VARIANT=cpu
ARG CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG CUDA_INDEX=https://download.pytorch.org/whl/cu128

FROM python:3.11-slim-bookworm AS base-cpu
# g++ stays: the CPU kernels are compiled below, and a server finds that build only beside the same compiler
# (the build's cache key names it). libibverbs1: Mooncake's engine links it even over TCP.
RUN apt-get update && apt-get install -y --no-install-recommends g++ libibverbs1 \
    && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:12.8.1-runtime-ubuntu24.04 AS base-cuda
# gcc and the Python headers: Triton compiles its kernel launcher with them at the first kernel launch (the
# runtime image has no compiler).
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    libibverbs1 && rm -rf /var/lib/apt/lists/*

FROM base-${VARIANT}
ARG VARIANT
ARG CPU_INDEX
ARG CUDA_INDEX
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    VLSERVE_KERNEL_CACHE=/opt/vlserve/kernels
RUN python3 -m venv /opt/venv && pip install --no-cache-dir --upgrade pip
# torch first, from the index of the variant: the package's own pin would otherwise fetch PyPI's build.
RUN if [ "$VARIANT" = cuda ]; then index="$CUDA_INDEX"; else index="$CPU_INDEX"; fi \
    && pip install --no-cache-dir --index-url "$index" torch==2.13.0
COPY pyproject.toml README.md /tmp/vlserve/
COPY vlserve /tmp/vlserve/vlserve
# The transports: Mooncake on both; NIXL's wheel is a CUDA build (~220 MB), on the CUDA image only.
RUN if [ "$VARIANT" = cuda ]; then extras=disagg; else extras=mooncake; fi \
    && pip install --no-cache-dir "/tmp/vlserve[$extras]" && rm -rf /tmp/vlserve
# Built as root into $VLSERVE_KERNEL_CACHE (/opt/vlserve/kernels/cpu-kernels-<key>), served as uid 10001 below: the
# cache must be readable by every user (the build makes it so; the chmod keeps it so whatever the builder's umask).
# A cache the server cannot read is a warning and the torch paths, never a failed start
# (tests/test_kernel_cache_access.py runs this image's start command as a non-root user against such a build).
RUN if [ "$VARIANT" = cpu ]; then \
      python -m vlserve.model.kernels.cpu_kernels || echo "CPU kernels not built: the torch fallbacks will run"; \
    fi \
    && mkdir -p "$VLSERVE_KERNEL_CACHE" && chmod -R a+rX "$VLSERVE_KERNEL_CACHE"
RUN useradd --uid 10001 --user-group --create-home vlserve
USER 10001
WORKDIR /home/vlserve
EXPOSE 8000 8100 8101 8200 8201
ENTRYPOINT ["vlserve"]
# (a server in a container must listen on every address for `docker run -p` to reach it)
CMD ["serve", "--host", "0.0.0.0"]
