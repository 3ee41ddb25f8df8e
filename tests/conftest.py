"""Shared pytest fixtures: tiny real transformer models built once per session.

All models use random weights (see ``benchmarks/tiny_models.py``) and are written
to a session temp dir together with a locally trained byte-level BPE
tokenizer, so no network or hub access is needed.  Building everything takes
a couple of seconds on CPU.

Run the suite on a GPU with ``pytest --device cuda``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Make the suite's helper modules (own_warnings, harness, ...) importable in any pytest import mode.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import own_warnings  # noqa: E402
from benchmarks.tiny_models import (  # noqa: E402
    OTHER_CORPUS,
    TINY_CORPUS,
    build_tiny_model,
    build_tokenizer,
    deepen_model,
    perturb_model,
    truncate_model,
)

# Seeds are fixed so every session builds byte-identical models.
LLAMA_SEED = 1
QWEN2_SEED = 2
UNRELATED_SEED = 1234
OTHER_VOCAB_SEED = 5
PERTURB_SEED = 101


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        action="store",
        default="cpu",
        help="torch device for model-running tests, e.g. 'cpu' or 'cuda' (default: cpu)",
    )


def pytest_configure(config):
    # Deprecations our code causes count as ours, for pyproject's filterwarnings (tests/own_warnings.py).
    own_warnings.install()
    # Tiny models: one intra-op thread beats two (thread hand-off costs more than
    # the matmuls), and the servers under test share the process anyway.
    torch.set_num_threads(int(os.environ.get("SPECMESH_TORCH_THREADS", "1")))
    try:  # keep test output free of "Loading weights" progress bars
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # pragma: no cover
        pass
    dev = config.getoption("--device")
    if dev.startswith("cuda") and not torch.cuda.is_available():
        raise pytest.UsageError(f"--device {dev} requested but CUDA is not available")


def pytest_unconfigure(config):
    own_warnings.uninstall()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups (--dist loadgroup)
def pytest_collection_modifyitems(items):
    """Under xdist, a module's tests run on one worker in file order, as they do without it: its
    module fixtures start once, and tests that follow a module deployment's state see it. Tests
    marked with a group of their own (Ray's: one cluster at a time) keep it."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    return pytestconfig.getoption("--device")


# --------------------------------------------------------------------------
# Tiny models (session scoped, built lazily, each at most once)
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_models_root):
    """The shared ``PreTrainedTokenizerFast`` (vocab 320) object."""
    return build_tokenizer(tiny_models_root / "tokenizer", corpus=TINY_CORPUS)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tiny_models_root, tiny_tokenizer) -> Path:
    return tiny_models_root / "tokenizer"


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_models_root, tiny_tokenizer) -> Path:
    """Target: Llama, hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 320."""
    return build_tiny_model(tiny_models_root / "llama", "llama", tiny_tokenizer, seed=LLAMA_SEED)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_models_root, tiny_tokenizer) -> Path:
    """Target: Qwen2, hidden 64, 2 layers, 4 heads / 2 kv heads, vocab 320."""
    return build_tiny_model(tiny_models_root / "qwen2", "qwen2", tiny_tokenizer, seed=QWEN2_SEED)


@pytest.fixture(scope="session")
def tiny_llama_perturbed_dir(tiny_models_root, tiny_llama_dir) -> Path:
    """Draft for tiny_llama: same weights + 12% relative noise (partial acceptance)."""
    return perturb_model(tiny_llama_dir, tiny_models_root / "llama_perturbed", seed=PERTURB_SEED)


@pytest.fixture(scope="session")
def tiny_llama_unrelated_dir(tiny_models_root, tiny_tokenizer) -> Path:
    """Same architecture/tokenizer as tiny_llama, different seed: ~zero acceptance."""
    return build_tiny_model(
        tiny_models_root / "llama_unrelated", "llama", tiny_tokenizer, seed=UNRELATED_SEED
    )


@pytest.fixture(scope="session")
def tiny_llama_deep_dir(tiny_models_root, tiny_llama_dir) -> Path:
    """Target whose outputs are tiny_llama's, bit for bit, at several times its step cost (16 layers, 14 of
    them adding zero): tiny_llama is its draft, accepted on every token and genuinely cheaper."""
    return deepen_model(tiny_llama_dir, tiny_models_root / "llama_deep")


@pytest.fixture(scope="session")
def tiny_qwen2_draft_dir(tiny_models_root, tiny_qwen2_dir) -> Path:
    """Draft for tiny_qwen2: its first decoder layer only (1 layer), partial acceptance."""
    return truncate_model(tiny_qwen2_dir, tiny_models_root / "qwen2_draft", num_layers=1)


@pytest.fixture(scope="session")
def other_vocab_model_dir(tiny_models_root) -> Path:
    """Tiny Llama whose tokenizer has a DIFFERENT vocabulary (different corpus).

    Deliberately the same vocab size (320) as the tiny tokenizer, so a
    "tokenizers differ" check has to compare the vocabularies themselves.
    """
    dest = tiny_models_root / "other_vocab_llama"
    tok = build_tokenizer(dest, corpus=OTHER_CORPUS + TINY_CORPUS)
    return build_tiny_model(dest, "llama", tok, seed=OTHER_VOCAB_SEED)


@pytest.fixture(scope="session")
def all_tiny_model_dirs(
    tiny_llama_dir,
    tiny_qwen2_dir,
    tiny_llama_perturbed_dir,
    tiny_llama_unrelated_dir,
    tiny_qwen2_draft_dir,
    other_vocab_model_dir,
) -> dict[str, Path]:
    return {
        "tiny_llama": tiny_llama_dir,
        "tiny_qwen2": tiny_qwen2_dir,
        "tiny_llama_perturbed": tiny_llama_perturbed_dir,
        "tiny_llama_unrelated": tiny_llama_unrelated_dir,
        "tiny_qwen2_draft": tiny_qwen2_draft_dir,
        "other_vocab_model": other_vocab_model_dir,
    }
