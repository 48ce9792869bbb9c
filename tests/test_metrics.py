"""Prometheus metrics, health and reflection of the served application.

The Ray tests share the session's Ray + Serve instance (tests/serving_fixtures.py) and read the
metrics the way Prometheus does: from the node's metrics export port. The requests whose metrics
are checked go to an application of this module alone (``specinfer-metrics``): its series count
this module's requests and nothing else, so a test knows what they held before it (nothing, or
what the tests before it checked had arrived) instead of waiting for the endpoint to look still.
Each test sends its requests and polls until the increase equals the statistics they returned.
"""

from __future__ import annotations

import time
import urllib.request

import grpc
import pytest

from cluster.metrics import (ALL_SPECS, SPECS, VLLM_SPECS, VLLM_TWINS, RequestObservation, ServingMetrics,
                             exported_name, observed, parse_samples, sample_sum)
from cluster.serve_client import Client, build_request
from engine.requests import HOPS
from serving_fixtures import (metrics_url, own_app, ray_session, serving,  # noqa: F401 (fixtures)
                              tiny_args, tiny_models, wait_until)

APP_NAME = "specinfer-metrics"
APP = {"application": APP_NAME}
PROMPT = "def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"

COUNTERS = ["specinfer:spec_decode_num_draft_tokens", "specinfer:spec_decode_num_accepted_tokens",
            "specinfer:target_steps", "specinfer:prompt_tokens", "specinfer:generation_tokens"]


# --- without Ray ----------------------------------------------------------------------------


def test_exported_names_follow_ray_rules():
    assert exported_name("specinfer:spec_decode_num_draft_tokens") == "ray_specinfer_spec_decode_num_draft_tokens_total"
    assert exported_name("specinfer:spec_decode_num_accepted_tokens_per_pos") == \
        "ray_specinfer_spec_decode_num_accepted_tokens_per_pos_total"
    assert exported_name("specinfer:e2e_request_latency_seconds") == "ray_specinfer_e2e_request_latency_seconds"
    assert exported_name("specinfer:num_requests_running") == "ray_specinfer_num_requests_running"
    # vLLM's names as vLLM's own Ray wrappers export them (vllm/v1/metrics/ray_wrappers.py)
    assert exported_name("vllm:num_requests_running") == "ray_vllm_num_requests_running"
    assert exported_name("vllm:spec_decode_num_drafts") == "ray_vllm_spec_decode_num_drafts_total"
    assert exported_name("vllm:time_to_first_token_seconds") == "ray_vllm_time_to_first_token_seconds"
    for spec in ALL_SPECS.values():
        assert spec.name.split(":")[0] in ("specinfer", "vllm") and ":" not in spec.ray_name
        assert all(b > 0 for b in spec.boundaries)  # Ray refuses boundaries <= 0
        assert not {"deployment", "replica", "application", "route"} & set(spec.tags)  # Serve's own tags
    assert set(SPECS) | set(VLLM_SPECS) == set(ALL_SPECS) and len(ALL_SPECS) == len(SPECS) + len(VLLM_SPECS)


# vLLM v1's own definitions (vllm/v1/metrics/loggers.py PrometheusStatLogger, vllm/v1/spec_decode/metrics.py
# SpecDecodingProm): name -> (type, labels). A vLLM-named metric means what vLLM's does, or it is not here.
VLLM_DEFINITIONS = {
    "vllm:num_requests_running": ("gauge", ("model_name", "engine")),
    "vllm:num_requests_waiting": ("gauge", ("model_name", "engine")),
    "vllm:kv_cache_usage_perc": ("gauge", ("model_name", "engine")),
    "vllm:prompt_tokens": ("counter", ("model_name", "engine")),
    "vllm:generation_tokens": ("counter", ("model_name", "engine")),
    "vllm:request_success": ("counter", ("model_name", "engine", "finished_reason")),
    "vllm:spec_decode_num_drafts": ("counter", ("model_name", "engine")),
    "vllm:spec_decode_num_draft_tokens": ("counter", ("model_name", "engine")),
    "vllm:spec_decode_num_accepted_tokens": ("counter", ("model_name", "engine")),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("counter", ("model_name", "engine", "position")),
    "vllm:time_to_first_token_seconds": ("histogram", ("model_name", "engine")),
    "vllm:e2e_request_latency_seconds": ("histogram", ("model_name", "engine")),
}


