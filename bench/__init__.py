"""The benchmark harness behind `specinfer bench` and `specinfer experiment`, one job per module.

* ``methods``: method spellings (``incremental``, ``sequence:K``, ``tree[a,b]:K1-K2+RULE``, ...) parsed
  against a config's proposers.
* ``workloads``: HumanEval, ShareGPT or JSONL prompts, encoded with the target's tokenizer.
* ``rows``: one generation's figures (``BenchRow``) and the resumable ``rows.jsonl`` store.
* ``runners``: where a method runs: in-process engine, transformers' assisted generation, gRPC.
* ``summary``: per-prompt ratios to ``incremental`` and per-method statistics.
* ``load``: concurrency levels through gRPC (``--concurrency``) and their figures.
* ``report``: ``results.json``, ``results.md`` and the PNG plots.
* ``run``: one benchmark run: its settings, resume checks and the order of work.
* ``experiment``: SSM subsets x schedules x datasets over ``run``.
* ``cli``: the ``bench`` and ``experiment`` sub-commands (``cluster/cli.py`` registers them).

The scripts beside these modules (``headline.py``, ``cost_curve.py``, ``gpu_verify_curve.py``,
``load_plot.py``, ``load_batching.sh``) are run by hand; docs/benchmarking.md says how. One-off
probes are in ``bench/experiments/``; ``benchmarks_md`` writes BENCHMARKS.md from the results.
Layers: ``bench`` imports ``engine``, ``cluster`` and ``settings``; none of them imports ``bench``.
"""
