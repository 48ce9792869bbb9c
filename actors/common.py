"""Shared bits of the actors: process setup, vocabulary fingerprints, the TTL sweep interval."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from engine.batcher import BatchCounters
from engine.kv_pool import StateLost

if TYPE_CHECKING:  # a type only: the merge actor and the ingress do without transformers' models
    from engine.models import LoadedModel

DEFAULT_EXTENSIONS_DIR = "~/.cache/specinfer/torch_extensions"


@dataclass(frozen=True)
class Vocabulary:
    """What must match between the target and an SSM: vocab size and the token -> id map."""

    size: int
    digest: str


class TargetUnavailable(StateLost):
    """The verifier is down or restarting: a request fails fast (UNAVAILABLE, as for StateLost)
    instead of waiting for the restart; the requests in flight lost their KV caches anyway."""


class NeedsResync(RuntimeError):
    """An actor lacks the start of a request's committed tokens (it was restarted, or its state
    expired): the caller sends the whole history again (``start`` 0)."""


def sync_history(history: list[int], start: int, new_tokens: list[int]) -> None:
    """Apply the committed tokens a call carries: ``new_tokens`` belong at offset ``start``.

    Callers send only what an actor has not seen; ``start`` 0 with everything resyncs it.
    Example: history [5, 6], start 2, new [7] -> [5, 6, 7]; history [], start 2 -> NeedsResync.
    """
    if start > len(history):
        raise NeedsResync(f"have {len(history)} committed tokens, the call continues at {start}")
    history[start:] = new_tokens


def setup_process(torch_threads: int, cpu_affinity: list[int] | None = None) -> None:
    """Ray sets OMP_NUM_THREADS=1 in workers; take the configured thread count explicitly.

    ``cpu_affinity``: pin this process (all its threads) to these CPUs (``ActorOptions.cpu_affinity``),
    before torch starts its thread pool. Also points JIT-built torch extensions (DeepSpeed's CPU
    all-reduce) at the cache directory.
    """
    if cpu_affinity is not None:
        pin_process(cpu_affinity)
    torch.set_num_threads(torch_threads)
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir(os.environ.get("TORCH_EXTENSIONS_DIR"))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


class ComputeThread:
    """The one thread that runs a model actor's torch work: loading, the verify-cost curve and the
    engine loop's passes (``on_compute_thread``).

    PyTorch's OpenMP (libgomp) gives each thread that starts parallel work a team of its own, and
    lets a team's threads spin between parallel regions only while the process's OpenMP threads are
    no more than its CPUs; past that, every region wakes its threads through the kernel (about 25
    us, paid by each small op). A threaded actor's calls land on any of its ``max_concurrency``
    threads, so its passes soon ran that way: the default target's 32-token pass took 200-225 ms
    on a second thread against 165-175 ms on the thread that loaded it (2-core EPYC, bf16), the
    small ops 5x slower. The per-request calls of the unlooped path still run on the call's
    thread: their threads meet in the forward batcher.
    """

    def __init__(self):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="torch-compute")

    def run(self, fn: Callable, /, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the compute thread; its result or its exception."""
        return self._executor.submit(fn, *args, **kwargs).result()


