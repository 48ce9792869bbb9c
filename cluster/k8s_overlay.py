"""The ``kubernetes`` section of k8s/overlay.yaml: what `specinfer k8s render` puts around serveConfigV2.

Pure data models with their own cross-field checks; cluster.k8s renders them. The KubeRay
behaviour each option relies on is cited from KubeRay v1.7.0's source in docs/kubernetes.md.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, field_validator, model_validator

from settings.config import APP_NAME, Strict

Quantity = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, (int, float)) else v)]
AccessMode = Literal["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany", "ReadOnlyMany"]
SINGLE_NODE_MODES = ("ReadWriteOnce", "ReadWriteOncePod")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# An image reference pinned by a tag, a digest or both: [registry[:port]/]path[:tag][@sha256:<64 hex>]
# (the grammar of github.com/distribution/reference, lower-case path components).
_IMAGE = re.compile(r"^(?P<name>(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
                    r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*)"
                    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


def _dns_name(value: str, what: str) -> str:
    """A Kubernetes object name (Secret, PVC): lower-case DNS label characters."""
    if not (_DNS_LABEL.match(value) and len(value) <= 253):
        raise ValueError(f"{what} {value!r} is not a valid Kubernetes name (lower-case letters, digits, '-')")
    return value


class ModelsVolume(Strict):
    """Where the GPU workers find the converted models: a PersistentVolumeClaim (k8s/models-pvc.yaml),
    or an emptyDir of each worker pod that its fetch initContainer fills (``volume: per_pod``)."""

    # claim: the PVC below, shared by every worker pod; per_pod: an emptyDir per worker pod (size_limit),
    # filled by the fetch initContainer at each pod start (needs fetch: true; any number of pods, any node).
    volume: Literal["claim", "per_pod"] = "claim"
    size_limit: Quantity = "20Gi"  # per_pod: the emptyDir's sizeLimit (the models take about 5 GiB)
    claim_name: str = "specinfer-models"
    # spec.accessModes of k8s/models-pvc.yaml (rendered from this section): the renderer refuses
    # upgrade_strategy NewCluster, and more than one worker pod, on a volume only one
    # node can mount.
    access_mode: AccessMode = "ReadWriteOnce"
    mount_path: str = "/models"
    # True: an initContainer in each worker pod runs `specinfer models fetch --cache-dir <mount_path>`
    # (a no-op once filled). False: the volume is pre-filled (docs/kubernetes.md) and mounted read-only.
    fetch: bool = True
    fetch_cpu: Quantity = "2"
    fetch_memory: Quantity = "12Gi"
    # claim: the PVC's storage request (k8s/models-pvc.yaml, rendered); None: computed from the models
    # (``cluster.fetch.volume_size``: each bundled model's conversion footprint, each hub model's files
    # as the hub lists them, plus 25%; a hub model's size needs the hub, so offline set it here).
    claim_size: Quantity | None = None
    storage_class: str | None = None  # claim: the PVC's storageClassName (None: the cluster's default)
    # A Secret whose key holds a hub token: the fetch initContainer's HF_TOKEN (gated or private hub
    # models). Only that container gets it; the Ray containers stay offline.
    hub_token_secret: str | None = None
    hub_token_key: str = "token"

    @field_validator("hub_token_secret", "claim_name")
    @classmethod
    def _names(cls, value: str | None, info) -> str | None:
        return None if value is None else _dns_name(value, f"models.{info.field_name}")

    @model_validator(mode="after")
    def _writable_for_fetch(self) -> "ModelsVolume":
        if self.volume == "per_pod" and not self.fetch:
            raise ValueError("models: volume per_pod is an empty directory of each worker pod; it needs fetch: true")
        if self.volume == "claim" and self.fetch and self.access_mode == "ReadOnlyMany":
            raise ValueError("models: fetch: true writes the volume, but access_mode is ReadOnlyMany; pre-fill it "
                             "and set fetch: false (docs/kubernetes.md)")
        return self

    @property
    def single_node(self) -> bool:
        """Whether only the pods of one node can mount the models (a ReadWriteOnce(Pod) claim)."""
        return self.volume == "claim" and self.access_mode in SINGLE_NODE_MODES


class HeadGroup(Strict):
    """Ray head: GCS, dashboard, Serve controller and a proxy; no GPUs and no logical CPUs."""

    cpu: Quantity = "2"
    memory: Quantity = "8Gi"
    ephemeral_storage: Quantity = "10Gi"  # requested: Ray's session logs under /tmp/ray


class WorkerGroup(Strict):
    """GPU workers: the ingress replicas, the verifiers, the SSM and merge actors.

    The pod counts default to what the ingress deployment's replica bounds need (cluster.k8s,
    ``worker_bounds``: Serve's min/initial/max replicas over the pipelines one pod holds); set
    them to override, and render refuses bounds that cannot hold max_replicas pipelines."""

    group_name: str = "gpu"
    replicas: int | None = Field(default=None, ge=0)
    min_replicas: int | None = Field(default=None, ge=0)
    max_replicas: int | None = Field(default=None, ge=1)
    cpu: Quantity = "8"
    memory: Quantity = "32Gi"
    gpus: int = Field(default=1, ge=0)
    gpu_resource: str = "nvidia.com/gpu"
    tolerate_gpu_taint: bool = True  # GPU node pools are commonly tainted <gpu_resource>:NoSchedule
    # requested: Ray's logs and object spilling under /tmp/ray, torch/Triton/DeepSpeed caches
    ephemeral_storage: Quantity = "20Gi"
    # the pod's nodeSelector: which accelerator to land on, e.g. {nvidia.com/gpu.product: NVIDIA-L4} (NVIDIA
    # GPU feature discovery) or {cloud.google.com/gke-accelerator: nvidia-l4} (GKE); empty: any GPU node
    node_selector: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounds(self) -> "WorkerGroup":
        if None in (self.replicas, self.min_replicas, self.max_replicas):
            return self  # checked by render once the missing ones are derived
        if not self.min_replicas <= self.replicas <= self.max_replicas:
            raise ValueError(f"worker: need min_replicas <= replicas <= max_replicas, got "
                             f"{self.min_replicas} <= {self.replicas} <= {self.max_replicas}")
        return self


class SecretKey(Strict):
    """A key of a Secret in the RayService's namespace."""

    secret: str
    key: str

    @field_validator("secret")
    @classmethod
    def _secret_name(cls, value: str) -> str:
        return _dns_name(value, "secret")


