# The honest training loop in a CUDA image: the official PyTorch runtime image (Python, torch, CUDA,
# cuDNN, NCCL) plus the project's other pinned packages and its code, run as a non-root user.
#
#   docker build --build-arg GIT_COMMIT=$(git rev-parse HEAD) -t honest-loop .
#   docker run --gpus all --ipc=host --init -v "$PWD/runs:/app/runs" honest-loop   # default config
#   docker run --gpus all --ipc=host --init -v "$PWD/runs:/runs" -v "$PWD/.env:/app/.env:ro" honest-loop \
#       torchrun --standalone --nproc_per_node=8 train.py run.out_dir=/runs/x
#
# --ipc=host (or --shm-size=16g): DataLoader workers and NCCL pass tensors through /dev/shm, and
# Docker's default 64 MB is too small. --init: a minimal init as PID 1 forwards `docker stop`'s
# SIGTERM (the loop checkpoints and exits 143; give it time: docker stop -t 120) and reaps exited
# children. The container runs as uid 10001: a mounted runs dir must be writable by it and a mounted
# .env (mode 600, as it should be) readable, else add --user "$(id -u):$(id -g)". Secrets: mount .env
# as above (train.py loads ./.env; see loop/config/dotenv.py); the image itself holds none (.dockerignore).
# A rerun with the same out_dir resumes from its newest checkpoint.

# Versions pinned here, checked below. The tag is not verified from this machine (no registry access):
# public Dockerfiles name pytorch/pytorch:2.13.0-cuda12.6-cudnn9-runtime and -cuda13.0-, and report
# Ubuntu 24.04 with Python 3.12. CUDA 12.6 runs on older drivers (>= 560, or 525+ by minor-version
# compatibility) and covers Hopper (H100/H200); for Blackwell, --build-arg CUDA_VERSION=13.0 (driver
# >= 580). The check after the install fails the build if the tag holds other versions.
# For a byte-identical base, add the digest: docker buildx imagetools inspect <image> shows it.
ARG TORCH_VERSION=2.13.0
ARG CUDA_VERSION=12.6
FROM pytorch/pytorch:${TORCH_VERSION}-cuda${CUDA_VERSION}-cudnn9-runtime
ARG TORCH_VERSION
ARG CUDA_VERSION
ARG PYTHON_VERSION=3.12

WORKDIR /app
# Dependencies before the code, so a code change reuses this layer. torch and CUDA come with the
# base image: every pin of requirements.lock but torch (from PyPI, a second and different build).
# --break-system-packages: the image's Python is reported to be the distribution's (PEP 668), and
# its torch lives in that same site-packages, where a virtualenv would not see it.
COPY requirements.lock ./
RUN grep -v '^torch==' requirements.lock > /tmp/requirements.txt \
    && python3 -m pip install --no-cache-dir --break-system-packages -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && python3 -c "import sys, numpy, torch; \
print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__); \
assert sys.version.startswith('${PYTHON_VERSION}.') and torch.__version__.split('+')[0] == '${TORCH_VERSION}' \
and torch.version.cuda == '${CUDA_VERSION}', 'the base image is not the pinned Python, torch and CUDA'"

# torch.compile (train.compile=true) needs a C compiler when it runs:
# Triton builds its kernel launchers with it. Runtime images from before pytorch/pytorch#170235
# ship none (pytorch/pytorch#116696): install gcc where the base lacks it.
RUN command -v gcc >/dev/null || { apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*; }

COPY . .
# uid 10001, not 1000: Ubuntu 24.04 images already have user `ubuntu` with 1000. The code stays
# root-owned (read-only to the run); only the default output and data-cache dirs are writable, by
# any uid (mode 1777, as /tmp), so --user "$(id -u):$(id -g)" works too.
RUN useradd --create-home --uid 10001 trainer \
    && install -d -o trainer -m 1777 runs data/cache

# The image has no .git: loop/observe/metadata.py records this commit instead (built without it: "unknown").
# Declared after the install: a new value of a build argument reruns every RUN that follows it.
ARG GIT_COMMIT=unknown
# Unbuffered: `docker logs` shows each step as it happens. No .pyc: /app is not the user's to write.
ENV GIT_COMMIT=${GIT_COMMIT} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
LABEL org.opencontainers.image.revision=${GIT_COMMIT}
USER trainer
# The default config. Any command replaces it: torchrun ..., python3 train.py --config ...,
# python3 -m pytest. python3, not python: a distribution's Python need not install that name.
CMD ["python3", "train.py"]
