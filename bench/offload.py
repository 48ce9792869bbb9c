"""Offloading benchmark (a target streamed from disk every pass): served methods vs a library baseline.

    python -m bench.offload --config configs/offload.yaml --num-prompts 4 --max-new-tokens 64 \\
        --out bench/out/offload

One run, on an otherwise idle machine:

1. the disk's raw direct-read MB/s (O_DIRECT reads of the target's safetensors file);
2. the Serve app of ``--config`` (its target must set ``offload``) on loopback; each prompt runs
   every method in turn (interleaved) through gRPC. Around each generation the verifier actor's
   own ``/proc/<pid>/io`` gives bytes read, and a sampler its peak anonymous RSS (``RssAnon``,
   every 50 ms) and ``VmHWM`` (reset per generation through ``/proc/<pid>/clear_refs``);
3. after Serve stops, the library baseline in this process: transformers ``generate`` with
   accelerate's disk offload (``device_map`` "disk" for every decoder layer; accelerate reads
   them from the safetensors file through a memory map), the file's pages dropped before every
   forward so that it reads the disk as ours does; and DeepSpeed ZeRO-Inference's status.

Writes ``OUT/results.json``, ``OUT/results.md`` and ``OUT/offload.png``.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import mmap
import os
import platform
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.report import bar_panels, optional
from bench.machine import with_machine

logger = logging.getLogger("bench.offload")

METHODS = ("incremental", "sequence:4", "tree")


def direct_read_mbps(path: str, total: int = 1 << 30, chunk: int = 16 << 20, threads: int = 2) -> float:
    """MB/s of O_DIRECT reads of ``total`` bytes from the middle of ``path`` (``threads`` in flight)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    size = os.fstat(fd).st_size
    start = max(0, (size - total) // 2) // 4096 * 4096
    buffers = [mmap.mmap(-1, chunk) for _ in range(threads)]
    offsets = list(range(start, min(size, start + total) - chunk, chunk))

    def read(index: int) -> int:
        return os.preadv(fd, [buffers[index % threads]], offsets[index])

    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(read, range(len(offsets))))
    elapsed = time.perf_counter() - began
    os.close(fd)
    return done / elapsed / 1e6


def read_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/io") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("read_bytes"))


def memory_kb(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as handle:
        return {line.split(":")[0]: int(line.split()[1]) for line in handle if line.startswith(("RssAnon", "VmHWM", "VmRSS"))}


class Watch:
    """Bytes read, peak anonymous RSS and VmHWM of process ``pid`` over a ``with`` block."""

    def __init__(self, pid: int, interval_s: float = 0.05):
        self.pid, self.interval_s = pid, interval_s
        self.peak_anon_kb = 0
        self.stop = threading.Event()

    def __enter__(self) -> "Watch":
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as handle:
                handle.write("5")  # reset VmHWM (peak RSS)
        except OSError:
            pass
        self.bytes_before = read_bytes(self.pid)
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak_anon_kb = max(self.peak_anon_kb, memory_kb(self.pid)["RssAnon"])
            self.stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.bytes_read = read_bytes(self.pid) - self.bytes_before
        self.hwm_kb = memory_kb(self.pid)["VmHWM"]


@dataclass(frozen=True)
class Row:
    prompt_id: str
    method: str
    new_tokens: int
    target_steps: int
    latency_ms: float  # the client's, prefill included
    decode_ms: float  # the server's speculative steps after prefill (draft, merge, verify, transport)
    draft_ms: float
    verify_ms: float
    bytes_read: int
    peak_anon_mb: float
    hwm_mb: float
    token_ids: tuple[int, ...]
    tree_nodes: float = 0.0  # mean draft tokens per verify pass

    def line(self) -> str:
        return (f"{self.prompt_id} {self.method}: {self.new_tokens} tokens in {self.target_steps} passes, "
                f"{self.latency_ms / max(self.new_tokens, 1):.0f} ms/token end to end, "
                f"{self.bytes_read / 1e6 / max(self.new_tokens, 1):.0f} MB read/token, peak anon {self.peak_anon_mb:.0f} MB")


def verifier_pid() -> int:
    """The process id of the replica's verifier actor (named ``<app>/<replica>/verifier``)."""
    import ray

    named = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("/verifier")]
    if len(named) != 1:
        raise RuntimeError(f"expected one verifier actor, found {named}")
    actor = ray.get_actor(named[0]["name"], namespace=named[0]["namespace"])
    return int(ray.get(actor.__ray_call__.remote(lambda instance: os.getpid())))


