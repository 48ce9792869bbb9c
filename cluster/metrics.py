"""Prometheus metrics of the serving path, recorded through Ray Serve's metrics API.

Each ingress replica records its requests with ``ray.serve.metrics`` (which adds the
``deployment``, ``replica`` and ``application`` tags); Ray's metrics agent on every node serves
them in Prometheus text format on the node's metrics export port (``ray start
--metrics-export-port``, ``ray.init(_metrics_export_port=...)``; KubeRay: 8080).

Names follow vLLM's where they mean the same (``vllm:`` becomes ``specinfer:``). Ray 2.60 records
through OpenTelemetry, whose instrument names allow no ``:`` (Ray warns, and the metric never
reaches ``/metrics``), so Ray is given the name with ``:`` replaced by ``_`` -- as vLLM's own Ray
metric wrappers do -- and its Prometheus exporter then prefixes ``ray_`` and suffixes counters
with ``_total`` (histograms get ``_bucket`` / ``_sum`` / ``_count``)::

    specinfer:spec_decode_num_draft_tokens  ->  ray_specinfer_spec_decode_num_draft_tokens_total

``exported_name`` gives the name to scrape; docs/serving.md lists them all.

Where the meaning is vLLM's own, the value is also written under vLLM's name, with vLLM's labels
(``model_name``, ``engine``) and histogram buckets (``VLLM_SPECS``, vllm/v1/metrics/loggers.py and
vllm/v1/spec_decode/metrics.py): ``vllm:num_requests_running`` becomes
``ray_vllm_num_requests_running``, the name vLLM's own Ray metric wrappers produce
(vllm/v1/metrics/ray_wrappers.py), so dashboards written for vLLM on Ray Serve read it. No Ray
import at module level: the request bookkeeping (``RequestObservation``) is plain Python.
"""

from __future__ import annotations

import logging
import math
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

logger = logging.getLogger(__name__)

COUNTER, HISTOGRAM, GAUGE = "counter", "histogram", "gauge"
# The gRPC status names a request ends with, as counted by specinfer:requests{status}.
STATUSES = ("OK", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "CANCELLED", "UNAVAILABLE", "INTERNAL")
APIS = ("grpc", "openai")


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its vLLM-style name, kind, help text, tag keys and histogram boundaries."""

    name: str
    kind: str
    description: str
    tags: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()

    @property
    def ray_name(self) -> str:
        """The name Ray is given: OpenTelemetry instrument names allow [a-zA-Z0-9_] only here."""
        return re.sub(r"[^a-zA-Z0-9_]", "_", self.name)

    @property
    def exported_name(self) -> str:
        """The Prometheus family name on Ray's metrics endpoint (counters: the ``_total`` series)."""
        return f"ray_{self.ray_name}" + ("_total" if self.kind == COUNTER else "")


LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0,
                     240.0, 480.0, 960.0)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
TOKENS_PER_STEP_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 16.0)
TREE_NODES_BUCKETS = (0.5, 1.0, 2.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 96.0, 128.0)
TOKENS_PER_S_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 75.0, 100.0, 150.0, 200.0, 300.0, 500.0, 1000.0,
                        2000.0)

