"""The text of one choice: incremental detokenisation and stop strings (held back while they could still match)."""

from __future__ import annotations

from tokenizers import Tokenizer


class IncrementalDetokenizer:
    """Token ids -> text deltas whose concatenation equals decoding all ids at once: decodes a short window
    (prefix/read offsets, as text-generation-inference does) and holds back incomplete UTF-8."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, tid: int) -> str:
        self.ids.append(tid)
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self.tok.decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        new_text = self.tok.decode(self.ids[self.prefix:], skip_special_tokens=True)
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text):]


class ChoiceText:
    """Text of one choice: detokenises, applies stop strings, and holds back what could still become one."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], skip_ids: frozenset[int]):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.skip_ids = skip_ids
        self.text = ""
        self.sent = 0
        self.token_ids: list[int] = []
        self.sent_ids = 0
        self.finish: str | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def _check_stop(self, new_len: int) -> bool:
        start = max(0, len(self.text) - new_len - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.finish = "stop"
            return True
        return False

    def feed(self, ids: list[int], finish: str | None) -> bool:
        """Add engine tokens; True when this choice has just ended because of a stop string."""
        if self.finish is not None:
            return False
        for t in ids:
            self.token_ids.append(t)
            if t in self.skip_ids:
                continue
            delta = self.detok.push(t)
            if delta:
                self.text += delta
                if self.stop and self._check_stop(len(delta)):
                    return True
        if finish is not None:
            tail = self.detok.flush()
            if tail:
                self.text += tail
                if self.stop and self._check_stop(len(tail)):
                    return True
            self.finish = finish
        return False

    def take(self) -> tuple[str, list[int]]:
        """The text (and token ids) not sent yet that can be sent now."""
        limit = len(self.text) if self.finish is not None else max(self.sent, len(self.text) - self.hold)
        delta = self.text[self.sent:limit]
        self.sent = limit
        ids = self.token_ids[self.sent_ids:]
        self.sent_ids = len(self.token_ids)
        return delta, ids
