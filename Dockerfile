# Two targets:
#   docker build --target cpu -t orchestrate:cpu .
#   docker build --target gpu -t orchestrate:gpu .     # CUDA 11.8 + cuDNN 8, what onnxruntime-training 1.19.2 needs
# Run: docker run --rm -v $PWD/runs:/runs -w /runs orchestrate:cpu backend=ondevice

FROM python:3.11-slim AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends build-essential git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/orchestrate
COPY . .
RUN pip install --no-cache-dir -c constraints.txt -e . \
    && python -m onnxruntime.training.ortmodule.torch_cpp_extensions.install
ENTRYPOINT ["python", "-m", "orchestrate"]

FROM nvidia/cuda:11.8.0-cudnn8-devel-ubuntu22.04 AS gpu
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends software-properties-common git build-essential \
    && add-apt-repository ppa:deadsnakes/ppa && apt-get update \
    && apt-get install -y --no-install-recommends python3.11 python3.11-dev python3.11-venv \
    && rm -rf /var/lib/apt/lists/* && python3.11 -m ensurepip
WORKDIR /opt/orchestrate
COPY . .
# The GPU build replaces the CPU one (both install the same `onnxruntime` module); torch's CUDA
# 11.8 build matches ORT's CUDA.
RUN grep -v -e '^onnxruntime-training-cpu' -e '^torch=' -e '^nvidia-' -e '^triton' constraints.txt > /tmp/constraints-gpu.txt \
    && python3.11 -m pip install --no-cache-dir torch==2.6.0 --index-url https://download.pytorch.org/whl/cu118 \
    && python3.11 -m pip install --no-cache-dir -c /tmp/constraints-gpu.txt onnxruntime-training==1.19.2 \
    && python3.11 -m pip install --no-cache-dir -c /tmp/constraints-gpu.txt --no-deps -e . \
    && python3.11 -m pip install --no-cache-dir -c /tmp/constraints-gpu.txt hydra-core mlflow 'ray[default,train]' scikit-learn matplotlib tqdm ninja transformers \
    && python3.11 -m onnxruntime.training.ortmodule.torch_cpp_extensions.install
ENTRYPOINT ["python3.11", "-m", "orchestrate"]
