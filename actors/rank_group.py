"""A tensor-parallel group: N rank actors running DeepSpeed AutoTP, called as one.

Each rank actor joins one torch.distributed group (NCCL on GPUs, gloo on CPU) and holds its shard
of the target as ``deepspeed.init_inference(..., replace_with_kernel_inject=False)`` (AutoTP) cuts
it, read from the checkpoint slice by slice (``actors.sharded``: a rank never holds the whole target).
Kernel injection stays off: DeepSpeed's injected attention kernels ignore custom attention masks
(DeepSpeed issues #1466, #1912, #3960) and tree verification depends on the tree mask.

A rank serves two kinds of calls: per-request ones over its own DynamicCache shards (``prefill``,
``forward_tree``, ``commit``: ``TensorParallelTarget``) and packed forwards over its shard of a
paged KV pool (``run_packed``: ``TensorParallelPagedModel``), both in ``actors.tensor_parallel``.

Every call goes to all ranks in the same order (submission under ``RankGroup.lock``; each rank
runs one call at a time, in order), since every forward runs collectives. A failed or stuck rank
fails the call within ``collective_timeout_s`` (a dead rank: at once) with ``RanksFailed``; the
whole group is killed, so no rank keeps a half-written cache, and the next call starts a new
group (``generation`` counts them).
"""


from __future__ import annotations

import dataclasses
import datetime
import glob
import logging
import os
import threading
import time
import uuid

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from settings.config import EngineConfig
from engine.kv_pool import KVStorage, StateLost
from engine.packed import PackedBatch, PackedRunner
from engine.target import TargetModel
from engine.tree import TokenTree

from .common import DEFAULT_EXTENSIONS_DIR, process_memory, setup_process
from .loading import load_configured, model_spec, resolved_dtype
from .placement import TIMEOUT_FIELD, Demand, PlacementFailed, node_totals, shortage
from .sharded import NotShardable, load_rank_shard

logger = logging.getLogger(__name__)


class RanksFailed(StateLost):
    """A rank died, raised or timed out: the group is rebuilt and the request's KV cache is lost."""


def rank_environment(rank: int, world_size: int, on_gpu: bool) -> dict[str, str]:
    """Environment a rank process needs before torch/DeepSpeed start (MASTER_* come later).

    LOCAL_SIZE must equal the world size on CPU: DeepSpeed's shared-memory all-reduce only sets
    itself up then (otherwise ``inference_all_reduce`` segfaults). On GPUs Ray gives each rank
    actor one device, which it sees as cuda:0, so LOCAL_RANK is 0 there.
    Example: rank 1 of 2 on CPU -> RANK 1, WORLD_SIZE 2, LOCAL_RANK 1, LOCAL_SIZE 2, DS_ACCELERATOR cpu.
    """
    env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0" if on_gpu else str(rank),
           "LOCAL_SIZE": str(world_size), "GLOO_SOCKET_IFNAME": "lo",  # STRICT_PACK: one node
           "TORCH_EXTENSIONS_DIR": os.path.expanduser(os.environ.get("TORCH_EXTENSIONS_DIR", DEFAULT_EXTENSIONS_DIR))}
    if not on_gpu:
        env["DS_ACCELERATOR"] = "cpu"
    return env


def remove_shared_memory(address: str, port: int) -> None:
    """Remove the /dev/shm buffers (about 66 MiB per rank) DeepSpeed's CPU all-reduce left."""
    for path in glob.glob(f"/dev/shm/deepspeed_*_{address}_{port}_*"):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


def load_rank_module(config: EngineConfig, world_size: int, rank: int, device: str) -> torch.nn.Module:
    """This rank's AutoTP shard of the target, in eval mode, read slice by slice from its checkpoint
    (``actors.sharded``); where the checkpoint does not allow that, the whole target loaded on the
    CPU and sharded by AutoTP, which replaces its nn.Linear layers (so its CPU linears stay torch's).
    ``device``: where ``dtype: auto`` resolves for (the rank's GPU, or the CPU)."""
    import deepspeed  # imported in rank processes only (slow, and it reads the environment)

    whole = config.model_copy(update={"device": "cpu", "cpu_linears": "torch"})
    spec = dataclasses.replace(model_spec(whole, config.target), dtype=resolved_dtype(whole, config.target, device))
    if config.target.num_layers is None and config.target.quantize == "none" and config.target.offload is None:
        try:
            shard = load_rank_shard(spec, world_size, rank)
            logger.info("rank %d: read %.2f GB of the checkpoint for its shard", rank, shard.bytes_read / 1e9)
            return shard.module
        except NotShardable as why:
            logger.warning("rank %d: loading the whole target, then sharding it: %s", rank, why)
    loaded = load_configured(whole, config.target, dtype_device=device)
    engine = deepspeed.init_inference(loaded.model, tensor_parallel={"tp_size": world_size},
                                      dtype=loaded.model.dtype, replace_with_kernel_inject=False)
    return engine.module.eval()


