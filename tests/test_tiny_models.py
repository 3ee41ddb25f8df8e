"""Sanity checks for the tiny test models built in conftest.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.tiny_models import (
    BOS_TOKEN,
    EOS_TOKEN,
    TINY_PROMPTS,
    build_tokenizer,
    greedy_agreement,
    load_model,
    mean_max_prob,
)

pytestmark = pytest.mark.unit

MODEL_FIXTURES = [
    "tiny_llama_dir",
    "tiny_qwen2_dir",
    "tiny_llama_perturbed_dir",
    "tiny_llama_unrelated_dir",
    "tiny_qwen2_draft_dir",
    "other_vocab_model_dir",
]


def test_tokenizer_round_trip(tiny_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert len(tok) == 320
    for text in [
        "The quick brown fox jumps over the lazy dog.",
        "def add(a, b):\n    return a + b  # ~!@#$%^&*() 0123456789",
        "  leading spaces and\ttabs\n\nand ZEBRA xylophone",
    ]:
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == EOS_TOKEN
    assert tok.bos_token == BOS_TOKEN
    assert tok.eos_token_id == tok.pad_token_id != tok.bos_token_id


def test_tokenizer_is_deterministic(tmp_path, tiny_tokenizer_dir):
    again = build_tokenizer(tmp_path / "again")
    ref = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    assert again.get_vocab() == ref.get_vocab()
    a = json.loads((tmp_path / "again" / "tokenizer.json").read_text())["model"]["merges"]
    b = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())["model"]["merges"]
    assert a == b


@pytest.mark.parametrize("fixture_name", MODEL_FIXTURES)
def test_model_loads_and_greedy_is_deterministic(request, fixture_name, device):
    path = request.getfixturevalue(fixture_name)
    model = AutoModelForCausalLM.from_pretrained(str(path)).to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.pad_token_id == tok.pad_token_id
    assert model.config.bos_token_id == tok.bos_token_id
    assert model.config.tie_word_embeddings is False
    assert model.generation_config.do_sample is False

    ids = tok(TINY_PROMPTS[0], return_tensors="pt").input_ids.to(device)
    outs = [
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20)
        for _ in range(2)
    ]
    assert torch.equal(outs[0], outs[1])
    # greedy must not stop on eos right away
    assert outs[0].shape[1] == ids.shape[1] + 20
    assert tok.eos_token_id not in outs[0][0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("fixture_name", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_targets_are_peaked_but_not_degenerate(request, fixture_name, device):
    model, tok = load_model(request.getfixturevalue(fixture_name), device)
    p = mean_max_prob(model, tok, device=device)
    assert 0.2 < p < 0.7, p


@pytest.mark.parametrize(
    ("target", "draft", "lo", "hi"),
    [
        ("tiny_llama_dir", "tiny_llama_perturbed_dir", 0.2, 0.95),
        ("tiny_qwen2_dir", "tiny_qwen2_draft_dir", 0.2, 0.95),
        ("tiny_llama_dir", "tiny_llama_unrelated_dir", 0.0, 0.3),
    ],
)
def test_draft_agreement(request, target, draft, lo, hi, device):
    t_model, tok = load_model(request.getfixturevalue(target), device)
    d_model, _ = load_model(request.getfixturevalue(draft), device)
    agreement = greedy_agreement(t_model, d_model, tok, TINY_PROMPTS, steps=30, device=device)
    assert lo <= agreement < hi, agreement
    if lo > 0:
        assert agreement > lo, agreement


def test_qwen2_draft_is_smaller(tiny_qwen2_dir, tiny_qwen2_draft_dir):
    t = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir))
    d = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_draft_dir))
    assert d.config.num_hidden_layers < t.config.num_hidden_layers
    assert d.config.model_type == t.config.model_type == "qwen2"


def test_deep_target_computes_its_drafts_logits_at_more_cost(tiny_llama_dir, tiny_llama_deep_dir, device):
    """The deepened copy's added layers add exactly zero: the same logits, bit for bit, from more layers."""
    shallow, tok = load_model(tiny_llama_dir, device)
    deep, _ = load_model(tiny_llama_deep_dir, device)
    assert deep.config.num_hidden_layers >= 4 * shallow.config.num_hidden_layers
    ids = torch.tensor([tok.encode(TINY_PROMPTS[1])], device=device)
    with torch.no_grad():
        assert torch.equal(deep(ids).logits, shallow(ids).logits)


def test_other_vocab_differs(tiny_tokenizer_dir, other_vocab_model_dir):
    ref = AutoTokenizer.from_pretrained(str(tiny_tokenizer_dir))
    other = AutoTokenizer.from_pretrained(str(other_vocab_model_dir))
    assert other.get_vocab() != ref.get_vocab()
    text = "Zebras and the quick brown fox"
    assert other(text).input_ids != ref(text).input_ids
    assert other.decode(other(text).input_ids) == text
