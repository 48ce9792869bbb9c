"""Where a method runs: the in-process engine (with transformers' assisted generation as a peer) or a
running server's gRPC API. Every runner turns one (method, prompt) into one ``BenchRow``."""

from __future__ import annotations

import copy
import time
from typing import Iterable, Protocol

from engine.requests import GenerationRequest
from engine.sampling import SamplingParams
from settings.config import EngineConfig

from .methods import Method
from .rows import BenchRow, row_from_stats
from .workloads import EncodedPrompt


class Runner(Protocol):
    def run(self, method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams) -> BenchRow:
        ...

    def forget(self) -> None:
        """Empty the suffix proposer's global store of earlier responses, where this runner can."""

    def close(self) -> None:
        ...


class LocalRunner:
    """Runs methods on one in-process engine, built on first use (a finished run loads no model).

    Each run starts with an empty global suffix store (no method sees a prompt's answer from another
    method's run), unless ``keep_responses``: then only ``forget`` empties it (repeated workloads)."""

    def __init__(self, config: EngineConfig, engine=None, keep_responses: bool = False):
        self.config, self._engine, self.keep_responses = config, engine, keep_responses

    @property
    def engine(self):
        if self._engine is None:
            from cluster.build import build_engine

            self._engine = build_engine(self.config)
        return self._engine

    def run(self, method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams) -> BenchRow:
        if method.kind == "hf-assisted":
            return hf_assisted_row(self.engine, method, prompt, max_new_tokens, sampling)
        if not self.keep_responses:
            self.forget()  # no method sees this prompt's answer from another's run
        request = GenerationRequest(prompt.ids, max_new_tokens, sampling, method.options)
        started = time.perf_counter()
        result = self.engine.generate(request)
        latency_ms = (time.perf_counter() - started) * 1e3
        return row_from_stats(prompt, method.spelling, result.token_ids, result.finish_reason,
                              result.stats.to_dict(), latency_ms)

    def forget(self) -> None:
        from cluster.build import forget_responses

        forget_responses(self.engine)

    def close(self) -> None:
        if self._engine is not None:
            from cluster.build import close_engine

            close_engine(self._engine)


def hf_generation_config(eos_ids: Iterable[int], max_new_tokens: int, sampling: SamplingParams):
    """A plain GenerationConfig (no penalties): greedy, or the request's temperature / top-k / top-p."""
    from transformers import GenerationConfig

    eos = sorted(eos_ids)
    values: dict = {"do_sample": not sampling.greedy, "max_new_tokens": max_new_tokens,
                    "eos_token_id": eos or None, "pad_token_id": eos[0] if eos else 0}
    if not sampling.greedy:
        values.update(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
    return GenerationConfig(**values)


def hf_assisted_row(engine, method: Method, prompt: EncodedPrompt, max_new_tokens: int,
                    sampling: SamplingParams) -> BenchRow:
    """transformers' assisted generation with the SSM as assistant; a forward pre-hook counts target
    forwards (prefill included, as ``target_steps``). The assistant's generation config is restored
    after each call, so HF's adaptive draft length starts afresh for every prompt."""
    import torch

    target = engine.target.model
    if not isinstance(target, torch.nn.Module):
        raise ValueError("hf-assisted needs the target in this process: use verifier.tensor_parallel_size 1")
    assistant = engine.drafters[engine.names.index(method.assistant)].model
    config = hf_generation_config(engine.eos_ids, max_new_tokens, sampling)
    saved, calls = copy.deepcopy(assistant.generation_config), [0]
    hook = target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = torch.tensor([prompt.ids], dtype=torch.long)  # [1, prompt tokens]
    torch.manual_seed(sampling.seed or 0)
    started = time.perf_counter()
    try:
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                  assistant_model=assistant)  # [1, prompt + new tokens]
    finally:
        hook.remove()
        assistant.generation_config = saved
    latency_ms = (time.perf_counter() - started) * 1e3
    tokens = tuple(out[0, len(prompt.ids):].tolist())
    finish = "stop" if tokens and tokens[-1] in engine.eos_ids else "length"
    return BenchRow(prompt_id=prompt.id, method=method.spelling, prompt_tokens=len(prompt.ids), token_ids=tokens,
                    finish_reason=finish, new_tokens=len(tokens), target_steps=calls[0],
                    tokens_per_step=len(tokens) / calls[0] if calls[0] else None,
                    ms_per_token=latency_ms / max(len(tokens), 1), latency_ms=latency_ms)


