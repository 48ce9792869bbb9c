"""One-off probes: scripts that answered one question once, kept to rerun, not part of the harness.

``int8_paths.py`` (torch.ao's quantize_dynamic against torchao for the int8 SSM),
``fused_int8_ab.py`` (fused q/k/v and gate/up int8 products against separate ones),
``served_overhead.py`` (in-process against served, with a per-hop profile),
``paged_vs_padded.py`` (the paged pool against a padded cache) and ``backfill_machine.py`` (the
machine record added to result files written before ``bench.machine``). Run them from the
repository root as ``python bench/experiments/NAME.py``; their figures are in
docs/benchmark-history.md.
"""
