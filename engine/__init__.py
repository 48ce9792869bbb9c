"""Tree-based speculative inference engine (after SpecInfer, Miao et al., ASPLOS 2024).

Pure torch + transformers + the standard library: no Ray, gRPC or YAML here. The actors
(`actors/`) and the Serve application (`cluster/`) are thin adapters around this package.

A speculative step is four calls: draft -> merge -> verify -> commit. ``loop.EngineLoop`` runs it
for every running request together (one packed forward per SSM tree level, one target pass per
iteration) through an executor (``phases``: the models in this process). Model work is written as
forward programs (``programs``: generators that yield the forwards they need), so the same code
runs one request alone or a whole batch. Under load the loop's ``draft_gate`` lets only as many
requests draft as the measured goodput says pay.

Glossary of dimension letters used in tensor shape comments (``# [N, V]``):

    B  batch dimension of a model input (1: several requests are packed along T instead)
    T  tokens of one packed forward: the new tokens of every request in the batch
    C  KV slots one request's tokens attend to (its committed prefix + its speculative nodes;
       under CUDA graphs, ``engine.graphs``, the whole fixed buffer)
    K  speculative KV entries of one request (its tree nodes written but not yet committed)
    W  slot moves recorded by commits and applied before the next packed forward
    R  rows of a packed forward whose logits are kept
    N  nodes of a token tree, root included (node 0 is the root: the last committed token,
       not yet in the target's KV cache)
    M  draws: one entry per proposed child (several draws can name the same node)
    F  frontier: the tree nodes of one level, drafted in one SSM forward
    P  prefix length: tokens already held in a KV cache
    S  sequence length of a forward's input
    A  accepted path length, root included
    G  nodes of a proposer's own best path, root excluded (prefetch guesses the outcome along it)
    V  vocabulary size
    L  transformer layers
    H  key/value heads (Hq: query heads)
    D  head dimension
"""

__all__ = ["tree", "models", "kv", "draft", "merge", "verify", "sampling", "target", "requests", "step", "generate",
           "kv_pool", "packed", "batcher", "paged_models", "budget", "shape", "text", "offload", "prefetch",
           "timing", "fused_int8", "graphs", "graphed_models", "programs", "loop", "phases", "dtypes",
           "draft_gate"]
