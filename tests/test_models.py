"""Model loading checks: the architecture allow-list, one shared vocabulary, the CLI on a real model."""

from __future__ import annotations

import copy
import gc
import json
import mmap

import pytest
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from cluster.cli import main
import torch

from engine.models import (ONEDNN_MIN_WEIGHTS, LoadedModel, ModelSpec, OneDNNLinear, PackedOneDNNLinear,
                           check_architecture, check_same_vocabulary, checkpoint_mappings, cpu_has_bf16,
                           drop_mapped_pages, onednn_linears, quantize_int8, use_onednn)
from tests.tiny_models import tiny_model


ARCHITECTURES = [  # (config, the words of its error, or None: accepted); every family: tests/test_architectures.py
    (LlamaConfig(), None),
    (Qwen2Config(), None),
    (MistralConfig(sliding_window=4096), None),
    (GPT2Config(), "gpt2.*no test covers it"),
    (Qwen2Config(use_sliding_window=True, sliding_window=128, max_window_layers=1, num_hidden_layers=2), None),
]


@pytest.mark.parametrize("config,message", ARCHITECTURES)
def test_the_architecture_allow_list_accepts_full_attention_and_names_the_rest(config, message):
    if message is None:
        assert check_architecture(config, "my-model") is None
        return
    with pytest.raises(ValueError, match=f"'my-model'.*{message}"):
        check_architecture(config, "my-model")


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def loaded(name, vocab_size, vocab):
    return LoadedModel(ModelSpec(name, f"/models/{name}"), tiny_model("llama", vocab_size, layers=1), FakeTokenizer(vocab))


@pytest.mark.parametrize("other_size,other_vocab", [(97, {"a": 0, "b": 2}), (98, {"a": 0, "b": 1})])
def test_vocabulary_mismatch_names_both_models(other_size, other_vocab):
    target = loaded("big-target", 97, {"a": 0, "b": 1})
    with pytest.raises(ValueError, match="small-ssm.*big-target"):
        check_same_vocabulary(target, loaded("small-ssm", other_size, other_vocab))
    check_same_vocabulary(target, loaded("twin", 97, {"a": 0, "b": 1}))


def test_cli_generate_json_matches_incremental(smollm2_dir, capsys):
    outputs = {}
    for mode in ("incremental", "tree", "sequence"):
        code = main(["generate", "--config", "configs/smollm2-fp32.yaml", "--prompt", "def add(a, b):",
                     "--max-new-tokens", "16", "--mode", mode, "--json"])
        assert code == 0
        outputs[mode] = json.loads(capsys.readouterr().out)
    for mode, out in outputs.items():
        assert out["token_ids"] == outputs["incremental"]["token_ids"], mode
        assert out["mode"] == mode and out["new_tokens"] == len(out["token_ids"])
        assert {"text", "target_steps", "tokens_per_step", "ms_per_token"} <= set(out)
    assert outputs["incremental"]["tokens_per_step"] == 1.0
    assert outputs["tree"]["target_steps"] <= outputs["incremental"]["target_steps"]


def test_cli_reports_config_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: {name: t, source: t}\nspeculation: {expansion: [0]}\n")
    assert main(["generate", "--config", str(bad), "--prompt", "x"]) == 2
    assert "expansion" in capsys.readouterr().err


@pytest.mark.parametrize("tied", [False, True])
def test_int8_keeps_bf16_embeddings_and_the_same_logits(tied):
    """quantize_int8 of a bf16 model keeps its input embeddings in bf16 (widened per lookup, which
    is exact), so its logits equal those of the same int8 model with a float32 table."""
    import copy

    import torch

    from engine.models import quantize_int8
    from tests.tiny_models import tiny_model

    model = tiny_model("llama", 97, layers=2, seed=3)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(torch.bfloat16)
    reference = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).float(), {torch.nn.Linear},
                                                       dtype=torch.qint8)
    quantized = quantize_int8(model)
    assert quantized.get_input_embeddings().weight.dtype == torch.bfloat16
    ids = torch.tensor([[5, 17, 3, 88, 41]])
    with torch.inference_mode():
        assert torch.equal(quantized(ids).logits, reference(ids).logits)


