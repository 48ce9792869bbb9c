"""The shipped configuration served end to end, once: `specinfer serve`'s application as it ships.

configs/serve.yaml's ``specinfer`` application (the engine of configs/default.yaml: the
Qwen2.5-Coder 1.5B target with the 0.5B SSM quantized to int8, dtype auto, the CPU linear kernels
auto picks (oneDNN, packed weights in bf16), the suffix proposer with its global store, cost-aware
tree shapes; plus continuous batching with its tree budget) is deployed next to the session's
application and answers one short greedy request over gRPC. Marked ``shipped`` (and ``slow``: it
loads the default pair, fetched by `specinfer models fetch`); the README's test command runs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.serve_client import build_request
from serving_fixtures import own_app, ray_session, serving, tiny_args, tiny_models  # noqa: F401 (fixtures)
from settings.config import EngineConfig, engine_section, read_yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
PROMPT = "def quicksort(arr):\n    "
NEW_TOKENS = 8
MARGIN = 1.0  # logits: the greedy token's lead over the runner-up at every step of the reference


def shipped_args() -> dict:
    """configs/serve.yaml's application args, unchanged."""
    return engine_section(read_yaml(CONFIGS / "serve.yaml"), CONFIGS / "serve.yaml")


def test_the_served_engine_is_the_default_configs():
    """What `specinfer serve` ships runs the engine `specinfer generate` ships (configs/default.yaml);
    only the serving sections (verifier actor, server) are its own."""
    served = EngineConfig.model_validate(shipped_args()).model_dump(exclude={"verifier", "server"})
    default = EngineConfig.model_validate(read_yaml(CONFIGS / "default.yaml")).model_dump(exclude={"verifier", "server"})
    assert served == default


@torch.inference_mode()
def target_greedy(args: dict, prompt: str, new_tokens: int) -> tuple[list[int], float]:
    """The configured target's own greedy decoding, loaded as the verifier loads it (same dtype and
    kernels), one token per forward: (tokens, the smallest lead of a greedy token over the next)."""
    from actors.loading import load_configured

    config = EngineConfig.model_validate(args)
    loaded = load_configured(config, config.target)
    ids = torch.tensor([loaded.tokenizer.encode(prompt)])
    out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, output_scores=True, return_dict_in_generate=True,
                                pad_token_id=loaded.tokenizer.pad_token_id)
    leads = [float(top[0] - top[1]) for top in (scores[0].float().topk(2).values for scores in out.scores)]
    return out.sequences[0, ids.shape[1]:].tolist(), min(leads)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.shipped
def test_shipped_config_served_end_to_end(serving, qwen_models_dir):  # noqa: F811
    """One short greedy request over gRPC to the shipped application answers the target's own
    greedy decoding, loaded in-process the way the verifier loads it.

    The reference is the target's own decoding rather than the in-process engine's: building that
    engine measures its own verify-cost curve (a minute on 2 cores) to give, greedy, these same
    tokens. dtype auto is bf16 on a CPU with native bf16, where a batched verify pass rounds
    differently from a one-token step, so output may drift from the target's after a few dozen
    tokens: the request is 8 tokens of a prompt whose greedy token leads the next by more than
    MARGIN logits at every step (asserted), far beyond what bf16 rounding moves."""
    args = shipped_args()
    expected, lead = target_greedy(args, PROMPT, NEW_TOKENS)
    assert lead > MARGIN, f"the reference's greedy tokens are nearly tied ({lead:.2f}): pick another prompt"
    with own_app(serving, args, "specinfer-shipped", "/shipped") as (client, _, _):
        reply = client.generate(build_request(PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0), timeout=300)
    assert list(reply.token_ids) == expected
    assert reply.stats.new_tokens == NEW_TOKENS and reply.stats.mode == "tree"