def test_vllm_names_types_and_labels_are_vllms():
    assert {name: (spec.kind, spec.tags) for name, spec in VLLM_SPECS.items()} == VLLM_DEFINITIONS
    assert VLLM_SPECS["vllm:time_to_first_token_seconds"].boundaries[-4:] == (80.0, 160.0, 640.0, 2560.0)
    assert VLLM_SPECS["vllm:e2e_request_latency_seconds"].boundaries[:3] == (0.3, 0.5, 0.8)
    # a twin has its specinfer: metric's kind and labels, plus vLLM's model_name and engine
    assert set(VLLM_TWINS.values()) == set(VLLM_SPECS) - {"vllm:request_success", "vllm:spec_decode_num_drafts"}
    for ours, theirs in VLLM_TWINS.items():
        assert ours.split(":")[1] == theirs.split(":")[1] and SPECS[ours].kind == VLLM_SPECS[theirs].kind
        assert VLLM_SPECS[theirs].tags == ("model_name", "engine") + SPECS[ours].tags


def test_docs_list_every_metric_under_its_exported_name():
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    rows = dict(re.findall(r"^\| `((?:specinfer|vllm):[a-z0-9_]+)` \| `([a-z0-9_]+)` \|", docs, re.M))
    assert rows == {name: spec.exported_name for name, spec in ALL_SPECS.items()}


class FakeMetric:
    def __init__(self, spec):
        self.spec, self.calls = spec, []

    def inc(self, value=1.0, tags=None):
        assert value > 0 and set(tags or {}) == set(self.spec.tags)
        self.calls.append((value, tags or {}))

    def observe(self, value, tags=None):
        assert value >= 0 and set(tags or {}) == set(self.spec.tags)  # a histogram takes 0 too
        self.calls.append((value, tags or {}))

    set = observe

    def total(self, **tags):
        return sum(v for v, t in self.calls if all(t.get(k) == x for k, x in tags.items()))


def fake_metrics() -> ServingMetrics:
    return ServingMetrics(factory=FakeMetric, model_name="tiny-target")


VLLM_TAGS = {"model_name": "tiny-target", "engine": "0"}


def assert_twins_match(metrics: ServingMetrics) -> None:
    """Every vLLM twin got exactly its specinfer: metric's writes, with vLLM's labels added."""
    for ours, theirs in VLLM_TWINS.items():
        expected = [(value, {**tags, **VLLM_TAGS}) for value, tags in metrics.metrics[ours].calls]
        assert metrics.metrics[theirs].calls == expected, theirs


