# CPU image: trains with gloo. For GPUs, start from a CUDA PyTorch image and install the same way.
FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends build-essential && rm -rf /var/lib/apt/lists/*
WORKDIR /opt/atorch
COPY setup.cfg pyproject.toml README.md ./
COPY atorch ./atorch
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -e ".[transformers,deepspeed]"
COPY examples ./examples
COPY bench ./bench
ENV OMP_NUM_THREADS=1
CMD ["torchrun", "--nproc_per_node", "2", "examples/train_gpt2.py"]