class RankActor:
    """One rank: its shard of the target and either, per request state id, its shard of that
    request's DynamicCache, or its shard of a paged KV pool's storage (its key/value heads)."""

    def __init__(self, config: EngineConfig, rank: int, world_size: int, torch_threads: int):
        setup_process(torch_threads)
        self.config, self.rank, self.world_size = config, rank, world_size
        self.address: tuple[str, int] | None = None
        self.target: TargetModel | None = None
        self.runner: PackedRunner | None = None
        self.states: dict[str, object] = {}
        self.load_seconds: float | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: a free port on loopback for the group's TCP store."""
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return "127.0.0.1", probe.getsockname()[1]

    def start(self, address: tuple[str, int], timeout_s: float, pool_slots: int | None = None) -> str:
        """Join the process group and load this rank's shard of the target (``load_rank_module``);
        with ``pool_slots``, also allocate this rank's shard of the paged pool's storage. Returns the device."""
        self.address = address
        os.environ.update(MASTER_ADDR=address[0], MASTER_PORT=str(address[1]))
        on_gpu = torch.cuda.is_available() and self.config.device != "cpu"
        torch.distributed.init_process_group("nccl" if on_gpu else "gloo", rank=self.rank,
                                             world_size=self.world_size,
                                             timeout=datetime.timedelta(seconds=timeout_s))
        began = time.perf_counter()
        module = load_rank_module(self.config, self.world_size, self.rank, "cuda" if on_gpu else "cpu")
        self.load_seconds = time.perf_counter() - began
        self.target = TargetModel(module)
        if pool_slots is not None:
            storage = KVStorage.for_model(self.target.model, pool_slots, shards=self.world_size)
            self.runner = PackedRunner(self.target.model, storage)
        return str(self.target.model.device)

    def run_packed(self, batch: PackedBatch) -> torch.Tensor | None:  # -> [R, V] on rank 0
        """One packed forward over this rank's storage shard (moves, writes, attention)."""
        logits = self.runner.run(batch)
        return logits.cpu() if self.rank == 0 else None

    def prefill(self, state_id: str, prompt_ids: list[int]) -> torch.Tensor | None:  # -> [V] on rank 0
        state = self.states[state_id] = self.target.new_state()
        logits = self.target.prefill(state, prompt_ids)
        return logits if self.rank == 0 else None

    def forward_tree(self, state_id: str, tree: TokenTree) -> torch.Tensor | None:  # -> [N, V] on rank 0
        logits = self.target.forward_tree(self.states[state_id], tree)
        return logits.cpu() if self.rank == 0 else None

    def commit(self, state_id: str, prefix_length: int, path: tuple[int, ...]) -> int:
        state = self.states[state_id]
        self.target.commit(state, prefix_length, path)
        return state.length

    def drop(self, state_id: str) -> bool:
        return self.states.pop(state_id, None) is not None

    def num_states(self) -> int:
        return len(self.states)

    @ray.method(concurrency_group="control")
    def load_report(self) -> dict:
        """This rank's load in seconds and its memory in MB (``actors.common.process_memory``: VmHWM,
        the resident peak, and VmRSS, RssAnon, RssFile)."""
        return {"load_seconds": self.load_seconds, **process_memory()}

    @ray.method(concurrency_group="control")
    def group_address(self) -> tuple[str, int] | None:
        return self.address

    @ray.method(concurrency_group="control")
    def cleanup(self) -> None:
        """Remove the shared-memory buffers; runs even while the main thread is stuck in a collective."""
        if self.address is not None:
            remove_shared_memory(*self.address)