def run_served(config_path: str, prompts, methods, max_new_tokens: int, warmup_tokens: int) -> list[Row]:
    """Every prompt x method through gRPC (interleaved), watched in the verifier actor's process."""
    from bench.local_app import start_app
    from bench.runners import grpc_request
    from cluster.cli_serve import stop_serving
    from cluster.serve_client import Client, response_dict
    from engine.sampling import SamplingParams

    address = start_app(config_path, lambda args: args, ready_timeout_s=1800)
    rows: list[Row] = []
    try:
        pid, client = verifier_pid(), Client(address)
        for method in methods:  # warm-up, not recorded
            client.generate(grpc_request(method, prompts[0], warmup_tokens, SamplingParams()), timeout=3600)
        for prompt in prompts:
            for method in methods:
                request = grpc_request(method, prompt, max_new_tokens, SamplingParams())
                with Watch(pid) as watch:
                    began = time.perf_counter()
                    data = response_dict(client.generate(request, timeout=3600))
                    latency_ms = (time.perf_counter() - began) * 1e3
                rows.append(served_row(prompt.id, method.spelling, data, latency_ms, watch))
                logger.info("%s", rows[-1].line())
        client.close()
    finally:
        stop_serving()
    return rows


def served_row(prompt_id: str, method: str, data: dict, latency_ms: float, watch: Watch) -> "Row":
    stats = data["stats"]
    return Row(prompt_id, method, int(stats["new_tokens"]), int(stats["target_steps"]), latency_ms,
               sum(stats.get("hop_ms", {}).values()), float(stats["draft_ms"]), float(stats["verify_ms"]),
               watch.bytes_read, watch.peak_anon_kb / 1024, watch.hwm_kb / 1024, tuple(data["token_ids"]),
               sum(stats["tree_sizes"]) / max(len(stats["tree_sizes"]), 1))


