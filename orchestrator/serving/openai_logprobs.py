"""The target's log-probabilities (GenerateResponse.logprobs) as OpenAI's `logprobs` objects.

A token's text is its own decode; `bytes` are that text's UTF-8 (a token holding
part of a multi-byte character decodes to U+FFFD, as its text shows).
"""

from __future__ import annotations

from typing import Any, Sequence

from transformers import PreTrainedTokenizerBase

from specmesh.v1 import common_pb2


class TokenTexts:
    """Token id -> its text, cached: the same ids recur across positions and alternatives."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


def completion_logprobs(texts: TokenTexts, entries: Sequence[common_pb2.TokenLogprob],
                        text_offset: int) -> dict[str, Any]:
    """Legacy completions form; text_offset: where the first token's text starts in the choice's text."""
    tokens = [texts(entry.token_id) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [{texts(t): value for t, value in zip(entry.top_token_ids, entry.top_logprobs)}
                             for entry in entries],
            "text_offset": offsets}


def chat_logprobs(texts: TokenTexts, entries: Sequence[common_pb2.TokenLogprob]) -> dict[str, Any]:
    """Chat form: {"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}."""
    return {"content": [{**_chat_token(texts, entry.token_id, entry.logprob),
                         "top_logprobs": [_chat_token(texts, t, value)
                                          for t, value in zip(entry.top_token_ids, entry.top_logprobs)]}
                        for entry in entries],
            "refusal": None}


def _chat_token(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text = texts(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
