# syntax=docker/dockerfile:1
# The serving image named by k8s/overlay.yaml and k8s/rayservice.yaml:
#   docker build -t ghcr.io/specinfer/specinfer:0.1.0 .
# The Ray head, the GPU workers and the workers' fetch-models initContainer all run it.
# The base's Ray must equal the pin in pyproject.toml (ray[serve]==2.60.0) and rayVersion in the manifest.
FROM rayproject/ray:2.60.0-py311-gpu

# CUDA-enabled torch. On Linux x86_64 the torch wheel from PyPI is the CUDA build (it brings the CUDA
# runtime as nvidia-* wheels and needs only the node's NVIDIA driver). The CPU-only torch that
# scripts/setup.sh installs is for local runs and CI only, never for this image.
ARG TORCH_VERSION=2.13.0
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
 && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'CPU-only torch in the serving image')"

# arctic-inference (the suffix proposer's suffix trees) ships as an sdist whose build needs cmake,
# nanobind and ninja (installed first): built here without build isolation, so that the
# dependency layer below finds its pin (pyproject.toml) satisfied.
RUN pip install --no-cache-dir cmake nanobind==2.9.2 ninja \
 && pip install --no-cache-dir --no-build-isolation arctic-inference==0.3.0 \
 && python -c "import arctic_inference.suffix_decoding"

# The package's dependencies in a layer of their own, keyed on pyproject.toml only: a source change
# does not reinstall them. [project].dependencies only: the test and bench extras (pytest, HumanEval,
# ShareGPT, matplotlib) stay out of the serving image. torch is already satisfied by the CUDA build.
COPY --chown=ray:users pyproject.toml /tmp/specinfer-deps/pyproject.toml
RUN python -c "import tomllib; deps = tomllib.load(open('/tmp/specinfer-deps/pyproject.toml', 'rb'))['project']['dependencies']; print(*deps, sep='\n')" \
      > /tmp/specinfer-deps/requirements.txt \
 && pip install --no-cache-dir -r /tmp/specinfer-deps/requirements.txt \
 && rm -rf /tmp/specinfer-deps \
 && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'the dependencies replaced the CUDA torch')"

# This package, not editable and without dependencies (installed above): engine, actors, cluster,
# settings, bench and protos with the committed gRPC stubs (protos/specinfer_pb2*.py; the Serve config's
# grpc_servicer_functions name cluster.wire's servicer, which uses them). The source is removed after the install so that the installed package
# is the only copy on sys.path. The imports below fail the build if the dependency layer misses one.
COPY --chown=ray:users . /tmp/specinfer-src
RUN pip install --no-cache-dir --no-deps /tmp/specinfer-src \
 && mkdir -p /home/ray/specinfer \
 && cp -r /tmp/specinfer-src/configs /home/ray/specinfer/configs \
 && rm -rf /tmp/specinfer-src \
 && python -c "import protos.specinfer_pb2_grpc, grpc_health.v1.health_pb2_grpc, cluster.wire, cluster.serve_app" \
 && specinfer --help > /dev/null

WORKDIR /home/ray/specinfer
# Models are read from the volume the manifest mounts (models_dir in the Serve config); nothing is
# downloaded from a model hub at run time.
ENV HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
