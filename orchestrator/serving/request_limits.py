"""How large a client's request may be, in bytes, before anything reads it.

The default fits the longest prompt the target's context window can hold with room to spare:
a generous bound on the bytes one token takes on the wire (UTF-8, JSON escapes such as
"\\ud83d\\ude00", or token ids written out as decimal numbers) times the context window, plus
an allowance for the other fields (stop strings, chat structure). A larger message cannot be
a valid request, so it is refused unread: gRPC RESOURCE_EXHAUSTED, HTTP 413.
"""

from __future__ import annotations

BYTES_PER_TOKEN_BOUND = 32
OTHER_FIELDS_ALLOWANCE = 64 * 1024


def request_size_limit(context_window: int, configured: int | None = None) -> int:
    """`configured` (the --max-request-bytes flag) when given, else the context window's default."""
    if configured is not None:
        if configured <= 0:
            raise ValueError("the request size limit must be a positive number of bytes")
        return configured
    return OTHER_FIELDS_ALLOWANCE + context_window * BYTES_PER_TOKEN_BOUND
