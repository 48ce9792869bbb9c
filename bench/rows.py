"""One generation's figures (``BenchRow``) and ``rows.jsonl``, the store a rerun resumes from."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Sequence

from .workloads import EncodedPrompt

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchRow:
    """One generation. ``ms_per_token``: wall time (prefill included) / new tokens; through gRPC it is
    the client's end-to-end time and ``server_ms_per_token`` the server's own figure."""

    prompt_id: str
    method: str
    prompt_tokens: int
    token_ids: tuple[int, ...]
    finish_reason: str | None
    new_tokens: int
    target_steps: int | None  # target forwards, prefill included
    tokens_per_step: float | None
    ms_per_token: float
    latency_ms: float
    draft_ms: float | None = None
    verify_ms: float | None = None
    draft_tokens: int | None = None
    accepted_per_proposer: dict[str, int] | None = None
    accepted_per_depth: tuple[int, ...] | None = None
    server_ms_per_token: float | None = None
    hop_ms: dict[str, float] | None = None  # the steps' wall time by hop (engine.requests.HOPS); None: older rows

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "BenchRow":
        values = {f.name: data.get(f.name) for f in fields(cls)}
        values["token_ids"] = tuple(values["token_ids"] or ())
        if values["accepted_per_depth"] is not None:
            values["accepted_per_depth"] = tuple(values["accepted_per_depth"])
        return cls(**values)


def row_from_stats(prompt: EncodedPrompt, method: str, token_ids: Sequence[int], finish_reason: str | None,
                   stats: dict, latency_ms: float, remote: bool = False) -> BenchRow:
    """A row from an engine stats dict (GenerationStats.to_dict() or the gRPC stats)."""
    new_tokens = len(token_ids)
    return BenchRow(
        prompt_id=prompt.id, method=method, prompt_tokens=len(prompt.ids), token_ids=tuple(token_ids),
        finish_reason=finish_reason, new_tokens=new_tokens, target_steps=int(stats["target_steps"]),
        tokens_per_step=float(stats["tokens_per_step"]),
        ms_per_token=latency_ms / max(new_tokens, 1) if remote else float(stats["ms_per_token"]),
        latency_ms=latency_ms, draft_ms=float(stats["draft_ms"]), verify_ms=float(stats["verify_ms"]),
        draft_tokens=int(stats["draft_tokens"]), accepted_per_proposer=dict(stats["accepted_per_proposer"]),
        accepted_per_depth=tuple(int(x) for x in stats["accepted_per_depth"]),
        server_ms_per_token=float(stats["ms_per_token"]) if remote else None,
        hop_ms={hop: float(ms) for hop, ms in stats["hop_ms"].items()})


def append_json_line(path: Path, data: dict, sync: bool = False) -> None:
    """Append one JSON object as a line; ``sync``: fsync before returning (a kill loses no row)."""
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(data) + "\n")
        if sync:
            handle.flush()
            os.fsync(handle.fileno())


class RowStore:
    """``rows.jsonl``: one JSON row per line, appended and fsynced one at a time, keyed by
    (prompt id, method spelling).

    A cut-off last line (a run killed mid-write) is dropped and the file rewritten without it.
    """

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[tuple[str, str], BenchRow] = {}
        for row in self._load():
            self.rows[(row.prompt_id, row.method)] = row

    def _load(self) -> list[BenchRow]:
        if not self.path.exists():
            return []
        text = self.path.read_text(encoding="utf-8")
        lines = [line for line in text.splitlines() if line.strip()]
        rows = []
        for number, line in enumerate(lines, start=1):
            try:
                rows.append(BenchRow.from_json(json.loads(line)))
            except (json.JSONDecodeError, TypeError, KeyError) as error:
                if number < len(lines):
                    raise ValueError(f"{self.path}:{number}: corrupt row ({error}); remove the line") from None
                logger.warning("%s: dropping a cut-off last row", self.path)
        if text and (not text.endswith("\n") or len(rows) < len(lines)):
            self.path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in rows), encoding="utf-8")
        return rows

    def __contains__(self, key: tuple[str, str]) -> bool:
        return key in self.rows

    def append(self, row: BenchRow) -> None:
        append_json_line(self.path, row.to_json(), sync=True)
        self.rows[(row.prompt_id, row.method)] = row