def test_record_counts_a_request_from_its_stats():
    from engine.requests import GenerationStats, StepUpdate

    stats = GenerationStats(mode="tree", target_steps=5, new_tokens=12, draft_tokens=30,
                            accepted_per_proposer={"ssm-a": 5, "suffix": 2}, accepted_per_depth=[4, 3, 0],
                            tree_sizes=[12, 0, 10, 8], prefetch_hits=3, prefetch_misses=1, prefetch_saved_ms=250.0,
                            hop_ms={"draft": 300.0, "merge": 20.0, "verify": 500.0, "transport": 80.0})
    now = [10.0]
    observation = RequestObservation("grpc", clock=lambda: now[0])
    metrics = fake_metrics()
    with observed(metrics, observation, lambda error: "INTERNAL"):
        observation.admitted(9)
        now[0] = 10.5
        observation.update(StepUpdate((1,), "a", None, stats))
        now[0] = 12.0
        observation.update(StepUpdate((2, 3), "bc", "length", stats))
    m = metrics.metrics
    assert observation.status == "OK" and observation.latency_s == 2.0 and observation.ttft_s == 0.5
    assert m["specinfer:requests"].calls == [(1, {"status": "OK", "api": "grpc"})]
    assert m["specinfer:spec_decode_num_draft_tokens"].total() == 30
    assert m["specinfer:spec_decode_num_accepted_tokens"].total() == 7
    assert m["specinfer:spec_decode_num_accepted_tokens_per_pos"].calls == [(4, {"position": "0"}),
                                                                            (3, {"position": "1"})]
    assert m["specinfer:spec_decode_num_accepted_tokens_per_ssm"].total(ssm="ssm-a") == 5
    assert m["specinfer:spec_decode_num_accepted_tokens_per_ssm"].total(ssm="suffix") == 2
    assert m["specinfer:target_steps"].total() == 5 and m["specinfer:prompt_tokens"].total() == 9
    assert m["specinfer:generation_tokens"].total() == 12
    assert m["specinfer:tokens_per_step"].calls == [(2.4, {})]
    assert m["specinfer:spec_decode_tree_nodes"].calls == [(12, {}), (0, {}), (10, {}), (8, {})]
    assert m["specinfer:spec_decode_prefetch"].calls == [(3, {"result": "hit"}), (1, {"result": "miss"})]
    assert m["specinfer:spec_decode_prefetch_saved_seconds"].calls == [(0.25, {})]
    assert m["specinfer:step_hop_seconds"].calls == [(0.3, {"hop": "draft"}), (0.02, {"hop": "merge"}),
                                                     (0.5, {"hop": "verify"}), (0.08, {"hop": "transport"})]
    assert m["specinfer:e2e_request_latency_seconds"].calls == [(2.0, {})]
    assert m["specinfer:time_to_first_token_seconds"].calls == [(0.5, {})]
    assert m["specinfer:output_tokens_per_second"].calls == [(6.0, {})]
    assert_twins_match(metrics)
    assert m["vllm:spec_decode_num_accepted_tokens_per_pos"].calls == [
        (4, {"position": "0", **VLLM_TAGS}), (3, {"position": "1", **VLLM_TAGS})]
    assert m["vllm:spec_decode_num_drafts"].calls == [(3, VLLM_TAGS)]  # the steps whose tree had drafts
    assert m["vllm:request_success"].calls == [(1, {**VLLM_TAGS, "finished_reason": "length"})]


def test_each_loop_iteration_sets_the_gauges_and_counts_tokens_once():
    """An iteration's tokens are counted as it happens; the request's end then adds its steps and
    histograms but not the same tokens again."""
    from engine.loop import IterationStats
    from engine.requests import GenerationStats, StepUpdate

    metrics, m = fake_metrics(), None
    ms = {"schedule": 1.0, "draft": 20.0, "verify": 30.0, "commit": 2.0}
    for waiting, used, limit in ((3, 40, 4), (1, 25, None)):
        metrics.iteration(IterationStats(7, 2, waiting, 0, used, 100, drafted_tokens=10, accepted_tokens=4,
                                         emitted_tokens=6, prompt_tokens=16, ms=ms, drafts=2, draft_limit=limit))
    m = metrics.metrics
    assert m["specinfer:draft_limit"].calls == [(4, {})]  # set where the loop has a gate
    assert m["specinfer:num_requests_waiting"].calls == [(3, {}), (1, {})]
    assert m["specinfer:kv_cache_usage_perc"].calls == [(0.4, {}), (0.25, {})]
    assert m["specinfer:iterations"].total() == 2
    assert {p: m["specinfer:iteration_phase_seconds"].total(phase=p) for p in ms} == \
        {"schedule": 0.002, "draft": 0.04, "verify": 0.06, "commit": 0.004}
    totals = {name: m[name].total() for name in COUNTERS if name != "specinfer:target_steps"}
    assert totals == {"specinfer:spec_decode_num_draft_tokens": 20, "specinfer:spec_decode_num_accepted_tokens": 8,
                      "specinfer:prompt_tokens": 32, "specinfer:generation_tokens": 12}
    observation = RequestObservation("grpc", per_iteration=True)
    with observed(metrics, observation, lambda error: "INTERNAL"):
        observation.admitted(16)
        observation.update(StepUpdate((1, 2), "ab", "length", GenerationStats(
            mode="tree", target_steps=3, new_tokens=6, draft_tokens=10, accepted_per_depth=[3, 1])))
    assert {name: m[name].total() for name in totals} == totals  # not again at the request's end
    assert m["specinfer:target_steps"].total() == 3 and m["specinfer:tokens_per_step"].calls == [(2.0, {})]
    assert_twins_match(metrics)
    assert m["vllm:num_requests_waiting"].calls == [(3, VLLM_TAGS), (1, VLLM_TAGS)]
    assert m["vllm:spec_decode_num_drafts"].total() == 4  # the iterations' drafts, not again at the end