def int8_pair_engine(paged: bool, float_table: bool):
    """A bf16 target with an int8 SSM quantized from bf16 (the default pair's dtypes), or, with
    ``float_table``, the same SSM quantized the library's way (every float weight float32)."""
    import torch

    from engine.draft import ModelDrafter
    from engine.generate import SpeculativeEngine
    from engine.models import quantize_int8
    from engine.paged_models import PagedDrafter, PagedTarget, paged_parts
    from engine.target import TargetModel
    from tests.tiny_models import IdTokenizer

    target = tiny_model("llama", 97, layers=2, seed=0).to(torch.bfloat16)
    ssm = tiny_model("llama", 97, layers=1, seed=1).to(torch.bfloat16)
    if float_table:
        ssm = torch.ao.quantization.quantize_dynamic(ssm.float(), {torch.nn.Linear}, dtype=torch.qint8)
    else:
        ssm = quantize_int8(ssm)
    if not paged:
        return SpeculativeEngine(TargetModel(target), [ModelDrafter(ssm, 0, "ssm")], IdTokenizer(), [], 1024)
    target_pool, target_batcher = paged_parts(target, 1024)
    ssm_pool, ssm_batcher = paged_parts(ssm, 1024)
    return SpeculativeEngine(PagedTarget(target, target_pool, target_batcher),
                             [PagedDrafter(ssm, 0, "ssm", ssm_pool, ssm_batcher)], IdTokenizer(), [], 1024)


@pytest.mark.parametrize("paged", [False, True])
def test_int8_ssm_with_a_bf16_table_drafts_as_with_a_float32_table(paged):
    """The SSM's masks and KV entries follow its float32 compute, not its bf16 embedding table
    (``model.dtype``): a bf16 target with such an SSM generates, in-process and paged, exactly what
    it generates with the same SSM holding a float32 table (same tokens, same accepted drafts)."""
    from engine.requests import GenerationRequest, SpeculationOptions

    request = GenerationRequest(tuple(range(50, 65)), 24, speculation=SpeculationOptions(expansion=(4, 2, 1)))
    got, want = (int8_pair_engine(paged, table).generate(request) for table in (False, True))
    assert got.token_ids == want.token_ids
    assert (got.stats.accepted_per_depth, got.stats.tree_sizes) == (want.stats.accepted_per_depth, want.stats.tree_sizes)
    assert got.stats.accepted_tokens > 0  # the drafts were used, so the comparison covers them


@pytest.mark.parametrize("dtype,quantized,expected", [
    ("bfloat16", False, "bfloat16"), ("float32", False, "float32"), ("bfloat16", True, "float32"),
])
def test_activation_dtype_and_kv_pool_follow_the_compute(dtype, quantized, expected):
    """``kv.activation_dtype`` (masks, KV pools) is the compute dtype; for int8 quantized from bf16
    that is float32, though ``model.dtype`` reads the bf16 embedding table."""
    import torch

    from engine.kv import activation_dtype
    from engine.kv_pool import KVStorage
    from engine.models import quantize_int8

    model = tiny_model("llama", 97, layers=1, seed=1).to(getattr(torch, dtype))
    if quantized:
        model = quantize_int8(model)
    assert activation_dtype(model) == getattr(torch, expected)
    assert KVStorage.for_model(model, slots=4).keys[0].dtype == getattr(torch, expected)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("shape,bias", [((1, 32), True), ((3, 32), False), ((1, 1, 32), True), ((1, 8, 32), True),
                                        ((2, 5, 32), False), ((1, 40, 32), True)])
def test_onednn_linear_computes_the_same_product(shape, bias, packed):
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48, bias=bias)
    x = torch.randn(*shape)
    expected = linear(x)
    use_onednn(linear, packed)
    assert isinstance(linear, OneDNNLinear) and linear.weight.is_mkldnn == packed
    got = linear(x)
    assert got.shape == expected.shape == (*shape[:-1], 48)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype,quantized,min_weights,switched", [
    (torch.float32, False, 0, 15),  # 2 layers x 7 projections + lm_head
    (torch.float32, False, 64 * 64, 11),  # k_proj and v_proj (64 -> 32) stay with torch
    (torch.float32, False, ONEDNN_MIN_WEIGHTS, 0),  # the default bound: a tiny model keeps torch's path everywhere
    (torch.bfloat16, False, 0, "native"),  # packed only, where the CPU multiplies bf16 natively
    (torch.float32, True, 0, 0),  # int8 dynamic linears are not nn.Linear: they keep fbgemm
])
def test_onednn_linears_switches_large_float32_and_packed_native_bf16_linears(dtype, quantized, min_weights, switched, packed):
    if switched == "native":  # plain bf16 weights: torch's own path is oneDNN's already, nothing to switch
        switched = 15 if packed and cpu_has_bf16() else 0
    model = tiny_model("qwen2", 64, layers=2).to(dtype)
    if quantized:
        model = quantize_int8(model)
    state = copy.deepcopy(model.state_dict())  # a copy: the plain path's state dict shares the weights
    ids = torch.tensor([[3, 17, 5, 9]])
    with torch.inference_mode():
        before = model(ids).logits
        assert onednn_linears(model, min_weights, packed) == switched
        after = model(ids).logits
    kinds = [type(m) for m in model.modules()]
    assert kinds.count(PackedOneDNNLinear if packed else OneDNNLinear) == switched
    assert kinds.count(OneDNNLinear if packed else PackedOneDNNLinear) == 0
    assert list(model.state_dict()) == list(state)  # and the same weights: a packed one reads back exactly
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items()
               if isinstance(value, torch.Tensor))  # an int8 model's state dict holds dtypes too
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # bf16: each product rounds its sums apart
    torch.testing.assert_close(after, before, rtol=tolerance, atol=tolerance)


