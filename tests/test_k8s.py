"""The Kubernetes manifests in k8s/: schema validity, freshness and safety properties.

* The RayService (and the RayCluster spec inside it) is validated against the KubeRay CRD
  OpenAPI v3 schemas in ``../shared/schemas`` (``$SPECINFER_SCHEMAS`` overrides) the way the API
  server does it: schema defaults applied first, unknown fields rejected (kubectl's strict field
  validation), ``x-kubernetes-int-or-string``, int32/int64 ranges and list-map keys honoured.
* Core objects (Service, PVC, the pod templates) are validated with ``kubernetes-validate``,
  which ships the Kubernetes schemas and works offline.
* ``serveConfigV2`` is validated with our own config model and Ray Serve's schema, and the
  committed manifest must equal what ``specinfer k8s render`` generates.
* Negative tests mutate valid manifests and check that each mutation is rejected.
"""

from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from cluster import k8s
from settings.config import EngineConfig, engine_section, read_yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

# Importing Ray Serve's schema (serveConfigV2 validation) warns about its own pydantic usage.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
OVERLAY = K8S / "overlay.yaml"  # the input of `specinfer k8s render`, not a manifest
RAYSERVICE = K8S / "rayservice.yaml"
NETWORK_POLICY = K8S / "networkpolicy.yaml"
PVC = K8S / "models-pvc.yaml"
DOCKERFILE = ROOT / "Dockerfile"
K8S_VERSIONS = ("1.29", "1.37")  # oldest and newest Kubernetes the core objects must be valid for
SERVING_PORTS = {8000, 9000}
DASHBOARD_PORT = 8265
CORE_KINDS = {"NetworkPolicy", "PersistentVolumeClaim"}
API_VERSIONS = {"RayService": "ray.io/v1", "NetworkPolicy": "networking.k8s.io/v1", "PersistentVolumeClaim": "v1",
                "PodMonitor": "monitoring.coreos.com/v1"}


# ---------------------------------------------------------------------------------------------
# Loading


def schemas_dir() -> Path:
    env = os.environ.get("SPECINFER_SCHEMAS")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "schemas"
    if not (path / "ray.io_rayservices.yaml").is_file() or not (path / "ray.io_rayclusters.yaml").is_file():
        pytest.fail(f"KubeRay CRD schemas not found in {path} (need ray.io_rayservices.yaml and "
                    "ray.io_rayclusters.yaml): put them in ../shared/schemas next to the repository or point "
                    "$SPECINFER_SCHEMAS at their directory", pytrace=False)
    return path


def crd_openapi(path: Path, version: str = "v1") -> dict:
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 18k lines
    for entry in crd["spec"]["versions"]:
        if entry["name"] == version:
            return entry["schema"]["openAPIV3Schema"]
    raise AssertionError(f"{path.name} has no version {version}")


@pytest.fixture(scope="module")
def rayservice_schema() -> dict:
    return crd_openapi(schemas_dir() / "ray.io_rayservices.yaml")


@pytest.fixture(scope="module")
def raycluster_spec_schema() -> dict:
    return crd_openapi(schemas_dir() / "ray.io_rayclusters.yaml")["properties"]["spec"]


def manifest_docs() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(K8S.glob("*.y*ml")):
        if path == OVERLAY:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def load_rayservice() -> dict:
    (doc,) = [doc for _, doc in manifest_docs() if doc.get("kind") == "RayService"]
    return doc


