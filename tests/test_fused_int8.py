"""Fused int8 sibling projections (engine.fused_int8): the same outputs, bit for bit, as the
separate int8 linears, whatever the call order or thread."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from engine.fused_int8 import FusedPart, SharedProduct, fuse_int8_siblings, stack_int8
from tests.tiny_models import tiny_model


def int8_linears(sizes, bias: bool, scale_by=(1.0, 3.0, 0.25), per_channel: bool = False):
    """Dynamic int8 linears 32 -> each size, with differing weight ranges (so their scales differ)."""
    torch.manual_seed(0)
    qconfig = torch.ao.quantization.per_channel_dynamic_qconfig if per_channel else None
    linears = []
    for size, scale in zip(sizes, scale_by):
        linear = torch.nn.Linear(32, size, bias=bias)
        with torch.no_grad():
            linear.weight.mul_(scale)
        wrapped = torch.nn.Sequential(linear)
        spec = {torch.nn.Linear: qconfig} if qconfig else {torch.nn.Linear}
        linears.append(torch.ao.quantization.quantize_dynamic(wrapped, spec, dtype=torch.qint8)[0])
    return linears


@pytest.mark.parametrize("sizes,bias,per_channel", [
    ((48, 8, 8), True, False),  # q/k/v with bias (Qwen2)
    ((48, 8, 8), False, False),  # q/k/v without (Llama)
    ((64, 64), False, False),  # gate/up
    ((16, 40), True, True),  # per-channel weights keep their per-row scales
])
@pytest.mark.parametrize("shape", [(1, 32), (1, 1, 32), (1, 4, 32), (2, 7, 32)])
def test_stacked_product_equals_the_separate_linears(sizes, bias, per_channel, shape):
    linears = int8_linears(sizes, bias, per_channel=per_channel)
    product = SharedProduct(stack_int8(linears), sizes)
    parts = [FusedPart(product, i, "fused") for i in range(len(sizes))]
    x = torch.randn(*shape) * 3
    with torch.inference_mode():
        for part, linear in zip(parts, linears):
            got, want = part(x), linear(x)
            assert got.shape == want.shape == (*shape[:-1], linear.out_features)
            assert torch.equal(got, want)
    assert getattr(product._local, "last", None) is None  # every part took its slice: nothing kept


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 1, 0, 2, 2), (0, 0, 0)])
def test_any_call_order_gives_each_part_its_own_output(order):
    linears = int8_linears((48, 8, 8), True)
    product = SharedProduct(stack_int8(linears), (48, 8, 8))
    x, y = torch.randn(1, 3, 32), torch.randn(1, 3, 32)
    with torch.inference_mode():
        for step, index in enumerate(order):
            inputs = x if step % 2 == 0 else y  # alternating inputs: a stale slice would show
            assert torch.equal(FusedPart(product, index, "fused")(inputs), linears[index](inputs))


def test_threads_do_not_take_each_others_slices():
    """Thread A starts a product, thread B runs a whole one in between, A finishes its own."""
    linears = int8_linears((48, 8, 8), True)
    product = SharedProduct(stack_int8(linears), (48, 8, 8))
    parts = [FusedPart(product, i, "fused") for i in range(3)]
    x, y = torch.randn(1, 2, 32), torch.randn(1, 2, 32)
    seen = {}

    def other_thread():
        with torch.inference_mode():
            seen["b"] = [part(y) for part in parts]

    with torch.inference_mode():
        first = parts[0](x)
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        rest = [parts[1](x), parts[2](x)]
        assert all(torch.equal(got, linear(x)) for got, linear in zip([first] + rest, linears))
        assert all(torch.equal(got, linear(y)) for got, linear in zip(seen["b"], linears))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_fused_int8_model_gives_the_unfused_logits(arch):
    """Prompt and cached one-token steps: the same logits as torch.ao's separate int8 linears."""
    from transformers import DynamicCache

    model = tiny_model(arch, 97, layers=2, seed=4)
    reference = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {torch.nn.Linear}, dtype=torch.qint8)
    fused = torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear}, dtype=torch.qint8)
    assert fuse_int8_siblings(fused) == 4  # q/k/v and gate/up in each of 2 layers
    assert fuse_int8_siblings(fused) == 0  # done once
    assert sum(isinstance(m, FusedPart) for m in fused.modules()) == 10
    copied = copy.deepcopy(fused)  # a copy has products of its own
    with torch.inference_mode():
        caches = [DynamicCache(config=m.config) for m in (reference, fused, copied)]
        ids = torch.tensor([[5, 17, 3, 88, 41, 9]])
        for _ in range(3):
            logits = [m(input_ids=ids, past_key_values=c, use_cache=True).logits
                      for m, c in zip((reference, fused, copied), caches)]
            assert torch.equal(logits[1], logits[0]) and torch.equal(logits[2], logits[0])
            ids = logits[0][:, -1:].argmax(-1)


def test_float_linears_and_mixed_widths_are_left_alone():
    model = tiny_model("qwen2", 97, layers=1)
    assert fuse_int8_siblings(model) == 0  # float linears: nothing to fuse
    block = torch.nn.Module()
    block.q_proj, block.k_proj, block.v_proj = int8_linears((48, 8, 8), True)
    block.v_proj = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(16, 8)),
                                                          {torch.nn.Linear}, dtype=torch.qint8)[0]
    assert fuse_int8_siblings(block) == 0  # different input widths: not siblings of one input
