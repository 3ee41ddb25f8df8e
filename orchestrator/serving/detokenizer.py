"""Incremental detokenization with stop strings for streaming responses.

Text is decoded in a small sliding window (as TGI and vLLM do), so each new
token costs O(1), a multi-byte character split across tokens is held back until
complete, and tokenizers that drop a leading space at the start of a decode
still get it from the context tokens in the window. Text that might be the
start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from typing import Sequence

from transformers import PreTrainedTokenizerBase

_CONTEXT_TOKENS = 5  # prompt tokens kept in the window for the first decode


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: Sequence[int],
                 stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.token_ids)  # tokens before this are already in `text`
        self.text = ""  # generated text so far (stop string cut off once found)
        self.emitted = 0  # characters of `text` already returned
        self.stopped = False

    def add(self, token_ids: Sequence[int]) -> tuple[str, int]:
        """Add tokens; return (text safe to emit now, how many of token_ids were consumed).

        Fewer tokens than given are consumed when a stop string completes: the
        tokens after the one that completed it are dropped.
        """
        for consumed, token_id in enumerate(token_ids, start=1):
            self.token_ids.append(token_id)
            self.text += self._decode_newest()
            if self._cut_at_stop_string():
                return self._release(len(self.text)), consumed
        return self._release(len(self.text) - self._held_back()), len(token_ids)

    def finish(self) -> str:
        """The text still held back, at the end of the generation."""
        return self._release(len(self.text))

    def _decode_newest(self) -> str:
        window = self.token_ids[self.prefix_offset:]
        before = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset],
                                       skip_special_tokens=True)
        after = self.tokenizer.decode(window, skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            return after[len(before):]
        return ""  # an incomplete character: wait for the next token

    def _cut_at_stop_string(self) -> bool:
        if not self.stop:
            return False
        # Any prefix of a stop string is held back, so none can start before `emitted`.
        hits = [i for i in (self.text.find(s, self.emitted) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        self.stopped = True
        return True

    def _held_back(self) -> int:
        """Length of the longest suffix of text that could begin a stop string."""
        for length in range(min(len(self.text), max((len(s) for s in self.stop), default=0)), 0, -1):
            suffix = self.text[-length:]
            if any(s.startswith(suffix) for s in self.stop):
                return length
        return 0

    def _release(self, upto: int) -> str:
        upto = max(upto, self.emitted)
        delta, self.emitted = self.text[self.emitted:upto], upto
        return delta