SPECS = {spec.name: spec for spec in (
    # speculation: vLLM's spec_decode family (position = depth in the token tree - 1)
    MetricSpec("specinfer:spec_decode_num_draft_tokens", COUNTER,
               "Draft tokens proposed (token-tree nodes without the root), summed over verify steps."),
    MetricSpec("specinfer:spec_decode_num_accepted_tokens", COUNTER,
               "Draft tokens accepted by the target (the bonus token of each step excluded)."),
    MetricSpec("specinfer:spec_decode_num_accepted_tokens_per_pos", COUNTER,
               "Accepted draft tokens by position in the accepted path (0 = depth 1 of the token tree).",
               ("position",)),
    MetricSpec("specinfer:spec_decode_num_accepted_tokens_per_ssm", COUNTER,
               "Accepted draft tokens by proposer (an SSM or the suffix proposer); a token proposed by "
               "several proposers credits each of them.", ("ssm",)),
    MetricSpec("specinfer:target_steps", COUNTER, "Target model forward passes, the prefill included."),
    MetricSpec("specinfer:step_hop_seconds", COUNTER,
               "Seconds of the verify steps' wall time by hop: draft (the slowest proposer, inside its actor), "
               "merge, verify (forward, verification and commit inside the verifier), transport (the rest: "
               "actor calls, scheduling, serialisation). Divide by specinfer:target_steps for a per-step profile.",
               ("hop",)),
    MetricSpec("specinfer:spec_decode_tree_nodes", HISTOGRAM,
               "Per verify step: draft tokens in the merged token tree (the root excluded; 0: plain decoding), "
               "the tree sizes the cost-aware policy and the load budget chose.", boundaries=TREE_NODES_BUCKETS),
    MetricSpec("specinfer:spec_decode_prefetch", COUNTER,
               "SSM trees drafted ahead during verification (speculation.prefetch), per SSM and step: result "
               "hit (the verdict matched a prepared tree, used at once) or miss (prepared for other outcomes).",
               ("result",)),
    MetricSpec("specinfer:spec_decode_prefetch_saved_seconds", COUNTER,
               "Seconds of SSM drafting the prefetch hits did not wait for (drafted during verification)."),
    MetricSpec("specinfer:tokens_per_step", HISTOGRAM,
               "Per request: generated tokens / target steps (1.0 without speculation).",
               boundaries=TOKENS_PER_STEP_BUCKETS),
    # requests and tokens: vLLM's names
    MetricSpec("specinfer:prompt_tokens", COUNTER, "Prompt tokens of the requests that reached the prefill."),
    MetricSpec("specinfer:generation_tokens", COUNTER, "Generated tokens."),
    MetricSpec("specinfer:requests", COUNTER,
               "Requests by how they ended (gRPC status name; OpenAI requests map their HTTP status to it) "
               "and by API (grpc, openai).", ("status", "api")),
    MetricSpec("specinfer:num_requests_running", GAUGE,
               "Requests in flight on this replica and not in the engine loop's queue."),
    # the engine loop, each iteration (engine.loop.IterationStats)
    MetricSpec("specinfer:num_requests_waiting", GAUGE,
               "Requests in the engine loop's queue (beyond max_concurrent_requests or the KV pool)."),
    MetricSpec("specinfer:kv_cache_usage_perc", GAUGE,
               "Fraction of the verifier's KV pool blocks in use (0 to 1), after the last iteration."),
    MetricSpec("specinfer:iterations", COUNTER, "Engine loop iterations (one target pass for all requests each)."),
    MetricSpec("specinfer:draft_limit", GAUGE,
               "Requests the engine loop's draft gate lets draft with their cost-aware SSMs at the load of "
               "the last iteration (engine.draft_gate); 0 while drafting sits out."),
    MetricSpec("specinfer:iteration_phase_seconds", COUNTER,
               "Seconds of engine loop iterations by phase: schedule, draft (drafting and merging, with the "
               "actor calls' transport), verify (the target pass, verification and commit, as long as the "
               "verifier's call ran), commit (outboxes); divide by "
               "specinfer:iterations for a per-iteration profile.", ("phase",)),
    MetricSpec("specinfer:e2e_request_latency_seconds", HISTOGRAM,
               "Per successful request: seconds from its arrival at the ingress replica to its last token.",
               boundaries=LATENCY_BUCKETS_S),
    MetricSpec("specinfer:time_to_first_token_seconds", HISTOGRAM,
               "Seconds from a request's arrival at the ingress replica to its first token (the prefill's).",
               boundaries=TTFT_BUCKETS_S),
    MetricSpec("specinfer:output_tokens_per_second", HISTOGRAM,
               "Per successful request: generated tokens / end-to-end seconds.", boundaries=TOKENS_PER_S_BUCKETS),
)}


