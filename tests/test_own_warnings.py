"""A deprecation our code causes fails the test; a library's own stays a warning
(pyproject.toml's filterwarnings, tests/own_warnings.py)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specmesh.loading.hf_compat import NEW_CACHE_KEYWORD

pytestmark = pytest.mark.unit


def tiny_llama() -> LlamaForCausalLM:
    return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, vocab_size=64))


def library(name: str, source: str) -> dict:
    """A module as if installed: its frames are a library's, not ours."""
    namespace = {"__name__": name}
    exec(compile(source, f"/venv/lib/site-packages/{name}.py", "exec"), namespace)
    return namespace


@pytest.mark.skipif(NEW_CACHE_KEYWORD not in inspect.signature(LlamaForCausalLM.forward).parameters,
                    reason="this transformers has no `cache` argument: `past_key_values` is current")
def test_a_renamed_argument_we_pass_is_an_error_though_torch_is_named():
    # transformers names the frame that called forward, torch's Module.__call__
    with pytest.raises(FutureWarning, match="past_key_values"), torch.inference_mode():
        tiny_llama()(torch.tensor([[1, 2]]), past_key_values=DynamicCache(), use_cache=True)


def test_a_deprecated_call_of_ours_is_an_error_where_the_library_names_itself():
    deprecated = library("old_lib", "import warnings\n"
                                    "def old():\n"
                                    "    warnings.warn('old() is deprecated', DeprecationWarning)\n")
    with pytest.raises(DeprecationWarning, match="old"):
        deprecated["old"]()


def test_a_librarys_own_deprecation_stays_a_warning():
    deprecated = library("old_lib", "import warnings\n"
                                    "def old():\n"
                                    "    warnings.warn('old() is deprecated', FutureWarning)\n")
    caller = library("other_lib", "def uses(f):\n"
                                  "    return f()\n")
    with warnings.catch_warnings(record=True) as caught:  # the suite's filters, recorded here
        caller["uses"](deprecated["old"])
    assert [(w.category, w.filename) for w in caught] == [(FutureWarning, "/venv/lib/site-packages/old_lib.py")]
