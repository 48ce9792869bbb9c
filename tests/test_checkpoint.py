"""Reading safetensors by block (``engine.checkpoint``), the direct single-device load, and the
model sources a user has: a local directory, a hub id with revision and $HF_TOKEN (never logged)."""

from __future__ import annotations

import logging
from unittest import mock

import pytest
import torch
from safetensors.torch import save_file

from engine.checkpoint import Block, Checkpoint, NotDirect, checkpoint_names, load_direct, parameters_on_meta, runs
from engine.models import ModelSourceError, ModelSpec, load_model, pretrained_args
from tests.tiny_models import tiny_model

TOKEN = "hf_SECRETsentinel0123456789"


def test_runs_of_a_block():
    assert list(runs((4, 6), Block((0, 3), (4, 3)))) == [(3, 3), (9, 3), (15, 3), (21, 3)]
    assert list(runs((4, 6), Block((1, 0), (2, 6)))) == [(6, 12)]  # whole rows: one run
    assert list(runs((2, 3, 4), Block((0, 1, 0), (2, 2, 4)))) == [(4, 8), (16, 8)]
    assert list(runs((5,), Block((2,), (3,)))) == [(2, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_blocks_read_equal_slices_and_count_their_bytes(tmp_path, dtype):
    full = torch.arange(2 * 6 * 10).reshape(2, 6, 10).to(dtype)
    save_file({"a": full, "b": torch.ones(3)}, tmp_path / "model.safetensors")
    checkpoint = Checkpoint.open(tmp_path)
    assert torch.equal(checkpoint.read("a"), full)
    assert checkpoint.bytes_read == full.numel() * full.element_size()
    before = checkpoint.bytes_read
    block = checkpoint.read("a", Block((1, 2, 3), (1, 3, 4)))
    assert torch.equal(block, full[1:2, 2:5, 3:7])
    assert checkpoint.bytes_read - before == 12 * full.element_size()
    with pytest.raises(ValueError, match="outside"):
        checkpoint.read("a", Block((0, 0, 8), (2, 6, 4)))


def test_an_indexed_checkpoint_is_read_across_its_files(tmp_path):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    checkpoint = Checkpoint.open(tmp_path)
    assert len({entry.path for entry in checkpoint.entries.values()}) > 1
    for name, param in model.named_parameters():
        assert torch.equal(checkpoint.read(name), param.detach()), name


def test_parameters_on_meta_keep_buffers_real():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = tiny_model("qwen2").config
    with parameters_on_meta():
        model = Qwen2ForCausalLM(Qwen2Config(**config.to_dict()))
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert {b.device.type for b in model.buffers()} == {"cpu"}
    assert torch.equal(model.model.rotary_emb.inv_freq, Qwen2ForCausalLM(config).model.rotary_emb.inv_freq)


@pytest.mark.parametrize("tied", [False, True])
def test_direct_load_equals_from_pretrained(tmp_path, tied):
    """A bf16 checkpoint loaded in float32 tensor by tensor: the same parameters, buffers, ties and
    generation config as from_pretrained's."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    model = tiny_model("qwen2")
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.generation_config = GenerationConfig(max_new_tokens=7, eos_token_id=3)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    direct = load_direct(tmp_path, AutoConfig.from_pretrained(tmp_path), torch.float32, torch.device("cpu"))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    got, want = direct.state_dict(), reference.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[name], want[name]) for name in want)
    assert all(torch.equal(a, b) for a, b in zip(direct.buffers(), reference.buffers()))
    assert (direct.lm_head.weight is direct.model.embed_tokens.weight) == tied
    assert direct.generation_config.max_new_tokens == 7 and not direct.training


def test_checkpoint_names_follow_ties_and_name_what_is_missing(tmp_path):
    model = tiny_model("llama")
    model.lm_head.weight = model.model.embed_tokens.weight
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, tmp_path / "model.safetensors")
    names = checkpoint_names(model, Checkpoint.open(tmp_path))
    assert names["lm_head.weight"] == "model.embed_tokens.weight"
    save_file({"model.norm.weight": torch.ones(64)}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="no tensor for"):
        checkpoint_names(model, Checkpoint.open(tmp_path))


def test_load_model_reads_a_local_directory_directly(tmp_path):
    """No from_pretrained for a local safetensors model; a directory without one falls back to it."""
    from transformers import AutoConfig

    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    with mock.patch("transformers.AutoModelForCausalLM.from_pretrained", side_effect=AssertionError), \
            mock.patch("transformers.AutoTokenizer.from_pretrained", return_value="tokenizer"):
        loaded = load_model(ModelSpec("tiny", str(tmp_path), dtype="float32", device="cpu"))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(loaded.model(ids).logits, model(ids).logits)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(NotDirect):
        load_direct(tmp_path, AutoConfig.from_pretrained(tmp_path), torch.float32, torch.device("cpu"))


def hub_mocks(error: Exception | None = None):
    """from_pretrained of config, model and tokenizer mocked (no network): a tiny llama config."""
    config = tiny_model("llama").config
    model = mock.MagicMock()
    model.to.return_value = model
    return (mock.patch("transformers.AutoConfig.from_pretrained", return_value=config),
            mock.patch("transformers.AutoModelForCausalLM.from_pretrained", return_value=model,
                       side_effect=error),
            mock.patch("transformers.AutoTokenizer.from_pretrained", return_value="tokenizer"))


def test_a_hub_id_gets_its_revision_token_and_safetensors(monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    spec = ModelSpec("remote", "org/model", dtype="bfloat16", revision="abc123", device="cpu")
    config_mock, model_mock, tokenizer_mock = hub_mocks()
    with caplog.at_level(logging.DEBUG), config_mock as config, model_mock as model, tokenizer_mock as tokenizer:
        load_model(spec)
    for call in (config, model, tokenizer):
        assert call.call_args.args == ("org/model",)
        assert call.call_args.kwargs["revision"] == "abc123" and call.call_args.kwargs["token"] == TOKEN
    assert model.call_args.kwargs["use_safetensors"] is True
    assert TOKEN not in caplog.text and TOKEN not in repr(spec)


def test_a_local_directory_gets_no_token(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    source, kwargs = pretrained_args(ModelSpec("local", str(tmp_path)))
    assert source == str(tmp_path) and "token" not in kwargs
    monkeypatch.delenv("HF_TOKEN")
    assert "token" not in pretrained_args(ModelSpec("remote", "org/model"))[1]


def test_a_hub_error_names_the_model_and_never_the_token(monkeypatch, caplog):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    spec = ModelSpec("remote", "org/model", revision="v2", device="cpu")
    config_mock, model_mock, tokenizer_mock = hub_mocks(OSError(f"401 for org/model with token {TOKEN}"))
    with caplog.at_level(logging.DEBUG), config_mock, model_mock, tokenizer_mock:
        with pytest.raises(ModelSourceError) as error:
            load_model(spec)
    assert "'remote'" in str(error.value) and "org/model at revision v2" in str(error.value)
    assert TOKEN not in str(error.value) and TOKEN not in repr(error.value) and error.value.__cause__ is None
    assert TOKEN not in caplog.text


def test_a_hub_id_is_downloaded_for_loading_by_shard(monkeypatch, tmp_path):
    """A tensor-parallel rank fetches the hub snapshot (safetensors and configs) at the revision."""
    from actors.sharded import local_checkpoint

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with mock.patch("huggingface_hub.snapshot_download", return_value=str(tmp_path)) as download:
        assert local_checkpoint(ModelSpec("remote", "org/model", revision="abc123")) == tmp_path
    kwargs = download.call_args.kwargs
    assert (kwargs["repo_id"], kwargs["revision"], kwargs["token"]) == ("org/model", "abc123", TOKEN)
    assert "*.safetensors" in kwargs["allow_patterns"] and not any("bin" in p for p in kwargs["allow_patterns"])
    assert local_checkpoint(ModelSpec("local", str(tmp_path))) == tmp_path


def test_row_chunks_cover_a_piece_in_bounded_reads(tmp_path):
    """A piece read in chunks (float32 model, bf16 checkpoint) lands where the whole piece would."""
    from engine.checkpoint import Piece, fill_parameters, row_chunks

    piece = Piece(Block((2, 0), (10, 4)), 8, (4, 1))
    chunks = list(row_chunks(piece, 4, limit=64))
    assert [(c.block.starts, c.block.sizes, c.offset) for c in chunks] == [
        ((2, 0), (4, 4), 8), ((6, 0), (4, 4), 24), ((10, 0), (2, 4), 40)]
    full = torch.randn(12, 4).to(torch.bfloat16)
    save_file({"w": full}, tmp_path / "model.safetensors")
    layer = torch.nn.Linear(4, 12, bias=False)
    with mock.patch("engine.checkpoint.READ_CHUNK_BYTES", 16):
        fill_parameters(layer, Checkpoint.open(tmp_path), {"weight": "w"})
    assert torch.equal(layer.weight, full.float())


@pytest.mark.parametrize("dtype, expected", [("bfloat16", "specinfer_paged"), ("float32", "sdpa")])
def test_a_reduced_precision_cpu_model_attends_through_the_engines_attention(tmp_path, dtype, expected):
    """On a CPU in bf16 a model's DynamicCache passes go through ``engine.packed``'s attention (its
    few-query passes as matmuls, SDPA's reduced-precision kernel being slow there); float32 keeps
    SDPA. Both give the same decode step, to bf16's precision."""
    tiny_model("llama").save_pretrained(tmp_path)
    with mock.patch("transformers.AutoTokenizer.from_pretrained", return_value="tokenizer"):
        model = load_model(ModelSpec("tiny", str(tmp_path), dtype=dtype, device="cpu")).model
    assert model.config._attn_implementation == expected

    def decode_step() -> torch.Tensor:  # -> [1, 1, V]: one query over a 5-token cache
        with torch.no_grad():
            cache = model(torch.tensor([[1, 2, 3, 4, 5]]), use_cache=True).past_key_values
            return model(torch.tensor([[6]]), past_key_values=cache).logits.float()

    ours = decode_step()
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, decode_step(), rtol=0.02, atol=0.02 * ours.abs().max().item())
