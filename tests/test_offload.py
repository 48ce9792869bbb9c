"""Offloading (engine.offload): streamed targets give the resident target's greedy output, read
the file every pass, recover from a failed pass, and are configured with clear errors."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from engine.draft import ModelDrafter
from engine.generate import SpeculativeEngine
from engine.models import ModelSpec
from engine.checkpoint import Checkpoint, TensorEntry
from engine.offload import ALIGN, OffloadSpec, load_offloaded, plan_layer, streamer_of
from engine.paged_models import PagedTarget, paged_parts
from engine.requests import GenerationRequest, SpeculationOptions
from engine.target import TargetModel
from serving_fixtures import local_engine, own_app, ray_session, serving, tiny_args, tiny_models  # noqa: F401
from settings.config import EngineConfig
from test_serving import PROMPTS, local_result
from tests.tiny_models import IdTokenizer, greedy_to_eos, reference_greedy, tiny_model

PROMPT = [5, 9, 3, 5, 9, 11, 7, 5, 9, 3, 17, 2]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """A 4-layer target and a 1-layer SSM saved as safetensors (float32)."""
    root = tmp_path_factory.mktemp("offload-models")
    dirs = {}
    for name, layers, seed in (("target", 4, 1), ("ssm", 1, 2)):
        model = tiny_model("qwen2", 151, layers=layers, seed=seed)
        model.save_pretrained(root / name)
        with open(root / name / "model.safetensors", "rb+") as handle:
            os.fsync(handle.fileno())  # dirty pages cannot be dropped: written back, the fadvise tier reads them
        dirs[name] = root / name
    return dirs


class StubAutoTokenizer:
    """The tiny directories have no tokenizer files; the engines here decode with IdTokenizer."""

    @staticmethod
    def from_pretrained(*args, **kwargs):
        return IdTokenizer()


def offloaded(directory: Path, spec: OffloadSpec):
    """The streamed model of a tiny directory."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("engine.offload.AutoTokenizer", StubAutoTokenizer)
        return load_offloaded(ModelSpec("target", str(directory), "float32", device="cpu"), spec).model


@pytest.mark.parametrize("spans,expected_runs,expected_offsets", [
    # one file, adjacent tensors: one aligned run; pieces keep their offsets inside it
    ([("a", 5000, 6000), ("b", 6000, 9000)], [(4096, 8192, 0)], {"a": 904, "b": 1904}),
    # a gap over 1 MiB splits the run; the second lands after the first in the slot
    ([("a", 0, 100), ("b", 3 << 20, (3 << 20) + 10)], [(0, 4096, 0), (3 << 20, 4096, 4096)], {"a": 0, "b": 4096}),
    # listed out of order: runs follow file order
    ([("b", 8192, 8200), ("a", 4096, 8192)], [(4096, 8192, 0)], {"a": 0, "b": 4096}),
])
def test_plan_layer(spans, expected_runs, expected_offsets):
    named = {key: TensorEntry(Path("f"), torch.float32, ((end - start) // 4,), start) for key, start, end in spans}
    plan = plan_layer(named)
    assert [(r.start, r.length, r.into) for r in plan.runs] == expected_runs
    assert {p.key: p.offset for p in plan.pieces} == expected_offsets
    assert all(r.start % ALIGN == 0 and r.length % ALIGN == 0 for r in plan.runs)
    assert plan.nbytes == sum(r.length for r in plan.runs)


def test_checkpoint_entries_match_the_saved_tensors(tiny_dirs):
    """The byte spans the layer plans read (engine.checkpoint's header reader)."""
    from safetensors.torch import load_file

    entries = Checkpoint.open(tiny_dirs["target"]).entries
    saved = load_file(tiny_dirs["target"] / "model.safetensors")
    assert set(entries) == set(saved)
    with open(tiny_dirs["target"] / "model.safetensors", "rb") as handle:
        for key, entry in entries.items():
            handle.seek(entry.offset)
            raw = torch.frombuffer(bytearray(handle.read(entry.end - entry.offset)), dtype=torch.uint8)
            assert torch.equal(raw.view(entry.dtype).view(entry.shape), saved[key])


SPECS = [
    OffloadSpec("disk", 0, 1, direct_io=True, read_threads=1),
    OffloadSpec("disk", 0, 2, direct_io=True, read_threads=2),
    OffloadSpec("disk", 2, 1, direct_io=False),
    OffloadSpec("host", 0, 2),
    OffloadSpec("host", 3, 4),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.tier}-r{s.resident_layers}-p{s.prefetch_layers}-"
                                                      f"{'direct' if s.direct_io else 'fadvise'}")
@pytest.mark.parametrize("mode,expansion", [("incremental", (1,)), ("sequence", (1,)), ("tree", (3, 2, 1, 1))])
def test_streamed_greedy_equals_resident_and_generate(tiny_dirs, spec, mode, expansion):
    resident = tiny_model("qwen2", 151, layers=4, seed=1)
    model = offloaded(tiny_dirs["target"], spec)
    ssm = tiny_model("qwen2", 151, layers=1, seed=2)
    options = SpeculationOptions(mode=mode, expansion=expansion, sequence_depth=3, proposers=("ssm",),
                                 policy="schedule")
    request = GenerationRequest(tuple(PROMPT), 40, speculation=options)
    outputs = [SpeculativeEngine(TargetModel(m), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), set())
               .generate(request).token_ids for m in (model, resident)]
    expected = reference_greedy(resident, PROMPT, 40)
    assert list(outputs[0]) == list(outputs[1]) == expected
    stats = streamer_of(model).stats()
    streamed = 4 - spec.resident_layers
    assert stats.layers_loaded >= stats.passes * streamed  # every pass loaded every streamed layer again


def test_paged_target_over_a_streamed_model(tiny_dirs):
    """Continuous batching's packed forwards use the streamed model unchanged."""
    model = offloaded(tiny_dirs["target"], OffloadSpec("disk", 1, 2))
    resident = tiny_model("qwen2", 151, layers=4, seed=1)
    ssm = tiny_model("qwen2", 151, layers=1, seed=2)
    pool, batcher = paged_parts(model, 1024, 16)
    engine = SpeculativeEngine(PagedTarget(model, pool, batcher), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), set())
    options = SpeculationOptions(mode="tree", expansion=(2, 2, 1), proposers=("ssm",), policy="schedule")
    result = engine.generate(GenerationRequest(tuple(PROMPT), 32, speculation=options))
    assert list(result.token_ids) == reference_greedy(resident, PROMPT, 32)


