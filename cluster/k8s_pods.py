"""The RayCluster's pod groups for `specinfer k8s render`: containers, security contexts, volumes.

Every pod runs as the image's user ``ray`` (uid 1000, group ``users`` = 100: ``useradd --uid 1000
--gid 100`` and ``USER 1000:100`` in the Dockerfile's final stage, the ids of ray-project/ray's
images too), never as root, with no privilege escalation,
no capabilities and the runtime's default seccomp profile: the Pod Security Standards'
"restricted" level. KubeRay copies the Ray container's securityContext into the init container it
injects into worker pods (``wait-gcs-ready``; ray-operator/controllers/ray/common/pod.go in v1.7.0).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from settings.config import APP_NAME

from .k8s_overlay import KubernetesOverlay

SERVE_PORT = 8000  # Serve's HTTP proxy: KubeRay's readiness probe checks /-/healthz on the port named "serve"
GRPC_PORT = 9000  # Serve's gRPC proxy: specinfer.v1.SpecInfer
DASHBOARD_PORT = 8265  # Ray dashboard and job submission: cluster-internal only (k8s/networkpolicy.yaml)
# Ray's metrics export port, KubeRay's default name and number (utils.MetricsPortName / DefaultMetricsPort in
# v1.7.0; it adds the port when missing): declared here so that k8s/podmonitor.yaml's `metrics` is in the manifest.
METRICS_PORT, METRICS_PORT_NAME = 8080, "metrics"
# KubeRay's <name>-serve-svc takes the head container ports named "serve" or "serve-*"
# (isServingPort in ray-operator/controllers/ray/common/service.go, v1.7.0).
SERVE_PORT_NAME, GRPC_PORT_NAME = "serve", "serve-grpc"
ALL_INTERFACES = "0.0.0.0"
RAY_UID = 1000  # user `ray` of our image (Dockerfile: USER 1000:100), the rayproject/ray images' ids too
RAY_GID = 100  # its primary group `users`
AUTH_MOUNT, AUTH_FILE = "/etc/specinfer/auth", "tokens"  # the serving tokens' Secret, in the worker pods


@dataclass(frozen=True)
class WorkerPlan:
    """What render derived for the worker group: pod counts (from the ingress replica bounds) and the
    shutdown: ``prestop`` runs in the Ray container before SIGTERM, within ``grace_s`` seconds."""

    replicas: int
    min_replicas: int
    max_replicas: int
    grace_s: int
    prestop: tuple[str, ...]
    sigterm_drain_s: int  # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S: Ray's own drain on SIGTERM, after the hook
    fetch_names: tuple[str, ...]


def object_labels(kube: KubernetesOverlay) -> dict[str, str]:
    """Labels of everything rendered; k8s/networkpolicy.yaml selects the Ray pods by the last two."""
    return {**kube.labels, "app.kubernetes.io/instance": kube.name, "app.kubernetes.io/part-of": APP_NAME}


def pod_labels(kube: KubernetesOverlay, component: str) -> dict[str, str]:
    """Labels of the Ray pods. app.kubernetes.io/name stays KubeRay's: its head Service selects on it."""
    return {**object_labels(kube), "app.kubernetes.io/component": component}


def _port(name: str, number: int) -> dict:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def _resources(cpu: str, memory: str, extra: dict | None = None, storage: str | None = None) -> dict:
    """Limits = requests (Guaranteed QoS); ephemeral storage is requested only (scheduling, no eviction cap)."""
    amounts = {"cpu": cpu, "memory": memory, **(extra or {})}
    return {"limits": dict(amounts), "requests": {**amounts, **({"ephemeral-storage": storage} if storage else {})}}


def _env(kube: KubernetesOverlay, fetch: bool = False) -> list[dict]:
    """Models load from the volume only (hub models from its hub cache, ``cluster.fetch.hub_environment``);
    only the fetch initContainer (``fetch``) reaches a model hub. (The serving tokens come as a file,
    ``worker_group``; Ray's token, with authOptions, KubeRay adds itself.)"""
    from .fetch import hub_environment

    env = [{"name": "HF_HUB_OFFLINE", "value": "0" if fetch else "1"},
           {"name": "TOKENIZERS_PARALLELISM", "value": "false"}]
    return env + [{"name": name, "value": value} for name, value in hub_environment(kube.models.mount_path).items()]


