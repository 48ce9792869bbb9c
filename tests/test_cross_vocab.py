"""Drafts from another family (issue 42, item 3): an SSM with a tokenizer of its own drafts through
text (engine.cross_vocab), each proposed target token a point mass.

Two byte-level BPE tokenizers trained here on a small ASCII corpus (different merges, different
vocabulary sizes; both round-trip any text over the corpus's characters), tiny random models on
them, and a *mirror* SSM: the target's weights with its vocabulary's ids permuted, so that drafts
through text are the target's own greedy text and are accepted (the tests are not vacuous).

1. The translation, pure, on worked examples.
2. Greedy output equal to the target's own ``generate``, alone and merged beside a same-vocabulary
   SSM and the suffix proposer; the statistics count the SSM tokens that survived re-encoding.
3. Sampled output: the first two tokens follow the target's exact distribution (chi-square), and
   the same test at the same size rejects a verifier that accepts every first draw.
4. Config: the refusal without ``cross_vocabulary``, the engine built from a config with it, and
   a cross-family pair served through gRPC end to end.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch

from actors.suffix import SuffixDrafter
from engine.cross_vocab import (CrossVocabDrafter, TranslationCounts, chain_proposal, continuation, draft_texts,
                                fit_context, stable_continuation)
from engine.draft import DraftSpec, ModelDrafter
from engine.generate import SpeculativeEngine
from engine.requests import GenerationRequest, SpeculationOptions
from engine.sampling import SamplingParams
from engine.target import TargetModel
from serving_fixtures import own_app, ray_session, serving, tiny_args, tiny_models  # noqa: F401 (fixtures)
from settings.config import SuffixConfig
from tests.lookup_models import accept_first_draws, chi_square, target_first_two
from tests.tiny_models import family_model, reference_greedy, tiny_model

CORPUS = ["the cat sat on the mat and the dog sat on the log",
          "a bird in the hand is worth two in the bush",
          "speculative decoding drafts tokens that the target verifies"]
PROMPT = "the dog sat in the"
THRESHOLD = 1e-3  # chi-square p-value: above it the output is the target distribution
SAMPLES = 600  # per distribution case, the control's as the test's
TOP5 = SamplingParams(temperature=1.0, top_k=5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def byte_bpe(vocab_size: int, corpus: list[str]):
    """A GPT-2 style byte-level BPE trained on ``corpus`` (its alphabet: the corpus's bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def permuted(tokenizer, seed: int):
    """The same tokenizer with its ids permuted: (tokenizer, order), target id i -> id order[i]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    order = torch.randperm(len(model["vocab"]), generator=torch.Generator().manual_seed(seed)).tolist()
    vocab = {token: order[i] for token, i in model["vocab"].items()}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in model["merges"]]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend), order


def mirror(target, order: list[int]):
    """The target over the permuted vocabulary: embedding and output rows moved to id order[i]."""
    ssm = copy.deepcopy(target)
    index = torch.tensor(order)
    with torch.no_grad():
        for weight in (ssm.model.embed_tokens.weight, ssm.lm_head.weight):
            weight[index] = weight.clone()
    return ssm


@pytest.fixture(scope="module")
def pair():
    """Target (llama over a 60-token BPE), a random qwen2 SSM over another BPE (84 tokens), a mirror
    SSM (the target over its permuted vocabulary) and a same-vocabulary llama SSM."""
    target_tok, ssm_tok = byte_bpe(60, CORPUS), byte_bpe(90, CORPUS[::-1])
    mirror_tok, order = permuted(target_tok, seed=3)
    target = tiny_model("llama", vocab_size=len(target_tok), layers=2, seed=21)
    return {"target": target, "target_tok": target_tok, "ssm": family_model("qwen2", len(ssm_tok), layers=1, seed=22),
            "ssm_tok": ssm_tok, "mirror": mirror(target, order), "mirror_tok": mirror_tok,
            "same": tiny_model("llama", vocab_size=len(target_tok), layers=1, seed=23)}


# ---------------------------------------------------------------------------------------------
# 1. The translation, pure.

def _char_encode(text: str) -> list[str]:
    """Characters as tokens, "ab" and "cd" merged: "xabc" -> [x, ab, c]."""
    out, i = [], 0
    while i < len(text):
        step = 2 if text[i:i + 2] in ("ab", "cd") else 1
        out.append(text[i:i + step])
        i += step
    return out


def _char_decode(tokens) -> str:
    return "".join(tokens)


@pytest.mark.parametrize("committed,text,expected", [
    (["x"], "ab", ["ab"]),  # the draft continues the committed tokens
    (["a"], "bc", None),  # "abc" re-encodes as [ab, c]: no longer after [a]
    (["x", "y"], "", []),
    (["a", "x"], "cdc", ["cd", "c"]),
])
def test_continuation_worked_examples(committed, text, expected):
    assert continuation(committed, text, _char_decode, _char_encode) == expected


@pytest.mark.parametrize("texts,expected", [
    (["bc", "bcd"], ["b"]),  # "c" merges with the last drafted "d": unstable
    (["bx", "bxy"], ["b", "x"]),
    (["", "b"], []),  # one SSM token: nothing stable yet
])
def test_stable_continuation_drops_the_unstable_end(texts, expected):
    assert stable_continuation(["x"], texts, _char_decode, _char_encode) == expected


def test_draft_texts_and_chain():
    assert draft_texts(["a", "b"], ["c", "d"], _char_decode) == ["", "c", "cd"]
    proposal = chain_proposal(5, 2, [9, 7])
    assert proposal.tree.tokens.tolist() == [5, 9, 7] and proposal.tree.parents.tolist() == [-1, 0, 1]
    assert proposal.draws.deterministic.all() and proposal.draws.q is None
    assert proposal.draws.proposer.tolist() == [2, 2]


@pytest.mark.parametrize("ids,depth,context,expected", [
    ([1, 2, 3, 4, 5], 2, 5, [3, 4, 5]),
    ([1, 2, 3], 2, 5, [1, 2, 3]),
    ([1, 2, 3], 2, None, [1, 2, 3]),
])
def test_fit_context_keeps_room_for_the_draft(ids, depth, context, expected):
    assert fit_context(ids, depth, context) == expected


def test_real_tokenizers_translate_a_draft(pair):
    """A draft of the SSM's ids for " on the mat" proposes target ids whose text continues the
    committed text: the re-encoding of "the cat sat on the mat" after "the cat sat"."""
    target_tok, ssm_tok = pair["target_tok"], pair["ssm_tok"]
    committed = target_tok.encode("the cat sat")
    drafted = ssm_tok.encode(" on the mat")
    texts = draft_texts(ssm_tok.encode("the cat sat"), drafted, ssm_tok.decode)
    assert texts[-1] == " on the mat"
    tokens = stable_continuation(committed, texts, target_tok.decode, target_tok.encode)
    assert tokens and target_tok.encode("the cat sat on the mat")[len(committed):][:len(tokens)] == tokens
    assert target_tok.decode(committed + tokens).startswith("the cat sat on the")


# ---------------------------------------------------------------------------------------------
# 2. Greedy output equal to the target's own.

def cross(pair, kind: str, proposer: int = 0) -> CrossVocabDrafter:
    return CrossVocabDrafter(pair[kind], pair[f"{kind}_tok"], pair["target_tok"], proposer, f"x-{kind}")


def drafters(pair, names: tuple[str, ...]) -> list:
    """The proposers of a case, in proposer order."""
    made = []
    for name in names:
        if name == "same":
            made.append(ModelDrafter(pair["same"], len(made), "same"))
        elif name == "suffix":
            made.append(SuffixDrafter(len(made), SuffixConfig(max_cached_requests=0)))
        else:
            made.append(cross(pair, name, len(made)))
    return made


GREEDY_CASES = [  # (name, proposers, speculation, whether the cross-family SSM must get tokens accepted)
    ("random qwen2 ssm", ("ssm",), SpeculationOptions("tree", (2, 2, 1, 1), policy="schedule"), False),
    ("mirror ssm", ("mirror",), SpeculationOptions("tree", (2, 2, 1, 1), policy="schedule"), True),
    ("mirror sequence", ("mirror",), SpeculationOptions("sequence", sequence_depth=3), True),
    ("mixed: mirror + same-vocab + suffix", ("mirror", "same", "suffix"),
     SpeculationOptions("tree", (2, 1, 1), policy="schedule"), True),
    ("mixed: random + same-vocab + suffix", ("ssm", "same", "suffix"),
     SpeculationOptions("tree", (2, 2), policy="schedule"), False),
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name,proposers,options,accepted", GREEDY_CASES, ids=[c[0] for c in GREEDY_CASES])
def test_greedy_output_equals_the_targets(pair, name, proposers, options, accepted):
    target_tok, made = pair["target_tok"], drafters(pair, proposers)
    engine = SpeculativeEngine(TargetModel(pair["target"]), made, target_tok, eos_ids=())
    prompt = target_tok.encode(PROMPT)
    result = engine.generate(GenerationRequest(tuple(prompt), 24, speculation=options))
    assert list(result.token_ids) == reference_greedy(pair["target"], prompt, 24)
    counts = made[0].counts
    print(f"\n{name}: {counts}, accepted {result.stats.accepted_per_proposer}")
    assert result.stats.translated_per_proposer == {made[0].name: [counts.drafted, counts.survived]}
    assert result.stats.to_dict()["translated_per_proposer"] == {made[0].name: [counts.drafted, counts.survived]}
    assert counts.drafts > 0 and counts.drafted >= counts.drafts * (len(options.expansion) + 1 if options.mode == "tree"
                                                                     else options.sequence_depth + 1)
    if accepted:
        assert counts.survived > 0 and result.stats.accepted_per_proposer.get(made[0].name, 0) > 0


# ---------------------------------------------------------------------------------------------
# 3. Sampled output: the target's distribution, and a negative control.

@pytest.fixture(scope="module")
def letters():
    """Target and mirror SSM over two byte-level tokenizers without merges (ids permuted): every
    sequence of characters is its own canonical encoding, so the mirror drafts the target's greedy
    text whatever it sampled."""
    alphabet = sorted(set("".join(CORPUS)))
    target_tok = byte_bpe(len(alphabet), CORPUS)
    mirror_tok, order = permuted(target_tok, seed=5)
    target = tiny_model("llama", vocab_size=len(target_tok), layers=2, seed=31)
    return {"target": target, "target_tok": target_tok, "mirror": mirror(target, order), "mirror_tok": mirror_tok}


def first_two(letters) -> tuple[list[tuple[int, ...]], int, TranslationCounts]:
    drafter = cross(letters, "mirror")
    engine = SpeculativeEngine(TargetModel(letters["target"]), [drafter], letters["target_tok"], eos_ids=())
    prompt = tuple(letters["target_tok"].encode(PROMPT))
    options = SpeculationOptions("tree", (1, 1), policy="schedule")
    results = [engine.generate(GenerationRequest(prompt, 2, replace(TOP5, seed=seed), options))
               for seed in range(SAMPLES)]
    return [r.token_ids for r in results], sum(r.stats.accepted_tokens for r in results), drafter.counts


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_sampled_first_two_tokens_are_target_distributed(letters):
    samples, accepted, counts = first_two(letters)
    result = chi_square(samples, target_first_two(letters["target"], letters["target_tok"].encode(PROMPT), TOP5))
    print(f"\nchi2 cross-vocabulary mirror: p-value {result.pvalue:.4g}, cells {result.cells}; accepted {accepted}, "
          f"{counts}")
    assert result.pvalue > THRESHOLD
    assert accepted > 0.15 * SAMPLES and counts.survived > 0  # drafts through text were really verified


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_biased_verifier_is_rejected_at_the_same_size(letters, monkeypatch):
    """Negative control: a verifier that accepts every first draw (the point mass taken as certain)."""
    monkeypatch.setattr("engine.step.verify_stochastic", accept_first_draws)
    samples, _, _ = first_two(letters)
    result = chi_square(samples, target_first_two(letters["target"], letters["target_tok"].encode(PROMPT), TOP5))
    print(f"\nchi2 NEGATIVE CONTROL cross-vocabulary, first draws accepted: p-value {result.pvalue:.4g}")
    assert result.pvalue < THRESHOLD


def test_a_draft_fits_the_spec_budget(pair):
    drafter = cross(pair, "mirror")
    committed = pair["target_tok"].encode(PROMPT)
    proposal = drafter.draft(drafter.new_state(), committed, DraftSpec((1,) * 6, max_nodes=3))
    assert proposal.tree.size <= 3 and proposal.tree.tokens[0] == committed[-1]


# ---------------------------------------------------------------------------------------------
# 4. Config: refusal without the option, the engine built with it, served through gRPC.

@pytest.fixture(scope="module")
def saved_pair(pair, tmp_path_factory):
    """The target and the random qwen2 SSM with their tokenizers on disk: the config's entries."""
    root = tmp_path_factory.mktemp("cross-vocab")
    for name, model, tokenizer in (("x-target", pair["target"], pair["target_tok"]),
                                   ("x-ssm", pair["ssm"], pair["ssm_tok"])):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


def config_args(root, cross_vocabulary: bool | None = True, **extra) -> dict:
    ssm = {"name": "x-ssm", "source": str(root / "x-ssm")}
    if cross_vocabulary is not None:
        ssm["cross_vocabulary"] = cross_vocabulary
    return {"models_dir": str(root), "dtype": "float32", "torch_threads": 1,
            "target": {"name": "x-target", "source": str(root / "x-target")}, "ssms": [ssm],
            "suffix": {"name": "suffix", "max_cached_requests": 0},
            "speculation": {"mode": "tree", "policy": "schedule", "expansion": [2, 2, 1], "max_tree_nodes": 32},
            **extra}


@pytest.mark.parametrize("cross_vocabulary", [None, False], ids=["unset", "false"])
def test_another_vocabulary_without_the_option_is_refused(saved_pair, cross_vocabulary):
    from cluster.build import build_engine
    from settings.config import EngineConfig

    with pytest.raises(ValueError) as error:
        build_engine(EngineConfig.model_validate(config_args(saved_pair, cross_vocabulary)))
    message = str(error.value)
    assert "'x-ssm'" in message and "'x-target'" in message and "cross_vocabulary: true" in message


def test_only_an_ssm_drafts_through_text(saved_pair):
    from pydantic import ValidationError

    from settings.config import EngineConfig

    args = config_args(saved_pair)
    args["target"]["cross_vocabulary"] = True
    with pytest.raises(ValidationError, match="target.cross_vocabulary"):
        EngineConfig.model_validate(args)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("batched", [False, True], ids=["engine", "batched engine"])
def test_built_engine_drafts_through_text(saved_pair, pair, batched):
    """``cluster.build`` from a config: the cross-family SSM beside the suffix proposer, greedy output
    equal to the target's own, alone and in the batched engine loop (paged target)."""
    from cluster.build import build_engine
    from settings.config import EngineConfig

    engine = build_engine(EngineConfig.model_validate(config_args(saved_pair)), batched=batched)
    assert isinstance(engine.drafters[0], CrossVocabDrafter) and engine.neural == (True, False)
    prompt = pair["target_tok"].encode(PROMPT)
    result = engine.generate(GenerationRequest(tuple(prompt), 16))
    assert list(result.token_ids) == reference_greedy(pair["target"], prompt, 16)
    assert engine.drafters[0].counts.survived > 0


@pytest.mark.ray
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_served_cross_family_pair_through_grpc(serving, saved_pair, pair):  # noqa: F811
    """The cross-family pair served: gRPC output equal to the target's own greedy decoding; the SSM
    actor counts the tokens that survived re-encoding."""
    import ray

    from cluster.serve_client import build_request

    actor = {"num_cpus": 0.25, "torch_threads": 1, "max_concurrency": 4}
    args = config_args(saved_pair, defaults={"max_new_tokens": 16}, verifier={"actor": actor},
                       server={"max_concurrent_requests": 2, "ssm_actor": actor,
                               "merge_actor": {**actor, "num_cpus": 0.1}, "batching": {"kv_cache_tokens": 512},
                               "tree_budget": {"enabled": False}})
    expected = reference_greedy(pair["target"], pair["target_tok"].encode(PROMPT), 16)
    with own_app(serving, args, "specinfer-cross-vocab", "/cross-vocab") as (client, handle, _):
        reply = client.generate(build_request(PROMPT, max_new_tokens=16), timeout=120)
        assert list(reply.token_ids) == expected
        ssm = handle.actors.remote().result()["ssm/x-ssm"]
        counts = ray.get(ssm.translation_counts.remote(), timeout=60)
    print(f"\nserved cross-vocabulary: {counts}, accepted per SSM {dict(reply.stats.accepted_per_ssm)}")
    assert counts.drafts > 0 and counts.survived > 0
    assert dict(reply.stats.drafted_through_text) == {"x-ssm": counts.drafted}  # the request's stats, via gRPC
    assert dict(reply.stats.survived_through_text) == {"x-ssm": counts.survived}

