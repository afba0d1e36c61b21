"""Incremental detokenization with stop strings.

Tokens do not map to whole characters (byte-level BPE splits UTF-8 sequences), and a stop string may
arrive split across tokens. So the stream decodes all generated ids each time, emits only text that
is final: not ending in an incomplete character, and not a possible beginning of a stop string.
"""

from __future__ import annotations

from llmopt.model.tokenizer import TokenizerInfo


class TextStream:
    def __init__(self, tokenizer: TokenizerInfo, stop: list[str] | tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # the generated text so far (cut at a stop string once one appears)
        self.emitted = 0  # characters of `text` already handed out
        self.stopped = False

    def push(self, token: int) -> str:
        """Add one token; return the newly final text (possibly empty)."""
        self.ids.append(token)
        self.text = self.tokenizer.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True
            return self._take(len(self.text))
        final = len(self.text)
        if self.text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its other bytes
            final = len(self.text.rstrip("\ufffd"))
        head = self.text[:final]  # hold back a tail that could still grow into a stop string
        final -= max((k for s in self.stop for k in range(1, min(len(s), final + 1)) if head.endswith(s[:k])), default=0)
        return self._take(max(final, self.emitted))

    def finish(self) -> str:
        """Everything not yet emitted (generation ended without completing a stop string)."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        piece = self.text[self.emitted:upto]
        self.emitted = max(self.emitted, upto)
        return piece
