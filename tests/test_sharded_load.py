"""A tensor-parallel rank reads only its own slices of the checkpoint (``actors.sharded``).

Two gloo processes (no Ray) each load their shard of a tiny target on the meta device plus
safetensors slices, and compare it with what DeepSpeed AutoTP cuts from the fully loaded model in
the same process: every parameter equal, and the bytes read from the checkpoint exactly the bytes
of the rank's shard (so the rank never read, let alone held, the rest). The untied and the tied
(output head saved once, as the embeddings) cases; the checkpoint in bf16, the model in float32.
"""

from __future__ import annotations

import glob
import os
import socket

import pytest
import torch

from tests.tiny_models import tiny_model

pytest.importorskip("deepspeed")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_main(rank: int, world: int, port: int, directory: str, out: str) -> None:
    """One rank: its shard read by slices, the reference cut by AutoTP from the whole model."""
    from actors.common import DEFAULT_EXTENSIONS_DIR
    from actors.rank_group import rank_environment

    os.environ.update(rank_environment(rank, world, on_gpu=False), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCH_EXTENSIONS_DIR=os.path.expanduser(DEFAULT_EXTENSIONS_DIR))
    import deepspeed
    from transformers import AutoModelForCausalLM

    from actors.sharded import load_rank_shard
    from engine.checkpoint import Checkpoint
    from engine.models import ModelSpec

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    shard = load_rank_shard(ModelSpec("tiny", directory, dtype="float32", device="cpu"), world, rank)
    whole = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    reference = deepspeed.init_inference(whole, tensor_parallel={"tp_size": world}, dtype=torch.float32,
                                         replace_with_kernel_inject=False).module
    checkpoint = Checkpoint.open(directory)
    got, want = dict(shard.module.named_parameters()), dict(reference.named_parameters())
    shard_bytes = sum(param.numel() for param in got.values()) * 2  # read in the checkpoint's bf16
    ids = torch.tensor([[5, 17, 3, 42, 8]])
    with torch.no_grad():
        logits = [m(ids).logits for m in (shard.module, reference)]
    torch.save({"names": (sorted(got), sorted(want)),
                "unequal": [n for n in want if n not in got or not torch.equal(got[n], want[n])],
                "shapes": {n: tuple(p.shape) for n, p in got.items()},
                "bytes_read": shard.bytes_read, "shard_bytes": shard_bytes, "elements": shard.elements,
                "checkpoint_bytes": sum(e.dtype.itemsize * torch.Size(e.shape).numel()
                                        for e in checkpoint.entries.values()),
                "logits_equal": torch.equal(logits[0], logits[1]),
                "buffers_equal": all(torch.equal(a, b) for a, b in zip(shard.module.buffers(), reference.buffers()))},
               f"{out}/rank{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("family, tied, hidden", [("qwen2", False, 64), ("qwen2", True, 128), ("gemma2", True, 64)])
def test_each_rank_reads_only_its_shard(tmp_path, family, tied, hidden):
    """hidden 64: AutoTP gives rank 1 none of the output head's 64 input columns (an empty share);
    gemma2: tied embeddings, sliding and full layers, softcaps."""
    import torch.multiprocessing as mp

    from actors.rank_group import remove_shared_memory
    from tests.tiny_models import family_model

    model = tiny_model("qwen2", hidden=hidden) if family == "qwen2" else family_model(family, window=6)
    if tied and family == "qwen2":
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(torch.bfloat16).save_pretrained(tmp_path / "model")
    port = free_port()
    try:
        mp.spawn(rank_main, args=(2, port, str(tmp_path / "model"), str(tmp_path)), nprocs=2)
    finally:
        remove_shared_memory("127.0.0.1", port)
    assert not glob.glob(f"/dev/shm/deepspeed_*_127.0.0.1_{port}_*")
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    for rank, result in enumerate(results):
        assert result["names"][0] == result["names"][1], rank
        assert result["unequal"] == [], rank
        assert result["logits_equal"] and result["buffers_equal"], rank
        assert result["bytes_read"] == result["shard_bytes"] == 2 * result["elements"], rank
        assert result["bytes_read"] < result["checkpoint_bytes"], rank
    # the split layers hold half of their rows (column-parallel) or columns (row-parallel) on each rank
    shapes = results[1]["shapes"]
    up, down = model.model.layers[0].mlp.up_proj.weight.shape, model.model.layers[0].mlp.down_proj.weight.shape
    assert shapes["model.layers.0.mlp.up_proj.weight"] == (up[0] // 2, up[1])  # column-parallel: half the rows
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (down[0], down[1] // 2)  # row-parallel: half the columns


def test_shard_load_bench_on_a_planted_tiny_target(tmp_path):
    """bench/shard_load.py at the tiny shape: the planted target written one tensor at a time loads
    whole and by shard with the planted next token, and each rank read exactly its weights' bytes
    (float32 file, float32 model), less than the whole model's."""
    import json

    from bench import shard_load

    result = shard_load.main(["--shape", "tiny", "--tp", "2", "--dtype", "float32", "--workdir", str(tmp_path),
                              "--out", str(tmp_path / "load.json")])
    assert result["follows_planted_rule"] and result["next_tokens_agree"]
    whole, *ranks = result["processes"]
    assert whole["process"] == "whole" and [r["process"] for r in ranks] == ["rank 0", "rank 1"]
    for rank in ranks:
        assert rank["bytes_read"] == rank["weights_mb"] * 2**20 < whole["weights_mb"] * 2**20
    assert json.loads((tmp_path / "load.json").read_text())["machine"]["recorded"] == "at run time"
