"""Every decoder-only family on the allow-list (``engine.architectures.SUPPORTED_ARCHITECTURES``), table-driven:
a tiny random model of each, built from its config (no download), speculates with an SSM of its own
family, and its fp32 greedy output equals the target's own ``generate``: in-process (a DynamicCache
per request) and in the engine loop over the paged pool (two requests batched). Sliding-window
families get prompts longer than the window, and negative controls show that the window (and
gemma2's logit softcap) changed the output: the engine with it ignored no longer matches. Families
that cannot take a tree are refused with their reason; one sliding family is served over gRPC.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

import engine.masks
import engine.packed
from actors.suffix import SuffixDrafter
from engine.draft import ModelDrafter
from engine.generate import SpeculativeEngine
from engine.graphs import GraphRunner, graphable
from engine.kv_pool import BlockPool, PagedSequence
from engine.loop import EngineLoop
from engine.models import NOT_TENSOR_PARALLEL, SUPPORTED_ARCHITECTURES, attention_for, check_architecture, \
    check_tensor_parallel
from engine.paged_models import PagedDrafter, PagedTarget, paged_parts
from engine.phases import local_loop
from engine.requests import GenerationRequest, SpeculationOptions
from engine.target import TargetModel
from engine.tree import attention_bias, windowed
from serving_fixtures import own_app, ray_session, save_tokenizer, serving, tiny_args, tiny_models  # noqa: F401
from tests.tiny_models import FAMILIES, IdTokenizer, family_model, reference_greedy

VOCAB, NEW_TOKENS = 97, 24
PROMPTS = [[(7 * i + 3) % 61 + 1 for i in range(20)], [(5 * i + 2) % 53 + 1 for i in range(17)]]
TREE = SpeculationOptions(expansion=(2, 2, 1))

# (family, sliding window): every family of the allow-list once; window 6 < the prompts' 17 and 20
# tokens; window 2 < a tree's depth 3, so a deep node sees its parent and itself only.
CASES = [("llama", None), ("granite", None), ("olmo2", None), ("gemma", None),
         ("mistral", 6), ("phi3", 6), ("starcoder2", 6), ("qwen2", 6), ("qwen3", 6), ("gemma2", 6),
         ("gemma3_text", 6), ("olmo3", 6), ("mistral", 2), ("gemma2", 2)]
SLIDING = [case for case in CASES if case[1] is not None]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: these models are tiny, and more threads only contend for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pair(family: str, window: int | None):
    """(target of 2 layers, SSM of 1), both of ``family`` with ``window``."""
    return family_model(family, VOCAB, 2, seed=1, window=window), family_model(family, VOCAB, 1, seed=2, window=window)


def in_process(target, ssm) -> list[list[int]]:
    """Each prompt through the in-process engine (one request at a time, DynamicCaches)."""
    engine = SpeculativeEngine(TargetModel(target), [ModelDrafter(ssm, 0, "ssm"), SuffixDrafter(1)], IdTokenizer(),
                               set())
    return [list(engine.generate(GenerationRequest(tuple(p), NEW_TOKENS, speculation=TREE)).token_ids)
            for p in PROMPTS]


def in_the_loop(target, ssm) -> list[list[int]]:
    """Both prompts submitted together to an engine loop over paged pools, stepped until idle."""
    target_pool, target_batcher = paged_parts(target, 1024)
    ssm_pool, ssm_batcher = paged_parts(ssm, 1024)
    loop = local_loop(PagedTarget(target, target_pool, target_batcher),
                      [PagedDrafter(ssm, 0, "ssm", ssm_pool, ssm_batcher), SuffixDrafter(1)], IdTokenizer(), ())
    outputs = run_together(loop)
    assert target_pool.num_free == target_pool.num_blocks and ssm_pool.num_free == ssm_pool.num_blocks
    return outputs


def run_together(loop: EngineLoop) -> list[list[int]]:
    """Every prompt submitted at once, the loop stepped until idle: each request's tokens. Its first
    iteration runs them all (one packed target pass over both trees)."""
    ids = [loop.submit(GenerationRequest(tuple(p), NEW_TOKENS, speculation=TREE)) for p in PROMPTS]
    outputs, running = {i: [] for i in ids}, []
    while loop.has_work:
        loop.step()
        running.append(loop.last.running)
        for request_id in [i for i in ids if i in loop.requests]:
            outputs[request_id].extend(t for u in loop.take(request_id) for t in u.token_ids)
    assert running[0] == len(PROMPTS) and not loop.requests
    return [outputs[i] for i in ids]


@pytest.mark.parametrize("family,window", CASES)
def test_greedy_output_equals_generate_in_process_and_in_the_engine_loop(family, window):
    target, ssm = pair(family, window)
    assert target.config.model_type == family
    expected = [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    assert in_process(target, ssm) == expected
    assert in_the_loop(target, ssm) == expected
    assert [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS] == expected  # under the paged attention too


@pytest.mark.parametrize("family,window", SLIDING)
def test_the_window_changes_the_output_and_the_engine_applies_it(family, window, monkeypatch):
    """Negative controls: without its window the model answers otherwise; the engine with windows
    ignored (in its masks and in the paged pool's attention) no longer equals generate."""
    target, ssm = pair(family, window)
    expected = [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    unwindowed = family_model(family, VOCAB, 2, seed=1, window=None)
    assert [reference_greedy(unwindowed, p, NEW_TOKENS) for p in PROMPTS] != expected
    bias = engine.packed._Reads.bias
    monkeypatch.setattr(engine.masks, "sliding_window", lambda config: None)
    monkeypatch.setattr(engine.packed._Reads, "bias", lambda reads, window: bias(reads, None))
    assert in_process(target, ssm) != expected
    assert in_the_loop(target, ssm) != expected


def test_gemma2_s_softcap_is_applied_in_the_paged_pool(monkeypatch):
    """Negative control: the paged attention without gemma2's attention logit softcap answers otherwise."""
    target, ssm = pair("gemma2", 6)
    assert target.config.attn_logit_softcapping is not None
    expected = [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    attend = engine.packed.attend
    monkeypatch.setattr(engine.packed, "attend", lambda q, k, v, bias, scaling, softcap: attend(q, k, v, bias, scaling,
                                                                                                 None))
    assert in_the_loop(target, ssm) != expected


def test_the_allow_list_is_exactly_what_this_table_covers():
    assert set(SUPPORTED_ARCHITECTURES) == set(FAMILIES) == {family for family, _ in CASES}
    for family, window in CASES:
        check_architecture(family_model(family, VOCAB, 2, window=window).config, family)
    assert {family for family, style in SUPPORTED_ARCHITECTURES.items() if style} == {f for f, _ in SLIDING}


REFUSED = [  # (config, words of the error)
    (transformers.MambaConfig(), "recurrent"),
    (transformers.JambaConfig(), "recurrent"),
    (transformers.BloomConfig(), "ALiBi"),
    (transformers.MptConfig(), "ALiBi"),
    (transformers.FalconConfig(alibi=True), "ALiBi"),
    (transformers.T5Config(), "encoder-decoder"),
    (transformers.BartConfig(), "encoder-decoder"),
    (transformers.Gemma3Config(), "multimodal"),
    (transformers.Llama4TextConfig(), "chunked attention"),
    (transformers.Gemma3TextConfig(use_bidirectional_attention=True), "bidirectional"),
    (transformers.GPT2Config(), "no test covers it"),
]


@pytest.mark.parametrize("config,reason", REFUSED, ids=[c.model_type for c, _ in REFUSED])
def test_families_that_cannot_take_a_tree_are_refused_with_the_reason(config, reason):
    with pytest.raises(ValueError, match=f"'my-model' has architecture '{config.model_type}'.*{reason}"):
        check_architecture(config, "my-model")


def test_windowed_keeps_keys_less_than_the_window_behind_the_query():
    assert windowed(torch.ones(1, 4, dtype=torch.bool), torch.tensor([5]), torch.tensor([2, 3, 4, 5]),
                    3).tolist() == [[False, True, True, True]]
    # a chain of 3 tree nodes after a 4-token prefix (positions 4, 5, 6), window 2: each node sees
    # the entry before it and itself
    bias = attention_bias(torch.ones(3, 3, dtype=torch.bool).tril(), 4, torch.float32, 2, torch.tensor([4, 5, 6]),
                          torch.tensor([4, 5, 6]))
    assert (bias[0, 0] == 0).tolist() == [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1, 1]]


def test_a_paged_sequence_knows_its_speculative_entries_positions():
    sequence = PagedSequence(BlockPool(4, 4))
    sequence.append(3)  # a chain: positions 0, 1, 2
    sequence.keep([0, 1, 2])
    sequence.append(3, torch.tensor([3, 4, 4]))  # a root and two children
    sequence.append(1, torch.tensor([5]))  # a grandchild, drafted a level later
    assert sequence.pending_positions().tolist() == [3, 4, 4, 5]
    sequence.keep([0, 2, 3])
    assert sequence.pending_positions().tolist() == [] and sequence.length == 6


def test_windows_and_softcaps_are_run_eagerly_not_graphed():
    assert graphable(family_model("llama", VOCAB).config)
    assert graphable(family_model("qwen2", VOCAB, window=None).config)
    for family, window in (("mistral", 6), ("qwen2", 6), ("gemma2", 6)):
        assert not graphable(family_model(family, VOCAB, window=window).config)
    with pytest.raises(ValueError, match="cuda_graphs: a gemma2 model with a sliding window"):
        GraphRunner(family_model("gemma2", VOCAB, window=6), 64, graphs=False)
    assert attention_for(family_model("gemma2", VOCAB, window=6).config, "sdpa") == "eager"
    assert attention_for(family_model("llama", VOCAB).config, "sdpa") == "sdpa"


def test_families_autotp_shards_wrongly_are_refused_for_tensor_parallelism():
    assert set(NOT_TENSOR_PARALLEL) == {"olmo2", "olmo3", "phi3"} < set(SUPPORTED_ARCHITECTURES)
    for family in SUPPORTED_ARCHITECTURES:
        config = family_model(family, VOCAB).config
        check_tensor_parallel(config, "t", 1)
        if family not in NOT_TENSOR_PARALLEL:
            check_tensor_parallel(config, "t", 2)
            continue
        with pytest.raises(ValueError, match=f"tensor_parallel_size 2: target 't' \\({family}\\).*AutoTP"):
            check_tensor_parallel(config, "t", 2)


@pytest.mark.ray
def test_a_sliding_window_family_tensor_parallel_over_the_paged_pool_equals_generate(ray_session, tmp_path):
    """gemma2 (sliding and full layers, logit softcaps) as a 2-rank AutoTP target over the paged pool
    (each rank its share of the heads), two requests in the engine loop: generate's output."""
    from actors.targets import build_target
    from settings.config import EngineConfig

    vocab = len(save_tokenizer(tmp_path))
    target = family_model("gemma2", vocab, 2, seed=1, window=6)
    target.save_pretrained(tmp_path)
    expected = [reference_greedy(target, p, NEW_TOKENS) for p in PROMPTS]
    unwindowed = family_model("gemma2", vocab, 2, seed=1, window=None)
    assert [reference_greedy(unwindowed, p, NEW_TOKENS) for p in PROMPTS] != expected  # the window matters here
    args = {"models_dir": str(tmp_path), "dtype": "float32", "torch_threads": 1, "suffix": None,
            "target": {"name": "gemma2", "source": str(tmp_path)},
            "verifier": {"tensor_parallel_size": 2, "collective_timeout_s": 30.0,
                         "actor": {"num_cpus": 0.25, "torch_threads": 1}},
            "server": {"batching": {"kv_cache_tokens": 1024}, "tree_budget": {"enabled": False}}}
    paged, _ = build_target(EngineConfig.model_validate(args), expected=lambda: 0)
    try:
        ssm = family_model("gemma2", vocab, 1, seed=2, window=6)
        outputs = run_together(local_loop(paged, [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), ()))
    finally:
        paged.shutdown()
    assert outputs == expected


# -- Served: one sliding-window family through gRPC. ---------------------------------------------

SERVED_APP, SERVED_WINDOW = "specinfer-gemma2", 8
SERVED_PROMPTS = ["def sliding(window, tokens):", "The quick brown fox jumps over it"]


@pytest.fixture(scope="module")
def gemma2_app(serving, tmp_path_factory):  # noqa: F811
    """An application next to the shared one on a tiny gemma2 (layers sliding and full, window 8,
    logit softcaps), its first layer as the SSM, with the byte tokenizer; (client, target, tokenizer)."""
    root = tmp_path_factory.mktemp("gemma2")
    model = family_model("gemma2", len(save_tokenizer(root / "target")), 2, seed=1, window=SERVED_WINDOW)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = None
    model.save_pretrained(root / "target")
    actor = {"num_cpus": 0.25, "torch_threads": 1, "max_concurrency": 8}
    args = {"models_dir": str(root), "dtype": "float32", "torch_threads": 1,
            "target": {"name": "gemma2-target", "source": str(root / "target")},
            "ssms": [{"name": "gemma2-ssm", "source": str(root / "target"), "num_layers": 1}], "suffix": None,
            "speculation": {"mode": "tree", "policy": "schedule", "expansion": [2, 2, 1], "max_tree_nodes": 16},
            "verifier": {"actor": actor},
            "server": {"max_concurrent_requests": 2, "ssm_actor": actor, "merge_actor": {**actor, "num_cpus": 0.1},
                       "batching": {"kv_cache_tokens": 512}, "tree_budget": {"enabled": False}}}
    target = transformers.AutoModelForCausalLM.from_pretrained(root / "target").float().eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(root / "target")
    with own_app(serving, args, SERVED_APP, "/gemma2") as (client, _, _):
        yield client, target, tokenizer


@pytest.mark.ray
def test_a_sliding_window_family_served_over_grpc_equals_generate(gemma2_app):
    from cluster.serve_client import build_request

    client, target, tokenizer = gemma2_app
    prompts = [tokenizer.encode(p) for p in SERVED_PROMPTS]
    assert all(len(p) > 2 * SERVED_WINDOW for p in prompts) and target.config.layer_types == [
        "sliding_attention", "full_attention"]
    with ThreadPoolExecutor(len(SERVED_PROMPTS)) as pool:  # both requests in the replica's loop together
        replies = list(pool.map(lambda p: client.generate(build_request(p, max_new_tokens=NEW_TOKENS), timeout=300),
                                SERVED_PROMPTS))
    expected = [reference_greedy(target, p, NEW_TOKENS) for p in prompts]
    assert [list(r.token_ids) for r in replies] == expected
    assert sum(r.stats.accepted_tokens for r in replies) > 0  # trees were verified, not plain decoding
    unwindowed = transformers.AutoModelForCausalLM.from_pretrained(target.name_or_path, sliding_window=1 << 20)
    assert [reference_greedy(unwindowed.float().eval(), p, NEW_TOKENS) for p in prompts] != expected
