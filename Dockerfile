# Two targets:
#   docker build --target cpu -t orchestrate:cpu .
#   docker build --target gpu -t orchestrate:gpu .     # CUDA 11.8 + cuDNN 8, what onnxruntime-training 1.19.2 needs
# Run: docker run --rm -v $PWD/runs:/runs orchestrate:cpu backend=ondevice
# Both run as the unprivileged user `orchestrate` (uid 1000, named by number so that Kubernetes'
# runAsNonRoot can verify it) in /runs: mount a folder it can write.
# The versions here are checked against constraints.txt and pyproject.toml by tests/test_docker.py,
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
RUN pip install --no-cache-dir -c constraints.txt . \
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
# The GPU build of ORT replaces the CPU one (both install the same `onnxruntime` module), and
# torch's CUDA 11.8 build matches ORT's CUDA. The other dependencies are orchestrate's own, read
# from the package's metadata (no second list to keep in step), with the same constraints.
RUN grep -v -e '^onnxruntime-training-cpu' -e '^torch=' -e '^nvidia-' -e '^triton' constraints.txt > /tmp/constraints-gpu.txt \
    && python3.11 -m pip install --no-cache-dir torch==2.6.0 --index-url https://download.pytorch.org/whl/cu118 \
    && python3.11 -m pip install --no-cache-dir -c /tmp/constraints-gpu.txt onnxruntime-training==1.19.2 \
    && python3.11 -m pip install --no-cache-dir --no-deps . \
    && python3.11 -c 'import importlib.metadata as m; print("\n".join(r for r in m.requires("orchestrate") if "extra ==" not in r and not r.startswith(("onnxruntime-training-cpu", "torch="))))' > /tmp/requirements-gpu.txt \
    && python3.11 -m pip install --no-cache-dir -c /tmp/constraints-gpu.txt -r /tmp/requirements-gpu.txt \
    && python3.11 -m onnxruntime.training.ortmodule.torch_cpp_extensions.install \
    && useradd --create-home --uid 1000 orchestrate && mkdir /runs && chown orchestrate /runs
USER 1000:1000
WORKDIR /runs
ENTRYPOINT ["python3.11", "-m", "orchestrate"]