def test_refused_and_cancelled_requests_are_counted_by_status():
    from cluster.status import Overloaded, status_name
    from cluster.serve_requests import InvalidArgument

    metrics = fake_metrics()
    for error in (InvalidArgument("top_p", "bad"), Overloaded("busy"), ValueError("boom")):
        with pytest.raises(type(error)), observed(metrics, RequestObservation("openai"), status_name):
            raise error

    async def abandoned():  # a stream the consumer stops reading: closed with GeneratorExit
        with observed(metrics, RequestObservation("grpc"), status_name):
            yield 1
            yield 2

    import asyncio

    async def read_one():
        stream = abandoned()
        await stream.__anext__()
        await stream.aclose()

    asyncio.run(read_one())
    requests = metrics.metrics["specinfer:requests"]
    assert [t for _, t in requests.calls] == [
        {"status": "INVALID_ARGUMENT", "api": "openai"}, {"status": "RESOURCE_EXHAUSTED", "api": "openai"},
        {"status": "INTERNAL", "api": "openai"}, {"status": "CANCELLED", "api": "grpc"}]
    assert not metrics.metrics["specinfer:e2e_request_latency_seconds"].calls  # successful requests only
    assert status_name(asyncio.CancelledError()) == "CANCELLED"


class BrokenMetric(FakeMetric):
    """Every write is recorded, then fails as it would with the metrics agent gone."""

    def inc(self, value=1.0, tags=None):
        super().inc(value, tags)
        raise RuntimeError("metrics agent gone")

    def observe(self, value, tags=None):
        super().observe(value, tags)
        raise RuntimeError("metrics agent gone")

    set = observe


def test_metric_failures_do_not_fail_requests():
    """A failing metric never changes a request's outcome: its result and its own error pass
    through unchanged, and the write was really attempted (it failed, it was not skipped)."""
    metrics = ServingMetrics(factory=BrokenMetric)
    with observed(metrics, RequestObservation("grpc"), lambda error: "INTERNAL") as observation:
        observation.admitted(3)
    assert observation.status == "OK"
    with pytest.raises(KeyError, match="the request's own"), \
            observed(metrics, RequestObservation("grpc"), lambda error: "INVALID_ARGUMENT"):
        raise KeyError("the request's own error")
    metrics.running(3)
    m = metrics.metrics
    assert m["specinfer:requests"].calls == [(1, {"status": "OK", "api": "grpc"}),
                                             (1, {"status": "INVALID_ARGUMENT", "api": "grpc"})]
    assert m["specinfer:num_requests_running"].calls == [(3, {})]


def test_prometheus_text_parsing():
    text = "\n".join([
        "# HELP ray_x_total d", "# TYPE ray_x_total counter",
        'ray_x_total{application="specinfer",ssm="a",x="q\\"uote"} 3.0',
        'ray_x_total{application="specinfer",ssm="b"} 4.0',
        'ray_x_total{application="other",ssm="a"} 100.0',
        "ray_y 7",
    ])
    assert list(parse_samples(text))[0] == ("ray_x_total", {"application": "specinfer", "ssm": "a", "x": 'q"uote'},
                                            3.0)
    assert sample_sum(text, "ray_x_total", application="specinfer") == 7.0
    assert sample_sum(text, "ray_x_total", ssm="a") == 103.0
    assert sample_sum(text, "ray_y") == 7.0 and sample_sum(text, "ray_z") == 0.0


