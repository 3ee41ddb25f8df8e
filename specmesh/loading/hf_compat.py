"""The one place that knows which transformers API the installed version speaks.

transformers 5.x renamed a causal LM forward's ``past_key_values`` argument to ``cache``:
the old name warns (FutureWarning) and is removed in 5.40.0, after which a forward taking
``**kwargs`` would drop it without a word and start a fresh cache. We pass the cache under
the name the model's forward declares: ``cache`` where the installed version has it, the
old name only where it must (4.56 up to the rename). The name is read from the forward's
signature once per model class, never per call: after a class's first forward,
``cache_kwargs`` is a dict lookup. A forward declaring neither name (a remote model taking
``**kwargs``) gets the old name, the one every version before the rename understood.
"""

from __future__ import annotations

import inspect
from typing import Any

OLD_CACHE_KEYWORD = "past_key_values"
NEW_CACHE_KEYWORD = "cache"

_keywords: dict[type, str] = {}


def declared_cache_keyword(forward: Any) -> str:
    """The KV cache's name in `forward`'s signature (which follows functools.wraps to the real forward)."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - an opaque (C-level) forward
        return OLD_CACHE_KEYWORD
    return NEW_CACHE_KEYWORD if NEW_CACHE_KEYWORD in parameters else OLD_CACHE_KEYWORD


def cache_keyword(model: Any) -> str:
    """The name under which `model`'s forward takes its KV cache (decided once per class)."""
    cls = type(model)
    keyword = _keywords.get(cls)
    if keyword is None:
        keyword = _keywords[cls] = declared_cache_keyword(cls.forward)
    return keyword


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``model(..., **cache_kwargs(model, cache))`` passes `cache` under the name the model declares."""
    return {cache_keyword(model): cache}