def container_security() -> dict:
    # readOnlyRootFilesystem stays false: Ray writes its session directory under /tmp/ray, and torch,
    # Triton and DeepSpeed write caches under /home/ray; an emptyDir for each is untested here.
    return {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": False,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def pod_security() -> dict:
    # fsGroup makes a fresh model volume writable for the fetch; OnRootMismatch skips the recursive
    # chown of a filled volume on later mounts.
    return {"runAsNonRoot": True, "runAsUser": RAY_UID, "runAsGroup": RAY_GID, "fsGroup": RAY_GID,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def _container(kube: KubernetesOverlay, name: str, resources: dict, *, ports: list | None = None,
               command: list[str] | None = None, mounts: list[dict] | None = None, fetch: bool = False) -> dict:
    container: dict[str, Any] = {"name": name, "image": kube.image, "imagePullPolicy": kube.image_pull_policy}
    if command:
        container["command"] = command
    if ports:
        container["ports"] = ports
    container["env"] = _env(kube, fetch)
    container["resources"] = resources
    if mounts:
        container["volumeMounts"] = mounts
    container["securityContext"] = container_security()
    return container


def _pod_spec(kube: KubernetesOverlay, containers: list[dict], init: list[dict] | None = None) -> dict:
    spec: dict[str, Any] = {}
    if init:
        spec["initContainers"] = init
    spec["containers"] = containers
    spec["securityContext"] = pod_security()
    if kube.image_pull_secrets:
        spec["imagePullSecrets"] = [{"name": name} for name in kube.image_pull_secrets]
    return spec


def head_group(kube: KubernetesOverlay) -> dict:
    # KubeRay builds <name>-serve-svc from these ports: "serve" and "serve-grpc" must stay here even
    # though the head takes no traffic (excludeHeadPodFromServeSvc).
    ports = [_port("gcs-server", 6379), _port("dashboard", DASHBOARD_PORT), _port("client", 10001),
             _port(SERVE_PORT_NAME, SERVE_PORT), _port(GRPC_PORT_NAME, GRPC_PORT),
             _port(METRICS_PORT_NAME, METRICS_PORT)]
    resources = _resources(kube.head.cpu, kube.head.memory, storage=kube.head.ephemeral_storage)
    container = _container(kube, "ray-head", resources, ports=ports)
    return {
        "serviceType": "ClusterIP",
        # num-cpus 0: no replica or model actor is scheduled on the head (it mounts no model volume);
        # the dashboard listens on the pod network, reachable only as k8s/networkpolicy.yaml allows.
        "rayStartParams": {"dashboard-host": ALL_INTERFACES, "num-cpus": "0", "num-gpus": "0"},
        "template": {"metadata": {"labels": pod_labels(kube, "ray-head")},
                     "spec": _pod_spec(kube, [container])},
    }


def fetch_container(kube: KubernetesOverlay, names: list[str]) -> dict:
    """The initContainer that fills the model volume; idempotent (checksum markers)."""
    models = kube.models
    container = _container(kube, "fetch-models", _resources(models.fetch_cpu, models.fetch_memory),
                           command=["specinfer", "models", "fetch", "--cache-dir", models.mount_path, *names],
                           mounts=[{"name": "models", "mountPath": models.mount_path}], fetch=True)
    if models.hub_token_secret:
        from .fetch import HUB_TOKEN_ENV

        ref = {"name": models.hub_token_secret, "key": models.hub_token_key}
        container["env"].append({"name": HUB_TOKEN_ENV, "valueFrom": {"secretKeyRef": ref}})
    return container


def _worker_volumes(kube: KubernetesOverlay) -> tuple[list[dict], list[dict]]:
    """(volumes, the Ray container's mounts): the models (a claim, or an emptyDir per pod) and the
    serving tokens' Secret (a directory mount, not subPath, so that Kubernetes updates it in place)."""
    models = kube.models
    if models.volume == "per_pod":
        volumes = [{"name": "models", "emptyDir": {"sizeLimit": models.size_limit}}]
    else:
        volumes = [{"name": "models", "persistentVolumeClaim": {"claimName": models.claim_name,
                                                                "readOnly": not models.fetch}}]
    mounts = [{"name": "models", "mountPath": models.mount_path, "readOnly": True}]
    if kube.auth:
        items = [{"key": kube.auth.key, "path": AUTH_FILE}]
        volumes.append({"name": "auth-tokens", "secret": {"secretName": kube.auth.secret, "items": items}})
        mounts.append({"name": "auth-tokens", "mountPath": AUTH_MOUNT, "readOnly": True})
    return volumes, mounts


def worker_group(kube: KubernetesOverlay, plan: WorkerPlan) -> dict:
    """The GPU worker group: pod counts, the model volume (filled by the fetch initContainer with
    models.fetch), the drain before a pod stops (preStop ``plan.prestop``, ``docs/kubernetes.md``)."""
    models, worker = kube.models, kube.worker
    resources = _resources(worker.cpu, worker.memory, {worker.gpu_resource: str(worker.gpus)},
                           worker.ephemeral_storage)
    volumes, mounts = _worker_volumes(kube)
    ports = [_port(SERVE_PORT_NAME, SERVE_PORT), _port(GRPC_PORT_NAME, GRPC_PORT),
             _port(METRICS_PORT_NAME, METRICS_PORT)]
    container = _container(kube, "ray-worker", resources, ports=ports, mounts=mounts)
    container["env"].append({"name": "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "value": str(plan.sigterm_drain_s)})
    container["lifecycle"] = {"preStop": {"exec": {"command": list(plan.prestop)}}}
    init = [fetch_container(kube, list(plan.fetch_names))] if models.fetch else None
    spec = _pod_spec(kube, [container], init)
    spec["volumes"] = volumes
    spec["terminationGracePeriodSeconds"] = plan.grace_s
    if worker.tolerate_gpu_taint and worker.gpus:
        spec["tolerations"] = [{"key": worker.gpu_resource, "operator": "Exists", "effect": "NoSchedule"}]
    if worker.node_selector:
        spec["nodeSelector"] = dict(worker.node_selector)
    return {
        "groupName": worker.group_name,
        "replicas": plan.replicas,
        "minReplicas": plan.min_replicas,
        "maxReplicas": plan.max_replicas,
        "rayStartParams": {},
        "template": {"metadata": {"labels": pod_labels(kube, "ray-worker")}, "spec": spec},
    }


def autoscaler_options(kube: KubernetesOverlay) -> dict:
    """rayClusterConfig.autoscalerOptions: the autoscaler sidecar in the head pod, restricted like the rest."""
    scaler = kube.autoscaler
    return {"upscalingMode": scaler.upscaling_mode, "idleTimeoutSeconds": scaler.idle_timeout_s,
            "imagePullPolicy": kube.image_pull_policy, "resources": _resources(scaler.cpu, scaler.memory),
            "securityContext": container_security()}