def proc_read_bytes() -> int:
    with open("/proc/self/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("read_bytes"))


@pytest.mark.parametrize("direct", [True, False])
def test_disk_tier_reads_the_file_every_pass(tiny_dirs, direct):
    """Each pass reads every streamed layer from the file again. With O_DIRECT, /proc/self/io's
    read_bytes (bytes fetched from the device, not the page cache) grows by at least the streamed
    layers' size; dropping pages after plain reads (direct_io: false) is best effort (the kernel
    may keep pages it has not yet put on its LRU lists), so there only the reads are counted."""
    model = offloaded(tiny_dirs["target"], OffloadSpec("disk", 0, 1, direct_io=direct))
    entries = Checkpoint.open(tiny_dirs["target"]).entries
    layer_bytes = sum(e.end - e.offset for k, e in entries.items() if k.startswith("model.layers."))
    target = TargetModel(model)
    state = target.new_state()
    target.prefill(state, PROMPT)
    streamer = streamer_of(model)
    assert streamer.wait_idle()  # the next pass's read-ahead is done, before and after: counts compare exactly
    before, stats_before = proc_read_bytes(), streamer.stats()
    for _ in range(3):
        target.prefill(state, [7])
    assert streamer.wait_idle()
    stats = streamer.stats()
    assert stats.passes - stats_before.passes == 3
    assert stats.bytes_read - stats_before.bytes_read >= 3 * layer_bytes
    if direct:
        assert proc_read_bytes() - before >= 3 * layer_bytes


@pytest.mark.parametrize("failing_layer", [0, 2, 3])
@pytest.mark.parametrize("prefetch", [1, 2, 3])
def test_a_failed_pass_leaves_the_next_pass_exact(tiny_dirs, failing_layer, prefetch):
    """A forward that raises at any layer (bound weights, requested read-ahead, stale loaded layers)
    is cleaned up: the next passes give the resident model's logits, and nothing hangs."""
    model = offloaded(tiny_dirs["target"], OffloadSpec("disk", 0, prefetch))
    resident = tiny_model("qwen2", 151, layers=4, seed=1)
    calls = {"n": 0}

    def fail_once(module, args):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")

    handle = model.model.layers[failing_layer].register_forward_pre_hook(fail_once)
    ids = torch.tensor([PROMPT])
    with pytest.raises(RuntimeError, match="injected"):
        model(input_ids=ids)
    handle.remove()
    with torch.inference_mode():
        for _ in range(3):
            assert torch.allclose(model(input_ids=ids).logits, resident(input_ids=ids).logits, atol=1e-5)


def test_a_read_error_fails_the_forward_not_hangs(tiny_dirs):
    model = offloaded(tiny_dirs["target"], OffloadSpec("disk", 0, 1))
    streamer = streamer_of(model)
    fetch = streamer.source.fetch
    streamer.source.fetch = lambda index, slot: (_ for _ in ()).throw(OSError("disk gone"))
    with pytest.raises(RuntimeError, match="reading decoder layer"):
        model(input_ids=torch.tensor([PROMPT]))
    streamer.source.fetch = fetch
    resident = tiny_model("qwen2", 151, layers=4, seed=1)
    with torch.inference_mode():
        assert torch.allclose(model(input_ids=torch.tensor([PROMPT])).logits,
                              resident(input_ids=torch.tensor([PROMPT])).logits, atol=1e-5)


def base_config(models_dir: Path, **target) -> dict:
    return {"models_dir": str(models_dir), "dtype": "float32",
            "target": {"name": "t", "source": "smollm2-135m-instruct", **target},
            "ssms": [{"name": "s", "source": "smollm2-135m-instruct", "num_layers": 8}]}


@pytest.mark.parametrize("change,message", [
    ({"ssms": [{"name": "s", "source": "x", "offload": {}}]}, "SSMs stay resident"),
    ({"verifier": {"tensor_parallel_size": 2}}, "tensor parallelism is not supported"),
    ({"target": {"name": "t", "source": "x", "quantize": "int8", "offload": {}}}, "cannot be combined"),
    ({"target": {"name": "t", "source": "x", "offload": {"tier": "tape"}}}, "tier"),
    ({"target": {"name": "t", "source": "x", "offload": {"prefetch_layers": 0}}}, "prefetch_layers"),
])
def test_config_errors(tmp_path, change, message):
    data = {**base_config(tmp_path, offload={}), **change}
    with pytest.raises(ValueError, match=message):
        EngineConfig.model_validate(data)


def test_offload_needs_a_safetensors_directory(tmp_path):
    with pytest.raises(ValueError, match="local directory of safetensors"):
        load_offloaded(ModelSpec("t", str(tmp_path / "model.gguf"), "float32", device="cpu"), OffloadSpec())
    (tmp_path / "config.json").write_text(json.dumps(tiny_model("qwen2", 64).config.to_dict()))
    with pytest.raises(ValueError, match="does not exist"):
        load_offloaded(ModelSpec("t", str(tmp_path), "float32", device="cpu"), OffloadSpec())


def test_smollm2_streamed_from_the_config(smollm2_dir):
    """As a user runs it: a config with target.offload, built by cluster.build; fp32 greedy output
    equals the resident target's generate(), in tree and sequence modes (incremental decoding of a
    streamed target: test_streamed_greedy_equals_resident_and_generate on tiny models)."""
    from cluster.build import build_engine

    config = EngineConfig.model_validate({
        **base_config(smollm2_dir.parent, offload={"tier": "disk", "resident_layers": 4, "prefetch_layers": 2}),
        "torch_threads": 2, "suffix": None, "speculation": {"policy": "schedule"}})
    engine = build_engine(config)
    model = engine.target.model
    assert streamer_of(model) is not None and len(streamer_of(model).streamed) == model.config.num_hidden_layers - 4
    from engine.models import load_model

    resident = load_model(ModelSpec("r", str(smollm2_dir), "float32", device="cpu")).model
    prompt = engine.tokenizer.encode("def fibonacci(n):\n")
    expected = greedy_to_eos(resident, prompt, 24, engine.eos_ids)
    for mode in ("sequence", "tree"):
        options = SpeculationOptions(mode=mode, expansion=(2, 2, 1, 1), sequence_depth=4, policy="schedule")
        result = engine.generate(GenerationRequest(tuple(prompt), 24, speculation=options))
        assert list(result.token_ids) == expected, mode


def test_packed_timer_prefills_once_for_a_whole_curve():
    """The verifier's verify-cost curve (measured at start) pays one prefix prefill for all sizes:
    with streamed weights every pass reads the whole model, so each saved pass is seconds."""
    from engine.budget import measure_curve
    from engine.packed import PagedModel
    from engine.kv_pool import BlockPool
    from engine.paged_models import packed_timer

    model = tiny_model("qwen2", 151, layers=2, seed=1)
    pool = BlockPool.for_tokens(512, 16)
    packed = PagedModel(model, pool)
    calls = []
    handle = model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                             with_kwargs=True)
    with packed_timer(packed, prefix=32, repeats=1) as time_pass:
        curve = measure_curve(time_pass, 4, float("inf"))
    handle.remove()
    assert sorted(curve) == [1, 2, 4]
    # one 32-token prefill, then (repeats + 1) passes per timing: sizes 1 (warm-up), 1, 2, 4, 1 (again)
    assert calls == [32] + [n for n in (1, 1, 2, 4, 1) for _ in range(2)]
    assert pool.num_free == pool.num_blocks  # the timing sequence gave its blocks back


