"""What a result file says about its machine: CPU model and ISA flags from /proc/cpuinfo, the commit."""

from __future__ import annotations

import subprocess

import pytest
import torch

from bench.machine import ISA_FLAGS, cpu_model, git_commit, isa_flags, machine, with_machine

AMX_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: another model on a later core
flags\t\t: fpu
"""
AVX2_EPYC = "model name\t: AMD EPYC 7B12\nflags\t\t: fpu sse avx avx2 fma\n"


def test_cpu_model_is_the_first_model_name():
    assert cpu_model(AMX_XEON) == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert cpu_model("processor : 0\n") is None


def test_isa_flags_tell_native_bf16_and_amx_from_avx2_only():
    assert isa_flags(AMX_XEON) == dict.fromkeys(ISA_FLAGS, True)
    assert isa_flags(AVX2_EPYC) == {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False,
                                    "amx_tile": False}
    assert isa_flags("") == dict.fromkeys(ISA_FLAGS, False)


def git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_git_commit_names_head_and_a_dirty_tree(tmp_path):
    assert git_commit(tmp_path) is None  # not a repository
    git(tmp_path, "init", "-q")
    (tmp_path / "f.txt").write_text("one")
    git(tmp_path, "add", "f.txt")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("not part of the run's code")
    assert git_commit(tmp_path) == head
    (tmp_path / "f.txt").write_text("two")
    assert git_commit(tmp_path) == f"{head}-dirty"


def test_machine_record_reads_the_given_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(AVX2_EPYC)
    record = machine(cpuinfo, repo=tmp_path)
    assert record["cpu_model"] == "AMD EPYC 7B12" and record["isa"]["avx2"] and not record["isa"]["amx_bf16"]
    assert record["torch_threads"] == torch.get_num_threads()
    assert record["commit"] is None and record["recorded"] == "at run time"
    assert record["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    assert machine(tmp_path / "missing", repo=tmp_path)["cpu_model"] is None


@pytest.mark.parametrize("env, cap", [
    ({}, None),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}, "ONEDNN_MAX_CPU_ISA=AVX2"),
    ({"ATEN_CPU_CAPABILITY": "avx2"}, "ATEN_CPU_CAPABILITY=avx2"),
    ({"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": "avx512"}, None),
])
def test_machine_record_names_what_capped_the_isa(tmp_path, env, cap):
    """A native-bf16 machine run as an AVX2 one says so in its record."""
    assert machine(tmp_path / "missing", repo=tmp_path, env=env)["isa_cap"] == cap


def test_with_machine_keeps_the_result_and_adds_the_record():
    result = {"rows": [1, 2]}
    recorded = with_machine(result)
    assert recorded["rows"] == [1, 2] and set(recorded["machine"]) >= {"cpu_model", "isa", "gpu", "commit"}
    assert "machine" not in result


def test_a_reports_machine_line_names_the_isa_cap():
    from bench.report import machine_lines

    record = {"cpu_model": "Xeon", "isa": {"avx2": True, "amx_bf16": True}, "isa_cap": "ONEDNN_MAX_CPU_ISA=AVX2",
              "gpu": None, "commit": "abc"}
    assert machine_lines(record) == ["CPU Xeon (avx2, amx_bf16, capped by ONEDNN_MAX_CPU_ISA=AVX2); GPU none; commit abc."]
    assert machine_lines({**record, "isa_cap": None}) == ["CPU Xeon (avx2, amx_bf16); GPU none; commit abc."]
