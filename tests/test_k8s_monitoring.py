"""Who reaches the Ray pods (k8s/networkpolicy.yaml), who scrapes them (k8s/podmonitor.yaml), and what
the dashboard reads (k8s/grafana-dashboard.json; its queries are checked against a live scrape in
tests/test_metrics.py). Also the render options that place the GPU pods: node selector, storage.

The NetworkPolicy is evaluated the way the API server's semantics define it (a peer without a
namespaceSelector means the policy's own namespace; no ``from`` means any source; a port range is
``port``..``endPort``) for a fixed set of sources and ports, and the answers must equal the intended
matrix; each mutation of the policy that opens too much is caught by the same evaluation.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from cluster import k8s_pods
from test_k8s import _kube, _render_with, load_rayservice, metadata_errors

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
NETWORK_POLICY = K8S / "networkpolicy.yaml"
POD_MONITOR = K8S / "podmonitor.yaml"
DASHBOARD = K8S / "grafana-dashboard.json"

RAY = {"app.kubernetes.io/instance": "specinfer", "app.kubernetes.io/part-of": "specinfer"}
OWN = {"kubernetes.io/metadata.name": "specinfer"}  # the namespace the policy is applied in
PORT_NAMES = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "serve-grpc": 9000,
              "metrics": 8080}
PORTS = {"gcs": 6379, "dashboard": 8265, "client": 10001, "metrics": 8080, "serve": 8000, "serve-grpc": 9000,
         "dashboard agent": 52365, "a worker port": 20042, "object manager": 8076}
EVERYTHING = set(PORTS)
SERVING = {"serve", "serve-grpc"}
# source: (pod labels, namespace labels, same namespace as the policy?) -> the ports it may reach
SOURCES = {
    "head": ({**RAY, "ray.io/node-type": "head"}, OWN, True),
    "worker": ({**RAY, "ray.io/node-type": "worker"}, OWN, True),
    "kuberay operator": ({"app.kubernetes.io/name": "kuberay-operator"},
                         {"kubernetes.io/metadata.name": "ray-system"}, False),
    "prometheus": ({"app.kubernetes.io/name": "prometheus"}, {"kubernetes.io/metadata.name": "monitoring"}, False),
    "other pod here": ({"app": "x"}, OWN, True),
    "pod of another namespace": ({"app": "x"}, {"kubernetes.io/metadata.name": "apps"}, False),
    "ray-labelled head elsewhere": ({**RAY, "ray.io/node-type": "head"}, {"kubernetes.io/metadata.name": "apps"},
                                    False),
}
EXPECTED = {
    "head": EVERYTHING,
    "worker": EVERYTHING - {"dashboard"},
    "kuberay operator": {"dashboard"} | SERVING,
    "prometheus": {"metrics"} | SERVING,
    "other pod here": SERVING,
    "pod of another namespace": SERVING,
    "ray-labelled head elsewhere": SERVING,
}


def _selects(selector: dict | None, labels: dict[str, str]) -> bool:
    assert not (selector or {}).get("matchExpressions"), "the evaluation models matchLabels only"
    return all(labels.get(k) == v for k, v in ((selector or {}).get("matchLabels") or {}).items())


def _peer_admits(peer: dict, pod: dict, namespace: dict, same_namespace: bool) -> bool:
    assert "ipBlock" not in peer, "the evaluation does not model ipBlock"
    if "namespaceSelector" in peer:
        in_namespace = _selects(peer["namespaceSelector"], namespace)
    else:
        in_namespace = same_namespace
    return in_namespace and ("podSelector" not in peer or _selects(peer["podSelector"], pod))


def _port_admits(ports: list[dict] | None, port: int) -> bool:
    for entry in ports or [{}]:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        number = PORT_NAMES.get(entry["port"], -1) if isinstance(entry.get("port"), str) else entry.get("port")
        if number is None or number <= port <= entry.get("endPort", number):
            return True
    return False


def admits(policy: dict, port: int, pod: dict, namespace: dict, same_namespace: bool) -> bool:
    """Whether ``policy`` lets a TCP connection from the source pod in to ``port`` of a selected pod."""
    for rule in policy["spec"].get("ingress") or []:
        peers = rule.get("from") or [{}]  # no `from`: every source
        if _port_admits(rule.get("ports"), port) and any(
                not peer or _peer_admits(peer, pod, namespace, same_namespace) for peer in peers):
            return True
    return False


def reachability(policy: dict) -> dict[str, set[str]]:
    return {source: {name for name, port in PORTS.items() if admits(policy, port, *SOURCES[source])}
            for source in SOURCES}


def exposures(policy: dict) -> list[str]:
    """What ``policy`` admits beyond the intended matrix (and what it blocks that must pass)."""
    problems = []
    for source, reached in reachability(policy).items():
        problems += [f"{source} reaches {p}" for p in sorted(reached - EXPECTED[source])]
        problems += [f"{source} is refused {p}" for p in sorted(EXPECTED[source] - reached)]
    return problems


def load_policy() -> dict:
    return yaml.safe_load(NETWORK_POLICY.read_text())


# ---------------------------------------------------------------------------------------------
# NetworkPolicy


def test_network_policy_admits_exactly_the_intended_sources():
    policy = load_policy()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert exposures(policy) == []
    assert reachability(policy)["worker"] == EVERYTHING - {"dashboard"}  # the job API stays on the head


def test_network_policy_selects_every_ray_pod_and_names_the_manifests_ports():
    policy, rayservice = load_policy(), load_rayservice()
    selected = policy["spec"]["podSelector"]["matchLabels"]
    assert selected == RAY and selected["app.kubernetes.io/instance"] == rayservice["metadata"]["name"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    ports = {}
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        assert selected.items() <= group["template"]["metadata"]["labels"].items()  # every Ray pod is covered
        for port in group["template"]["spec"]["containers"][0]["ports"]:
            ports[port["name"]] = port["containerPort"]
    assert ports == PORT_NAMES  # the evaluation's names are the manifest's
    assert (k8s_pods.DASHBOARD_PORT, k8s_pods.METRICS_PORT) == (PORTS["dashboard"], PORTS["metrics"])
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "-n ray-system" in docs and "-n monitoring" in docs  # where the policy expects operator and Prometheus


@pytest.mark.parametrize("case, mutate", [
    ("dashboard open to all", lambda p: p["spec"]["ingress"].append({"ports": [{"protocol": "TCP", "port": 8265}]})),
    ("every port open to all", lambda p: p["spec"]["ingress"].append({})),
    ("dashboard open to every namespace",
     lambda p: p["spec"]["ingress"].append({"from": [{"namespaceSelector": {}}], "ports": [{"port": 8265}]})),
    ("dashboard by name to all pods here",
     lambda p: p["spec"]["ingress"].append({"from": [{"podSelector": {}}], "ports": [{"port": "dashboard"}]})),
    ("Ray pods' rule without ports", lambda p: p["spec"]["ingress"][0].pop("ports")),
    ("range covering the dashboard", lambda p: p["spec"]["ingress"][0]["ports"][0].update(endPort=8265)),
    ("head rule without the head label",
     lambda p: p["spec"]["ingress"][1]["from"][0]["podSelector"]["matchLabels"].pop("ray.io/node-type")),
    ("operator in any namespace", lambda p: p["spec"]["ingress"][1]["from"][1].pop("namespaceSelector")),
    ("metrics to every namespace", lambda p: p["spec"]["ingress"][2]["from"][0].update(namespaceSelector={})),
    ("metrics rule without ports", lambda p: p["spec"]["ingress"][2].pop("ports")),
    ("serving closed", lambda p: p["spec"]["ingress"].pop(3)),
    ("metrics closed", lambda p: p["spec"]["ingress"].pop(2)),
])
def test_every_widening_or_narrowing_is_caught(case, mutate):
    policy = copy.deepcopy(load_policy())
    mutate(policy)
    assert exposures(policy), case


def test_evaluation_follows_networkpolicy_semantics():
    rule = {"from": [{"podSelector": {"matchLabels": {"a": "1"}}}], "ports": [{"port": 10, "endPort": 20}]}
    policy = {"spec": {"ingress": [rule]}}
    assert admits(policy, 15, {"a": "1"}, OWN, True) and admits(policy, 20, {"a": "1"}, OWN, True)
    assert not admits(policy, 21, {"a": "1"}, OWN, True)
    assert not admits(policy, 15, {"a": "1"}, {"kubernetes.io/metadata.name": "x"}, False)  # other namespace
    udp = {"spec": {"ingress": [{"ports": [{"protocol": "UDP", "port": 15}]}]}}
    assert not admits(udp, 15, {}, OWN, True)
    assert admits({"spec": {"ingress": [{"from": []}]}}, 15, {}, {}, False)  # empty from: any source


# ---------------------------------------------------------------------------------------------
# PodMonitor


def test_pod_monitor_scrapes_the_metrics_port_of_every_ray_pod():
    monitor = yaml.safe_load(POD_MONITOR.read_text())
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert metadata_errors(monitor["metadata"]) == [] and "namespace" not in monitor["metadata"]
    spec = monitor["spec"]
    assert set(spec) == {"jobLabel", "selector", "podMetricsEndpoints"}
    assert set(spec["selector"]) == {"matchLabels"} and spec["selector"]["matchLabels"] == RAY
    (endpoint,) = spec["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["scheme"]) == ("metrics", "/metrics", "http")
    assert re.fullmatch(r"\d+s", endpoint["interval"]) and int(endpoint["interval"][:-1]) >= 10  # Ray reports / 10 s
    for relabel in endpoint["relabelings"]:
        assert set(relabel) == {"action", "sourceLabels", "targetLabel"} and relabel["action"] == "replace"
        assert all(re.fullmatch(r"__meta_kubernetes_pod_label_[a-z_]+", label) for label in relabel["sourceLabels"])
    cluster = load_rayservice()["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        labels = group["template"]["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert spec["jobLabel"] in labels
        ports = group["template"]["spec"]["containers"][0]["ports"]
        assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in ports
    # the scrape is admitted: from the namespace the docs install Prometheus into, to that port
    assert "metrics" in reachability(load_policy())["prometheus"]


# ---------------------------------------------------------------------------------------------
# Grafana dashboard (structure; the names its queries read: tests/test_metrics.py)


def dashboard_queries(dashboard: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = re.fullmatch(r"label_values\((.*), *\w+\)", variable["query"]["query"])
            assert match, variable["query"]
            queries.append(match[1])
    return queries


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers, ranges, grouping and functions left out)."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    return {word for word in re.findall(r"\b[a-zA-Z_:][a-zA-Z0-9_:]*\b(?!\s*\()", expr)} - PROMQL_WORDS


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_metric_names_reads_promql():
    expr = ('sum by (le, model_name) (rate(ray_x_bucket{a=~"$b", c="d(e)"}[$__rate_interval])) '
            '/ scalar(sum(rate(ray_y_total{a="1"}[5m]))) + 1 + ray_z')
    assert metric_names(expr) == {"ray_x_bucket", "ray_y_total", "ray_z"}
    assert metric_names("histogram_quantile(0.95, sum by (le) (rate(ray_h_bucket[1m])))") == {"ray_h_bucket"}


def test_dashboard_is_a_grafana_dashboard_over_one_prometheus_variable():
    dashboard = load_dashboard()
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and {"h", "w", "x", "y"} <= set(panel["gridPos"])
        for target in panel["targets"]:
            assert metric_names(target["expr"]), (panel["title"], target["expr"])
            assert 'application=~"$application"' in target["expr"]  # follows the application chooser
    # every name a query reads is Ray's rendering of one of ours (the live check: tests/test_metrics.py)
    names = set().union(*map(metric_names, dashboard_queries(dashboard)))
    assert all(name.startswith(("ray_specinfer_", "ray_vllm_")) for name in names), names
    assert {"ray_vllm_num_requests_waiting", "ray_vllm_kv_cache_usage_perc",
            "ray_vllm_spec_decode_num_drafts_total"} <= names


# ---------------------------------------------------------------------------------------------
# Render: where the GPU pods land, what they request


def test_node_selector_and_ephemeral_storage_are_rendered():
    selector = {"nvidia.com/gpu.product": "NVIDIA-L4"}
    worker = dict(load_rayservice_overlay_worker(), node_selector=selector)
    rendered = _render_with(_kube(worker=worker))
    (group,) = rendered["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["template"]["spec"]["nodeSelector"] == selector
    committed = load_rayservice()["spec"]["rayClusterConfig"]
    assert "nodeSelector" not in committed["workerGroupSpecs"][0]["template"]["spec"]  # empty: not rendered
    for group, size in ((committed["headGroupSpec"], "10Gi"), (committed["workerGroupSpecs"][0], "40Gi")):
        resources = group["template"]["spec"]["containers"][0]["resources"]
        assert resources["requests"]["ephemeral-storage"] == size
        assert "ephemeral-storage" not in resources["limits"]  # requested for scheduling, not an eviction cap
    with pytest.raises(ValueError, match="node_selector"):
        _render_with(_kube(worker=dict(load_rayservice_overlay_worker(), node_selector=["l4"])))


def load_rayservice_overlay_worker() -> dict:
    return dict(yaml.safe_load((K8S / "overlay.yaml").read_text())["kubernetes"]["worker"])