def on_compute_thread(method: Callable) -> Callable:
    """An actor method that runs on the actor's ``ComputeThread`` (``self.compute``)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        return self.compute.run(method, self, *args, **kwargs)

    return run


def pin_process(cpus: list[int]) -> None:
    """Pin every thread of this process to ``cpus`` (``os.sched_setaffinity`` is per thread on
    Linux: Ray's worker threads exist before the actor starts, so each task in /proc/self/task is
    pinned, like ``taskset -a``; threads started later inherit it). A clear error for CPUs this
    process may not use."""
    count = os.cpu_count() or 1
    if not hasattr(os, "sched_setaffinity") or not all(0 <= cpu < count for cpu in cpus):
        raise ValueError(f"cpu_affinity {cpus}: this machine has CPUs 0..{count - 1}"
                         + ("" if hasattr(os, "sched_setaffinity") else " and no affinity support"))
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), set(cpus))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except OSError as error:  # e.g. a container's cpuset without these CPUs
            raise ValueError(f"cpu_affinity {cpus}: {error}") from None
    logging.getLogger(__name__).info("pinned to CPUs %s", sorted(cpus))


def extensions_dir(configured: str | None) -> str:
    """The absolute directory torch builds extensions in: ``configured``, or the specinfer cache.

    torch builds in ``$TORCH_EXTENSIONS_DIR/<name>``, so an empty value builds in the working
    directory: for a local Ray node, the checkout the driver ran in (``deepspeed_shm_comm/`` once
    got committed that way). Empty or unset means the default.

    >>> extensions_dir("/tmp/ext"), extensions_dir("") == os.path.expanduser(DEFAULT_EXTENSIONS_DIR)
    ('/tmp/ext', True)
    """
    return os.path.abspath(os.path.expanduser(configured or DEFAULT_EXTENSIONS_DIR))


def vocabulary(loaded: LoadedModel) -> Vocabulary:
    vocab = loaded.tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode("utf-8")).hexdigest()
    return Vocabulary(loaded.model.config.vocab_size, digest)


def sweep_interval(ttl_s: float) -> float:
    """Sweep a few times per TTL, but not more than once a second."""
    return max(1.0, ttl_s / 4)


MEMORY_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")


def process_memory() -> dict[str, float]:
    """This process's memory in MB (``/proc/self/status``): VmRSS (resident), RssAnon (its heap:
    weights copied out of their files, KV pools, buffers), RssFile (mapped files), VmHWM (the
    resident peak). Empty where /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            lines = [line.split() for line in status if line.startswith(MEMORY_FIELDS)]
    except OSError:
        return {}
    return {fields[0].rstrip(":"): int(fields[1]) / 1024 for fields in lines}


class HoldsRequests:
    """Per-request state in ``self.store`` (a RequestStore): release, TTL sweep, and a count; and the
    liveness probe every model actor answers."""

    def ping(self) -> None:
        """The liveness probe (``actors.liveness``): answers once the actor is up and ships nothing.
        Not ``ready``: the verifier's returns the target's tokenizer, which Qwen2.5's pickles to 10 MB
        (0.14 s to send, 0.65 s of the ingress's CPU to unpickle), once per health check."""

    def memory(self) -> dict[str, float]:
        """The actor process's memory in MB (``process_memory``), for bench/memory.py."""
        return process_memory()

    def init_loop(self, side) -> None:
        """The engine loop's calls here (``actors.executor``): their own states in ``side`` (an
        ``engine.phases`` side), the committed tokens each request has been sent, one call at a time
        (a release waits for the call under way)."""
        self.loop_side, self.loop_histories, self.loop_lock = side, {}, threading.Lock()
        self.loop_passes = BatchCounters()  # the loop's calls here: one pass each (tokens not counted)

    def count_pass(self, items: int) -> None:
        """One engine-loop call's pass over ``items`` requests (``loop_counters``)."""
        c = self.loop_passes
        c.forwards, c.items, c.largest = c.forwards + 1, c.items + items, max(c.largest, items)

    def loop_counters(self) -> BatchCounters:
        """The engine loop's calls here: how many, requests in them, the largest (for tests)."""
        return self.loop_passes

    def loop_history(self, request_id: str, start: int, new_tokens) -> tuple[int, ...]:
        """The request's committed tokens once this call's ``new_tokens`` (from ``start`` on) are in
        (NeedsResync when the start is missing: ``sync_history``). Under ``loop_lock``."""
        history = self.loop_histories.setdefault(request_id, [])
        sync_history(history, start, list(new_tokens))
        return tuple(history)

    def release(self, request_id: str) -> bool:
        with self.loop_lock:
            self.drop_loop_state(request_id)
        return self.store.release(request_id)

    def drop_loop_state(self, request_id: str) -> None:
        """The request's engine-loop state here (its side's states, its history). Under ``loop_lock``."""
        self.loop_side.release(request_id)
        self.loop_histories.pop(request_id, None)

    def sweep(self, max_idle_s: float | None = None) -> list[str]:
        return self.store.sweep(max_idle_s)

    def num_requests(self) -> int:
        """Requests holding state here: the per-request calls' and the engine loop's."""
        return len(self.store) + len(self.loop_side.states)
