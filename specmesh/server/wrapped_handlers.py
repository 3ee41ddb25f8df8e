"""A server interceptor's wrapped handlers, made once per method instead of once per call.

grpc.aio runs every server interceptor on every call. One that wraps the method's handler (the error
mapping, the drain's tracking) would build its closures, a tolerant deserializer and a copy of the
handler each time, for every round's PreDraft and every call. The handler a method resolves to is the
same object call after call (the services register theirs once), so its wrapped handler is kept and
reused while that stays so; behind an interceptor that wraps afresh per call (tracing's) it is made anew.
"""

from __future__ import annotations

from typing import Callable

import grpc

Wrap = Callable[[grpc.RpcMethodHandler, str], grpc.RpcMethodHandler]


class WrappedHandlers:
    """`wrapped(handler, method)`: wrap(handler, method), made once for each method's handler."""

    def __init__(self, wrap: Wrap):
        self._wrap = wrap
        self._by_method: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}  # a few methods

    def wrapped(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        kept = self._by_method.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self._wrap(handler, method)
        self._by_method[method] = (handler, wrapped)
        return wrapped
