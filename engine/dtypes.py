"""``dtype: auto``: bfloat16 where the model's device multiplies it natively, float32 elsewhere.

On a CPU without native bf16 (AVX2 only: no AVX512-BF16, no AMX) bf16 matrix products are
emulated, so a verify pass costs in proportion to its tokens (the default target on a 2-core AVX2
EPYC: 255 ms for 1 token, 1,429 ms for 8) and speculation becomes a loss, while float32 through
oneDNN costs about 300 ms for 1 and 700 ms for 8. ``choose_dtype`` is the decision, a pure function
of what the machine reports; ``machine_dtype`` reads this machine. Each process that loads a model
resolves ``auto`` for itself (a Ray actor on its own host)::

    >>> choose_dtype(frozenset({"avx2"}), "cpu", {}).dtype
    'float32'
    >>> choose_dtype(frozenset({"avx2", "avx512_bf16"}), "cpu", {"ONEDNN_MAX_CPU_ISA": "AVX2"}).dtype
    'float32'
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of the instructions oneDNN's bf16 kernels use
SHOWN_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what the log line names of a CPU's flags
# ONEDNN_MAX_CPU_ISA values that keep oneDNN's native bf16 kernels (AVX512_CORE_BF16 and above);
# any other value (AVX2, AVX512_CORE, ...) caps oneDNN below them.
ONEDNN_BF16_ISAS = frozenset({
    "ALL", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
    "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2"})
# ATEN_CPU_CAPABILITY values that keep ATen's AVX512 kernels; any other (default, avx2) caps them below.
ATEN_BF16_CAPABILITIES = frozenset({"avx512"})


@dataclass(frozen=True)
class DtypeChoice:
    """What ``auto`` resolved to, and why (for the log)."""

    dtype: str  # "bfloat16" or "float32"
    reason: str

    def describe(self) -> str:
        """``dtype auto -> float32: CPU has no native bf16 (flags: avx2; no avx512_bf16/amx_bf16)``"""
        return f"dtype auto -> {self.dtype}: {self.reason}"


def isa_restriction(env: Mapping[str, str]) -> str | None:
    """The environment setting that keeps bf16 off the native instructions (a native-bf16 machine
    emulating an AVX2 one), or None. An unrecognised value counts as a restriction."""
    onednn = env.get("ONEDNN_MAX_CPU_ISA") or env.get("DNNL_MAX_CPU_ISA")
    if onednn and onednn.strip().upper() not in ONEDNN_BF16_ISAS:
        name = "ONEDNN_MAX_CPU_ISA" if env.get("ONEDNN_MAX_CPU_ISA") else "DNNL_MAX_CPU_ISA"
        return f"{name}={onednn}"
    aten = env.get("ATEN_CPU_CAPABILITY")
    if aten and aten.strip().lower() not in ATEN_BF16_CAPABILITIES:
        return f"ATEN_CPU_CAPABILITY={aten}"
    return None


def choose_dtype(cpu_flags: frozenset[str], device_type: str, env: Mapping[str, str],
                 cuda_bf16: bool = False) -> DtypeChoice:
    """bfloat16 on a GPU that supports it (``cuda_bf16``) or a CPU with native bf16 (AVX512-BF16 or
    AMX, unless ``env`` caps the ISA below them); float32 elsewhere."""
    if device_type == "cuda":
        if cuda_bf16:
            return DtypeChoice("bfloat16", "the GPU supports bf16")
        return DtypeChoice("float32", "the GPU does not support bf16")
    if device_type != "cpu":
        raise ValueError(f"dtype auto: unknown device type {device_type!r} (expected 'cpu' or 'cuda')")
    shown = ", ".join(f for f in SHOWN_FLAGS if f in cpu_flags) or "none of " + "/".join(SHOWN_FLAGS)
    native = [f for f in NATIVE_BF16_FLAGS if f in cpu_flags]
    if not native:
        return DtypeChoice("float32", f"CPU has no native bf16 (flags: {shown}; no {'/'.join(NATIVE_BF16_FLAGS)})")
    restriction = isa_restriction(env)
    if restriction:
        return DtypeChoice("float32", f"{restriction} keeps the CPU off its native bf16 ({', '.join(native)})")
    return DtypeChoice("bfloat16", f"CPU multiplies bf16 natively (flags: {shown})")


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The first processor's flags from ``cpuinfo`` (Linux), or None where it has none."""
    try:
        text = Path(cpuinfo).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return None


def machine_dtype(device_type: str) -> DtypeChoice:
    """``choose_dtype`` for this machine: its CPU flags (where /proc/cpuinfo has none, oneDNN's own
    bf16 check stands in), its environment and, on a GPU, torch's bf16 check."""
    flags = cpu_flags()
    if flags is None:
        from .models import cpu_has_bf16

        flags = frozenset({"avx512_bf16"}) if cpu_has_bf16() else frozenset()
    cuda_bf16 = device_type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return choose_dtype(flags, device_type, os.environ, cuda_bf16)
