# Three targets, two stacks (docs/compatibility.md):
#   docker build --target cpu -t orchestrate:cpu .           # the ORT stack: every backend, Python 3.11, torch 2.6
#   docker build --target gpu -t orchestrate:gpu .           # the same with CUDA 11.8 + cuDNN 8, what onnxruntime-training 1.19.2 needs
#   docker build --target current -t orchestrate:current .   # the current stack: Python 3.12, the newest torch, no ORT
# Run: docker run --rm -v $PWD/runs:/runs orchestrate:cpu backend=ondevice
# Both run as the unprivileged user `orchestrate` (uid 1000, named by number so that Kubernetes'
# runAsNonRoot can verify it) in /runs: mount a folder it can write.
# The versions here are checked against constraints.txt, constraints-current.txt and pyproject.toml by tests/test_docker.py,
# and the file by hadolint (tests/test_docker.py): exceptions are justified where they are made.

FROM python:3.11-slim AS cpu
# DL3008 (apt versions unpinned): the base image's Debian release decides these; Debian drops a
# security-patched package's old version from its mirrors, so a pin would break the build.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/orchestrate
COPY pyproject.toml constraints.txt README.md ./
COPY orchestrate orchestrate
COPY hydra_plugins hydra_plugins
# ORTModule's C++ extensions are compiled into ORT's package folder, so as root, before USER.
RUN pip install --no-cache-dir -c constraints.txt '.[ort,hf,server]' \
    && python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install \
    && useradd --create-home --uid 1000 orchestrate && mkdir /runs && chown orchestrate /runs
USER 1000:1000
WORKDIR /runs
ENTRYPOINT ["python", "-m", "orchestrate"]

FROM nvidia/cuda:11.8.0-cudnn8-devel-ubuntu22.04 AS gpu
ENV DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# DL3008: as in the cpu stage (Ubuntu's and the PPA's mirrors keep only current versions).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common git build-essential \
    && add-apt-repository ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-dev python3.11-venv \
    && rm -rf /var/lib/apt/lists/* && python3.11 -m ensurepip
WORKDIR /opt/orchestrate
COPY pyproject.toml constraints.txt README.md ./
COPY orchestrate orchestrate
COPY hydra_plugins hydra_plugins
# The GPU build of ORT in place of the `ort` extra's CPU one (both install the same `onnxruntime`
# module), torch's CUDA 11.8 build to match ORT's CUDA, then orchestrate with its other extras and
# the `ort` extra's other pins, under the same constraints.
RUN grep -v -e '^onnxruntime-training-cpu' -e '^torch=' -e '^nvidia-' -e '^triton' constraints.txt > /tmp/constraints-gpu.txt \
    && python3.11 -m pip install --no-cache-dir torch==2.6.0 --index-url https://download.pytorch.org/whl/cu118 \
    && python3.11 -m pip install --no-cache-dir -c /tmp/constraints-gpu.txt onnxruntime-training==1.19.2 onnx==1.16.2 ninja \
    && python3.11 -m pip install --no-cache-dir -c /tmp/constraints-gpu.txt '.[hf,server]' \
    && python3.11 -m onnxruntime.training.ortmodule.torch_cpp_extensions.install \
    && useradd --create-home --uid 1000 orchestrate && mkdir /runs && chown orchestrate /runs
USER 1000:1000
WORKDIR /runs
ENTRYPOINT ["python3.11", "-m", "orchestrate"]

# The current stack: every backend but ORT's (no training build has a wheel past Python 3.12, and
# ORTModule needs torch 2.6), with the newest torch (its PyPI build carries CUDA 13 libraries) and
# the inference runtime that serves the logged model (the `serve` extra).
FROM python:3.12-slim AS current
WORKDIR /opt/orchestrate
COPY pyproject.toml constraints-current.txt README.md ./
COPY orchestrate orchestrate
COPY hydra_plugins hydra_plugins
RUN pip install --no-cache-dir -c constraints-current.txt '.[hf,server,serve]' \
    && useradd --create-home --uid 1000 orchestrate && mkdir /runs && chown orchestrate /runs
USER 1000:1000
WORKDIR /runs
ENTRYPOINT ["python", "-m", "orchestrate"]