# vLLM's own metrics, with its labels and buckets (vllm/v1/metrics/loggers.py: PrometheusStatLogger;
# vllm/v1/spec_decode/metrics.py: SpecDecodingProm). Each is written with the same value as its
# specinfer: twin (VLLM_TWINS) or, for the two without one, where ServingMetrics says.
VLLM_TAGS = ("model_name", "engine")
VLLM_TTFT_BUCKETS_S = TTFT_BUCKETS_S + (160.0, 640.0, 2560.0)
VLLM_LATENCY_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                          240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_SPECS = {spec.name: spec for spec in (
    MetricSpec("vllm:num_requests_running", GAUGE, "Number of requests in model execution batches.", VLLM_TAGS),
    MetricSpec("vllm:num_requests_waiting", GAUGE, "Number of requests waiting to be processed.", VLLM_TAGS),
    MetricSpec("vllm:kv_cache_usage_perc", GAUGE, "KV-cache usage. 1 means 100 percent usage.", VLLM_TAGS),
    MetricSpec("vllm:prompt_tokens", COUNTER, "Number of prefill tokens processed.", VLLM_TAGS),
    MetricSpec("vllm:generation_tokens", COUNTER, "Number of generation tokens processed.", VLLM_TAGS),
    MetricSpec("vllm:request_success", COUNTER, "Count of successfully processed requests.",
               VLLM_TAGS + ("finished_reason",)),
    MetricSpec("vllm:spec_decode_num_drafts", COUNTER,
               "Number of spec decoding drafts (a request's token tree with at least one draft token, per step).",
               VLLM_TAGS),
    MetricSpec("vllm:spec_decode_num_draft_tokens", COUNTER, "Number of draft tokens.", VLLM_TAGS),
    MetricSpec("vllm:spec_decode_num_accepted_tokens", COUNTER, "Number of accepted tokens.", VLLM_TAGS),
    MetricSpec("vllm:spec_decode_num_accepted_tokens_per_pos", COUNTER,
               "Accepted tokens per draft position.", VLLM_TAGS + ("position",)),
    MetricSpec("vllm:time_to_first_token_seconds", HISTOGRAM, "Histogram of time to first token in seconds.",
               VLLM_TAGS, VLLM_TTFT_BUCKETS_S),
    MetricSpec("vllm:e2e_request_latency_seconds", HISTOGRAM, "Histogram of e2e request latency in seconds.",
               VLLM_TAGS, VLLM_LATENCY_BUCKETS_S),
)}
VLLM_TWINS = {f"specinfer:{name.split(':', 1)[1]}": name for name in VLLM_SPECS
              if f"specinfer:{name.split(':', 1)[1]}" in SPECS}
ALL_SPECS = {**SPECS, **VLLM_SPECS}


# Counted per engine-loop iteration (ServingMetrics.iteration), per request on the older path:
# the metric -> the IterationStats field.
ITERATION_TOKENS = {"specinfer:prompt_tokens": "prompt_tokens", "specinfer:generation_tokens": "emitted_tokens",
                    "specinfer:spec_decode_num_draft_tokens": "drafted_tokens",
                    "specinfer:spec_decode_num_accepted_tokens": "accepted_tokens"}


def exported_name(name: str) -> str:
    """``specinfer:requests`` -> ``ray_specinfer_requests_total`` (what Prometheus scrapes)."""
    return ALL_SPECS[name].exported_name


