"""Which machine a benchmark ran on: CPU model, the ISA flags that decide the kernels, GPU, commit.

Result files written before this record existed carry ``{"recorded": "unknown"}`` or a record
backfilled from the dated notes BENCHMARKS.md held, now docs/benchmark-history.md
(``"recorded": "backfilled from BENCHMARKS.md"``).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Mapping

# The flags that change which CPU kernels run: AVX2 only, AVX-512, native bf16 dot products, AMX tiles.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
REPO = Path(__file__).resolve().parents[1]


def cpu_model(cpuinfo: str) -> str | None:
    """The first ``model name`` line of /proc/cpuinfo's text, or None when it has none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return None


def isa_flags(cpuinfo: str) -> dict[str, bool]:
    """Each of ``ISA_FLAGS``: whether the first ``flags`` line of /proc/cpuinfo's text lists it."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            present = set(value.split())
            return {flag: flag in present for flag in ISA_FLAGS}
    return {flag: False for flag in ISA_FLAGS}


def git_commit(repo: Path = REPO) -> str | None:
    """The short hash of HEAD, with ``-dirty`` when tracked files differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                              text=True, check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{head}-dirty" if dirty else head


def gpu_name() -> str | None:
    """The first CUDA device's name, or None where torch sees no GPU."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine(cpuinfo_path: Path = Path("/proc/cpuinfo"), repo: Path = REPO,
            env: Mapping[str, str] | None = None) -> dict:
    """The record every result file carries under ``machine``. ``isa_cap``: the setting in ``env``
    (default: this process's environment) that kept the kernels below the CPU's native bf16
    (``ONEDNN_MAX_CPU_ISA=AVX2``: a native-bf16 machine run as an AVX2 one), None when none did."""
    import torch

    from engine.dtypes import isa_restriction

    try:
        cpuinfo = cpuinfo_path.read_text()
    except OSError:
        cpuinfo = ""
    return {"recorded": "at run time", "cpu_model": cpu_model(cpuinfo), "isa": isa_flags(cpuinfo),
            "isa_cap": isa_restriction(os.environ if env is None else env),
            "gpu": gpu_name(), "torch_threads": torch.get_num_threads(), "commit": git_commit(repo)}


def with_machine(result: dict) -> dict:
    """``result`` with this machine's record under ``machine`` (what every result file carries)."""
    return {**result, "machine": machine()}