def serve_config_v2(rayservice: dict) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def containers(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = [("head", cluster["headGroupSpec"])] + [(g["groupName"], g) for g in cluster["workerGroupSpecs"]]
    return {name: group["template"]["spec"]["containers"][0] for name, group in groups}


def pod_specs(rayservice: dict) -> list[dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return [group["template"]["spec"] for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


def all_containers(rayservice: dict) -> list[dict]:
    return [c for spec in pod_specs(rayservice) for c in spec["containers"] + spec.get("initContainers", [])]


def serve_service(rayservice: dict) -> dict:
    """spec.serveService as a standalone core Service (KubeRay fills in the name and the selector)."""
    service = copy.deepcopy(rayservice["spec"]["serveService"])
    service["metadata"] = {"name": f"{rayservice['metadata']['name']}-serve-svc", **service.get("metadata", {})}
    return {"apiVersion": "v1", "kind": "Service", **service}


# ---------------------------------------------------------------------------------------------
# A small model of the API server's CRD validation


def apply_defaults(instance, schema: dict):
    """Fill in schema defaults the way the API server does, recursively; returns a new value.

    Within an object that is present, a missing property with a ``default`` gets a copy of it; a
    ``null`` for a property that is not ``nullable`` is pruned first (and then defaulted). Maps
    (``additionalProperties``) and array items are defaulted element by element.
    """
    instance = copy.deepcopy(instance)
    _default(instance, schema)
    return instance


def _default(instance, schema: dict) -> None:
    if isinstance(instance, dict):
        props = schema.get("properties") or {}
        for key, sub in props.items():
            if key in instance and instance[key] is None and not sub.get("nullable"):
                del instance[key]
            if key not in instance and "default" in sub:
                instance[key] = copy.deepcopy(sub["default"])
            if key in instance:
                _default(instance[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key, value in instance.items():
                if key not in props:
                    _default(value, extra)
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for item in instance:
            _default(item, schema["items"])


def to_json_schema(node: dict) -> dict:
    """An OpenAPI v3 (structural CRD) schema as a JSON Schema draft 4 for ``jsonschema``.

    ``nullable`` adds "null" to the type; ``x-kubernetes-int-or-string`` accepts an integer or a
    string; objects with ``properties`` reject unknown fields unless
    ``x-kubernetes-preserve-unknown-fields`` (strict field validation, kubectl's default);
    ``x-kubernetes-embedded-resource`` admits apiVersion/kind/metadata. The list-type keywords
    are kept and checked by the extra validators below; descriptions are dropped.
    """
    out: dict = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key in ("description", "example", "externalDocs", "x-kubernetes-validations", "nullable", "default"):
            continue
        else:
            out[key] = copy.deepcopy(value)
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("x-kubernetes-embedded-resource"):
        props = out.setdefault("properties", {})
        for name in ("apiVersion", "kind"):
            props.setdefault(name, {"type": "string"})
        props.setdefault("metadata", {"type": "object"})
    strict = not node.get("x-kubernetes-preserve-unknown-fields")
    if "properties" in out and "additionalProperties" not in out and strict:
        out["additionalProperties"] = False
    return out


def _list_type(validator, list_type, instance, schema):
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        seen = []
        for item in instance:
            if item in seen:
                yield jsonschema.ValidationError(f"duplicate entry {item!r} in a list of type set")
            seen.append(item)
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen = set()
        for item in instance:
            if isinstance(item, dict):
                key = tuple(repr(item.get(k)) for k in keys)
                if key in seen:
                    shown = {k: item.get(k) for k in keys}
                    yield jsonschema.ValidationError(f"duplicate entry {shown} in a list of type map")
                seen.add(key)


_FORMATS = jsonschema.FormatChecker(formats=())


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or isinstance(value, bool) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or isinstance(value, bool) or -(2**63) <= value < 2**63


CRDValidator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"x-kubernetes-list-type": _list_type})


_VALIDATORS: dict[int, tuple[dict, jsonschema.protocols.Validator]] = {}


def crd_validator(openapi: dict):
    """The (cached) validator of a CRD schema; the converted schema is itself checked once."""
    if id(openapi) not in _VALIDATORS or _VALIDATORS[id(openapi)][0] is not openapi:
        schema = to_json_schema(openapi)
        CRDValidator.check_schema(schema)
        _VALIDATORS[id(openapi)] = (openapi, CRDValidator(schema, format_checker=_FORMATS))
    return _VALIDATORS[id(openapi)][1]


def crd_errors(instance, openapi: dict) -> list[str]:
    """What the API server would refuse in ``instance`` (defaults applied first); [] when valid."""
    validator = crd_validator(openapi)
    errors = sorted(validator.iter_errors(apply_defaults(instance, openapi)), key=lambda e: list(e.absolute_path))
    return [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]


DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def metadata_errors(metadata: dict) -> list[str]:
    """ObjectMeta checks the CRD schema leaves to the API server: the name and the labels."""
    errors = []
    name = metadata.get("name", "")
    if not (DNS_SUBDOMAIN.match(name) and len(name) <= 253):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    for key, value in (metadata.get("labels") or {}).items():
        if not (isinstance(value, str) and LABEL_VALUE.match(value) and len(value) <= 63):
            errors.append(f"label {key}={value!r} is not a valid label value")
    return errors


# ---------------------------------------------------------------------------------------------
# Safety checks (functions, so that the negative tests can prove they catch violations)


def serving_port_violations(service: dict) -> list[str]:
    """A serving Service may expose Ray Serve's HTTP 8000 and gRPC 9000 and nothing else."""
    problems = []
    for port in service["spec"]["ports"]:
        if port["port"] not in SERVING_PORTS:
            problems.append(f"port {port['port']} ({port.get('name')}) is not a serving port")
        if port.get("targetPort", port["port"]) not in SERVING_PORTS | {"serve", "serve-grpc"}:
            problems.append(f"targetPort {port['targetPort']} is not a serving port")
    if service["spec"].get("type", "ClusterIP") not in ("ClusterIP",):
        problems.append(f"type {service['spec']['type']}: expose the service through TLS and authn, not directly")
    return problems


LOOPBACK = ("127.0.0.1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "--node-ip-address")


def loopback_violations(text: str) -> list[str]:
    return [needle for needle in LOOPBACK if needle in text]


def pinned_ray_version() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"ray(\[.*\])?==", d)]
    return pin.split("==", 1)[1]


# ---------------------------------------------------------------------------------------------
# Schema validity


def test_manifests_are_known_kinds():
    docs = manifest_docs()
    kinds = sorted(doc.get("kind", "?") for _, doc in docs)
    assert kinds == ["NetworkPolicy", "PersistentVolumeClaim", "PodMonitor", "RayService"], kinds
    for name, doc in docs:
        assert doc["apiVersion"] == API_VERSIONS[doc["kind"]], name
        assert metadata_errors(doc["metadata"]) == [], name


def test_rayservice_matches_kuberay_crd(rayservice_schema):
    rayservice = load_rayservice()
    assert crd_errors(rayservice, rayservice_schema) == []


def test_embedded_raycluster_spec_matches_raycluster_crd(raycluster_spec_schema):
    assert crd_errors(load_rayservice()["spec"]["rayClusterConfig"], raycluster_spec_schema) == []


def test_defaults_are_applied_before_validation(rayservice_schema):
    defaulted = apply_defaults(load_rayservice(), rayservice_schema)
    port = defaulted["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"][0]
    assert port["protocol"] == "TCP"  # the schema's default, also what we write
    # every default in the schema is a valid value under it
    assert crd_errors(defaulted, rayservice_schema) == []


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name, doc", [(n, d) for n, d in manifest_docs() if d["kind"] in CORE_KINDS],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_core_objects_match_kubernetes_schemas(name, doc, version):
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_serve_service_matches_kubernetes_schemas(version):
    kubernetes_validate.validate(serve_service(load_rayservice()), version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_pod_templates_match_kubernetes_schemas(version):
    cluster = load_rayservice()["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": group["template"]}
        kubernetes_validate.validate(template, version, strict=True)


def test_kubernetes_validate_works_offline(monkeypatch):
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError("kubernetes-validate tried to reach the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(yaml.safe_load(PVC.read_text()), version, strict=True)


# ---------------------------------------------------------------------------------------------
# serveConfigV2 and freshness


def test_serve_config_v2_is_a_valid_engine_config():
    serve_config = serve_config_v2(load_rayservice())
    engine = EngineConfig.model_validate(engine_section(serve_config))
    assert k8s.validate_serve_config(serve_config) == engine  # also Ray Serve's ServeDeploySchema
    overlay = k8s.Overlay.model_validate(read_yaml(OVERLAY))
    assert engine.models_dir == overlay.kubernetes.models.mount_path == "/models"
    assert engine.verifier.actor.num_gpus + engine.server.ssm_actor.num_gpus == 1  # they share one GPU
    assert engine.verifier.tensor_parallel_size == 1
    base = read_yaml(ROOT / "configs" / "serve.yaml")
    assert serve_config["grpc_options"]["grpc_servicer_functions"] == base["grpc_options"]["grpc_servicer_functions"]
    assert serve_config["grpc_options"]["port"] == 9000
    assert serve_config["http_options"] == {"host": "0.0.0.0", "port": 8000}
    # everything but the overlaid fields is configs/serve.yaml's
    assert engine.target == EngineConfig.model_validate(engine_section(base)).target


def test_committed_rayservice_is_up_to_date():
    generated = k8s.render(ROOT / "configs" / "serve.yaml", OVERLAY)
    assert RAYSERVICE.read_text() == generated, "k8s/rayservice.yaml is stale: run `specinfer k8s render`"
    assert generated.startswith("# generated by specinfer k8s render; do not edit")


def test_render_is_deterministic():
    serve_config, overlay = read_yaml(ROOT / "configs" / "serve.yaml"), read_yaml(OVERLAY)
    first = k8s.render_manifest(serve_config, overlay)[0]
    assert first == k8s.render_manifest(copy.deepcopy(serve_config), copy.deepcopy(overlay))[0]
    assert yaml.safe_load(first.split("---\n", 1)[1]) == k8s.render_manifest(serve_config, overlay)[1]


def _render_cli(argv: list[str]) -> int:
    import argparse

    from cluster import cli_k8s

    parser = argparse.ArgumentParser()
    cli_k8s.add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def test_render_cli_check_and_write(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert _render_cli(["k8s", "render", "--check"]) == 0
    stale = tmp_path / "rayservice.yaml"
    stale.write_text(RAYSERVICE.read_text().replace("replicas: 1", "replicas: 3"))
    assert _render_cli(["k8s", "render", "--check", "--out", str(stale)]) == 1
    assert "is stale" in capsys.readouterr().err
    fresh, pvc = tmp_path / "out" / "rayservice.yaml", tmp_path / "out" / "models-pvc.yaml"
    assert _render_cli(["k8s", "render", "--out", str(fresh), "--pvc-out", str(pvc)]) == 0
    assert fresh.read_text() == RAYSERVICE.read_text() and pvc.read_text() == PVC.read_text()
    pvc.write_text(PVC.read_text().replace("storage: 10Gi", "storage: 20Gi"))
    assert _render_cli(["k8s", "render", "--check", "--pvc-out", str(pvc)]) == 1
    assert f"{pvc} is stale" in capsys.readouterr().err
    overlay = read_yaml(OVERLAY)
    overlay["kubernetes"]["worker"]["memory"] = "64Gi"
    changed = tmp_path / "overlay.yaml"
    changed.write_text(yaml.safe_dump(overlay))
    assert _render_cli(["k8s", "render", "--check", "--overlay", str(changed)]) == 1


def test_render_command_is_registered(monkeypatch):
    from cluster import cli

    monkeypatch.chdir(ROOT)

    assert "cluster.cli_k8s" in cli.COMMAND_MODULES, "add cluster.cli_k8s to COMMAND_MODULES in cluster/cli.py"
    assert cli.main(["k8s", "render", "--check", "--out", str(RAYSERVICE)]) == 0


# ---------------------------------------------------------------------------------------------
# Safety properties


def test_serve_service_exposes_only_8000_and_9000():
    service = serve_service(load_rayservice())
    assert serving_port_violations(service) == []
    assert {p["port"] for p in service["spec"]["ports"]} == SERVING_PORTS
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"serve": "serve",
                                                                              "serve-grpc": "serve-grpc"}
    assert {p["name"]: p["appProtocol"] for p in service["spec"]["ports"]} == {"serve": "http",
                                                                               "serve-grpc": "kubernetes.io/h2c"}
    # KubeRay replaces the selector (ray.io/cluster of the active cluster + ray.io/serve=true) and the name
    assert "selector" not in service["spec"] and "name" not in load_rayservice()["spec"]["serveService"]["metadata"]


def test_kuberay_keeps_every_serve_service_port():
    """KubeRay v1.7.0's BuildServeService keeps a serveService port only if the head container has a
    port of that name, and takes only names "serve" or "serve-*" (isServingPort)."""
    rayservice = load_rayservice()
    head_ports = {p["name"]: p["containerPort"] for p in containers(rayservice)["head"]["ports"]}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "serve-grpc": 9000,
                          "metrics": 8080}  # "metrics" is not a serving port: it stays off the serve Service
    serving = {name: port for name, port in head_ports.items() if name == "serve" or name.startswith("serve-")}
    assert {p["name"]: p["port"] for p in rayservice["spec"]["serveService"]["spec"]["ports"]} == serving
    for name, container in containers(rayservice).items():  # the targetPorts resolve on every serving pod
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["serve"] == 8000 and ports["serve-grpc"] == 9000, name
    assert rayservice["spec"]["excludeHeadPodFromServeSvc"] is True


def test_no_loopback_binding_anywhere():
    paths = sorted(K8S.glob("*")) + [DOCKERFILE, ROOT / ".dockerignore"]
    for path in paths:
        assert loopback_violations(path.read_text()) == [], path.name
    serve_config = serve_config_v2(load_rayservice())
    assert serve_config["http_options"]["host"] == "0.0.0.0"
    head = load_rayservice()["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"


def test_ray_version_is_pinned_everywhere():
    version = pinned_ray_version()
    assert version == "2.60.0"
    assert load_rayservice()["spec"]["rayClusterConfig"]["rayVersion"] == version  # the image: tests/test_image.py


def test_image_is_the_package_version_for_every_container():
    package = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    cluster = load_rayservice()["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        spec = group["template"]["spec"]
        for container in spec["containers"] + spec.get("initContainers", []):
            assert container["image"] == f"ghcr.io/specinfer/specinfer:{package}"


def test_gpus_only_on_workers_and_enough_for_one_pipeline():
    rayservice = load_rayservice()
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0" and head["rayStartParams"]["num-cpus"] == "0"
    assert not any("gpu" in key for key in containers(rayservice)["head"]["resources"]["limits"])
    engine = EngineConfig.model_validate(engine_section(serve_config_v2(rayservice)))
    (worker,) = cluster["workerGroupSpecs"]
    gpus = int(worker["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
    assert gpus == math.ceil(k8s.gpus_per_pipeline(engine)) == k8s.gpus_per_pipeline(engine) == 1  # all used


def test_model_volume_is_per_pod_and_filled_by_the_fetch_init_container():
    (worker,) = load_rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = worker["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "models"]
    assert volume == {"name": "models", "emptyDir": {"sizeLimit": "20Gi"}}
    (init,) = spec["initContainers"]
    assert init["command"][:5] == ["specinfer", "models", "fetch", "--cache-dir", "/models"]
    assert set(init["command"][5:]) == {"qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in spec["containers"][0]["volumeMounts"]


# ---------------------------------------------------------------------------------------------
# Negative tests: the validators have teeth


def _set(doc: dict, path: str, value) -> dict:
    doc = copy.deepcopy(doc)
    *parents, last = path.split("/")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


RC = "spec/rayClusterConfig"
HEAD = f"{RC}/headGroupSpec"
WORKER = f"{RC}/workerGroupSpecs/0"
HEAD_C = f"{HEAD}/template/spec/containers/0"
WORKER_C = f"{WORKER}/template/spec/containers/0"

BAD_RAYSERVICES = {
    "replicas is a string": (f"{WORKER}/replicas", "two"),
    "replicas is a float": (f"{WORKER}/replicas", 1.5),
    "unknown field in headGroupSpec": (f"{HEAD}/rayStartParam", {"num-gpus": "0"}),
    "unknown field in a container": (f"{HEAD_C}/portz", []),
    "unknown field at the top of spec": ("spec/serveConfig", "x"),
    "containerPort is a string": (f"{HEAD_C}/ports/0/containerPort", "6379"),
    "containerPort beyond int32": (f"{HEAD_C}/ports/0/containerPort", 2**40),
    "int-or-string given a list": (f"{WORKER_C}/resources/limits/nvidia.com~gpu", ["2"]),
    "int-or-string given a bool": (f"{WORKER_C}/resources/limits/cpu", True),
    "rayStartParams value not a string": (f"{HEAD}/rayStartParams/num-gpus", 0),
    "serveConfigV2 not a string": ("spec/serveConfigV2", {"applications": []}),
    "enum violated": (f"{RC}/authOptions", {"mode": "magic"}),
    "duplicate list-map key": (f"{HEAD_C}/ports/1", {"name": "x", "containerPort": 6379, "protocol": "TCP"}),
    "negative minimum": ("spec/rayClusterDeletionDelaySeconds", -1),
}


def _mutate(doc: dict, path: str, value) -> dict:
    if "~" in path:  # a key with a slash: nvidia.com/gpu
        *parents, last = path.split("/")
        doc = copy.deepcopy(doc)
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last.replace("~", "/")] = value
        return doc
    return _set(doc, path, value)


@pytest.mark.parametrize("case", sorted(BAD_RAYSERVICES))
def test_invalid_rayservice_is_refused(case, rayservice_schema):
    path, value = BAD_RAYSERVICES[case]
    errors = crd_errors(_mutate(load_rayservice(), path, value), rayservice_schema)
    mutated = path.replace("~", "/")
    where = [e.split(": ", 1)[0] for e in errors]
    # refused, and for the mutation itself: the error sits on the mutated field or on its parent
    assert any(mutated.startswith(w) or w.startswith(mutated) for w in where), (case, errors)


def test_missing_required_head_group_is_refused(rayservice_schema, raycluster_spec_schema):
    rayservice = load_rayservice()
    del rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert any("headGroupSpec" in e for e in crd_errors(rayservice, rayservice_schema))
    assert crd_errors(rayservice["spec"]["rayClusterConfig"], raycluster_spec_schema)


@pytest.mark.parametrize("value", [2, "2", "500m"])
def test_int_or_string_accepts_both(value, rayservice_schema):
    rayservice = _mutate(load_rayservice(), f"{WORKER_C}/resources/limits/cpu", value)
    assert crd_errors(rayservice, rayservice_schema) == []


def test_default_applier():
    schema = {"type": "object", "properties": {
        "a": {"type": "integer", "default": 1},
        "b": {"type": "object", "properties": {"c": {"type": "string", "default": "x"}}},
        "d": {"type": "object", "default": {}, "properties": {"e": {"type": "boolean", "default": True}}},
        "m": {"type": "object", "additionalProperties": {"type": "object", "properties": {
            "f": {"type": "integer", "default": 7}}}},
        "l": {"type": "array", "items": {"type": "object", "properties": {"g": {"type": "string", "default": "y"}}}},
        "n": {"type": "string", "default": "z"},
    }}
    got = apply_defaults({"a": 5, "m": {"k": {}}, "l": [{}, {"g": "q"}], "n": None}, schema)
    # present values kept; absent parents not created unless they have a default themselves
    assert got == {"a": 5, "m": {"k": {"f": 7}}, "l": [{"g": "y"}, {"g": "q"}], "n": "z", "d": {"e": True}}
    assert "b" not in got


def test_strict_field_validation_respects_preserve_unknown_fields():
    schema = {"type": "object", "properties": {
        "strict": {"type": "object", "properties": {"a": {"type": "string"}}},
        "loose": {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                  "properties": {"a": {"type": "string"}}},
        "port": {"x-kubernetes-int-or-string": True},
    }}
    assert crd_errors({"loose": {"a": "x", "b": 1}, "port": "http"}, schema) == []
    assert crd_errors({"port": 80}, schema) == []
    assert crd_errors({"strict": {"a": "x", "b": 1}}, schema)
    assert crd_errors({"port": 1.5}, schema)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case, path, value", [
    ("pvc access modes not a list", "spec/accessModes", "ReadWriteOnce"),
    ("pvc unknown field", "spec/size", "20Gi"),
])
def test_invalid_pvc_is_refused(case, path, value, version):
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_set(yaml.safe_load(PVC.read_text()), path, value), version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case, path, value", [
    ("service port a string", "spec/ports/1/port", "9000"),
    ("service unknown field", "spec/exposeDashboard", True),
    ("service targetPort a list", "spec/ports/0/targetPort", [8000]),
])
def test_invalid_serve_service_is_refused(case, path, value, version):
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_set(serve_service(load_rayservice()), path, value), version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case, path, value", [
    ("policy podSelector a string", "spec/podSelector", "app=specinfer"),
    ("policy port a list", "spec/ingress/2/ports/0/port", [8000]),
    ("policy unknown field", "spec/ingress/0/source", []),
])
def test_invalid_network_policy_is_refused(case, path, value, version):
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(_set(yaml.safe_load(NETWORK_POLICY.read_text()), path, value), version,
                                     strict=True)


def test_safety_checks_catch_violations():
    service = serve_service(load_rayservice())
    dashboard = copy.deepcopy(service)
    dashboard["spec"]["ports"].append({"name": "dashboard", "port": 8265, "targetPort": 8265})
    assert serving_port_violations(dashboard)
    public = _set(service, "spec/type", "LoadBalancer")
    assert serving_port_violations(public)
    assert loopback_violations("http_options:\n  host: 127.0.0.1\n")
    assert loopback_violations("ENV RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1")


def test_invalid_serve_config_v2_is_refused():
    from pydantic import ValidationError

    serve_config = serve_config_v2(load_rayservice())
    args = engine_section(serve_config)
    for bad in ({**args, "unknown_option": 1},
                {**args, "verifier": {**args["verifier"], "actor": {**args["verifier"]["actor"], "num_gpus": "lots"}}},
                {**args, "speculation": {**args["speculation"], "expansion": []}}):
        with pytest.raises(ValidationError):
            EngineConfig.model_validate(bad)
    with pytest.raises(ValueError, match="0.0.0.0"):
        k8s.validate_serve_config(_set(serve_config, "http_options/host", "127.0.0.1"))
    with pytest.raises(ValueError, match="9000"):
        k8s.validate_serve_config(_set(serve_config, "grpc_options/port", 9001))


# ---------------------------------------------------------------------------------------------
# Render: merging and the checks it refuses on


def test_deep_merge_rules():
    base = {"a": {"b": 1, "c": [1, 2]}, "apps": [{"name": "x", "args": {"k": 1, "drop": 2}}, {"name": "y"}]}
    overlay = {"a": {"c": [3], "d": 4}, "apps": {"x": {"args": {"k": 5, "drop": None}}}}
    assert k8s.deep_merge(base, overlay) == {
        "a": {"b": 1, "c": [3], "d": 4}, "apps": [{"name": "x", "args": {"k": 5}}, {"name": "y"}]}
    assert base["apps"][0]["args"] == {"k": 1, "drop": 2}  # inputs untouched
    with pytest.raises(ValueError, match="no item named 'z'"):
        k8s.deep_merge(base, {"apps": {"z": {}}})
    assert k8s.deep_merge(base, {"apps": [{"name": "only"}]})["apps"] == [{"name": "only"}]


def _args(overlay: dict) -> dict:
    return overlay["serve"]["applications"]["specinfer"]["args"]


def _render_with(change) -> dict:
    serve_config, overlay = read_yaml(ROOT / "configs" / "serve.yaml"), read_yaml(OVERLAY)
    change(overlay)
    return k8s.render_manifest(serve_config, overlay)[1]


def _kube(**changes):
    return lambda o: o["kubernetes"].update(changes)


def _models(**changes):
    return lambda o: o["kubernetes"]["models"].update(changes)


def _claim(**changes):
    """The model volume as the PVC of k8s/models-pvc.yaml (ReadWriteOnce unless changed)."""
    return _models(volume="claim", **changes)


def _worker(**changes):
    return lambda o: o["kubernetes"]["worker"].update(changes)


def _ingress(**options):
    """The SpecInferIngress deployment's options in the overlay's serve section (replacing the committed ones)."""
    return lambda o: o["serve"]["applications"]["specinfer"].update(
        deployments=[{"name": k8s.INGRESS_DEPLOYMENT, **options}])


def _server(**changes):
    return lambda o: _args(o).setdefault("server", {}).update(changes)


def _all(*changes):
    return lambda o: [change(o) for change in changes]


@pytest.mark.parametrize("case, change, message", [
    ("1.25 GPUs do not fit in one", lambda o: _args(o)["verifier"]["actor"].update(num_gpus=1), "worker.gpus"),
    ("verifier on CPU", lambda o: _args(o)["verifier"]["actor"].update(num_gpus=0),
     "num_gpus"),
    ("tensor parallel 2 needs 2 GPUs",
     lambda o: (_args(o)["verifier"].update(tensor_parallel_size=2),
                _args(o).setdefault("server", {}).update(batching={"enabled": False})), "worker.gpus"),
    ("models_dir off the volume", lambda o: _args(o).update(models_dir="/data"),
     "mount_path"),
    ("loopback http", lambda o: o["serve"]["http_options"].update(host="127.0.0.1"), "0.0.0.0"),
    ("unknown overlay field", lambda o: o["kubernetes"].update(replicas=2), "replicas"),
    ("unknown engine field", lambda o: _args(o).update(gpu=True), "gpu"),
    ("unknown application", lambda o: o["serve"]["applications"].update(other={"args": {}}), "other"),
    ("replicas out of bounds", _worker(replicas=3), "min_replicas <= replicas <= max_replicas, got 1 <= 3 <= 2"),
    ("max_replicas pipelines beyond the worker group", _all(_ingress(autoscaling_config={"max_replicas": 3}),
                                                            _worker(max_replicas=2)),
     "3 ingress replicas (SpecInferIngress autoscaling_config.max_replicas) need 3 pipelines; worker.max_replicas "
     "2 pods of 1 GPUs hold 2 (1 each): raise worker.max_replicas to 3"),
    ("num_replicas beyond the worker group", _all(_ingress(num_replicas=2), _worker(max_replicas=1)),
     "2 ingress replicas (SpecInferIngress num_replicas) need 2 pipelines"),
    ("num_replicas auto takes Serve's max 100", _all(_ingress(num_replicas="auto"), _worker(max_replicas=4)),
     "100 ingress replicas (SpecInferIngress autoscaling_config.max_replicas)"),
    ("num_replicas and autoscaling_config", _ingress(num_replicas=2, autoscaling_config={"max_replicas": 2}),
     "Manually setting num_replicas is not allowed"),
    ("two worker pods on a ReadWriteOnce claim", _claim(), "is ReadWriteOnce: a pod on a second node never starts "
                                                           "(multi-attach error)"),
    ("two fixed replicas on a ReadWriteOncePod claim", _all(_claim(access_mode="ReadWriteOncePod"),
                                                            _ingress(num_replicas=2)), "ReadWriteOncePod: a pod"),
    ("per-pod volume without the fetch", _models(fetch=False), "volume per_pod is an empty directory"),
    ("image not pinned", _kube(image="ghcr.io/specinfer/specinfer"), "is not pinned"),
    ("image latest", _kube(image="ghcr.io/specinfer/specinfer:latest"), "is not pinned"),
    ("image digest too short", _kube(image="ghcr.io/specinfer/specinfer@sha256:abc123"), "not an image reference"),
    ("image digest upper case", _kube(image="ghcr.io/specinfer/specinfer@sha256:" + "A" * 64),
     "not an image reference"),
    ("ray auth secret not a name", _kube(ray_auth={"secret": "Ray_Token"}), "ray_auth.secret"),
    ("unfetchable source",
     lambda o: _args(o).update(target={"name": "t", "source": "/data/my-model"}),
     "models.fetch: false"),
    ("NewCluster on a ReadWriteOnce volume", _all(_kube(upgrade_strategy="NewCluster"), _claim()),
     "access_mode is ReadWriteOnce: a worker on another node never starts"),
    ("NewCluster on a ReadWriteOncePod volume",
     _all(_kube(upgrade_strategy="NewCluster"), _claim(access_mode="ReadWriteOncePod")), "ReadWriteOncePod"),
    ("incremental upgrade not offered", _kube(upgrade_strategy="NewClusterWithIncrementalUpgrade"), "NewCluster"),
    ("upgrade strategy misspelt", _kube(upgrade_strategy="Recreate"), "upgrade_strategy"),
    ("fetch into a read-only volume", _claim(access_mode="ReadOnlyMany"), "fetch: false"),
    ("pull secret not a name", _kube(image_pull_secrets=["Reg Cred"]), "image_pull_secrets"),
    ("pull secret twice", _kube(image_pull_secrets=["regcred", "regcred"]), "twice"),
    ("GCS FT without an address", _kube(gcs_fault_tolerance={"redis_password": {"secret": "r", "key": "p"}}),
     "redis_address"),
    ("auth secret not a name", _kube(auth={"secret": "My_Secret"}), "auth.secret"),
    ("auth token file where the Secret is not", _server(auth_token_file="/var/run/tokens"),
     "the Secret is mounted at /etc/specinfer/auth/tokens, but server.auth_token_file is '/var/run/tokens'"),
])
def test_render_refuses(case, change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _render_with(change)


def test_render_without_fetch_mounts_a_prefilled_volume():
    service = _render_with(_all(_claim(fetch=False, access_mode="ReadOnlyMany")))
    spec = service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "initContainers" not in spec
    assert spec["volumes"][0]["persistentVolumeClaim"] == {"claimName": "specinfer-models", "readOnly": True}


# ---------------------------------------------------------------------------------------------
# Overlay options: each variant renders a manifest that passes the same validation as the committed one


POD_SECURITY = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 100, "fsGroup": 100,
                "seccompProfile": {"type": "RuntimeDefault"}}
CONTAINER_SECURITY = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                      "seccompProfile": {"type": "RuntimeDefault"}}
REDIS = {"redis_address": "redis.specinfer.svc:6379"}
DIGEST = "sha256:" + "0123456789abcdef" * 4
VARIANTS = {
    "committed overlay": lambda o: None,
    "one pod on a ReadWriteOnce claim": _all(_claim(), _ingress(num_replicas=1)),
    "None on a per-pod volume": _kube(upgrade_strategy="None"),
    "NewCluster on ReadWriteMany": _all(_kube(upgrade_strategy="NewCluster"), _claim(access_mode="ReadWriteMany")),
    "auto on a pre-filled ReadOnlyMany": _claim(access_mode="ReadOnlyMany", fetch=False),
    "num_replicas auto, 2 pipelines a pod": _all(_ingress(num_replicas="auto", autoscaling_config={
        "min_replicas": 2, "max_replicas": 5, "initial_replicas": 3}), _worker(gpus=2)),
    "scale to zero": _ingress(autoscaling_config={"min_replicas": 0, "max_replicas": 3}),
    "fixed 2 replicas": _ingress(num_replicas=2),
    "no deployment options": lambda o: o["serve"]["applications"]["specinfer"].pop("deployments"),
    "longer drain and TTL": _server(drain_timeout_s=100, request_ttl_s=1000.5),
    "image by digest": _kube(image=f"ghcr.io/specinfer/specinfer@{DIGEST}"),
    "image by tag and digest": _kube(image=f"registry.example.com:5000/ml/specinfer:0.1.0@{DIGEST}"),
    "image pull secrets": _kube(image_pull_secrets=["regcred", "mirror"]),
    "GCS FT": _kube(gcs_fault_tolerance=REDIS),
    "GCS FT with a password": _kube(gcs_fault_tolerance={**REDIS, "redis_password": {"secret": "redis", "key": "pw"}}),
    "no auth": _kube(auth=None),
    "Ray auth with own Secret": _kube(ray_auth={"secret": "specinfer-ray-token"}),
    "no Ray auth": _kube(ray_auth=None),
}


@pytest.fixture(scope="module")
def variants() -> dict[str, dict]:
    return {name: _render_with(change) for name, change in VARIANTS.items()}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_passes_crd_and_kubernetes_validation(variant, variants, rayservice_schema):
    rayservice = variants[variant]
    assert crd_errors(rayservice, rayservice_schema) == []
    for spec in pod_specs(rayservice):
        template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": {"spec": spec}}
        kubernetes_validate.validate(template, K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("variant, expected", [
    ("committed overlay", "NewCluster"), ("one pod on a ReadWriteOnce claim", "None"),
    ("None on a per-pod volume", "None"), ("NewCluster on ReadWriteMany", "NewCluster"),
    ("auto on a pre-filled ReadOnlyMany", "NewCluster"),
])
def test_upgrade_strategy_is_rendered(variant, expected, variants):
    assert variants[variant]["spec"]["upgradeStrategy"] == {"type": expected}


def _rendered(change) -> k8s.Rendered:
    serve_config, overlay = read_yaml(ROOT / "configs" / "serve.yaml"), read_yaml(OVERLAY)
    change(overlay)
    return k8s.render_all(serve_config, overlay)


@pytest.mark.parametrize("variant, note", [
    ("committed overlay", "upgradeStrategy NewCluster (zero downtime): an upgrade starts a second cluster with 1 "
                          "worker pods (1 GPUs) beside this one"),
    ("one pod on a ReadWriteOnce claim", "upgradeStrategy None, not NewCluster: the model claim 'specinfer-models' "
                                         "is ReadWriteOnce, which a second cluster's workers cannot mount"),
    ("None on a per-pod volume", "upgradeStrategy None (set in the overlay): a change under rayClusterConfig is not "
                                 "rolled out"),
])
def test_render_says_what_the_upgrade_strategy_means(variant, note):
    rendered = _rendered(VARIANTS[variant])
    (said,) = [n for n in rendered.notes if n.startswith("upgradeStrategy")]
    assert said.startswith(note)
    assert f"# Note: {said}.\n" in rendered.text.split("---\n", 1)[0]  # in the manifest's header too


def test_render_cli_prints_the_notes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    overlay = read_yaml(OVERLAY)
    VARIANTS["one pod on a ReadWriteOnce claim"](overlay)
    (tmp_path / "overlay.yaml").write_text(yaml.safe_dump(overlay))
    assert _render_cli(["k8s", "render", "--overlay", str(tmp_path / "overlay.yaml"), "--out", "-"]) == 0
    out, err = capsys.readouterr()
    assert "note: upgradeStrategy None, not NewCluster: the model claim 'specinfer-models' is ReadWriteOnce" in err
    assert "note: worker pods: 1 for 1-1 ingress replicas" in err
    assert yaml.safe_load(out.split("---\n", 1)[1])["spec"]["upgradeStrategy"] == {"type": "None"}


def test_committed_upgrade_strategy_is_quoted_and_the_claim_matches_its_pvc():
    assert 'type: "None"' in k8s.render_manifest(read_yaml(ROOT / "configs" / "serve.yaml"),
                                                 _overlay_with(VARIANTS["one pod on a ReadWriteOnce claim"]))[0]
    overlay = k8s.Overlay.model_validate(read_yaml(OVERLAY))
    assert yaml.safe_load(PVC.read_text())["spec"]["accessModes"] == [overlay.kubernetes.models.access_mode]


def _overlay_with(change) -> dict:
    overlay = read_yaml(OVERLAY)
    change(overlay)
    return overlay


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_container_runs_restricted(variant, variants):
    rayservice = variants[variant]
    for spec in pod_specs(rayservice):
        assert POD_SECURITY.items() <= spec["securityContext"].items()
    for container in all_containers(rayservice):
        assert CONTAINER_SECURITY.items() <= container["securityContext"].items(), container["name"]
        assert container["securityContext"]["readOnlyRootFilesystem"] is False  # Ray writes /tmp/ray
    fetch = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"].get("initContainers")
    assert len(all_containers(rayservice)) == (3 if fetch else 2)  # head, worker (, fetch-models)


@pytest.mark.parametrize("variant, secrets", [("committed overlay", None),
                                              ("image pull secrets", [{"name": "regcred"}, {"name": "mirror"}])])
def test_image_pull_secrets_only_when_set(variant, secrets, variants):
    for spec in pod_specs(variants[variant]):
        assert spec.get("imagePullSecrets") == secrets


@pytest.mark.parametrize("variant, options", [
    ("committed overlay", None),
    ("GCS FT", {"redisAddress": "redis.specinfer.svc:6379"}),
    ("GCS FT with a password", {"redisAddress": "redis.specinfer.svc:6379",
                                "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "redis", "key": "pw"}}}}),
])
def test_gcs_fault_tolerance_renders_when_enabled(variant, options, variants):
    rayservice = variants[variant]
    assert rayservice["spec"]["rayClusterConfig"].get("gcsFaultToleranceOptions") == options
    # KubeRay v1.7.0 refuses the legacy annotation next to the options, and RAY_REDIS_ADDRESS in the head
    assert "ray.io/ft-enabled" not in (rayservice["metadata"].get("annotations") or {})
    assert all(e["name"] not in ("RAY_REDIS_ADDRESS", "REDIS_PASSWORD") for c in all_containers(rayservice)
               for e in c["env"])


@pytest.mark.parametrize("variant, wired", [("committed overlay", True), ("no auth", False)])
def test_auth_tokens_are_a_mounted_secret_file(variant, wired, variants):
    rayservice = variants[variant]
    (worker,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = worker["template"]["spec"]
    volume = {"name": "auth-tokens", "secret": {"secretName": "specinfer-auth",
                                                "items": [{"key": "token", "path": "tokens"}]}}
    mount = {"name": "auth-tokens", "mountPath": "/etc/specinfer/auth", "readOnly": True}  # a directory: updated live
    assert (volume in spec["volumes"]) == wired
    assert (mount in spec["containers"][0]["volumeMounts"]) == wired
    server = engine_section(serve_config_v2(rayservice))["server"]
    assert server.get("auth_token_file") == ("/etc/specinfer/auth/tokens" if wired else None)
    for container in all_containers(rayservice):  # no token in an environment variable (it could not rotate)
        assert all(e["name"] != "SPECINFER_AUTH_TOKEN" and "valueFrom" not in e for e in container["env"])
        assert "subPath" not in str(container.get("volumeMounts")), container["name"]


@pytest.mark.parametrize("variant, options", [
    ("committed overlay", {"mode": "token"}),
    ("Ray auth with own Secret", {"mode": "token", "secretName": "specinfer-ray-token"}),
    ("no Ray auth", None),
])
def test_ray_token_auth_is_on_by_default(variant, options, variants, raycluster_spec_schema):
    cluster = variants[variant]["spec"]["rayClusterConfig"]
    assert cluster.get("authOptions") == options
    assert crd_errors(cluster, raycluster_spec_schema) == []  # authOptions is in the KubeRay 1.7 RayCluster CRD
    # KubeRay needs Ray >= 2.52.0 for mode token (ValidateRayClusterSpec, utils/validation.go)
    assert tuple(int(p) for p in cluster["rayVersion"].split(".")) >= (2, 52, 0)


@pytest.mark.parametrize("variant, image", [
    ("image by digest", f"ghcr.io/specinfer/specinfer@{DIGEST}"),
    ("image by tag and digest", f"registry.example.com:5000/ml/specinfer:0.1.0@{DIGEST}"),
])
def test_image_digests_render_into_every_container(variant, image, variants):
    assert {c["image"] for c in all_containers(variants[variant])} == {image}


# ---------------------------------------------------------------------------------------------
# Scaling: Serve's autoscaling_config -> worker pod bounds and KubeRay's in-tree autoscaler


@pytest.mark.parametrize("variant, pods, scaler", [
    ("committed overlay", (1, 1, 2), True),  # min 1, max 2 replicas; one 1-GPU pipeline per 1-GPU pod
    ("num_replicas auto, 2 pipelines a pod", (2, 1, 3), True),  # 2 GPUs hold 2 pipelines: 3/2 start, 2/2, 5/2 pods
    ("scale to zero", (0, 0, 3), True),
    ("fixed 2 replicas", (2, 2, 2), False),
    ("no deployment options", (1, 1, 1), False),  # Serve's default: one replica
    ("one pod on a ReadWriteOnce claim", (1, 1, 1), False),
])
def test_worker_bounds_follow_the_ingress_replicas(variant, pods, scaler, variants):
    cluster = variants[variant]["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"]
    assert (worker["replicas"], worker["minReplicas"], worker["maxReplicas"]) == pods
    assert cluster["enableInTreeAutoscaling"] is scaler
    assert ("autoscalerOptions" in cluster) is scaler


def test_autoscaler_sidecar_is_restricted_and_sized(variants):
    options = variants["committed overlay"]["spec"]["rayClusterConfig"]["autoscalerOptions"]
    assert options["upscalingMode"] == "Default" and options["idleTimeoutSeconds"] == 60
    assert CONTAINER_SECURITY.items() <= options["securityContext"].items()
    assert options["resources"]["requests"] == options["resources"]["limits"] == {"cpu": "500m", "memory": "512Mi"}


def test_serve_keeps_its_own_autoscaling_keys():
    """serveConfigV2 carries Serve's autoscaling_config as written: Serve, not render, scales the replicas."""
    deployments = yaml.safe_load(load_rayservice()["spec"]["serveConfigV2"])["applications"][0]["deployments"]
    assert deployments == [{"name": "SpecInferIngress", "num_replicas": "auto", "autoscaling_config": {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 8}}]


@pytest.mark.parametrize("deployment, expected", [
    ({}, (1, 1, 1, False)),
    ({"num_replicas": 3}, (3, 3, 3, False)),
    ({"num_replicas": "auto"}, (1, 1, 100, True)),  # Serve's defaults for auto (AutoscalingConfig.default())
    ({"num_replicas": "auto", "autoscaling_config": {"max_replicas": 4}}, (1, 1, 4, True)),
    ({"autoscaling_config": {"min_replicas": 2, "max_replicas": 6, "initial_replicas": 4}}, (2, 4, 6, True)),
    ({"num_replicas": None, "autoscaling_config": {"max_replicas": 3}}, (1, 1, 3, True)),
])
def test_ingress_scaling_resolves_like_serve(deployment, expected):
    config = {"applications": [{"name": "specinfer",
                                "deployments": [{"name": "SpecInferIngress", **deployment}] if deployment else []}]}
    scaling = k8s.ingress_scaling(config)
    assert (scaling.min_replicas, scaling.initial_replicas, scaling.max_replicas, scaling.autoscaling) == expected


# ---------------------------------------------------------------------------------------------
# Shutdown: preStop drain, grace period, old-cluster deletion delay


@pytest.mark.parametrize("variant, drain, ttl", [("committed overlay", 30, 600), ("longer drain and TTL", 100, 1000.5)])
def test_shutdown_times_derive_from_the_server_config(variant, drain, ttl, variants):
    rayservice = variants[variant]
    server = EngineConfig.model_validate(engine_section(serve_config_v2(rayservice))).server
    assert (server.drain_timeout_s, server.request_ttl_s) == (drain, ttl)
    (worker,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = worker["template"]["spec"]
    # grace = drain_timeout_s + 15 s for the node to stop after the drain + 15 s for SIGTERM to stop Ray
    assert spec["terminationGracePeriodSeconds"] == math.ceil(drain) + 30
    (container,) = spec["containers"]
    command = ["specinfer", "k8s", "drain-node", "--deadline-s", str(drain), "--wait-s", str(drain + 15)]
    assert container["lifecycle"] == {"preStop": {"exec": {"command": command}}}
    # Ray's own SIGTERM drain gets what is left of the grace period (10 s < the 15 s margin)
    assert {"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": "10"} in container["env"]
    # the old cluster of an upgrade outlives the longest request by 30 s
    assert rayservice["spec"]["rayClusterDeletionDelaySeconds"] == math.ceil(ttl) + 30
    head = rayservice["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert "lifecycle" not in head["containers"][0]  # no replica runs on the head (num-cpus 0)


def test_prestop_command_is_the_cli(monkeypatch):
    """The preStop command parses as `specinfer k8s drain-node` and reaches its handler."""
    from cluster import cli, k8s_drain

    (worker,) = load_rayservice()["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    command = worker["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "specinfer"
    called = []
    monkeypatch.setattr(k8s_drain, "run_drain_node", lambda args: called.append(args) or 0)
    assert cli.main(command[1:]) == 0
    assert (called[0].deadline_s, called[0].wait_s) == (30.0, 45.0)


class FakeGcs:
    """A GCS with this pod's node (10.0.0.7) and another; the node dies ``dies_after`` polls after the drain."""

    def __init__(self, dies_after: int | None, accept: bool = True):
        from types import SimpleNamespace

        self.nodes = {b"\x01" * 28: SimpleNamespace(node_id=b"\x01" * 28, node_manager_address="10.0.0.7", state=0),
                      b"\x02" * 28: SimpleNamespace(node_id=b"\x02" * 28, node_manager_address="10.0.0.9", state=0)}
        self.dies_after, self.accept, self.drains, self.polls = dies_after, accept, [], 0

    def get_all_node_info(self, timeout=None):
        if self.drains:
            self.polls += 1
            if self.dies_after is not None and self.polls > self.dies_after:
                self.nodes[b"\x01" * 28].state = 1  # DEAD
        return self.nodes

    def drain_node(self, node_id, reason, reason_message, deadline_timestamp_ms, timeout=None):
        self.drains.append((node_id, reason, deadline_timestamp_ms))
        return (True, "") if self.accept else (False, "not idle")


@pytest.mark.parametrize("dies_after, expected", [(3, "drained and stopped after 3 s"),
                                                  (None, "still alive after 45 s: stopping it anyway")])
def test_drain_node_drains_this_node_and_waits_for_it(dies_after, expected):
    from cluster.k8s_drain import drain_node

    gcs, now = FakeGcs(dies_after), [1000.0]
    message = drain_node(gcs, "10.0.0.7", 30, 45, reason=2, clock=lambda: now[0],
                         sleep=lambda s: now.__setitem__(0, now[0] + s))
    assert message == f"node {'01' * 28} {expected}"
    # one drain, of this node, by its hex id (a binary id would be the nil node), with the deadline 30 s away
    assert gcs.drains == [("01" * 28, 2, 1_030_000)]


def test_drain_node_refusals_are_reported():
    from cluster.k8s_drain import drain_node

    assert drain_node(FakeGcs(0, accept=False), "10.0.0.7", 30, 45, 2) == f"drain of node {'01' * 28} refused: not idle"
    with pytest.raises(LookupError, match="0 live Ray nodes at 10.9.9.9"):
        drain_node(FakeGcs(0), "10.9.9.9", 30, 45, 2)


REAL_DRAIN = """
import os, socket, sys, threading, time
import ray
from ray.cluster_utils import Cluster
from ray._raylet import GcsClient
from ray.core.generated import autoscaler_pb2
from cluster.k8s_drain import drain_node

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def node_args(**more):
    return {"node_ip_address": "127.0.0.1", "dashboard_agent_listen_port": port(), "metrics_export_port": port(),
            **more}

cluster = Cluster(initialize_head=True, head_node_args=node_args(num_cpus=1, gcs_server_port=port(),
                                                                 include_dashboard=False, temp_dir=sys.argv[1]))
try:
    worker = cluster.add_node(**node_args(num_cpus=1, resources={"pipeline": 1}))
    ray.init(address=cluster.address)

    @ray.remote(num_cpus=0.5, resources={"pipeline": 1})
    class Replica:
        def node(self):
            return ray.get_runtime_context().get_node_id()

    replica = Replica.remote()
    assert ray.get(replica.node.remote()) == worker.node_id
    gcs = GcsClient(address=cluster.address)

    class ThisPod:  # both nodes are 127.0.0.1 here: the hook sees the worker only, as one pod's IP shows it
        def get_all_node_info(self, timeout=None):
            return {k: v for k, v in gcs.get_all_node_info(timeout=timeout).items() if not v.is_head_node}

        def drain_node(self, *args, **kwargs):
            return gcs.drain_node(*args, **kwargs)

    said = []
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    hook = threading.Thread(target=lambda: said.append(drain_node(ThisPod(), "127.0.0.1", 30, 60, reason)))
    hook.start()
    deadline = time.time() + 20
    while worker.node_id not in gcs.get_draining_nodes() and time.time() < deadline:
        time.sleep(0.2)
    print("draining:", worker.node_id in gcs.get_draining_nodes(), "waiting:", hook.is_alive(), flush=True)
    ray.kill(replica)  # what Serve does to a replica on a draining node once its requests are done
    hook.join(60)
    print("hook:", said[0] if said else "still running")
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.ray
def test_drain_node_on_a_real_cluster(tmp_path):
    """The hook against Ray 2.60 itself (a head and a worker node, in a subprocess): the GCS marks the
    node draining (so the id went in the form it decodes), the hook waits while an actor holds the
    node, and returns once the raylet, drained and idle, has exited by itself."""
    import shutil
    import subprocess
    import sys
    import tempfile

    ray_tmp = tempfile.mkdtemp(prefix="drain-", dir="/tmp")  # short: Ray's socket paths live under it
    os.makedirs(os.path.join(ray_tmp, "ray"))
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_TMPDIR": ray_tmp, "PYTHONPATH": str(ROOT)}
    try:
        result = subprocess.run([sys.executable, "-c", REAL_DRAIN, ray_tmp], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert "draining: True waiting: True" in lines, result.stdout
    (hook,) = [line for line in lines if line.startswith("hook:")]
    assert re.fullmatch(r"hook: node [0-9a-f]{56} drained and stopped after \d+ s", hook), hook


def test_drain_node_without_a_gcs_exits_at_once(monkeypatch, capsys):
    """The whole cluster is going (its head too): the hook must not hold the pod for the grace period."""
    from cluster import cli

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cli.main(["k8s", "drain-node", "--deadline-s", "30", "--wait-s", "45"]) == 1
    assert "no --address and no $RAY_ADDRESS; nothing drained" in capsys.readouterr().out


def test_minimum_kuberay_version_is_stated_with_its_reason():
    header = RAYSERVICE.read_text().split("---\n", 1)[0]
    assert "# Needs KubeRay >= 1.6: older operators build <name>-serve-svc from the head port named \"serve\"" in header
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "KubeRay 1.6 or newer" in docs and "isServingPort" in docs


def test_a_hub_model_is_fetched_by_the_init_container_into_the_volumes_hub_cache():
    """A target named by hub id and revision: the fetch initContainer downloads it (online), and
    every container finds it in the volume's hub cache (HF_HUB_CACHE); the Ray ones stay offline."""
    rayservice = _render_with(lambda o: _args(o).update(
        target={"name": "t", "source": "Qwen/Qwen2.5-7B-Instruct", "revision": "a09a354"}))
    (worker,) = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (init,) = worker["template"]["spec"]["initContainers"]
    assert set(init["command"][5:]) == {"Qwen/Qwen2.5-7B-Instruct@a09a354", "qwen2.5-coder-0.5b-instruct"}
    for container in all_containers(rayservice):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["HF_HUB_CACHE"] == "/models/hub", container["name"]
        assert env["HF_HUB_OFFLINE"] == ("0" if container["name"] == "fetch-models" else "1"), container["name"]


def test_committed_pvc_is_generated_and_sized_for_the_models():
    """k8s/models-pvc.yaml is render's: the claim's name, access mode and a size from the models (the
    default pair: (6 + 2) GB converted, plus 25% -> 10Gi)."""
    rendered = k8s.render_files(ROOT / "configs" / "serve.yaml", OVERLAY)
    assert PVC.read_text() == rendered.pvc_text, "k8s/models-pvc.yaml is stale: run `specinfer k8s render`"
    pvc = yaml.safe_load(rendered.pvc_text.split("---\n", 1)[1])
    assert pvc["spec"]["resources"]["requests"]["storage"] == "10Gi"
    assert pvc["metadata"]["name"] == "specinfer-models" and "storageClassName" not in pvc["spec"]


def _hub_target(o):
    _args(o).update(target={"name": "t", "source": "Qwen/Qwen2.5-7B-Instruct", "revision": "a09a354"})


def _rendered_pvc(change, hub_size=None) -> dict | None:
    serve_config, overlay = read_yaml(ROOT / "configs" / "serve.yaml"), read_yaml(OVERLAY)
    change(overlay)
    text = k8s.render_all(serve_config, overlay, hub_size).pvc_text
    return None if text is None else yaml.safe_load(text.split("---\n", 1)[1])


def _offline(repo, revision):
    raise OSError("offline")


@pytest.mark.parametrize("case, change, hub_size, storage", [
    ("hub target sized by the hub", _all(_claim(access_mode="ReadWriteMany"), _hub_target),
     lambda repo, revision: {("Qwen/Qwen2.5-7B-Instruct", "a09a354"): 15 * 10**9}[(repo, revision)], "20Gi"),
    ("size set by hand", _all(_claim(access_mode="ReadWriteMany", claim_size="40Gi", storage_class="fast"),
                              _hub_target), _offline, "40Gi"),
    ("per-pod volume, hub unreachable: no claim", _hub_target, _offline, None),
])
def test_claim_size_follows_the_models(case, change, hub_size, storage):
    """(15 GB + the bundled SSM's 2 GB) x 1.25 = 21.25 GB = 19.8 GiB -> 20Gi."""
    pvc = _rendered_pvc(change, hub_size)
    assert (pvc and pvc["spec"]["resources"]["requests"]["storage"]) == storage, case
    if storage == "40Gi":
        assert pvc["spec"]["storageClassName"] == "fast"


def test_claim_of_an_unsizable_hub_model_is_refused_naming_claim_size():
    with pytest.raises(ValueError, match=r"kubernetes.models.claim_size: the size of Qwen/Qwen2.5-7B-Instruct@a09a354 "
                                         r"cannot be asked from the hub \(OSError\); set claim_size"):
        _rendered_pvc(_all(_claim(access_mode="ReadWriteMany"), _hub_target), _offline)


def test_hub_token_reaches_the_fetch_init_container_only():
    """models.hub_token_secret: HF_TOKEN from the Secret in fetch-models (never a literal value);
    the Ray containers get no token."""
    rayservice = _render_with(_all(_models(hub_token_secret="hf-token", hub_token_key="hf"), _hub_target))
    for container in all_containers(rayservice):
        tokens = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
        if container["name"] == "fetch-models":
            assert tokens == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "hf"}}}]
        else:
            assert tokens == [], container["name"]
    with pytest.raises(ValueError, match="models.hub_token_secret 'HF_Token' is not a valid Kubernetes name"):
        _render_with(_models(hub_token_secret="HF_Token"))