def test_offload_preset_is_a_valid_serve_config():
    """configs/offload.yaml: what `specinfer serve --config` and `python -m bench.offload` read."""
    from cluster.cli_serve import load_serve_config
    from settings.config import load_config

    root = Path(__file__).resolve().parents[1]
    load_serve_config(root / "configs" / "offload.yaml")  # Ray Serve's own schema
    config = load_config(root / "configs" / "offload.yaml")
    assert config.target.offload is not None and config.target.offload.tier == "disk"
    assert config.cost_aware_shapes and config.speculation.cost.max_depth >= 12


def test_gpu_offload_script_runs_on_a_tiny_shape(tmp_path):
    """bench/gpu_offload.py (meant for a GPU) runs end to end on CPU with the tiny shape: streamed
    curve, three methods, every token generated, copies counted (bf16: outputs may round apart)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o.json"
    subprocess.run([sys.executable, str(root / "bench" / "gpu_offload.py"), "--shape", "tiny", "--device", "cpu",
                    "--tokens", "16", "--work", str(tmp_path / "work"), "--out", str(out)], check=True, timeout=600,
                   capture_output=True)
    result = json.loads(out.read_text())
    assert [r["method"] for r in result["rows"]] == ["incremental", "sequence:4", "tree"]
    assert [len(r["token_ids"]) for r in result["rows"]] == [16, 16, 16]
    assert set(result["curves_ms"]["streamed"]) == {"1", "2", "4", "8", "16", "32", "64", "128"}
    assert all(r["mb_copied_per_token"] > 0 for r in result["rows"])


# --- served ------------------------------------------------------------------------------------


def preset_offload() -> dict:
    """configs/offload.yaml's ``target.offload`` block (the shipped offloading preset)."""
    from cluster.cli_serve import load_serve_config
    from settings.config import engine_section

    path = Path(__file__).resolve().parents[1] / "configs" / "offload.yaml"
    return engine_section(load_serve_config(path), path)["target"]["offload"]


