"""``dtype: auto``: the decision table, this machine's probe, the config, the loader and the
verify-cost curve check (engine.dtypes, engine.budget.grows_with_tokens, actors.loading)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pydantic
import pytest
import torch

from actors.loading import auto_chose_cpu_bf16, check_bf16_curve, load_configured, with_dtype_resolved
from engine.budget import grows_with_tokens
from engine.dtypes import choose_dtype, cpu_flags, isa_restriction, machine_dtype
from engine.models import DTYPES
from settings.config import EngineConfig, load_config
from tests.serving_fixtures import save_tiny_llama, save_tokenizer

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}
BF16 = AVX512 | {"avx512_bf16"}
AMX = BF16 | {"amx_tile", "amx_bf16", "amx_int8"}
AMX_ONLY = AVX512 | {"amx_tile", "amx_bf16"}  # AMX without the AVX512-BF16 flag still multiplies bf16 natively


@pytest.mark.parametrize("flags,device,env,cuda_bf16,dtype,why", [
    (AVX2, "cpu", {}, False, "float32", "CPU has no native bf16 (flags: avx2; no avx512_bf16/amx_bf16)"),
    (AVX512, "cpu", {}, False, "float32", "no native bf16 (flags: avx2, avx512f;"),
    (frozenset(), "cpu", {}, False, "float32", "flags: none of avx2/avx512f/avx512_bf16/amx_bf16"),
    (BF16, "cpu", {}, False, "bfloat16", "natively (flags: avx2, avx512f, avx512_bf16)"),
    (AMX, "cpu", {}, False, "bfloat16", "avx512_bf16, amx_bf16"),
    (AMX_ONLY, "cpu", {}, False, "bfloat16", "amx_bf16"),
    # Environment caps: a native-bf16 box emulating an AVX2 one, or one capped at AVX512 without bf16
    (AMX, "cpu", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, False, "float32", "ONEDNN_MAX_CPU_ISA=AVX2 keeps"),
    (BF16, "cpu", {"ONEDNN_MAX_CPU_ISA": "avx512_core"}, False, "float32", "ONEDNN_MAX_CPU_ISA=avx512_core"),
    (BF16, "cpu", {"DNNL_MAX_CPU_ISA": "AVX2"}, False, "float32", "DNNL_MAX_CPU_ISA=AVX2"),
    (BF16, "cpu", {"ATEN_CPU_CAPABILITY": "avx2"}, False, "float32", "ATEN_CPU_CAPABILITY=avx2"),
    (BF16, "cpu", {"ATEN_CPU_CAPABILITY": "default"}, False, "float32", "ATEN_CPU_CAPABILITY=default"),
    (BF16, "cpu", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, False, "bfloat16", "natively"),
    (AMX, "cpu", {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX", "ATEN_CPU_CAPABILITY": "avx512"}, False, "bfloat16", ""),
    (BF16, "cpu", {"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": ""}, False, "bfloat16", ""),
    (AVX2, "cpu", {"ONEDNN_MAX_CPU_ISA": "ALL"}, False, "float32", "no native bf16"),  # a cap cannot add bf16
    # On a GPU the CPU does not matter
    (AVX2, "cuda", {}, True, "bfloat16", "the GPU supports bf16"),
    (AMX, "cuda", {}, False, "float32", "the GPU does not support bf16"),
    (AVX2, "cuda", {"ONEDNN_MAX_CPU_ISA": "AVX2"}, True, "bfloat16", "GPU"),
])
def test_auto_dtype_decision_table(flags, device, env, cuda_bf16, dtype, why):
    choice = choose_dtype(flags, device, env, cuda_bf16)
    assert choice.dtype == dtype
    assert why in choice.reason
    assert choice.describe() == f"dtype auto -> {dtype}: {choice.reason}"


def test_an_unknown_device_type_is_refused():
    with pytest.raises(ValueError, match="unknown device type 'mps'"):
        choose_dtype(BF16, "mps", {})


@pytest.mark.parametrize("env,restriction", [
    ({}, None), ({"ONEDNN_MAX_CPU_ISA": ""}, None), ({"ONEDNN_MAX_CPU_ISA": " avx10_1_512_amx "}, None),
    ({"ONEDNN_MAX_CPU_ISA": "AVX2_VNNI"}, "ONEDNN_MAX_CPU_ISA=AVX2_VNNI"),
    ({"ONEDNN_MAX_CPU_ISA": "AVX-2"}, "ONEDNN_MAX_CPU_ISA=AVX-2"),  # unrecognised: counted as a cap
    ({"ATEN_CPU_CAPABILITY": "AVX512"}, None), ({"ATEN_CPU_CAPABILITY": "zvector"}, "ATEN_CPU_CAPABILITY=zvector"),
])
def test_isa_restriction_reads_onednn_and_aten_caps(env, restriction):
    assert isa_restriction(env) == restriction


def test_cpu_flags_read_the_first_processor(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx2", "avx512_bf16"})
    info.write_text("processor\t: 0\nFeatures\t: fp asimd\n")  # an Arm CPU names them otherwise
    assert cpu_flags(info) is None
    assert cpu_flags(tmp_path / "missing") is None


def test_this_machine_resolves_by_its_own_flags(monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    flags = cpu_flags() or frozenset()
    native = bool(flags & {"avx512_bf16", "amx_bf16"})
    assert machine_dtype("cpu").dtype == ("bfloat16" if native else "float32")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # any box emulates an AVX2 one
    choice = machine_dtype("cpu")
    assert choice.dtype == "float32"
    assert ("ONEDNN_MAX_CPU_ISA=AVX2" if native else "no native bf16") in choice.reason


# ------------------------------------------------------------------------------------------------
# The config


def test_auto_is_the_default_dtype_and_each_shipped_default_config_uses_it():
    config = EngineConfig.model_validate({"target": {"name": "t", "source": "t"}})
    assert config.dtype == "auto" and config.model_dtype(config.target) == "auto"
    for path in ("configs/default.yaml", "configs/serve.yaml"):
        assert load_config(path).dtype == "auto", path
    assert load_config("configs/smollm2-fp32.yaml").dtype == "float32"
    assert load_config("configs/default.yaml", dtype="float32").dtype == "float32"  # --dtype overrides


@pytest.mark.parametrize("where", ["top", "model"])
def test_a_nonsense_dtype_is_refused_naming_the_choices(where):
    data = {"target": {"name": "t", "source": "t"}}
    if where == "top":
        data["dtype"] = "bf16"
    else:
        data["target"]["dtype"] = "bf16"
    with pytest.raises(pydantic.ValidationError) as error:
        EngineConfig.model_validate(data)
    message = str(error.value)
    assert "dtype" in message and "'auto', 'float32', 'bfloat16' or 'float16'" in message


def test_cpu_linears_need_the_resolved_dtype_under_auto():
    config = EngineConfig.model_validate({"target": {"name": "t", "source": "t"}})
    with pytest.raises(ValueError, match="t: dtype auto must be resolved"):
        config.linears_for(config.target)
    assert config.linears_for(config.target, "float32") == "onednn"
    assert config.linears_for(config.target, "bfloat16") == "onednn_packed"


def test_generate_cli_accepts_auto():
    import argparse

    from cluster import cli_generate

    parser = argparse.ArgumentParser()
    cli_generate.add_parsers(parser.add_subparsers(dest="command", required=True))
    assert parser.parse_args(["generate", "--config", "c", "--prompt", "p", "--dtype", "auto"]).dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--config", "c", "--prompt", "p", "--dtype", "bf16"])


# ------------------------------------------------------------------------------------------------
# Loading under auto


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-auto")
    save_tiny_llama(path, len(save_tokenizer(path)), hidden=32, layers=1, heads=2, seed=3)
    return path


def auto_config(tiny_dir, **fields) -> EngineConfig:
    return EngineConfig.model_validate({"dtype": "auto", "device": "cpu", **fields,
                                        "target": {"name": "tiny", "source": str(tiny_dir)}})


def test_a_model_loaded_under_auto_has_the_machines_dtype_and_says_why(tiny_dir, caplog, monkeypatch):
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    expected = machine_dtype("cpu")
    config = auto_config(tiny_dir)
    with caplog.at_level(logging.INFO, logger="actors.loading"):
        loaded = load_configured(config, config.target)
    assert loaded.spec.dtype == expected.dtype
    assert {p.dtype for p in loaded.model.parameters()} == {DTYPES[expected.dtype]}
    lines = [r.getMessage() for r in caplog.records if "dtype auto" in r.getMessage()]
    assert lines == [f"tiny: {expected.describe()}"]  # one line per loaded model
    assert auto_chose_cpu_bf16(config, loaded) == (expected.dtype == "bfloat16")


def test_an_isa_cap_loads_float32_and_an_explicit_dtype_is_kept(tiny_dir, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    config = auto_config(tiny_dir)
    loaded = load_configured(config, config.target)
    assert loaded.spec.dtype == "float32" and loaded.model.dtype == torch.float32
    assert not auto_chose_cpu_bf16(config, loaded)
    pinned = auto_config(tiny_dir, dtype="bfloat16")
    assert load_configured(pinned, pinned.target).model.dtype == torch.bfloat16  # bf16 as asked, even emulated
    assert with_dtype_resolved(config).dtype == "float32" and with_dtype_resolved(pinned) is pinned


def test_auto_resolves_for_the_device_the_model_runs_on(tiny_dir, monkeypatch):
    """A tensor-parallel rank loads on the CPU for its GPU: auto resolves for the GPU."""
    import engine.dtypes as dtypes

    seen = []
    monkeypatch.setattr(dtypes, "choose_dtype", lambda flags, device, env, cuda_bf16: seen.append(device)
                        or dtypes.DtypeChoice("float32", "test"))
    import actors.loading as loading

    config = auto_config(tiny_dir)
    assert loading.resolved_dtype(config, config.target, "cuda") == "float32"
    assert loading.resolved_dtype(config, config.target) == "float32"
    assert seen == ["cuda", "cpu"]


# ------------------------------------------------------------------------------------------------
# The verify-cost curve check


@pytest.mark.parametrize("curve,grows", [
    ({1: 255, 2: 420, 4: 760, 8: 1429, 16: 2800}, True),  # emulated bf16, 2-core AVX2 EPYC (5.6x at 8)
    ({1: 300, 2: 380, 4: 480, 8: 700, 16: 900}, False),  # float32 on oneDNN there (2.3x)
    ({1: 152, 4: 155, 8: 159, 32: 196}, False),  # native bf16 on AMX
    ({1: 100, 2: 150, 4: 300, 8: 300}, False),  # exactly 3x at 8 tokens: not above the limit (4 is not read)
    ({1: 100, 8: 299}, False), ({1: 100, 8: 301}, True),
    ({1: 255, 2: 420, 4: 760}, True),  # the budget's curve stopped at 4 tokens: against 1.5x there
    ({1: 255, 2: 300, 4: 370}, False),
    ({1: 255, 2: 600}, False),  # no pass of 4 or more tokens: nothing to tell
    ({2: 100, 8: 900}, False), ({}, False),
])
def test_grows_with_tokens(curve, grows):
    assert grows_with_tokens(curve) is grows


def test_an_emulated_looking_curve_warns_and_a_flat_one_does_not(caplog):
    with caplog.at_level(logging.WARNING, logger="actors.loading"):
        assert check_bf16_curve("target", {1: 300, 4: 480, 8: 700}) is False
        assert check_bf16_curve("target", None) is False
        assert not caplog.records
        assert check_bf16_curve("target", {1: 255.04, 8: 1429.0}) is True
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "bf16 looks emulated on this CPU" in record.getMessage() and "dtype: float32" in record.getMessage()
    assert "{1: 255.0, 8: 1429.0}" in record.getMessage()


@pytest.mark.parametrize("configured,loaded_dtype,device,expected", [
    ("auto", "bfloat16", "cpu", True), ("auto", "float32", "cpu", False), ("bfloat16", "bfloat16", "cpu", False),
    ("auto", "bfloat16", "cuda", False), ("auto", "bfloat16", None, False)])  # None: a tensor-parallel header
def test_the_curve_is_checked_only_where_auto_chose_bf16_on_the_cpu(configured, loaded_dtype, device, expected):
    config = EngineConfig.model_validate({"dtype": configured, "target": {"name": "t", "source": "t"}})
    model = SimpleNamespace(device=torch.device(device)) if device else SimpleNamespace()
    loaded = SimpleNamespace(spec=SimpleNamespace(dtype=loaded_dtype), model=model)
    assert auto_chose_cpu_bf16(config, loaded) is expected


EMULATED = {1: 255.0, 2: 420.0, 4: 760.0, 8: 1429.0}


@pytest.mark.parametrize("where", ["in-process", "verifier"])
@pytest.mark.parametrize("chosen,warns", [("bfloat16", True), ("float32", False)])
def test_the_start_curve_warns_where_auto_chose_bf16_and_it_looks_emulated(where, chosen, warns, tiny_dir,
                                                                            monkeypatch, caplog):
    """Both places that measure the curve at start (cluster.build for the in-process engine, the
    verifier actor when served) check it; the model stays in the dtype auto chose."""
    import actors.loading as loading
    import actors.verifier as verifier
    import cluster.build as build
    from engine.dtypes import DtypeChoice

    monkeypatch.setattr(loading, "machine_dtype", lambda device_type: DtypeChoice(chosen, "test"))
    config = auto_config(tiny_dir, torch_threads=torch.get_num_threads(), suffix=None,
                         ssms=[{"name": "ssm", "source": str(tiny_dir)}],
                         speculation={"policy": "cost", "cost": {"curve_max_tokens": 8}},
                         server={"batching": {"enabled": False}})
    with caplog.at_level(logging.INFO):
        if where == "in-process":
            monkeypatch.setattr(build, "measure_target_curve", lambda *args, **kwargs: dict(EMULATED))
            model = build.build_engine(config).target.model
        else:
            monkeypatch.setattr(verifier, "measure_target_curve", lambda *args, **kwargs: dict(EMULATED))
            monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # the actor's set-up sets it
            actor = verifier.VerifierActor(config, torch.get_num_threads())
            try:
                assert actor.measure_verify_cost() == EMULATED
            finally:
                actor._stop_sweeper.set()
            model = actor.target.model
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
                and "bf16 looks emulated" in r.getMessage()]
    assert len(warnings) == (1 if warns else 0)
    assert model.dtype == DTYPES[chosen]  # not reloaded
