# syntax=docker/dockerfile:1
# The serving image named by k8s/overlay.yaml and k8s/rayservice.yaml, GPU or CPU from this one file:
#   docker build -t ghcr.io/specinfer/specinfer:0.1.0 .                                      # GPU, CUDA 12.8
#   docker build --build-arg TORCH_FLAVOUR=cu130 -t ghcr.io/specinfer/specinfer:0.1.0-cu130 .
#   docker build --build-arg TORCH_FLAVOUR=cpu -t ghcr.io/specinfer/specinfer:0.1.0-cpu .
# The Ray head, the GPU workers and the workers' fetch-models initContainer all run it.
#
# One CUDA stack: a plain Python base, and torch's own CUDA wheels (nvidia-* packages) from the PyTorch
# index of TORCH_FLAVOUR; the node needs only the NVIDIA driver (the minimum per flavour: docs/kubernetes.md,
# "Build the image"). Every pip install runs with -c constraints.txt (tests/test_image.py checks those pins
# against pyproject.toml). The compilers and build tools of arctic-inference's C++ extension live in the
# builder stage only; the final stage gets the finished environment (/opt/specinfer) and runs as `ray`
# (uid 1000, gid 100 `users`: the ids the manifest's securityContext names).
# No Docker engine runs in this repository's CI: this file is checked by tests/test_image.py, which parses
# it (stages, FROM lines, ARGs, pins, USER, no compiler in the final stage); it has not been built here.

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
# cpu, or the CUDA flavour of a PyTorch wheel index: cu126, cu128, cu130 (which ones a torch release
# publishes: https://download.pytorch.org/whl/torch/). The index URL may be overridden (a mirror).
ARG TORCH_FLAVOUR=cu128
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_FLAVOUR}
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/specinfer \
    PATH=/opt/specinfer/bin:${PATH}

# C and C++ compilers for arctic-inference's extension (the suffix proposer's suffix trees): this stage only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/specinfer

COPY constraints.txt /tmp/build/constraints.txt

# torch first, the flavour's build at the constraints' version (torch==X there matches X+cu128 here); its
# dependencies, the nvidia-* CUDA wheels included, pinned by torch itself, come from the same index.
RUN case "${TORCH_FLAVOUR}" in cpu|cu1[0-9][0-9]) ;; *) echo "TORCH_FLAVOUR must be cpu or cuXYZ, got ${TORCH_FLAVOUR}" >&2; exit 1;; esac \
 && TORCH_VERSION="$(sed -n 's/^torch==//p' /tmp/build/constraints.txt)" \
 && pip install -c /tmp/build/constraints.txt --index-url "${TORCH_INDEX_URL}" \
      --extra-index-url https://pypi.org/simple "torch==${TORCH_VERSION}+${TORCH_FLAVOUR}" \
 && python -c "import sys, torch; cpu = '${TORCH_FLAVOUR}' == 'cpu'; sys.exit(0 if (torch.version.cuda is None) == cpu else 'torch ' + torch.__version__ + ' is not the ${TORCH_FLAVOUR} build')"

# arctic-inference ships as an sdist: a wheel built here against this torch (its setup.py imports torch
# and grpc_tools, and builds with cmake, nanobind and ninja), then cmake and nanobind are uninstalled so
# that the environment the final stage copies holds no build tool (ninja stays: deepspeed depends on it).
RUN pip install -c /tmp/build/constraints.txt cmake nanobind ninja grpcio-tools \
 && pip wheel -c /tmp/build/constraints.txt --no-deps --no-build-isolation -w /tmp/build/wheels arctic-inference \
 && pip uninstall -y cmake nanobind

# The package's dependencies in a layer of their own, keyed on pyproject.toml and the constraints only (a
# source change does not reinstall them). [project].dependencies only: the test and bench extras (pytest,
# HumanEval, ShareGPT, matplotlib) stay out of the serving image. torch is already satisfied.
COPY pyproject.toml /tmp/build/pyproject.toml
RUN python -c "import tomllib; deps = tomllib.load(open('/tmp/build/pyproject.toml', 'rb'))['project']['dependencies']; print(*deps, sep='\n')" \
      > /tmp/build/requirements.txt \
 && pip install -c /tmp/build/constraints.txt --find-links /tmp/build/wheels -r /tmp/build/requirements.txt \
 && python -c "import arctic_inference.suffix_decoding, torch, sys; sys.exit(0 if ('${TORCH_FLAVOUR}' == 'cpu') == (torch.version.cuda is None) else 'the dependencies replaced torch')"

# This package, not editable and without dependencies (installed above), built with the pinned setuptools:
# engine, actors, cluster, settings, bench and protos with the committed gRPC stubs (protos/specinfer_pb2*.py;
# the Serve config's grpc_servicer_functions name cluster.wire's servicer, which uses them).
COPY . /tmp/build/src
RUN pip install -c /tmp/build/constraints.txt --no-deps --no-build-isolation /tmp/build/src \
 && pip check

# ---------------------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
# bash (KubeRay runs `ray start` through bash) comes with the base; wget runs KubeRay's exec probes
# (the RayService worker readiness probe: `wget ... | grep success`, ray-operator common/pod.go in v1.7.0).
# The user `ray` in group `users` (100, Debian's) owns nothing but its home: the environment is root's.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 1000 --gid 100 --create-home --shell /bin/bash ray

COPY --from=builder /opt/specinfer /opt/specinfer
COPY --chown=1000:100 configs /home/ray/specinfer/configs

# Models are read from the volume the manifest mounts (models_dir in the Serve config); nothing is
# downloaded from a model hub at run time.
ENV VIRTUAL_ENV=/opt/specinfer \
    PATH=/opt/specinfer/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false

USER 1000:100
WORKDIR /home/ray/specinfer
# The imports fail the build if the environment misses a module the servers need.
RUN python -c "import protos.specinfer_pb2_grpc, grpc_health.v1.health_pb2_grpc, cluster.wire, cluster.serve_app" \
 && specinfer --help > /dev/null \
 && ray --version
