"""Asynchronous SSM prefetch benchmark: drafting beside verification, served, on one machine.

    python -m bench.prefetch --config configs/serve.yaml --num-prompts 20 --max-new-tokens 128 \\
        --out bench/out/prefetch

Overlap needs the SSM and the target on separate devices; here two cores stand in for them. The
Serve app of ``--config`` runs with batching off (one stream at a time: batching's packed forwards
would only add their waiting window) and ``speculation.prefetch`` set, twice, one placement after
the other:

- ``pinned``: ``server.ssm_actor.cpu_affinity`` [``--ssm-cpu``] and ``verifier.actor.cpu_affinity``
  [``--verifier-cpu``] (every thread of each process), one torch thread each;
- ``unpinned``: no affinity, the config's torch threads (the default).

The ingress, the merge actor and Ray's own processes are not pinned (they float). Within a
placement each prompt runs prefetch off and on in turn (interleaved; the request's
``speculation.prefetch``): methods ``pinned-off``, ``pinned-on``, ``unpinned-off``, ``unpinned-on``.
Torch's thread count is per thread once set, so a placement cannot change inside one app: the two
placements are two deployments, run one after the other. Writes ``OUT/results.json``,
``OUT/results.md`` and ``OUT/prefetch.png``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from bench.report import bar_panels, optional
from settings.config import APP_NAME
from bench.machine import with_machine

logger = logging.getLogger("bench.prefetch")

METHODS = ("pinned-off", "pinned-on", "unpinned-off", "unpinned-on")


@dataclass(frozen=True)
class Row:
    prompt_id: str
    method: str
    new_tokens: int
    target_steps: int
    latency_ms: float  # the client's, prefill included
    step_ms: float  # per verify step after the prefill (draft, merge, verify, transport)
    draft_ms: float  # per step: what the step waited for drafting (wall time minus verify)
    verify_ms: float  # per step, inside the verifier
    hits: int
    misses: int
    saved_ms: float
    tree_nodes: float  # mean draft tokens per step
    token_ids: tuple[int, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.latency_ms * 1e3


def affinities(app: str) -> dict[str, list[int]]:
    """The CPUs each of the app's SSM actors and its verifier may run on (read in the actor)."""
    import ray
    from ray import serve

    roles = serve.get_app_handle(app).actors.remote().result()

    def cpus(instance) -> list[int]:
        import os as os_

        return sorted(os_.sched_getaffinity(0))

    return {role: ray.get(actor.__ray_call__.remote(cpus), timeout=60) for role, actor in roles.items()}


def placed_args(app: dict, pinned: bool, cpus: tuple[int, int], prefetch: int, dtype: str | None) -> dict:
    """The engine args of one placement: batching off, prefetch on by default, the suffix proposer
    without its global store, pinned or not."""
    server = {**app.get("server", {}), "batching": {"enabled": False}}
    verifier = dict(app.get("verifier", {}))
    if pinned:
        server["ssm_actor"] = {**server.get("ssm_actor", {}), "cpu_affinity": [cpus[0]], "torch_threads": 1}
        verifier["actor"] = {**verifier.get("actor", {}), "cpu_affinity": [cpus[1]], "torch_threads": 1}
    suffix = app.get("suffix", {})  # no global store: a prompt's second method would be handed the first's answer
    suffix = None if suffix is None else {**suffix, "max_cached_requests": 0}
    return {**app, **({"dtype": dtype} if dtype else {}), "server": server, "verifier": verifier, "suffix": suffix,
            "speculation": {**app.get("speculation", {}), "prefetch": prefetch}}


def row(prompt_id: str, method: str, stats: dict, token_ids, latency_ms: float) -> Row:
    steps = max(int(stats["target_steps"]) - 1, 1)
    decode_ms = sum(stats["hop_ms"].values())
    return Row(prompt_id, method, int(stats["new_tokens"]), int(stats["target_steps"]), latency_ms,
               decode_ms / steps, (decode_ms - stats["hop_ms"]["verify"]) / steps, stats["hop_ms"]["verify"] / steps,
               int(stats["prefetch_hits"]), int(stats["prefetch_misses"]), float(stats["prefetch_saved_ms"]),
               sum(stats["tree_sizes"]) / max(len(stats["tree_sizes"]), 1), tuple(token_ids))


