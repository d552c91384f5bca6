# One image recipe for every hsx role; the entrypoint is `hsx`, the command names the role.
#
#   target cpu (producer, uploader, dashboard, CPU worker): FROM a slim Python image (build arg
#       SLIM_BASE) plus the CPU torch wheel (build args TORCH_VERSION, TORCH_INDEX_URL), a few GB
#       smaller than the CUDA image.
#   target gpu (GPU workers): FROM a CUDA PyTorch image (build arg CUDA_BASE); torch comes with it.
#
#   docker build --target cpu -t hsx:cpu .
#   docker build --target gpu -t hsx:gpu .
#   docker build --target gpu --build-arg CUDA_BASE=pytorch/pytorch:<tag>-cuda12.8-cudnn9-runtime -t hsx:gpu .
#   docker build --target cpu --build-arg TORCH_INDEX_URL=https://mirror.example/whl/cpu -t hsx:cpu .
#
# Stage order matters without BuildKit: the classic builder builds every stage up to the target,
# in file order. cpu comes before gpu, so `--target cpu` never needs the multi-GB CUDA base.
# (`--target gpu` without BuildKit also builds cpu; BuildKit builds only what a target needs.)
#
# Layers: hsx's dependencies are installed from pyproject.toml alone before the source is copied,
# so a source change rebuilds only the last, small layer.
#
# Both targets run as the unprivileged user hsx (uid 10001) and own the mount points that
# docker-compose.yml uses: /var/spool/hsx (spool), /models (model cache, HF_HOME), /out
# (a local-directory store). Named volumes take that ownership on first use; bind-mounted host
# folders must be writable by uid 10001 (`install -d -o 10001 /host/folder`): workers and
# uploaders check at start and exit with that fix otherwise.

ARG CUDA_BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
ARG SLIM_BASE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build inputs (shared by both targets)
FROM scratch AS deps
COPY pyproject.toml /opt/hsx/pyproject.toml
COPY docker/install.sh /opt/hsx/docker/install.sh

# Everything the build context holds (.dockerignore keeps it to what `pip install .` needs), so a
# new package needs no edit here.
FROM scratch AS src
COPY . /opt/hsx/

# ---------------------------------------------------------------- cpu
FROM ${SLIM_BASE} AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf HSX_SPOOL_DIR=/var/spool/hsx
# torch first, from the CPU wheel index, so that resolving hsx's dependencies pulls no CUDA build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
COPY --from=deps /opt/hsx /opt/hsx
ARG EXTRA_PIP=""
RUN EXTRA_PIP="${EXTRA_PIP}" sh /opt/hsx/docker/install.sh deps
COPY --from=src /opt/hsx /opt/hsx
RUN sh /opt/hsx/docker/install.sh hsx
USER hsx
WORKDIR /home/hsx
ENTRYPOINT ["hsx"]
CMD ["--help"]

# ---------------------------------------------------------------- gpu
FROM ${CUDA_BASE} AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf HSX_SPOOL_DIR=/var/spool/hsx
# The base image's torch satisfies hsx's `torch>=2.6`, so installing the dependencies keeps it.
RUN python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
COPY --from=deps /opt/hsx /opt/hsx
ARG EXTRA_PIP=""
# and the gpu extra: fla's kernels, so the worker packs rows and runs shared prefixes in waves (docs/benchmarks.md)
RUN EXTRA_PIP="${EXTRA_PIP}" sh /opt/hsx/docker/install.sh deps gpu
COPY --from=src /opt/hsx /opt/hsx
RUN sh /opt/hsx/docker/install.sh hsx
USER hsx
WORKDIR /home/hsx
ENTRYPOINT ["hsx"]
CMD ["--help"]
