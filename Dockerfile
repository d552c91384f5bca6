# One image recipe for every hsx role; the entrypoint is `hsx`, the command names the role.
#
#   target gpu (GPU workers): FROM a CUDA PyTorch image (build arg CUDA_BASE); torch comes with it.
#   target cpu (producer, uploader, dashboard, CPU worker): FROM a slim Python image (build arg
#       SLIM_BASE) plus the CPU torch wheel, a few GB smaller than the CUDA image.
#
#   docker build --target gpu -t hsx:gpu .
#   docker build --target cpu -t hsx:cpu .
#   docker build --target gpu --build-arg CUDA_BASE=pytorch/pytorch:<tag>-cuda12.8-cudnn9-runtime -t hsx:gpu .
#
# Both targets run as the unprivileged user hsx (uid 10001) and own the mount points that
# docker-compose.yml uses: /var/spool/hsx (spool), /models (model cache, HF_HOME), /out
# (a local-directory store). Named volumes take that ownership on first use; bind-mounted host
# folders must be writable by uid 10001.

ARG CUDA_BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
ARG SLIM_BASE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- source (shared by both targets)
FROM scratch AS src
COPY pyproject.toml README.md /opt/hsx/
COPY hsx /opt/hsx/hsx
COPY producer /opt/hsx/producer
COPY gpu_worker /opt/hsx/gpu_worker
COPY uploader /opt/hsx/uploader
COPY dashboard /opt/hsx/dashboard
COPY docker/install.sh /opt/hsx/docker/install.sh

# ---------------------------------------------------------------- gpu
FROM ${CUDA_BASE} AS gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf HSX_SPOOL_DIR=/var/spool/hsx
# The base image's torch satisfies hsx's `torch>=2.4`, so `pip install .` keeps it.
RUN python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
COPY --from=src /opt/hsx /opt/hsx
ARG EXTRA_PIP=""
RUN EXTRA_PIP="${EXTRA_PIP}" sh /opt/hsx/docker/install.sh
USER hsx
WORKDIR /home/hsx
ENTRYPOINT ["hsx"]
CMD ["--help"]

# ---------------------------------------------------------------- cpu
FROM ${SLIM_BASE} AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/models/hf HSX_SPOOL_DIR=/var/spool/hsx
# torch first, from the CPU wheel index, so that `pip install .` does not pull a CUDA build.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY --from=src /opt/hsx /opt/hsx
ARG EXTRA_PIP=""
RUN EXTRA_PIP="${EXTRA_PIP}" sh /opt/hsx/docker/install.sh
USER hsx
WORKDIR /home/hsx
ENTRYPOINT ["hsx"]
CMD ["--help"]
