"""The ``--methods`` defaults and spellings, apart from their parsing (``bench.methods``), so that
building the command line's parser imports no engine (torch, transformers)."""

from __future__ import annotations

BASELINE = "incremental"  # what every method is measured against
GREEDY_METHODS = ("incremental", "sequence:4", "tree", "ensemble", "hf-assisted")
SAMPLED_METHODS = ("incremental", "sequence:4", "tree+top_k", "tree+sampled", "tree+sampled_without_replacement",
                   "hf-assisted")
SPELLINGS = ("incremental, sequence[:K], tree[:K1-K2-...], ensemble[:K1-K2-...], tree[ssm,...][:K1-...], "
             "a +top_k / +sampled / +sampled_without_replacement suffix on tree and ensemble, hf-assisted")