def run(address: str, prompts, methods, max_new_tokens: int, prefetch: int, warmup_tokens: int,
        app: str = APP_NAME, log: Path | None = None) -> list[Row]:
    """Every prompt x method through gRPC (interleaved); ``-on`` methods ask for ``prefetch``. Each
    row is appended to ``log`` (JSON lines) as it comes, so a cut-short run keeps what it measured."""
    from cluster.serve_client import Client, build_request, response_dict

    rows, client = [], Client(address, app)

    def generate(prompt, method: str, tokens: int) -> tuple[dict, float]:
        text = prompt.prompt.text
        request = build_request(None if prompt.prompt.chat else text, [("user", text)] if prompt.prompt.chat else (),
                                max_new_tokens=tokens, temperature=0.0,
                                prefetch=prefetch if method.endswith("-on") else 0)
        began = time.perf_counter()
        data = response_dict(client.generate(request, timeout=7200))
        return data, (time.perf_counter() - began) * 1e3

    for method in methods:  # warm-up, not recorded
        generate(prompts[0], method, warmup_tokens)
    for prompt in prompts:
        for method in methods:
            data, latency_ms = generate(prompt, method, max_new_tokens)
            rows.append(row(prompt.id, method, data["stats"], data["token_ids"], latency_ms))
            if log is not None:
                with log.open("a") as handle:
                    handle.write(json.dumps(asdict(rows[-1])) + "\n")
            r = rows[-1]
            logger.info("%s %s: %d tokens, %.0f ms/step (draft %.0f, verify %.0f), %.2f tok/s, hits %d misses %d",
                        r.prompt_id, method, r.new_tokens, r.step_ms, r.draft_ms, r.verify_ms, r.tokens_per_s,
                        r.hits, r.misses)
    client.close()
    return rows


def summarize(rows: list[Row]) -> dict[str, dict]:
    """Per method: tokens/s (summed tokens over summed latency), per-step ms (mean over prompts),
    hit rate; speedups against pinned-off."""
    out = {}
    for method in dict.fromkeys(r.method for r in rows):
        mine = [r for r in rows if r.method == method]
        steps = sum(r.target_steps - 1 for r in mine)
        hits, misses = sum(r.hits for r in mine), sum(r.misses for r in mine)
        out[method] = {
            "prompts": len(mine), "new_tokens": sum(r.new_tokens for r in mine),
            "tokens_per_s": sum(r.new_tokens for r in mine) / sum(r.latency_ms for r in mine) * 1e3,
            "step_ms": sum(r.step_ms * (r.target_steps - 1) for r in mine) / steps,
            "draft_ms_per_step": sum(r.draft_ms * (r.target_steps - 1) for r in mine) / steps,
            "verify_ms_per_step": sum(r.verify_ms * (r.target_steps - 1) for r in mine) / steps,
            "tokens_per_step": sum(r.new_tokens for r in mine) / sum(r.target_steps for r in mine),
            # after the prefill (which prefetch does not touch): tokens of the verify steps / their time
            "decode_tokens_per_s": sum(r.new_tokens - 1 for r in mine) / sum(r.step_ms * (r.target_steps - 1)
                                                                             for r in mine) * 1e3,
            "tree_nodes": sum(r.tree_nodes for r in mine) / len(mine),
            "prefetch_hits": hits, "prefetch_misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "saved_ms_per_step": sum(r.saved_ms for r in mine) / steps,
        }
    for key in ("tokens_per_s", "decode_tokens_per_s"):
        base = out.get("pinned-off", {}).get(key)
        for values in out.values():
            values[f"{key}_vs_pinned_off"] = values[key] / base if base else None
    return out


def outputs_equal(rows: list[Row]) -> dict[str, str]:
    """Per method: prompts whose greedy tokens equal pinned-off's (bf16 may round differently
    between passes of other shapes; exactness is asserted in fp32 by tests/test_prefetch.py)."""
    base = {r.prompt_id: r.token_ids for r in rows if r.method == "pinned-off"}
    return {m: f"{sum(r.token_ids == base.get(r.prompt_id) for r in rows if r.method == m)}/"
               f"{sum(1 for r in rows if r.method == m)}" for m in dict.fromkeys(r.method for r in rows)}