# --- served: health and reflection ------------------------------------------------------------
# (before the metrics tests: without the application metadata, Serve routes to its one application,
# and those tests deploy a second one for this module)


@pytest.mark.ray
def test_grpc_health_check_is_serving(serving):  # noqa: F811
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(serving) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "specinfer.v1.SpecInfer"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10,
                                 metadata=(("application", "specinfer"),))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # without the application metadata too (one application: Serve routes to it)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING


@pytest.mark.ray
def test_grpc_server_reflection_lists_and_describes_the_service(serving):  # noqa: F811
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(serving) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"specinfer.v1.SpecInfer", "grpc.health.v1.Health"} <= services
        service = DescriptorPool(database).FindServiceByName("specinfer.v1.SpecInfer")
        assert {m.name for m in service.methods} == {"Generate", "GenerateStream"}
        assert service.methods_by_name["GenerateStream"].output_type.full_name == "specinfer.v1.GenerateChunk"


# --- served: the metrics endpoint -------------------------------------------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@pytest.fixture(scope="module")
def metrics_app(serving, tiny_args):  # noqa: F811
    """(gRPC address, Serve handle, HTTP base URL) of an application only this module sends to."""
    with own_app(serving, tiny_args, APP_NAME, "/metrics-app") as (_, handle, base_url):
        yield serving, handle, base_url


def idle_scrape(url: str, handle) -> str:
    """The endpoint's text once no request of the module's application runs. Its series hold only
    what this module's earlier tests sent, and each of those polled until its figures arrived."""
    assert wait_until(lambda: not handle.num_active.remote().result(), timeout_s=60)
    return scrape(url)


def wait_for(url: str, check, timeout_s: float = 60.0) -> str:
    """Scrape until ``check(text)`` holds; return the last text (the caller asserts on it)."""
    deadline = time.monotonic() + timeout_s
    text = scrape(url)
    while not check(text) and time.monotonic() < deadline:
        time.sleep(0.5)
        text = scrape(url)
    return text


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def total(text: str, name: str, **labels: str) -> float:
    return sample_sum(text, exported_name(name), **APP, **labels)


