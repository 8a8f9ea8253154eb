# mantra on a GPU cluster: the official PyTorch CUDA runtime image plus mantra and its dependencies.
#
#   docker build -t mantra .
#   docker run --gpus all -v $PWD:/workspace mantra run manifests/tiny-cpu.yaml
#
# Slurm with pyxis/enroot: import the image once (`enroot import -o mantra.sqsh dockerd://mantra`)
# and name it in the manifest (launcher.slurm.container_image: /shared/images/mantra.sqsh); `mantra
# submit` then runs every task inside it (srun --container-image, the run and working directories
# mounted at the same paths). pyxis runs the task's command, not this image's entrypoint.
#
# Pick the tag that matches your cluster's CUDA driver; its torch must satisfy pyproject's (>= 2.11).
ARG BASE_IMAGE=pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/mantra
# What the package needs to build (pyproject names README.md as its readme), then the sources.
COPY pyproject.toml README.md ./
COPY trainer/ trainer/
COPY launchers/ launchers/
COPY manifests/ manifests/
# torch comes from the base image (pip keeps it: it satisfies pyproject's torch>=2.11).
RUN pip install ".[tensorboard,wandb,text]" && mantra --help >/dev/null

WORKDIR /workspace
ENTRYPOINT ["mantra"]
CMD ["--help"]