@dataclass
class RequestObservation:
    """What one request did, collected while it runs; ``ServingMetrics.record`` turns it into metrics.

    ``api``: "grpc" or "openai". The clock starts when the request reaches the ingress replica.
    """

    api: str = "grpc"
    clock: Callable[[], float] = time.perf_counter
    started: float = field(default=None)  # type: ignore[assignment]
    prompt_tokens: int | None = None  # set once the request passed its checks
    first_token_at: float | None = None
    finished_at: float | None = None
    stats: object | None = None  # engine.generate.GenerationStats of the last update
    finish_reason: str | None = None
    status: str | None = None
    per_iteration: bool = False  # its token counts went in with the engine loop's iterations

    def __post_init__(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def admitted(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens

    def update(self, update) -> None:
        """One engine StepUpdate (token_ids, text, finish_reason, stats)."""
        if update.token_ids and self.first_token_at is None:
            self.first_token_at = self.clock()
        self.stats, self.finish_reason = update.stats, update.finish_reason

    def finish(self, status: str) -> None:
        self.status, self.finished_at = status, self.clock()

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.started

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started


class ServingMetrics:
    """The metric objects of one ingress replica.

    ``factory(spec)`` makes one metric with Ray's interface (``inc`` / ``observe`` / ``set``, each
    taking ``tags=``); the default makes ``ray.serve.metrics`` objects, so it must run inside a
    Serve replica (or with Ray initialized) and the replica's tags are added to every series.
    """

    def __init__(self, factory: Callable[[MetricSpec], object] | None = None, model_name: str = ""):
        factory = factory or ray_metric
        self.metrics = {name: factory(spec) for name, spec in ALL_SPECS.items()}
        self.vllm_tags = {"model_name": model_name, "engine": "0"}  # one engine loop per replica
        # what the recording code writes to: a specinfer: metric with a vLLM twin writes both
        self.writers = {name: Twinned(metric, self.metrics[VLLM_TWINS[name]], self.vllm_tags)
                        if name in VLLM_TWINS else metric for name, metric in self.metrics.items()}

    def running(self, count: int) -> None:
        self._safely(lambda: self.writers["specinfer:num_requests_running"].set(count))

    def iteration(self, stats) -> None:
        """One engine-loop iteration (``engine.loop.IterationStats``): the queue and KV gauges, the
        phase times, and the token counters of the requests it stepped, as they happen (a long
        stream's tokens are not counted at its end). Never raises."""
        self._safely(lambda: self._iteration(stats))

    def _iteration(self, s) -> None:
        m = self.writers
        _inc(m["vllm:spec_decode_num_drafts"], s.drafts, self.vllm_tags)
        m["specinfer:num_requests_waiting"].set(s.waiting)
        if s.kv_blocks_total:
            m["specinfer:kv_cache_usage_perc"].set(s.kv_blocks_used / s.kv_blocks_total)
        m["specinfer:iterations"].inc(1)
        if s.draft_limit is not None:
            m["specinfer:draft_limit"].set(s.draft_limit)
        for phase, ms in s.ms.items():
            _inc(m["specinfer:iteration_phase_seconds"], ms / 1e3, {"phase": phase})
        for name, value in ITERATION_TOKENS.items():
            _inc(m[name], getattr(s, value))

    def record(self, observation: RequestObservation) -> None:
        """Count a finished request; never raises (a metrics failure must not fail a request)."""
        self._safely(lambda: self._record(observation))

    def _record(self, o: RequestObservation) -> None:
        m = self.writers
        m["specinfer:requests"].inc(1, tags={"status": o.status or "INTERNAL", "api": o.api})
        if o.status == "OK":
            m["vllm:request_success"].inc(1, tags={**self.vllm_tags, "finished_reason": o.finish_reason or "stop"})
        if o.ttft_s is not None:
            m["specinfer:time_to_first_token_seconds"].observe(max(o.ttft_s, 0.0))
        stats = o.stats
        if stats is None or not stats.target_steps:
            return  # it never reached the prefill: no work to count
        if not o.per_iteration:
            _inc(m["specinfer:prompt_tokens"], o.prompt_tokens or 0)
            _inc(m["specinfer:generation_tokens"], stats.new_tokens)
            _inc(m["specinfer:spec_decode_num_draft_tokens"], stats.draft_tokens)
            _inc(m["specinfer:spec_decode_num_accepted_tokens"], stats.accepted_tokens)
            _inc(m["vllm:spec_decode_num_drafts"], sum(size > 0 for size in stats.tree_sizes), self.vllm_tags)
        _inc(m["specinfer:target_steps"], stats.target_steps)
        for position, count in enumerate(stats.accepted_per_depth):
            _inc(m["specinfer:spec_decode_num_accepted_tokens_per_pos"], count, {"position": str(position)})
        for ssm, count in sorted(stats.accepted_per_proposer.items()):
            _inc(m["specinfer:spec_decode_num_accepted_tokens_per_ssm"], count, {"ssm": ssm})
        for hop, ms in stats.hop_ms.items():
            _inc(m["specinfer:step_hop_seconds"], ms / 1e3, {"hop": hop})
        for size in stats.tree_sizes:
            m["specinfer:spec_decode_tree_nodes"].observe(size)
        _inc(m["specinfer:spec_decode_prefetch"], stats.prefetch_hits, {"result": "hit"})
        _inc(m["specinfer:spec_decode_prefetch"], stats.prefetch_misses, {"result": "miss"})
        _inc(m["specinfer:spec_decode_prefetch_saved_seconds"], stats.prefetch_saved_ms / 1e3)
        if o.status != "OK":
            return
        m["specinfer:tokens_per_step"].observe(stats.tokens_per_step)
        latency = o.latency_s
        if latency is not None:
            m["specinfer:e2e_request_latency_seconds"].observe(max(latency, 0.0))
            if latency > 0 and stats.new_tokens:
                m["specinfer:output_tokens_per_second"].observe(stats.new_tokens / latency)

    @staticmethod
    def _safely(action: Callable[[], None]) -> None:
        try:
            action()
        except Exception:
            logger.exception("recording metrics failed")


class Twinned:
    """A specinfer: metric and its vLLM twin: every write goes to both, the twin's with vLLM's labels."""

    def __init__(self, primary, twin, twin_tags: dict[str, str]):
        self.primary, self.twin, self.twin_tags = primary, twin, twin_tags

    def _both(self, method: str, value: float, tags: dict | None) -> None:
        getattr(self.primary, method)(value, tags=tags)
        getattr(self.twin, method)(value, tags={**(tags or {}), **self.twin_tags})

    def inc(self, value: float = 1.0, tags: dict | None = None) -> None:
        self._both("inc", value, tags)

    def observe(self, value: float, tags: dict | None = None) -> None:
        self._both("observe", value, tags)

    def set(self, value: float, tags: dict | None = None) -> None:
        self._both("set", value, tags)


def _inc(counter, value: float, tags: dict | None = None) -> None:
    if value > 0:  # Ray counters take positive increments only
        counter.inc(value, tags=tags)


def ray_metric(spec: MetricSpec):
    """A ``ray.serve.metrics`` Counter / Histogram / Gauge for ``spec``."""
    from ray.serve import metrics

    if spec.kind == COUNTER:
        return metrics.Counter(spec.ray_name, description=spec.description, tag_keys=spec.tags or None)
    if spec.kind == HISTOGRAM:
        return metrics.Histogram(spec.ray_name, description=spec.description, boundaries=list(spec.boundaries),
                                 tag_keys=spec.tags or None)
    return metrics.Gauge(spec.ray_name, description=spec.description, tag_keys=spec.tags or None)


@contextmanager
def observed(metrics: ServingMetrics, observation: RequestObservation,
             classify: Callable[[BaseException], str]) -> Iterator[RequestObservation]:
    """Record ``observation`` when the block ends: status OK, or ``classify(error)`` for whatever
    ended it (cancellation and generator close included); the error propagates."""
    try:
        yield observation
    except BaseException as error:
        observation.finish(classify(error))
        raise
    else:
        observation.finish("OK")
    finally:
        metrics.record(observation)


# --- reading Prometheus text (tests, `specinfer` tooling) -----------------------------------


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> Iterable[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus text exposition format."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        labels = {k: v.encode().decode("unicode_escape") for k, v in _LABEL.findall(match["labels"] or "")}
        try:
            value = float(match["value"])
        except ValueError:
            continue
        yield match["name"], labels, value


def sample_sum(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0.0 when there is none)."""
    total = 0.0
    for sample, tags, value in parse_samples(text):
        if sample == name and all(tags.get(k) == v for k, v in labels.items()) and not math.isnan(value):
            total += value
    return total