def markdown(result: dict) -> str:
    lines = [f"# Prefetch benchmark ({result['started']})", "", result["setup"], "",
             "| method | tokens/s | vs pinned-off | decode tokens/s | vs pinned-off | step ms | draft ms/step "
             "| verify ms/step | tokens/step | tree nodes | hit rate | saved ms/step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for method, v in result["summary"].items():
        lines.append(f"| {method} | {v['tokens_per_s']:.2f} | {optional(v['tokens_per_s_vs_pinned_off'])} | "
                     f"{v['decode_tokens_per_s']:.2f} | {optional(v['decode_tokens_per_s_vs_pinned_off'])} | {v['step_ms']:.0f} | "
                     f"{v['draft_ms_per_step']:.0f} | {v['verify_ms_per_step']:.0f} | {v['tokens_per_step']:.2f} | "
                     f"{v['tree_nodes']:.1f} | {optional(v['hit_rate'])} | {v['saved_ms_per_step']:.0f} |")
    lines += ["", f"Greedy outputs equal to pinned-off's: {result['outputs_equal_pinned_off']}",
              f"Placements (CPUs per actor): {result['placements']}"]
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: Path) -> None:
    methods = list(summary)
    bar_panels(path, methods, [
        ("tokens / s", {"tokens / s": [summary[m]["tokens_per_s"] for m in methods]}),
        ("ms per step", {"verify": [summary[m]["verify_ms_per_step"] for m in methods],
                         "waiting for drafts": [summary[m]["draft_ms_per_step"] for m in methods]})])


def write(out: Path, result: dict) -> None:
    (out / "results.json").write_text(json.dumps(with_machine(result), indent=1))
    (out / "results.md").write_text(markdown(result))
    plot(result["summary"], out / "prefetch.png")
    print(markdown(result))


def resummarize(out: Path) -> int:
    result = json.loads((out / "results.json").read_text())
    rows = [Row(**{**r, "token_ids": tuple(r["token_ids"])}) for r in result["rows"]]
    write(out, {**result, "summary": summarize(rows), "outputs_equal_pinned_off": outputs_equal(rows)})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/serve.yaml", help="a Serve config or an engine config")
    parser.add_argument("--dtype", default=None, help="override the config's dtype")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--prefetch", type=int, default=2, help="outcomes each SSM drafts ahead for")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--ssm-cpu", type=int, default=1)
    parser.add_argument("--verifier-cpu", type=int, default=0)
    parser.add_argument("--warmup-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--resummarize", action="store_true",
                        help="only recompute OUT's summary, table and plot from its results.json rows")
    args = parser.parse_args(argv)
    if args.resummarize:
        return resummarize(args.out)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from actors.loading import model_spec
    from bench.local_app import start_app
    from bench.workloads import load_workload
    from cluster.cli_serve import stop_serving
    from engine.models import load_header
    from settings.config import engine_section, load_config, read_yaml

    config = load_config(args.config, dtype=args.dtype)
    prompts = load_workload("humaneval", load_header(model_spec(config, config.target)).tokenizer, args.num_prompts)

    data = read_yaml(args.config)  # a Serve config, or an engine config served by configs/serve.yaml's proxies
    serve_yaml = args.config if "applications" in data else str(Path(__file__).resolve().parent.parent / "configs" / "serve.yaml")
    base = engine_section(data, args.config)
    methods = args.methods.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rows.jsonl").unlink(missing_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    rows, placements = [], {}
    for placement in ("pinned", "unpinned"):
        mine = [m for m in methods if m.startswith(placement + "-")]
        if not mine:
            continue
        cpus = (args.ssm_cpu, args.verifier_cpu)
        address = start_app(serve_yaml, lambda _: placed_args(base, placement == "pinned", cpus, args.prefetch,
                                                              args.dtype), ready_timeout_s=1800)
        try:
            placements[placement] = affinities(APP_NAME)
            logger.info("%s: CPUs per actor %s", placement, placements[placement])
            rows += run(address, prompts, mine, args.max_new_tokens, args.prefetch, args.warmup_tokens,
                        log=args.out / "rows.jsonl")
        finally:
            stop_serving()
    result = {
        "started": started, "config": args.config, "prefetch": args.prefetch,
        "setup": (f"{config.target.name} target, {', '.join(s.name for s in config.ssms)} SSM(s), {config.dtype}, "
                  f"greedy; HumanEval {len(prompts)} prompts x {args.max_new_tokens} tokens, served (gRPC), "
                  f"batching off, suffix global store off, prefetch {args.prefetch} outcomes per SSM for the -on "
                  f"methods; pinned: SSM on CPU "
                  f"{args.ssm_cpu}, verifier on CPU {args.verifier_cpu}, 1 torch thread each (ingress, merge actor "
                  f"and Ray float); {os.cpu_count()} CPUs, {platform.machine()}"),
        "summary": summarize(rows), "outputs_equal_pinned_off": outputs_equal(rows), "placements": placements,
        "rows": [asdict(r) for r in rows],
    }
    write(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
