"""The KV cache goes to a model's forward under the name that forward declares (specmesh/loading/hf_compat.py)."""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from transformers import DynamicCache

from harness import load
from specmesh.loading.hf_compat import NEW_CACHE_KEYWORD, OLD_CACHE_KEYWORD, cache_keyword, cache_kwargs

pytestmark = pytest.mark.unit


class Renamed(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs):
        return cache


class Old(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return past_key_values


class Silent(torch.nn.Module):  # a remote model: everything through **kwargs
    def forward(self, input_ids=None, **kwargs):
        return kwargs.get(OLD_CACHE_KEYWORD)


def renaming(forward):  # as transformers' @deprecate_kwarg wraps a forward
    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapped


class Wrapped(torch.nn.Module):
    forward = renaming(Renamed.forward)


def test_the_name_is_the_one_the_forward_declares():
    assert [cache_keyword(m()) for m in (Renamed, Old, Silent, Wrapped)] == [
        NEW_CACHE_KEYWORD, OLD_CACHE_KEYWORD, OLD_CACHE_KEYWORD, NEW_CACHE_KEYWORD]
    marker = object()
    assert all(m()(input_ids=None, **cache_kwargs(m(), marker), use_cache=True) is marker
               for m in (Renamed, Old, Silent, Wrapped))


def test_the_installed_transformers_gets_the_name_it_declares_and_uses_the_cache(tiny_llama_dir, device):
    model, _ = load(str(tiny_llama_dir), device)
    declared = inspect.signature(type(model).forward).parameters
    assert cache_keyword(model) == (NEW_CACHE_KEYWORD if NEW_CACHE_KEYWORD in declared else OLD_CACHE_KEYWORD)
    ids = torch.tensor([[5, 17, 42, 7, 99, 3]], device=model.device)
    cache = DynamicCache()
    with torch.inference_mode():
        full = model(input_ids=ids).logits[0, -1]
        model(input_ids=ids[:, :-1], **cache_kwargs(model, cache), use_cache=True)
        assert cache.get_seq_length() == ids.shape[1] - 1  # the forward filled our cache, not one of its own
        last = model(input_ids=ids[:, -1:], **cache_kwargs(model, cache), use_cache=True).logits[0, -1]
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(last, full, rtol=1e-4, atol=1e-5)
