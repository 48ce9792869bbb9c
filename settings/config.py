"""The one typed config model. YAML is read here; the engine receives plain values.

A config file is either a plain engine config (``configs/default.yaml``) or a Ray Serve config
whose ``specinfer`` application carries the same model in its ``args`` (``configs/serve.yaml``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Dtype = Literal["auto", "float32", "bfloat16", "float16"]  # auto: resolved where the model loads (engine.dtypes)
CpuLinears = Literal["auto", "onednn", "onednn_packed", "torch"]  # CPU linear kernels (engine.models.onednn_linears)
Kernels = Literal["onednn", "onednn_packed", "torch"]  # what ``auto`` resolves to, per model dtype
APP_NAME = "specinfer"
DEFAULT_AUTH_TOKEN_ENV = "SPECINFER_AUTH_TOKEN"  # server.auth_token_env's default; the client and k8s use it too


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OffloadConfig(Strict):
    """A target larger than memory (engine.offload): its decoder layers are streamed in for every
    forward pass. ``embed_tokens``, ``lm_head`` and the final norm always stay resident (467 MB each
    for embeddings and lm_head on the default bf16 target), plus the first ``resident_layers``."""

    tier: Literal["disk", "host"] = Field(
        default="disk", description="disk: read the safetensors file every pass (past the page cache); "
                                    "host: keep the layers in host memory (pinned) and copy them to the GPU")
    resident_layers: int = Field(default=0, ge=0, description="decoder layers kept resident, from the first")
    prefetch_layers: int = Field(default=2, ge=1, le=64,
                                 description="layers read ahead of the one computing (slots: this + 1 layers)")
    direct_io: bool = Field(default=True, description="disk tier: O_DIRECT reads; false: plain reads whose pages "
                                                      "are dropped after (file systems without O_DIRECT)")
    read_threads: int = Field(default=2, ge=1, le=16, description="disk tier: concurrent reads per layer")


class ModelConfig(Strict):
    """A target or SSM. ``source``: a hub id, a directory, a .gguf file, or a name in models_dir."""

    name: str
    source: str
    gguf_file: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: Dtype | None = None  # None: the config's dtype
    num_layers: int | None = Field(default=None, ge=1, description="keep only the first N layers")
    quantize: Literal["none", "int8"] = "none"
    offload: OffloadConfig | None = Field(default=None, description="target only: stream the weights per pass")
    cross_vocabulary: bool = Field(
        default=False, description="SSM only: its tokenizer differs from the target's (another model family); it "
                                   "drafts through text, its tokens decoded and re-encoded into the target's "
                                   "vocabulary, each proposed token a point mass (engine.cross_vocab)")
    context_tokens: int | None = Field(
        default=None, ge=1, description="SSM only: the most committed tokens it takes in at a request's first "
                                        "draft on the engine loop (None: the whole context); it reads the request "
                                        "from there on, so starting to draft costs at most this many tokens' "
                                        "forward (engine.phases.DraftSide)")


class SuffixConfig(Strict):
    """The suffix-tree proposer (SuffixDecoding): continuations of the request's own prompt and output,
    and of the responses of earlier requests kept in a global store (per served replica)."""

    name: str = "suffix"
    max_tree_depth: int = Field(default=24, ge=1, le=4096,
                                description="longest context matched and longest pattern stored, in tokens")
    max_cached_requests: int = Field(default=10000, ge=0, le=2**31 - 1,
                                     description="responses kept in the global store, evicted first in, "
                                                 "first out; 0 switches the global store off")
    max_spec_tokens: int = Field(default=32, ge=1, le=1024,
                                 description="the most tokens one proposal holds (also bounded by max_tree_nodes)")
    max_spec_factor: float = Field(default=1.0, ge=0.0,
                                   description="propose at most factor x matched length + offset tokens")
    max_spec_offset: float = Field(default=0.0, description="see max_spec_factor")
    min_token_prob: float = Field(default=0.1, ge=0.0, le=1.0,
                                  description="propose a token only if its estimated probability reaches this")


class CostTreeConfig(Strict):
    """Cost-aware tree shapes (engine.shape, after EAGLE-2): each level expands its ``beam`` most
    probable nodes with their ``branch`` top children, up to ``max_depth`` levels; the kept node
    count maximises expected tokens per ms from the measured verify-cost curve and the request's
    calibrated acceptance."""

    beam: int = Field(default=4, ge=1, le=64, description="nodes a level may expand (the most probable, as many as are expected to pay)")
    branch: int = Field(default=4, ge=1, le=64, description="children drafted per expanded node")
    max_depth: int = Field(default=16, ge=1, le=32, description="SSM levels at most")
    curve_max_tokens: int = Field(default=64, ge=1, le=4096, description="the verify-cost curve is measured up to this")


class SpeculationConfig(Strict):
    mode: Literal["incremental", "sequence", "tree"] = "tree"
    policy: Literal["cost", "schedule"] = Field(
        default="cost", description="tree shapes: cost-aware (top-k children; `cost`) or the fixed `expansion`")
    cost: CostTreeConfig = CostTreeConfig()
    expansion: list[int] = Field(default_factory=lambda: [2, 2, 1, 1])
    sequence_depth: int = Field(default=4, ge=1, le=32)
    children: Literal["top_k", "sampled", "sampled_without_replacement"] = "top_k"
    max_tree_nodes: int = Field(default=64, ge=1, le=1024, description="nodes per proposer's tree, root included")
    min_confidence: float = Field(default=0.0, ge=0.0, le=1.0, description="dynamic tree threshold")
    prefetch: int = Field(default=0, ge=0, le=8, description=(
        "while the target verifies a tree, each SSM drafts the next one for up to this many guessed "
        "outcomes (engine.prefetch); 0: off"))

    @field_validator("expansion")
    @classmethod
    def _expansion(cls, value: list[int]) -> list[int]:
        if not value or len(value) > 32 or any(k < 1 or k > 64 for k in value):
            raise ValueError("expansion must be 1..32 widths, each in [1, 64]")
        return value


class SamplingDefaults(Strict):
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)


class ActorOptions(Strict):
    """Ray actor options. Fractional CPUs let several actors share a small machine."""

    num_cpus: float = Field(default=0.5, ge=0.0)
    num_gpus: float = Field(default=0.0, ge=0.0)
    max_restarts: int = Field(default=-1, ge=-1, description="-1: restart a killed actor every time")
    max_concurrency: int = Field(default=16, ge=1)
    torch_threads: int = Field(default=2, ge=1)
    cpu_affinity: list[int] | None = Field(default=None, description=(
        "CPU ids the actor's process is pinned to (os.sched_setaffinity, Linux), e.g. [1] for the SSM and [0] "
        "for the verifier so drafting and verifying run side by side like on separate devices; None: "
        "unpinned. Ray's num_cpus only schedules, it does not pin"))

    @field_validator("cpu_affinity")
    @classmethod
    def _cpus(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(cpu < 0 for cpu in value)):
            raise ValueError("cpu_affinity must list at least one CPU id, each >= 0 (or be null)")
        return value


class VerifierConfig(Strict):
    """The target's actors. With ``tensor_parallel_size`` N > 1 the target runs as N DeepSpeed
    AutoTP rank actors (one GPU each when ``actor.num_gpus`` is 1), and ``actor`` applies per rank. With
    batching each rank holds whole key/value heads of the pool: N must divide the target's KV heads
    (checked when the target is built, since the model is not known here)."""

    tensor_parallel_size: int = Field(default=1, ge=1, le=64)
    collective_timeout_s: float = Field(default=30.0, gt=0.0, description="a stuck rank fails the call after this")
    actor: ActorOptions = ActorOptions()


class BatchingConfig(Strict):
    """Continuous batching: every running request's tree in one target forward, one SSM forward
    per tree level for all requests, KV caches in a pool of fixed-size blocks."""

    enabled: bool = True
    kv_cache_tokens: int = Field(default=16384, ge=64, description="target pool size in tokens")
    block_size: int = Field(default=16, ge=1, le=4096)
    window_ms: float = Field(default=3.0, ge=0.0, description="without the engine loop: wait this long for "
                                                              "other requests' calls")
    window_fraction: float = Field(default=0.5, ge=0.0, le=1.0,
                                   description="or this fraction of the last forward's time, if longer")
    burst_ms: float = Field(
        default=30.0, ge=0.0, le=1000.0,
        description="a forward of new prompts alone waits until no other prompt began for this long (the rest "
                    "of a burst), which then goes shortest first; a lone request's first token pays it, "
                    "running requests never do; 0: off")
    burst_max_ms: float = Field(default=150.0, ge=0.0, le=5000.0,
                                description="the burst wait ends this long after its first prompt began")
    admission_timeout_s: float = Field(
        default=30.0, ge=0.0, description="without the engine loop (and for prefetch requests): wait for KV "
                                          "blocks this long, then RESOURCE_EXHAUSTED (the loop queues instead)")
    prefill_chunk_tokens: int | None = Field(
        default=256, ge=1, description="chunked prefill: the most prompt tokens per packed forward, all requests "
                                       "together, the prompt that would finish first if prefilled alone first "
                                       "(target and SSMs), so running requests "
                                       "keep stepping while prompts join; null: a prompt in one forward")


class TreeBudgetConfig(Strict):
    """Tree tokens per step by load: the verifier measures its verify-cost curve at start. Cost-aware
    trees choose their size each step for the batch's goodput against the other running requests'
    share of the pass (engine.budget.RunningLoad). Fixed schedules and the suffix proposer share a
    cap: the largest total whose pass costs at most (1 + slack) x a decode step, cap / R nodes for
    each of R running requests (at least min_tree_nodes)."""

    enabled: bool = True
    slack: float = Field(default=1.0, ge=0.0)
    min_tree_nodes: int = Field(default=2, ge=1)
    max_total_tokens: int = Field(default=128, ge=1, le=4096)
    disable_above_running: int | None = Field(
        default=None, ge=1, description="with more running requests than this, no request speculates (plain "
                                         "decoding; like vLLM's speculative_disable_by_batch_size); null: never")
    draft_gate: bool = Field(
        default=True, description="with cost-aware trees (speculation.policy: cost), the engine loop measures "
                                  "what drafting buys the batch against plain decoding and lets only as many "
                                  "requests draft as pay (engine.draft_gate); false: every request may draft")


class HealthConfig(Strict):
    """How the ingress watches its actors (actors.liveness; docs/serving.md "Faults")."""

    probe_timeout_s: float = Field(default=2.0, gt=0.0, description="an actor's `ready` must answer within this")
    retry_interval_s: float = Field(default=2.0, gt=0.0, description="probe an actor marked down this often")
    unhealthy_after_s: float = Field(default=120.0, gt=0.0,
                                     description="Serve's check_health fails (replica replaced) after this long down")


class ServerConfig(Strict):
    max_concurrent_requests: int = Field(default=8, ge=1)
    engine_loop: bool = Field(
        default=True, description="one engine loop per replica steps every running request together "
                                   "(engine.loop; one call per actor per phase), and requests beyond "
                                   "max_concurrent_requests or the KV pool wait in its queue; false: a step "
                                   "loop per request (requests with speculation.prefetch > 0 always take one)")
    max_waiting_requests: int = Field(default=64, ge=0,
                                      description="with engine_loop: requests queued beyond the running ones "
                                                  "before RESOURCE_EXHAUSTED")
    max_new_tokens_limit: int = Field(default=2048, ge=1)
    max_prompt_chars: int = Field(default=262_144, ge=1,
                                  description="prompt, or all messages' roles and contents, checked before tokenizing")
    max_stop_strings: int = Field(default=16, ge=0)
    max_stop_string_chars: int = Field(default=256, ge=1)
    auth_token_env: str | None = Field(
        default=DEFAULT_AUTH_TOKEN_ENV,
        description="environment variable holding the bearer token (several: separated by commas); set and "
                    "non-empty in the replica: auth is on")
    auth_token_file: str | None = Field(
        default=None,
        description="file of accepted bearer tokens, one per line (# comments), read again whenever it changes "
                    "(a rotated Kubernetes Secret needs no restart); set: auth is on, and while the file is "
                    "missing or empty only the environment's tokens are accepted (none: every request is refused)")
    request_ttl_s: float = Field(default=600.0, gt=0.0)
    ssm_actor: ActorOptions = ActorOptions()
    merge_actor: ActorOptions = ActorOptions(num_cpus=0.1, torch_threads=1)
    batching: BatchingConfig = BatchingConfig()
    tree_budget: TreeBudgetConfig = TreeBudgetConfig()
    drain_timeout_s: float = Field(default=30.0, ge=0.0,
                                   description="on SIGTERM or a redeploy, running requests get this long to finish")
    actor_placement_timeout_s: float = Field(
        default=300.0, gt=0.0, description="a starting replica waits this long for its actors' CPUs and GPUs (one "
                                           "placement group), then fails its start naming what is missing (Serve "
                                           "retries it); where an autoscaler adds nodes, allow for a node's start")
    health: HealthConfig = HealthConfig()


class EngineConfig(Strict):
    """Models, speculation and serving options of one deployment."""

    models_dir: str = "~/.cache/specinfer/models"
    dtype: Dtype = Field(
        default="auto", description="auto (the default): bfloat16 where the model's device multiplies it natively "
                                    "(a GPU with bf16; a CPU with AVX512-BF16 or AMX, unless ONEDNN_MAX_CPU_ISA or "
                                    "ATEN_CPU_CAPABILITY caps it below them), float32 elsewhere (emulated bf16 "
                                    "makes a pass cost in proportion to its tokens). Each process that loads a "
                                    "model resolves it on its own host (engine.dtypes). Greedy output is exact in "
                                    "float32")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int | None = Field(default=None, ge=1)
    cpu_linears: CpuLinears = Field(
        default="auto", description="linear layers on CPU (engine.models.onednn_linears). float32: oneDNN's "
                                    "kernels (onednn; a forward over 8 tokens 1.7-1.8x faster than MKL on an "
                                    "AVX2 AMD EPYC), the same with weights packed once for passes of a few "
                                    "tokens (onednn_packed; HumanEval fp32, per-prompt medians of two runs: tree "
                                    "1.16-1.17x and HF assisted 1.08-1.12x faster, plain decoding 3-10% slower), "
                                    "or torch's default (torch: MKL). bfloat16, on a CPU that multiplies it "
                                    "natively: weights packed once (onednn_packed; the default target's forward "
                                    "10-17% faster at 1-32 tokens on a 2-core AMX Xeon) or torch's default "
                                    "(onednn or torch: oneDNN with plain weights). auto (the default): onednn in "
                                    "float32, onednn_packed in bfloat16")
    cuda_graphs: bool = Field(
        default=True, description="on a CUDA device, the in-process engine (specinfer generate, the benchmarks; one "
                                  "request at a time, one rank) replays the target's and the SSMs' forwards as CUDA "
                                  "graphs over fixed KV buffers (engine.graphs): on an H200 plain decoding of the "
                                  "default pair 9x faster, a tree step 11x. No effect on the CPU or when serving")
    cuda_graph_tokens: int = Field(
        default=4096, ge=1, description="with cuda_graphs, the most tokens (prompt and output) a request may have: "
                                        "the KV buffers are sized for it (longer requests are refused up front)")
    target: ModelConfig
    ssms: list[ModelConfig] = Field(default_factory=list)
    suffix: SuffixConfig | None = SuffixConfig()
    speculation: SpeculationConfig = SpeculationConfig()
    defaults: SamplingDefaults = SamplingDefaults()
    verifier: VerifierConfig = VerifierConfig()
    server: ServerConfig = ServerConfig()

    @model_validator(mode="after")
    def _unique_names(self) -> "EngineConfig":
        names = self.proposer_names()
        if len(set(names)) != len(names):
            raise ValueError(f"SSM names must be unique, got {names}")
        self._threads_fit_requests()
        self._offload_fits()
        if self.target.cross_vocabulary:
            raise ValueError("target.cross_vocabulary: only an SSM drafts through text; the target's tokenizer is "
                             "the one every proposal is re-encoded into")
        if self.target.context_tokens is not None:
            raise ValueError("target.context_tokens: only an SSM's view of a request can be cut; the target "
                             "verifies against the whole context")
        for ssm in self.ssms:
            if ssm.context_tokens is not None and ssm.cross_vocabulary:
                raise ValueError(f"ssms[{ssm.name}].context_tokens applies to an SSM of the target's vocabulary; "
                                 "a cross-vocabulary SSM re-reads the text")
        return self

    def _offload_fits(self) -> None:
        """Only the target streams its weights, on one rank, unquantized, from safetensors."""
        for ssm in self.ssms:
            if ssm.offload is not None:
                raise ValueError(f"ssms[{ssm.name}].offload: SSMs stay resident; only target.offload may be set")
        if self.target.offload is None:
            return
        if self.verifier.tensor_parallel_size > 1:
            raise ValueError("target.offload with verifier.tensor_parallel_size > 1: offloading with tensor "
                             "parallelism is not supported; use one rank")
        if self.target.quantize != "none" or self.target.num_layers or self.target.gguf_file:
            raise ValueError("target.offload streams the safetensors weights as stored: it cannot be combined with "
                             "target.quantize, target.num_layers or target.gguf_file")

    def proposer_names(self) -> list[str]:
        """Every proposer in engine order: the SSMs, then the suffix proposer."""
        return [m.name for m in self.ssms] + ([self.suffix.name] if self.suffix else [])

    def proposer_neural(self) -> list[bool]:
        """Whether each proposer of ``proposer_names`` is a model (the suffix proposer is not)."""
        return [True] * len(self.ssms) + ([False] if self.suffix else [])

    def proposer_windows(self) -> list[int | None]:
        """Each proposer's ``context_tokens`` (``proposer_names`` order; None: the whole context)."""
        return [m.context_tokens for m in self.ssms] + ([None] if self.suffix else [])

    def _threads_fit_requests(self) -> None:
        """Each running request has one call at a time in each actor (draft, merge, prefill or
        verify), and a call holds one of the actor's ``max_concurrency`` threads while it runs: with
        fewer threads than requests, calls queue and every packed forward waits out its window for
        requests that cannot enter. Releases and monitoring calls need threads too (use ~1.5x)."""
        limit, server = self.server.max_concurrent_requests, self.server
        for name, options in (("verifier.actor", self.verifier.actor), ("server.ssm_actor", server.ssm_actor),
                              ("server.merge_actor", server.merge_actor)):
            if options.max_concurrency < limit:
                raise ValueError(f"{name}.max_concurrency ({options.max_concurrency}) is below "
                                 f"server.max_concurrent_requests ({limit}): each running request has a call in "
                                 f"every actor; give the actors about 1.5x as many threads ({limit * 3 // 2})")

    @property
    def tree_budget_applies(self) -> bool:
        """Whether tree sizes follow load (``server.tree_budget``): with continuous batching only."""
        return self.server.batching.enabled and self.server.tree_budget.enabled

    @property
    def cost_aware_shapes(self) -> bool:
        """Whether cost-aware tree shapes can apply (policy "cost" and an SSM): the verify-cost
        curve is measured at start then."""
        return self.speculation.policy == "cost" and bool(self.ssms)

    def resolved_models_dir(self) -> Path:
        return Path(os.environ.get("SPECINFER_MODELS") or self.models_dir).expanduser()

    def model_dtype(self, model: ModelConfig) -> Dtype:
        """The dtype ``model`` runs in as configured: its own, or the config's (``auto`` is resolved
        by the process that loads it: actors.loading.load_configured)."""
        return model.dtype or self.dtype

    def linears_for(self, model: ModelConfig, dtype: str | None = None) -> Kernels:
        """The CPU linear kernels ``model`` runs on: ``cpu_linears``, with ``auto`` resolved by its
        dtype (float32: onednn; bfloat16: onednn_packed; float16: torch). Plain oneDNN is torch's own
        path outside float32, so ``onednn`` there is ``torch``. ``dtype``: the dtype it was loaded in
        (needed when it is configured ``auto``)."""
        dtype = dtype or self.model_dtype(model)
        if dtype == "auto":
            raise ValueError(f"{model.name}: dtype auto must be resolved on the machine that loads the model "
                             "before its CPU linear kernels can be chosen")
        kernels = self.cpu_linears
        if kernels == "auto":
            kernels = {"float32": "onednn", "bfloat16": "onednn_packed"}.get(dtype, "torch")
        return "torch" if kernels == "onednn" and dtype != "float32" else kernels

    def resolve_source(self, source: str) -> str:
        """A name under models_dir, an existing path, or else a hub id (left as is)."""
        candidate = self.resolved_models_dir() / source
        if not Path(source).is_absolute() and candidate.exists():
            return str(candidate)
        return str(Path(source).expanduser()) if Path(source).expanduser().exists() else source


def read_yaml(path: str | Path) -> dict:
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def engine_section(data: dict, path: str | Path = "<config>") -> dict:
    """The engine config inside a plain config or inside a Serve config's application args."""
    if "applications" not in data:
        return data
    for app in data["applications"]:
        if app.get("name") == APP_NAME:
            return app.get("args") or {}
    raise ValueError(f"{path}: no application named {APP_NAME!r} in this Serve config")


def load_config(path: str | Path, **overrides) -> EngineConfig:
    """Read and validate a config file; ``overrides`` replace top-level fields (e.g. dtype)."""
    section = engine_section(read_yaml(path), path)
    section.update({k: v for k, v in overrides.items() if v is not None})
    return EngineConfig.model_validate(section)
