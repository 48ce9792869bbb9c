"""Decoding methods: the ``--methods`` spellings parsed against a config's proposers.

Spellings (comma-separated on the command line):

* ``incremental``: plain decoding by the target (the baseline every ratio is taken against).
* ``sequence`` / ``sequence:K``: one chain of depth K (default: the config's ``sequence_depth``)
  from the first neural SSM: classical speculative decoding.
* ``tree`` / ``tree:K1-K2-...``: a token tree from the **first neural SSM only**, shaped by the
  config's policy (cost-aware by default, else its expansion schedule), or by the schedule given.
* ``ensemble`` / ``ensemble:K1-K2-...``: a tree from **every** configured proposer (all SSMs and the
  suffix proposer), merged: what ``specinfer generate --mode tree`` does.
* ``tree[a,b]`` / ``tree[a,b]:K1-...``: a tree from the named proposers only (``specinfer experiment``
  spells its runs this way); ``sequence[a]:K`` picks the chain's SSM.
* a ``+RULE`` suffix on tree / ensemble spellings picks the child rule when sampling
  (``--temperature > 0``): ``tree+top_k``, ``tree+sampled``, ``tree+sampled_without_replacement``.
  Greedy requests always take top-k children, so the suffix changes nothing there.
* ``hf-assisted``: transformers ``generate(assistant_model=<first neural SSM>)`` with its default
  assistant settings (the peer a CPU user would pick); target forwards are counted with a hook.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Sequence

from cluster.build import speculation_options
from engine.draft import CHILDREN_RULES
from engine.requests import SpeculationOptions
from settings.config import EngineConfig

from .method_names import BASELINE, GREEDY_METHODS, SAMPLED_METHODS, SPELLINGS  # noqa: F401 (re-exported)

PEER = "hf-assisted"  # transformers' assisted generation: the per-prompt ratios' second reference


@dataclass(frozen=True)
class Proposers:
    """The proposers a config declares, in engine order (neural SSMs first, then suffix)."""

    names: tuple[str, ...]
    neural: tuple[bool, ...]

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Proposers":
        return cls(tuple(config.proposer_names()), tuple(config.proposer_neural()))

    def first_neural(self, spelling: str) -> str:
        for name, neural in zip(self.names, self.neural):
            if neural:
                return name
        raise ValueError(f"method {spelling!r} needs a neural SSM, and the config has none")

    def pick(self, listed: str | None, spelling: str) -> tuple[str, ...] | None:
        """Names from a ``[a,b]`` list (None when absent); unknown names raise ValueError."""
        if listed is None:
            return None
        names = tuple(n.strip() for n in listed.split(",") if n.strip())
        unknown = sorted(set(names) - set(self.names))
        if not names or unknown:
            raise ValueError(f"method {spelling!r}: unknown or no proposer names {unknown}; known: {list(self.names)}")
        return names


@dataclass(frozen=True)
class Method:
    """A decoding method: engine options, or transformers' assisted generation with one SSM."""

    spelling: str
    kind: str  # "engine" | "hf-assisted"
    options: SpeculationOptions | None = None
    assistant: str | None = None

    def proposers(self, names: Sequence[str]) -> list[str]:
        """The proposers this method drafts with, of a config's ``names`` (sequence: the first it lists)."""
        if self.kind == "hf-assisted":
            return [self.assistant]
        if self.options.mode == "incremental":
            return []
        listed = list(self.options.proposers) if self.options.proposers is not None else list(names)
        return listed[:1] if self.options.mode == "sequence" else listed


_TREE = re.compile(r"(?P<kind>tree|ensemble)(?:\[(?P<names>[^\]]*)\])?(?::(?P<schedule>\d+(?:-\d+)*))?"
                   r"(?:\+(?P<rule>\w+))?")
_SEQUENCE = re.compile(r"sequence(?:\[(?P<names>[^\]]*)\])?(?::(?P<depth>\d+))?")


def parse_method(spelling: str, proposers: Proposers, base: SpeculationOptions) -> Method:
    """One method spelling (see the module docstring); ValueError names the accepted spellings."""
    if spelling == "incremental":
        return Method(spelling, "engine", replace(base, mode="incremental", proposers=None))
    if spelling == "hf-assisted":
        return Method(spelling, "hf-assisted", assistant=proposers.first_neural(spelling))
    if match := _SEQUENCE.fullmatch(spelling):
        names = proposers.pick(match["names"], spelling) or (proposers.first_neural(spelling),)
        depth = int(match["depth"]) if match["depth"] else base.sequence_depth
        if depth < 1:
            raise ValueError(f"method {spelling!r}: the depth must be >= 1")
        return Method(spelling, "engine", replace(base, mode="sequence", sequence_depth=depth, proposers=names))
    if match := _TREE.fullmatch(spelling):
        names = proposers.pick(match["names"], spelling)
        if names is None and match["kind"] == "tree":
            names = (proposers.first_neural(spelling),)
        schedule = tuple(int(k) for k in match["schedule"].split("-")) if match["schedule"] else base.expansion
        rule = match["rule"] or base.children
        if rule not in CHILDREN_RULES or any(k < 1 for k in schedule):
            raise ValueError(f"method {spelling!r}: widths must be >= 1 and the rule one of {CHILDREN_RULES}")
        policy = "schedule" if match["schedule"] else base.policy  # a schedule given is followed as given
        options = replace(base, mode="tree", expansion=schedule, children=rule, proposers=names, policy=policy)
        return Method(spelling, "engine", options)
    raise ValueError(f"unknown method {spelling!r}; spellings: {SPELLINGS}")


def resolve_methods(spellings: Sequence[str], config: EngineConfig, via: str | None = None) -> list[Method]:
    """Parse every spelling against the config; the baseline always runs (it is added first)."""
    spellings = [s.strip() for s in spellings if s.strip()]
    if BASELINE not in spellings:
        spellings.insert(0, BASELINE)
    if len(set(spellings)) != len(spellings):
        raise ValueError(f"methods listed twice: {spellings}")
    methods = [parse_method(s, Proposers.from_config(config), speculation_options(config)) for s in spellings]
    if via and any(m.kind == "hf-assisted" for m in methods):
        raise ValueError("hf-assisted runs in-process only: drop it from --methods when using --via grpc")
    return methods