@pytest.mark.ray
def test_metrics_equal_the_request_statistics(metrics_app, metrics_url, tiny_models):  # noqa: F811
    from transformers import AutoTokenizer

    address, handle, _ = metrics_app
    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_models["target"]).encode(PROMPT))
    before = idle_scrape(metrics_url, handle)
    with Client(address, application=APP_NAME) as client:
        reply = client.generate(build_request(PROMPT, max_new_tokens=40), timeout=60)
    stats = reply.stats
    assert stats.new_tokens == 40 and stats.draft_tokens > 0 and stats.accepted_tokens > 0
    expected = {
        "specinfer:spec_decode_num_draft_tokens": stats.draft_tokens,
        "specinfer:spec_decode_num_accepted_tokens": stats.accepted_tokens,
        "specinfer:target_steps": stats.target_steps,
        "specinfer:prompt_tokens": prompt_tokens,
        "specinfer:generation_tokens": stats.new_tokens,
        "specinfer:iterations": stats.target_steps,  # alone on its replica's loop: one pass an iteration
    }

    def delta(text: str, name: str, **labels: str) -> float:
        return total(text, name, **labels) - total(before, name, **labels)

    def per_label(text: str, name: str, label: str) -> dict[str, float]:
        keys = {labels[label] for n, labels, _ in parse_samples(text) if n == exported_name(name) and label in labels}
        return {key: delta(text, name, **{label: key}) for key in keys if delta(text, name, **{label: key})}

    per_pos = {str(i): float(v) for i, v in enumerate(stats.accepted_per_depth) if v}
    per_ssm = {k: float(v) for k, v in stats.accepted_per_ssm.items() if v}
    # where the steps' wall time went (seconds per hop): the reply's hop_ms, every hop present; the
    # hops sum to the steps' wall time (draft_ms + verify_ms), verify is verify_ms
    hops = {hop: ms / 1e3 for hop, ms in stats.hop_ms.items()}
    assert set(hops) == set(HOPS) and all(seconds > 0 for seconds in hops.values()), hops
    assert stats.hop_ms["verify"] == stats.verify_ms
    assert sum(stats.hop_ms.values()) == pytest.approx(stats.draft_ms + stats.verify_ms, rel=1e-9)

    def hop_seconds(text: str) -> dict[str, float]:
        return per_label(text, "specinfer:step_hop_seconds", "hop")

    # vLLM's names carry the same counts, under model_name / engine; num_drafts: the drafted steps
    twins = {VLLM_TWINS[name]: value for name, value in expected.items() if name in VLLM_TWINS}
    twins["vllm:spec_decode_num_drafts"] = sum(size > 0 for size in stats.tree_sizes)
    twins["vllm:request_success"] = 1
    assert len(twins) == 6 and twins["vllm:spec_decode_num_drafts"] > 0

    def vllm_delta(text: str, name: str) -> float:
        return delta(text, name, model_name="tiny-target", engine="0")

    # the iterations' draft phase waited for the drafting and merging in their actors (the verifier's
    # call resolves the merge actor's reference first); the verify phase is the verifier's call
    def phases(text: str) -> dict[str, float]:
        return {p: delta(text, "specinfer:iteration_phase_seconds", phase=p) for p in ("draft", "verify")}

    def phases_cover_hops(text: str) -> bool:
        seconds = phases(text)
        return seconds["draft"] >= hops["draft"] + hops["merge"] and seconds["verify"] >= hops["verify"]

    def complete(text: str) -> bool:  # every figure in: an export may carry an iteration's counters before its phases
        return (phases_cover_hops(text)
                and all(delta(text, name) == value for name, value in expected.items())
                and all(vllm_delta(text, name) == value for name, value in twins.items())
                and delta(text, "specinfer:requests", status="OK", api="grpc") == 1
                and per_label(text, "specinfer:spec_decode_num_accepted_tokens_per_pos", "position") == per_pos
                and per_label(text, "specinfer:spec_decode_num_accepted_tokens_per_ssm", "ssm") == per_ssm
                and hop_seconds(text) == pytest.approx(hops, rel=1e-6))

    after = wait_for(metrics_url, complete)
    assert {name: delta(after, name) for name in expected} == expected
    assert {name: vllm_delta(after, name) for name in twins} == twins
    from protos import specinfer_pb2

    reason = specinfer_pb2.FinishReason.Name(reply.finish_reason).removeprefix("FINISH_REASON_").lower()
    assert delta(after, "vllm:request_success", finished_reason=reason) == 1 and reason in ("stop", "length")
    assert per_label(after, "vllm:spec_decode_num_accepted_tokens_per_pos", "position") == per_pos
    assert delta(after, "specinfer:requests", status="OK", api="grpc") == 1
    assert per_label(after, "specinfer:spec_decode_num_accepted_tokens_per_pos", "position") == per_pos
    assert per_label(after, "specinfer:spec_decode_num_accepted_tokens_per_ssm", "ssm") == per_ssm
    assert hop_seconds(after) == pytest.approx(hops, rel=1e-6)  # specinfer:step_hop_seconds, hop by hop
    assert sum(per_pos.values()) == stats.accepted_tokens
    assert phases_cover_hops(after), (phases(after), hops)
    assert total(after, "specinfer:num_requests_waiting") == total(after, "vllm:num_requests_waiting") == 0
    assert 0 <= total(after, "specinfer:kv_cache_usage_perc") == total(after, "vllm:kv_cache_usage_perc") < 1
    # histograms: one observation each, tokens/step summed exactly
    for name in ("specinfer_e2e_request_latency_seconds", "specinfer_time_to_first_token_seconds",
                 "specinfer_tokens_per_step", "specinfer_output_tokens_per_second",
                 "vllm_e2e_request_latency_seconds", "vllm_time_to_first_token_seconds"):
        count = f"ray_{name}_count"
        assert sample_sum(after, count, **APP) - sample_sum(before, count, **APP) == 1, name
    # Ray 2.60 exports each histogram's _sum from bucket midpoints, so only the buckets are exact:
    # the request's tokens/step falls in the first bucket whose bound reaches it.
    buckets = {float(labels["le"]) for name, labels, _ in parse_samples(after)
               if name == "ray_specinfer_tokens_per_step_bucket"}
    for bound in sorted(buckets):
        added = sample_sum(after, "ray_specinfer_tokens_per_step_bucket", le=_le(bound), **APP) - \
            sample_sum(before, "ray_specinfer_tokens_per_step_bucket", le=_le(bound), **APP)
        assert added == (1 if stats.tokens_per_step <= bound else 0), (bound, stats.tokens_per_step)
    running = [v for name, labels, v in parse_samples(after)
               if name == exported_name("specinfer:num_requests_running") and labels.get("application") == APP_NAME]
    assert running and sum(running) == 0