def grpc_request(method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams):
    """The GenerateRequest for one method and prompt (raw prompts as ``prompt``, chat prompts as one
    user message, so the server applies the same chat template). A cost-aware method sends no
    expansion: the server follows any expansion a request gives as a fixed schedule."""
    from cluster.serve_client import build_request

    if method.kind != "engine":
        raise ValueError(f"{method.spelling} cannot run through gRPC")
    o, text = method.options, prompt.prompt.text
    return build_request(
        prompt=None if prompt.prompt.chat else text, messages=[("user", text)] if prompt.prompt.chat else (),
        max_new_tokens=max_new_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, seed=sampling.seed, mode=o.mode, ssms=o.proposers or (),
        expansion=o.expansion if o.policy == "schedule" else (),  # a request's expansion means "follow it"
        children=o.children, sequence_depth=o.sequence_depth)


class GrpcRunner:
    """Runs methods against a running server's Generate RPC (requests as ``grpc_request`` builds them)."""

    def __init__(self, address: str, timeout_s: float = 3600.0):
        from cluster.serve_client import Client

        self.client, self.timeout_s = Client(address), timeout_s

    def run(self, method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams) -> BenchRow:
        from cluster.serve_client import response_dict

        request = grpc_request(method, prompt, max_new_tokens, sampling)
        started = time.perf_counter()
        response = self.client.generate(request, timeout=self.timeout_s)
        latency_ms = (time.perf_counter() - started) * 1e3
        data = response_dict(response)
        stats = {**data["stats"], "accepted_per_proposer": data["stats"]["accepted_per_ssm"]}
        return row_from_stats(prompt, method.spelling, data["token_ids"], data["finish_reason"], stats, latency_ms,
                              remote=True)

    def forget(self) -> None:
        """Nothing: a server's store belongs to its merge actor (restart the server to empty it)."""

    def close(self) -> None:
        self.client.close()


class ServedRunner:
    """Runs methods through a Ray Serve app of its own: started on first use (Ray on loopback, the
    Serve config's proxies on free ports, ``engine_args`` as the app's args), stopped on close."""

    def __init__(self, serve_config: str, engine_args: dict, ready_timeout_s: float, num_cpus: int | None = None,
                 object_store_memory: int | None = None):
        self.serve_config, self.engine_args, self.ready_timeout_s = serve_config, engine_args, ready_timeout_s
        self.ray_resources = {"num_cpus": num_cpus, "object_store_memory": object_store_memory}
        self._grpc: GrpcRunner | None = None

    @property
    def grpc(self) -> GrpcRunner:
        if self._grpc is None:
            from .local_app import start_app

            address = start_app(self.serve_config, lambda _: self.engine_args, self.ready_timeout_s,
                                **self.ray_resources)
            self._grpc = GrpcRunner(address)
        return self._grpc

    def run(self, method: Method, prompt: EncodedPrompt, max_new_tokens: int, sampling: SamplingParams) -> BenchRow:
        return self.grpc.run(method, prompt, max_new_tokens, sampling)

    def forget(self) -> None:
        """Nothing: the app's suffix store belongs to its merge actor (``engine_args`` may switch it off)."""

    def close(self) -> None:
        if self._grpc is not None:
            from cluster.cli_serve import stop_serving

            self._grpc.close()
            self._grpc = None
            stop_serving()