class RankGroup:
    """``verifier.tensor_parallel_size`` rank actors in one STRICT_PACK placement group.

    ``pool_slots``: each rank allocates its shard of a paged pool of that many slots (None: none).
    """

    def __init__(self, config: EngineConfig, name_prefix: str = "specinfer", namespace: str | None = None,
                 pool_slots: int | None = None):
        self.config, self.name_prefix, self.namespace, self.pool_slots = config, name_prefix, namespace, pool_slots
        self.world_size = config.verifier.tensor_parallel_size
        self.timeout_s = config.verifier.collective_timeout_s
        self.lock = threading.RLock()
        self.generation, self.uid = 0, uuid.uuid4().hex[:8]
        self.ranks: list = []
        self._group = None
        self.ensure_started()

    def ensure_started(self) -> int:
        """Start the group if it is not running (after a failure); its generation."""
        with self.lock:
            if not self.ranks:
                self._start()
            return self.generation

    def _start(self) -> None:
        options = self.config.verifier.actor
        bundle = {"CPU": options.num_cpus, "GPU": options.num_gpus}
        bundle = {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.01}
        self._group = placement_group([bundle] * self.world_size, strategy="STRICT_PACK")
        self._wait_placed(bundle)
        on_gpu = options.num_gpus > 0
        threads = options.torch_threads if on_gpu else max(1, options.torch_threads // self.world_size)
        self.generation += 1
        self.ranks = [self._rank_actor(rank, bundle, threads, on_gpu) for rank in range(self.world_size)]
        address = ray.get(self.ranks[0].rendezvous.remote())
        began = time.perf_counter()
        starts = [rank.start.remote(address, self.timeout_s, self.pool_slots) for rank in self.ranks]
        try:
            devices = self._gather(starts, timeout_s=1800)
        except Exception:  # no half-started group: the next call starts a fresh one
            self.shutdown()
            raise
        logger.info("tensor-parallel group: %d ranks on %s ready in %.1f s (generation %d)",
                    self.world_size, devices[0], time.perf_counter() - began, self.generation)

    def _wait_placed(self, bundle: dict) -> None:
        """Wait for the ranks' group up to ``server.actor_placement_timeout_s``; past it remove it and
        raise PlacementFailed saying what the ranks need and what the cluster has."""
        timeout_s = self.config.server.actor_placement_timeout_s
        try:
            ray.get(self._group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            demands = tuple(Demand(f"rank-{r}", bundle.get("CPU", 0.0), bundle.get("GPU", 0.0))
                            for r in range(self.world_size))
            missing = shortage(demands, ray.available_resources(), node_totals())
            remove_placement_group(self._group)
            self._group = None
            raise PlacementFailed(f"the tensor-parallel verifier's {self.world_size} ranks could not be placed "
                                  f"on one node (STRICT_PACK) within {timeout_s:g} s ({TIMEOUT_FIELD}): "
                                  f"{missing}") from None

    def _rank_actor(self, rank: int, bundle: dict, threads: int, on_gpu: bool):
        env = rank_environment(rank, self.world_size, on_gpu)
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        strategy = PlacementGroupSchedulingStrategy(placement_group=self._group, placement_group_bundle_index=rank)
        return ray.remote(concurrency_groups={"control": 1})(RankActor).options(
            name=f"{self.name_prefix}/verifier-{self.uid}.{self.generation}/rank-{rank}", namespace=self.namespace,
            num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=strategy,
            runtime_env={"env_vars": env},
        ).remote(self.config, rank, self.world_size, threads)

    def shutdown(self) -> None:
        """Kill every rank (a survivor may be stuck in a collective) and free their resources."""
        with self.lock:
            cleanups = [rank.cleanup.remote() for rank in self.ranks]
            ray.wait(cleanups, num_returns=len(cleanups), timeout=5)
            for rank in self.ranks:
                ray.kill(rank, no_restart=True)
            if self._group is not None:
                remove_placement_group(self._group)
            self.ranks, self._group = [], None

    def _gather(self, refs: list, timeout_s: float) -> list:
        """All ranks' results; fails fast when any rank raises or dies, or after ``timeout_s``."""
        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RanksFailed(f"tensor-parallel ranks did not answer within {timeout_s:.0f} s")
            ray.get(ready[0])  # raises the rank's error
        return ray.get(refs)

    def submit(self, generation: int, method: str, *args) -> list:
        """Send one call to every rank (in the group's one order); its refs. Hold ``lock`` around
        whatever must be decided in the same order as the call (packing a batch)."""
        with self.lock:
            if generation != self.generation or not self.ranks:
                raise StateLost("the tensor-parallel group was restarted; this request's KV cache is gone")
            return [getattr(rank, method).remote(*args) for rank in self.ranks]

    def collect(self, refs: list, generation: int, method: str):
        """Rank 0's result; on any failure the group is killed and ``RanksFailed`` raised."""
        try:
            return self._gather(refs, self.timeout_s)[0]
        except Exception as error:
            logger.error("tensor-parallel rank failed in %s: %s; restarting the group", method, error)
            with self.lock:
                if self.ranks and generation == self.generation:
                    self.shutdown()  # the next call starts a new group
            raise RanksFailed(f"a tensor-parallel rank failed during {method}: {error}") from error

    def call(self, generation: int, method: str, *args):
        """``method`` on every rank of ``generation``; rank 0's result."""
        return self.collect(self.submit(generation, method, *args), generation, method)
