"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Tests never reach a model hub: everything is loaded from local directories.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Every Hypothesis test runs the same examples on every run and machine (derandomised, no example
# database carried between runs) and is bounded by the suite's timeout, not a per-example deadline
# that a loaded 2-core box misses. Tests set only max_examples (and health checks) themselves.
settings.register_profile("specinfer", derandomize=True, database=None, deadline=None, print_blob=True)
settings.load_profile("specinfer")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors run faster on one thread, and do not fight other processes for the cores (a
    module's ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def models_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The model cache `specinfer models fetch` fills (``$SPECINFER_MODELS`` or the default)."""
    from cluster.fetch import default_cache_dir

    return default_cache_dir()


@pytest.fixture(scope="session")
def smollm2_dir(models_cache_dir: Path) -> Path:
    """Directory of the converted SmolLM2-135M-Instruct test model (fetched once per session, ~90 MB)."""
    from cluster.fetch import TEST_MODEL, fetch_models

    return fetch_models(models_cache_dir, [TEST_MODEL], progress=False)[TEST_MODEL]


@pytest.fixture(scope="session")
def qwen_models_dir(models_cache_dir: Path) -> Path:
    """Cache dir holding the default Qwen target and SSM (fetched if missing; ~1.5 GB)."""
    from cluster.fetch import DEFAULT_SSM, DEFAULT_TARGET, fetch_models

    fetch_models(models_cache_dir, [DEFAULT_TARGET, DEFAULT_SSM], progress=False)
    return models_cache_dir


def pytest_collection_modifyitems(config, items):
    """In-process tests first, Ray ones last (a stable sort: each keeps its order), so Ray's
    processes do not compete with the in-process tests for the CPUs; tests marked ``gpu`` need a
    CUDA device: skipped where there is none.

    The suite runs in one process: pytest-xdist gained nothing on the 2-core box (AMX Xeon). The
    in-process tests took 591 s and 1,113 CPU-seconds on two workers, against 478-592 s (the box
    drifts) and 883 CPU-seconds on one, which already keeps 1.5 cores busy; the Ray tests on two
    workers (a Ray node and the deploys each) ran past 930 s at 98 % CPU, against about 800 s."""
    import torch

    items.sort(key=lambda item: item.get_closest_marker("ray") is not None)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