@pytest.mark.ray
def test_offloaded_target_served_over_grpc_equals_in_process(serving, tiny_args, local_engine):  # noqa: F811
    """configs/offload.yaml's offloading (every decoder layer read from the safetensors file on each
    pass, O_DIRECT, read ahead) on the serving tests' tiny models, served: the greedy tokens over gRPC
    are the in-process engine's on the same config, and the resident target's. The served verifier
    really streamed: a pass per target step at least, each loading every streamed layer."""
    import ray

    from cluster.build import build_engine
    from cluster.serve_client import build_request

    offload = preset_offload()
    args = {**tiny_args, "target": {**tiny_args["target"], "offload": offload}}
    _, offloaded_local = local_result(build_engine(EngineConfig.model_validate(args)), args, PROMPTS[1],
                                      max_new_tokens=40)
    _, resident = local_result(local_engine, tiny_args, PROMPTS[1], max_new_tokens=40)
    with own_app(serving, args, "specinfer-offload", "/offload") as (client, handle, _):
        reply = client.generate(build_request(PROMPTS[1], max_new_tokens=40), timeout=120)
        verifier = handle.actors.remote().result()["verifier"]
        stats = ray.get(verifier.__ray_call__.remote(lambda actor: streamer_of(actor.target.model).stats()),
                        timeout=60)
    assert list(reply.token_ids) == list(offloaded_local.token_ids) == list(resident.token_ids)
    assert len(reply.token_ids) == 40 and reply.stats.target_steps == offloaded_local.stats.target_steps
    streamed = local_engine.target.model.config.num_hidden_layers - offload["resident_layers"]
    assert streamed > 0 and stats.passes >= reply.stats.target_steps
    assert stats.layers_loaded >= stats.passes * streamed

