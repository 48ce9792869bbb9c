"""Incremental detokenization with stop strings, safe for streaming."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TextStream:
    """Turns a growing list of token ids into text chunks.

    A chunk never ends inside a UTF-8 character (the tokenizer's replacement character at the
    end is held back) and never shows a partial match of a stop string that may later be cut.
    Once a stop string appears, the text is cut before it and ``stopped`` is set.
    """

    tokenizer: object
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the final text already handed out
    stopped: bool = False
    text: str = ""

    def push(self, new_ids: list[int]) -> str:
        """Add ids; return the new text that is safe to show now."""
        self.token_ids.extend(new_ids)
        self.text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._stop_position(self.text)
        if cut is not None:
            self.text, self.stopped = self.text[:cut], True
            return self._emit(len(self.text))
        safe = len(self.text.rstrip("\ufffd")) if self.text.endswith("\ufffd") else len(self.text)
        return self._emit(safe - self._held_back(self.text[:safe]))

    def finish(self) -> str:
        """The rest of the text at the end of generation."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        end = max(end, self.emitted)
        chunk, self.emitted = self.text[self.emitted : end], end
        return chunk

    def _stop_position(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.stop if s and s in text]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string.

        Example: stop ("END",), text "abcEN" -> 2.
        """
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    longest = max(longest, k)
                    break
        return longest

    def tokens_for_text(self) -> list[int]:
        """The shortest prefix of token_ids whose decoded text covers the (possibly cut) text."""
        if not self.stopped:
            return list(self.token_ids)
        for n in range(1, len(self.token_ids) + 1):
            if len(self.tokenizer.decode(self.token_ids[:n], skip_special_tokens=True)) >= len(self.text):
                return self.token_ids[:n]
        return list(self.token_ids)