def test_bf16_linears_stay_plain_where_the_cpu_emulates_bf16(monkeypatch):
    """Without native bf16 (AVX512-BF16 or AMX) bf16 products are emulated: packing is not tried."""
    import engine.models as models

    monkeypatch.setattr(models, "cpu_has_bf16", lambda: False)
    model = tiny_model("qwen2", 64, layers=2).to(torch.bfloat16)
    assert onednn_linears(model, 0, packed=True) == 0
    assert not any(isinstance(m, OneDNNLinear) for m in model.modules())


def test_a_dtype_onednn_cannot_compute_keeps_torchs_path_alone(monkeypatch):
    """The probe is per dtype: where oneDNN fails on bf16 weights, the float32 ones still switch."""
    import engine.models as models

    monkeypatch.setattr(models, "cpu_has_bf16", lambda: True)
    monkeypatch.setattr(models, "_onednn_runs", lambda linear, packed: linear.weight.dtype == torch.float32)
    model = tiny_model("qwen2", 64, layers=2)
    model.model.layers[1].to(torch.bfloat16)  # 7 projections in bf16; 7 + lm_head stay float32
    assert onednn_linears(model, 0, packed=True) == 8
    assert type(model.model.layers[1].mlp.up_proj) is torch.nn.Linear
    assert type(model.model.layers[0].mlp.up_proj) is PackedOneDNNLinear


def test_packing_releases_the_checkpoint_mapping(tmp_path):
    """A model reads its weights from the mapped safetensors file; once packing copied the large
    ones, the rest are copied too and the mapping goes (else its pages stay in the RSS)."""
    from transformers import AutoModelForCausalLM

    tiny_model("qwen2", 64, layers=2).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    checkpoint = str(tmp_path / "model.safetensors")
    mapped = lambda: any(line.rstrip().endswith(checkpoint) for line in open("/proc/self/maps"))  # noqa: E731
    ids = torch.tensor([[3, 17, 5, 9]])
    with torch.inference_mode():
        before = model(ids).logits
    assert mapped()
    assert onednn_linears(model, 0, packed=True) == 15
    gc.collect()
    assert not mapped()
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-4)


def mapped_rss(path: str) -> int:
    """Bytes of ``path``'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if "-" in line.split(" ", 1)[0]:  # a mapping's header line
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_a_copied_weights_checkpoint_pages_leave_the_rss(tmp_path):
    """Packing drops the checkpoint pages each weight was read from (the loading peak): exactly the
    whole pages inside the weight leave the RSS, and the weight still reads the same values; a
    tensor outside the checkpoint's map is left alone."""
    from transformers import AutoModelForCausalLM

    tiny_model("qwen2", 64, layers=2).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    checkpoint, mappings = str(tmp_path / "model.safetensors"), checkpoint_mappings()
    weight = model.model.layers[0].mlp.up_proj.weight.detach()
    copied = weight.clone()  # reads every page of the weight
    start = weight.data_ptr()
    end = start + weight.numel() * weight.element_size()
    whole = end // mmap.PAGESIZE * mmap.PAGESIZE - -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    assert whole >= mmap.PAGESIZE
    resident = mapped_rss(checkpoint)
    assert drop_mapped_pages(weight, mappings) == whole
    assert resident - mapped_rss(checkpoint) == whole
    assert torch.equal(weight, copied)  # read back from the file
    assert drop_mapped_pages(copied, mappings) == 0


def test_packed_linears_load_a_state_dict_and_leave_tied_weights_plain():
    """A packed model takes another model's state dict (packing it again); a weight the embeddings
    share (tied lm_head) stays plain, so the embedding lookup still reads it."""
    model, other = tiny_model("qwen2", 64, layers=2, seed=1), tiny_model("qwen2", 64, layers=2, seed=2)
    assert onednn_linears(model, 0, packed=True) == 15
    model.load_state_dict(other.state_dict())
    ids = torch.tensor([[3, 17, 5, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, other(ids).logits, rtol=1e-4, atol=1e-4)
    assert model.model.layers[0].mlp.up_proj.weight.is_mkldnn
    tied = tiny_model("qwen2", 64, layers=2, seed=1)
    tied.lm_head.weight = tied.model.embed_tokens.weight
    assert onednn_linears(tied, 0, packed=True) == 15
    assert type(tied.lm_head) is OneDNNLinear and tied.lm_head.weight is tied.model.embed_tokens.weight
    assert type(tied.model.layers[0].mlp.up_proj) is PackedOneDNNLinear

