"""Lossless sampling through the served system: seeded sampled requests sent through the gRPC
ingress follow the target's exact distribution, and the same test at the same sample size rejects
a biased verification planted in the served verifier actor.

The in-process counterparts are in tests/test_distribution.py
(``test_engine_first_two_tokens_are_target_distributed`` and its negative control
``test_a_biased_verifier_in_the_loop_is_rejected_at_the_same_size``): the same models (random
Llamas over a 16-word vocabulary), prompt, speculation case (tree (2, 2), top-k children,
temperature 1), statistic (chi-square of the first two tokens against the target's exact joint
distribution, from its own forwards) and threshold. Served, the requests run on a Serve
application of this module's own (``specinfer-distribution``), deployed next to the session's.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.serve_client import Client, build_request
from engine.sampling import SamplingParams
from serving_fixtures import own_app, ray_session, serving, tiny_args, tiny_models  # noqa: F401 (fixtures)
from tests.lookup_models import accept_first_draws, chi_square, save_tiny_pair, target_first_two

APP_NAME = "specinfer-distribution"
VOCAB = 16
PROMPT = "w1 w5 w9"  # ids (1, 5, 9): tests/test_distribution.py's E2E_PROMPT
PROMPT_IDS = (1, 5, 9)
THRESHOLD = 1e-3  # chi-square p-value: above it the output is the target distribution
SAMPLES = 1000  # requests per test (seeds 0..SAMPLES-1), the control's as the test's
CONCURRENCY = 8  # requests in flight: they share the verifier's packed passes
SAMPLING = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def distribution_app(serving, tmp_path_factory):  # noqa: F811
    """(a gRPC client on this module's application, its Serve handle, the target model)."""
    from transformers import AutoModelForCausalLM

    models = tmp_path_factory.mktemp("served-distribution")
    pair = save_tiny_pair(models, VOCAB, target_seed=11, ssm_seed=12)  # test_distribution's tiny_models
    actor = {"num_cpus": 0.25, "torch_threads": 1, "max_concurrency": 16}
    args = {"models_dir": str(models), "dtype": "float32", "torch_threads": 1, **pair, "suffix": None,
            "speculation": {"mode": "tree", "policy": "schedule", "expansion": [2, 2], "children": "top_k",
                            "max_tree_nodes": 16},
            "defaults": {"max_new_tokens": 2, "temperature": SAMPLING.temperature},
            "verifier": {"actor": actor},
            "server": {"max_concurrent_requests": CONCURRENCY, "ssm_actor": actor,
                       "merge_actor": {**actor, "num_cpus": 0.1},
                       "batching": {"kv_cache_tokens": 1024}, "tree_budget": {"enabled": False}}}
    target = AutoModelForCausalLM.from_pretrained(models / "tiny-target").float().eval()
    with own_app(serving, args, APP_NAME, "/distribution") as (client, handle, _):
        yield client, handle, target


def served_first_two(client: Client) -> tuple[list[tuple[int, ...]], int]:
    """The first two tokens of SAMPLES seeded sampled requests (seeds 0..SAMPLES-1), sent through the
    gRPC ingress CONCURRENCY at a time, and the draft tokens they accepted."""
    def ask(seed: int):
        request = build_request(PROMPT, max_new_tokens=2, temperature=SAMPLING.temperature, seed=seed, mode="tree",
                                expansion=(2, 2), children="top_k")
        return client.generate(request, timeout=120)

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        replies = list(pool.map(ask, range(SAMPLES)))
    assert all(len(reply.token_ids) == 2 for reply in replies)
    return [tuple(reply.token_ids) for reply in replies], sum(reply.stats.accepted_tokens for reply in replies)


def report(name: str, result) -> None:
    print(f"\nchi2 served {name}: statistic {result.statistic:.2f}, cells {result.cells} "
          f"(pooled {result.pooled}), samples {result.samples}, p-value {result.pvalue:.4g}")


def set_verification(verifier, verify) -> None:
    """``engine.step.verify_stochastic`` inside the verifier actor's process (where the served
    requests are verified) set to ``verify``, or back to engine.verify's when None."""
    import ray

    def swap(actor, function):
        import engine.step
        import engine.verify

        engine.step.verify_stochastic = function or engine.verify.verify_stochastic

    ray.get(verifier.__ray_call__.remote(swap, verify), timeout=60)


@pytest.mark.ray
def test_served_first_two_tokens_are_target_distributed(distribution_app):
    client, _, target = distribution_app
    samples, accepted = served_first_two(client)
    result = chi_square(samples, target_first_two(target, PROMPT_IDS, SAMPLING))
    report("tree (2,2) top_k", result)
    assert result.pvalue > THRESHOLD
    assert accepted > 0.15 * SAMPLES  # speculation really happened


@pytest.mark.ray
def test_a_biased_served_verifier_is_rejected_at_the_same_size(distribution_app):
    """Negative control: the same requests, sample size and chi-square test, through the same
    ingress, reject a served verifier that accepts every first draw (planted in its process)."""
    client, handle, target = distribution_app
    verifier = handle.actors.remote().result()["verifier"]
    set_verification(verifier, accept_first_draws)
    try:
        samples, _ = served_first_two(client)
    finally:
        set_verification(verifier, None)
    result = chi_square(samples, target_first_two(target, PROMPT_IDS, SAMPLING))
    report("NEGATIVE CONTROL tree (2,2) top_k, first draws accepted", result)
    assert result.pvalue < THRESHOLD