def run_accelerate(target_dir: str, prompts, max_new_tokens: int, torch_threads: int) -> list[Row]:
    """transformers generate with accelerate's disk offload of every decoder layer (greedy, one
    prompt at a time); the safetensors file's unmapped pages are dropped before every forward."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(torch_threads)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": "disk" for i in range(config["num_hidden_layers"])}}
    folder = tempfile.mkdtemp(prefix="specinfer-accelerate-")
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16, device_map=device_map,
                                                 offload_folder=folder)
    files = glob.glob(os.path.join(target_dir, "*.safetensors"))

    def drop_pages(module, args) -> None:
        for path in files + glob.glob(os.path.join(folder, "*")):
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # mapped (resident) pages stay
            os.close(fd)

    model.register_forward_pre_hook(drop_pages)
    passes: list[float] = []  # each forward's ms; the first of a generation is the prefill
    began_pass = {}
    model.register_forward_pre_hook(lambda module, args: began_pass.__setitem__("t", time.perf_counter()))
    model.register_forward_hook(lambda module, args, out: passes.append((time.perf_counter() - began_pass["t"]) * 1e3))
    rows = []
    for prompt in prompts:
        generation = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                                      pad_token_id=0)
        passes.clear()
        with Watch(os.getpid()) as watch:
            began = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(torch.tensor([list(prompt.ids)]), generation_config=generation)
            latency_ms = (time.perf_counter() - began) * 1e3
        tokens = tuple(out[0, len(prompt.ids):].tolist())
        rows.append(Row(prompt.id, "accelerate-disk", len(tokens), len(passes), latency_ms, sum(passes[1:]),
                        0.0, sum(passes[1:]), watch.bytes_read, watch.peak_anon_kb / 1024, watch.hwm_kb / 1024, tokens))
        logger.info("%s", rows[-1].line())
    return rows


def deepspeed_status() -> dict:
    """Whether DeepSpeed ZeRO-Inference can stream weights from disk here (its NVMe tier needs the
    async_io op, built against libaio)."""
    try:
        import deepspeed
        from deepspeed.ops.op_builder import AsyncIOBuilder

        aio = bool(AsyncIOBuilder().is_compatible(verbose=False))
        return {"version": deepspeed.__version__, "async_io_compatible": aio,
                "why_not_run": None if aio else (
                    "ZeRO-Inference streams weights from disk only through its NVMe tier (offload_param device "
                    "nvme), which needs DeepSpeed's async_io op: libaio's headers and library are absent and no "
                    "system packages can be installed here. Its other tier (offload_param device cpu) keeps "
                    "every weight in host RAM: on a CPU-only box that is no offloading at all.")}
    except ImportError as error:
        return {"version": None, "why_not_run": f"deepspeed not importable: {error}"}


def summarize(rows: list[Row]) -> dict[str, dict]:
    """Per method: ms per token (end to end and decode steps), tokens per pass, MB read per token,
    peak anonymous RSS; speedups against incremental and sequence:4 (decode ms per token)."""
    out: dict[str, dict] = {}
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        tokens = sum(r.new_tokens for r in mine)
        decode = sum(r.decode_ms for r in mine)
        out[method] = {
            "prompts": len(mine), "new_tokens": tokens,
            "ms_per_token_end_to_end": sum(r.latency_ms for r in mine) / tokens,
            "decode_ms_per_token": decode / max(tokens - len(mine), 1),
            "tokens_per_pass": tokens / max(sum(r.target_steps for r in mine), 1),
            "mb_read_per_token": sum(r.bytes_read for r in mine) / 1e6 / tokens,
            "peak_anon_rss_mb": max(r.peak_anon_mb for r in mine), "peak_rss_mb": max(r.hwm_mb for r in mine),
            "mean_tree_nodes": sum(r.tree_nodes for r in mine) / len(mine),
        }
    for key in ("incremental", "sequence:4"):
        base = out.get(key, {}).get("decode_ms_per_token")
        for values in out.values():
            mine = values["decode_ms_per_token"]
            values[f"speedup_vs_{key}"] = base / mine if base and mine else None
        base = out.get(key, {}).get("ms_per_token_end_to_end")
        for values in out.values():
            values[f"end_to_end_speedup_vs_{key}"] = base / values["ms_per_token_end_to_end"] if base else None
    return out


def markdown(result: dict) -> str:
    lines = [f"# Offloading benchmark ({result['started']})", "",
             f"{result['setup']}", "", f"Raw O_DIRECT read of the target file: {result['direct_read_mbps']:.0f} MB/s", "",
             "| method | decode ms/token | speedup vs incremental | vs sequence:4 | end-to-end ms/token | tokens/pass "
             "| draft nodes/pass | MB read/token | peak anon RSS MB | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, v in result["summary"].items():
        lines.append(f"| {method} | {optional(v['decode_ms_per_token'], '.0f')} | {optional(v['speedup_vs_incremental'])} | "
                     f"{optional(v['speedup_vs_sequence:4'])} | {v['ms_per_token_end_to_end']:.0f} | "
                     f"{v['tokens_per_pass']:.2f} | {v['mean_tree_nodes']:.1f} | {v['mb_read_per_token']:.0f} | "
                     f"{v['peak_anon_rss_mb']:.0f} | {v['peak_rss_mb']:.0f} |")
    lines += ["", f"Greedy outputs equal to incremental's: {result['outputs_equal_incremental']}",
              f"DeepSpeed ZeRO-Inference: {result['deepspeed']}"]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    methods = list(summary)
    bar_panels(path, methods, [
        ("ms per token (end to end)", {"ms per token": [summary[m]["ms_per_token_end_to_end"] for m in methods]}),
        ("MB read per token", {"MB read": [summary[m]["mb_read_per_token"] for m in methods]})])


def outputs_equal(rows: list[Row]) -> dict[str, str]:
    """Per method: how many prompts gave incremental's tokens exactly (bf16 batched passes may round
    differently: exactness is asserted in fp32 by the tests)."""
    base = {r.prompt_id: r.token_ids for r in rows if r.method == "incremental"}
    out = {}
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method and r.prompt_id in base]
        same = sum(r.token_ids == base[r.prompt_id] for r in mine)
        out[method] = f"{same}/{len(mine)}"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/offload.yaml", help="Serve config whose target sets offload")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--baseline-prompts", type=int, default=1, help="prompts for accelerate (0: skip)")
    parser.add_argument("--baseline-tokens", type=int, default=16)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from bench.methods import resolve_methods
    from bench.workloads import load_workload
    from cluster.build import set_threads
    from engine.models import load_header
    from actors.loading import model_spec
    from settings.config import load_config

    config = load_config(args.config)
    if config.target.offload is None:
        raise SystemExit(f"{args.config}: target.offload is not set")
    spec = model_spec(config, config.target)
    header = load_header(spec)
    prompts = load_workload("humaneval", header.tokenizer, args.num_prompts)
    methods = resolve_methods(args.methods.split(","), config, via="grpc")
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    mbps = direct_read_mbps(os.path.join(spec.source, "model.safetensors"), threads=config.target.offload.read_threads)
    logger.info("raw direct read: %.0f MB/s", mbps)
    rows = run_served(args.config, prompts, methods, args.max_new_tokens, args.warmup_tokens)
    if args.baseline_prompts:
        set_threads(config.torch_threads)
        rows += run_accelerate(spec.source, prompts[: args.baseline_prompts], args.baseline_tokens,
                               config.torch_threads or 2)
    result = {
        "started": started, "config": args.config, "offload": config.target.offload.model_dump(),
        "setup": (f"{config.target.name} ({config.dtype}) streamed from disk, {config.ssms[0].name} SSM; "
                  f"HumanEval {len(prompts)} prompts x {args.max_new_tokens} tokens, served (gRPC); accelerate "
                  f"baseline {args.baseline_prompts} prompt(s) x {args.baseline_tokens} tokens in-process; "
                  f"{os.cpu_count()} CPUs, {platform.machine()}"),
        "direct_read_mbps": mbps, "summary": summarize(rows), "outputs_equal_incremental": outputs_equal(rows),
        "deepspeed": deepspeed_status(), "rows": [asdict(r) for r in rows],
    }
    (args.out / "results.json").write_text(json.dumps(with_machine(result), indent=1))
    (args.out / "results.md").write_text(markdown(result))
    plot(result["summary"], args.out / "offload.png")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