@pytest.mark.ray
def test_refused_requests_are_counted_by_status(metrics_app, metrics_url):  # noqa: F811
    import json
    import urllib.error

    address, handle, http_base = metrics_app
    before = idle_scrape(metrics_url, handle)
    with Client(address, application=APP_NAME) as client:
        with pytest.raises(grpc.RpcError) as caught:
            client.generate(build_request(PROMPT, max_new_tokens=0), timeout=30)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError):
            list(client.stream(build_request(PROMPT, top_p=2.0), timeout=30))
    body = json.dumps({"model": "tiny-target", "prompt": "hi", "n": 2}).encode()
    with pytest.raises(urllib.error.HTTPError) as http_error:
        urllib.request.urlopen(urllib.request.Request(f"{http_base}/v1/completions", body,
                                                      {"Content-Type": "application/json"}), timeout=30)
    assert http_error.value.code == 400

    def counted(text: str, api: str) -> float:
        return (total(text, "specinfer:requests", status="INVALID_ARGUMENT", api=api)
                - total(before, "specinfer:requests", status="INVALID_ARGUMENT", api=api))

    after = wait_for(metrics_url, lambda text: counted(text, "grpc") == 2 and counted(text, "openai") == 1)
    assert counted(after, "grpc") == 2 and counted(after, "openai") == 1
    assert total(after, "specinfer:requests", status="OK") == total(before, "specinfer:requests", status="OK")
    assert total(after, "specinfer:target_steps") == total(before, "specinfer:target_steps")  # no work counted


@pytest.mark.ray
def test_every_dashboard_query_names_a_metric_the_server_exports(metrics_app, metrics_url):  # noqa: F811
    """k8s/grafana-dashboard.json reads what a running application really exports: after one request
    (so every counter and histogram has a series), each metric name of each panel query and query
    variable is on the node's scrape endpoint."""
    from test_k8s_monitoring import dashboard_queries, load_dashboard, metric_names

    address, handle, _ = metrics_app
    before = idle_scrape(metrics_url, handle)
    with Client(address, application=APP_NAME) as client:
        assert client.generate(build_request(PROMPT, max_new_tokens=16), timeout=60).stats.new_tokens == 16
    queries = dashboard_queries(load_dashboard())
    wanted = set().union(*map(metric_names, queries))

    def exported(text: str) -> set[str]:
        return {name for name, labels, _ in parse_samples(text) if labels.get("application") == APP_NAME}

    def counted(text: str) -> bool:  # this request's counts arrived (Ray pushes every few seconds)
        return total(text, "specinfer:requests", status="OK") > total(before, "specinfer:requests", status="OK")

    after = wait_for(metrics_url, lambda text: counted(text) and wanted <= exported(text))
    assert counted(after)
    assert sorted(wanted - exported(after)) == []
    for query in queries:  # each query reads at least one exported name
        assert metric_names(query) and metric_names(query) <= exported(after), query
    # what Prometheus sees: Ray's renderings only, never a name with ':' (docs/kubernetes.md, "Monitoring")
    names = exported(after)
    assert not [name for name in names if ":" in name]
    assert {exported_name(name) for name in VLLM_SPECS if VLLM_SPECS[name].kind != "histogram"} <= names
    assert not {name.removesuffix("_total") for name in names if name.endswith("_total")} & names  # no bare twin