class GcsFaultTolerance(Strict):
    """Head-node fault tolerance: GCS state in an external Redis (rendered as gcsFaultToleranceOptions)."""

    redis_address: str  # host:port of a Redis the head pod reaches, e.g. redis.specinfer.svc:6379
    redis_password: SecretKey | None = None


class AuthToken(Strict):
    """The Secret whose key holds the serving bearer tokens (one per line; any one is accepted). It is
    mounted as a file into the worker pods, and render points ``server.auth_token_file`` at it: the
    ingress re-reads it when it changes, so a rotated Secret takes effect without a restart."""

    secret: str = "specinfer-auth"
    key: str = "token"

    @field_validator("secret")
    @classmethod
    def _secret_name(cls, value: str) -> str:
        return _dns_name(value, "auth.secret")


class RayAuth(Strict):
    """Ray's own token authentication (dashboard, job API, GCS and raylet RPCs): rayClusterConfig.authOptions
    with mode token. ``secret`` unset: KubeRay generates a Secret per RayCluster (key ``auth_token``);
    set: that existing Secret, with the key ``auth_token`` (authOptions.secretName, KubeRay >= 1.6)."""

    secret: str | None = None

    @field_validator("secret")
    @classmethod
    def _secret_name(cls, value: str | None) -> str | None:
        return None if value is None else _dns_name(value, "ray_auth.secret")


class Autoscaler(Strict):
    """KubeRay's in-tree autoscaler (a sidecar in the head pod), on when the worker group may grow."""

    idle_timeout_s: int = Field(default=60, ge=0, description="a worker pod idle this long is removed")
    upscaling_mode: Literal["Default", "Aggressive", "Conservative"] = "Default"
    cpu: Quantity = "500m"
    memory: Quantity = "512Mi"


class KubernetesOverlay(Strict):
    """The RayService/RayCluster-level settings (the overlay's ``kubernetes`` section)."""

    name: str = APP_NAME
    namespace: str | None = None
    image: str
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    image_pull_secrets: list[str] = Field(default_factory=list)  # Secret names, in every pod spec
    ray_version: str
    labels: dict[str, str] = Field(default_factory=dict)
    # spec.upgradeStrategy.type. auto: NewCluster where the model volume allows a second cluster (per_pod,
    # ReadWriteMany, ReadOnlyMany), else None, and render says why. None: a change under rayClusterConfig
    # is not rolled out (delete and re-apply the RayService); NewCluster: blue/green, twice the GPUs and a
    # volume both clusters can mount. NewClusterWithIncrementalUpgrade needs the Gateway API and is not
    # offered (docs/kubernetes.md).
    upgrade_strategy: Literal["auto", "None", "NewCluster"] = "auto"
    # Keep serving traffic off the head pod (GCS, dashboard); the worker pods' proxies serve it.
    exclude_head_from_serve_service: bool = True
    head: HeadGroup = HeadGroup()
    worker: WorkerGroup = WorkerGroup()
    models: ModelsVolume = ModelsVolume()
    autoscaler: Autoscaler = Autoscaler()
    gcs_fault_tolerance: GcsFaultTolerance | None = None  # off by default
    auth: AuthToken | None = None  # None: no token wired
    ray_auth: RayAuth | None = RayAuth()  # None: Ray's token authentication off

    @field_validator("image")
    @classmethod
    def _pinned_image(cls, value: str) -> str:
        match = _IMAGE.match(value)
        if not match:
            raise ValueError(f"image {value!r} is not an image reference ([registry/]name[:tag][@sha256:<64 hex>])")
        if not match["digest"] and match["tag"] in (None, "latest"):
            raise ValueError(f"image {value!r} is not pinned: give a version tag or a digest (name@sha256:...)")
        return value

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"image_pull_secrets lists a name twice: {value}")
        return [_dns_name(name, "image_pull_secrets entry") for name in value]

    @model_validator(mode="after")
    def _upgrade_fits_the_volume(self) -> "KubernetesOverlay":
        if self.upgrade_strategy == "NewCluster" and self.models.single_node:
            raise ValueError(
                f"upgrade_strategy NewCluster starts a second RayCluster whose GPU workers mount the same claim "
                f"{self.models.claim_name!r}, but its access_mode is {self.models.access_mode}: a worker on another "
                "node never starts. Use models.volume: per_pod, a ReadWriteMany (or pre-filled ReadOnlyMany) claim, or "
                "upgrade_strategy: None (docs/kubernetes.md, 'Upgrades and shutdowns')")
        return self


class Overlay(Strict):
    serve: dict[str, Any] = Field(default_factory=dict)
    kubernetes: KubernetesOverlay
