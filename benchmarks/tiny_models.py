"""Tiny, real (random-weight) transformer models for specmesh's tests and benchmarks.

Everything here is built locally: a byte-level BPE tokenizer trained on a
small embedded corpus, and Llama / Qwen2 causal LMs with ~0.1M parameters.
No network, no hub.  This module deliberately has no pytest dependency so it
can be used from scripts too.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Sequence

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|bos|>"

DEFAULT_VOCAB_SIZE = 320
CHAT_TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}### assistant:\n{% endif %}")
# Scale applied to the (randomly initialised) lm_head so that typical max
# softmax probability lands in ~0.2-0.6 for a vocabulary of ~320.
DEFAULT_LOGIT_SCALE = 3.5
# Factor applied to lm_head rows of non-printable tokens and eos.
DOWNWEIGHT = 0.1
EMBED_STD = 1.0
RESIDUAL_GAIN = 1.0
BIAS_STD = 0.1
# Relative Gaussian noise that gives a draft with partial greedy acceptance.
DEFAULT_PERTURB_NOISE = 0.12

TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog.
A journey of a thousand miles begins with a single step.
To be, or not to be, that is the question.
All that glitters is not gold, and not all those who wander are lost.
The rain in Spain stays mainly in the plain.
She sells sea shells by the sea shore on a sunny summer morning.
Once upon a time there was a little model that wanted to speak.
The cat sat on the mat and looked out of the window at the birds.
It was the best of times, it was the worst of times.
Speculative decoding lets a small draft model propose tokens for a large target model.
The target model verifies the proposed tokens in a single forward pass.
When the draft is right, many tokens are accepted at once and generation is faster.
When the draft is wrong, the target model corrects it and the draft starts again.
Servers stream tokens to clients over gRPC with low latency.
We measure throughput in tokens per second and latency in milliseconds.
The weather today is cloudy with a chance of rain in the afternoon.
Please remember to water the plants and feed the cat before you leave.
def add(a, b):
    return a + b

def fibonacci(n):
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

class Counter:
    def __init__(self, start=0):
        self.value = start

    def increment(self, step=1):
        self.value += step
        return self.value

for i in range(10):
    print(i, i * i)

import os
import sys

def read_file(path):
    with open(path, "r") as f:
        return f.read()

numbers = [1, 2, 3, 4, 5]
squares = [x * x for x in numbers if x % 2 == 1]
result = {"name": "specmesh", "version": 1, "ok": True}
while True:
    break
"""

# A different corpus used to build a tokenizer with a different vocabulary.
OTHER_CORPUS = """\
Zebras graze quietly while violet clouds drift above the savanna.
Xylophones, kazoos and banjos jostle for attention in the jazz quartet.
Jupiter's moons whirl through the void, frozen and jagged.
SELECT id, name FROM users WHERE age > 21 ORDER BY name;
fn main() { let v: Vec<u32> = vec![1, 2, 3]; println!("{:?}", v); }
{"key": [true, false, null], "nested": {"depth": 2}}
"""

TINY_PROMPTS: list[str] = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time",
    "for i in range(",
    "Speculative decoding lets",
    "class Counter:\n    def",
    "The weather today is",
    "import os\nimport",
]


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def build_tokenizer(
    dest: Path,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    corpus: str = TINY_CORPUS,
) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer and save it to ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=BOS_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE  # so /v1/chat/completions can be tested
    fast.save_pretrained(str(dest))
    return fast


# --------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------


def non_printable_token_ids(tokenizer) -> list[int]:
    """Ids whose standalone decoding is not printable ASCII (plus specials)."""
    out = []
    for i in range(len(tokenizer)):
        text = tokenizer.decode([i])
        ok = bool(text) and all(c == "\n" or 32 <= ord(c) < 127 for c in text)
        if not ok or i in tokenizer.all_special_ids:
            out.append(i)
    return out


def _special_ids(tokenizer) -> dict:
    return {
        "vocab_size": len(tokenizer),
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def _make_config(arch: str, tokenizer, hidden, layers, heads, kv_heads, intermediate, max_positions):
    common = dict(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        initializer_range=0.02,
        **_special_ids(tokenizer),
    )
    if arch == "llama":
        return LlamaConfig(**common), LlamaForCausalLM
    if arch == "qwen2":
        return Qwen2Config(**common), Qwen2ForCausalLM
    raise ValueError(f"unsupported arch {arch!r}; expected 'llama' or 'qwen2'")


def _set_generation_config(model, tokenizer) -> None:
    model.generation_config = GenerationConfig(
        do_sample=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@torch.no_grad()
def _init_weights(model, seed: int, logit_scale: float, down_ids: Sequence[int] = ()) -> None:
    """Deterministic random init, scaled so next-token distributions are peaked."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:  # RMSNorm gains
            p.fill_(1.0)
            continue
        if p.ndim == 1:  # biases (qwen2 q/k/v)
            p.copy_(torch.randn(p.shape, generator=gen) * BIAS_STD)
            continue
        std = 1.0 / p.shape[1] ** 0.5
        if "embed_tokens" in name:
            std = EMBED_STD
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            std *= RESIDUAL_GAIN
        p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.lm_head.weight.mul_(logit_scale)
    # Shrink the output rows of tokens that do not decode to printable ASCII
    # (stray UTF-8 bytes, control bytes, specials): their logits collapse
    # towards 0, so greedy text stays readable while sampling can still hit
    # them occasionally.  eos gets the same treatment: rarely generated.
    if down_ids:
        idx = torch.tensor(sorted(down_ids))
        w = model.lm_head.weight
        w[idx] = w[idx] * DOWNWEIGHT


def build_tiny_model(
    dest: Path,
    arch: str,
    tokenizer,
    seed: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 128,
    max_positions: int = 256,
    logit_scale: float = DEFAULT_LOGIT_SCALE,
) -> Path:
    """Build a random-weight causal LM and save it (with tokenizer) to ``dest``."""
    config, cls = _make_config(arch, tokenizer, hidden, layers, heads, kv_heads, intermediate, max_positions)
    torch.manual_seed(seed)
    model = cls(config)
    _init_weights(model, seed, logit_scale, non_printable_token_ids(tokenizer))
    return _save(model, tokenizer, dest)


@torch.no_grad()
def _add_noise(model, noise: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        scale = p.std() if p.numel() > 1 else p.abs().mean()
        if float(scale) == 0.0:  # e.g. all-ones norm gains
            scale = p.abs().mean()
        p.add_(torch.randn(p.shape, generator=gen) * scale * noise)


def _load_for_copy(src: Path) -> tuple:
    """``(model, tokenizer)`` of ``src``, in fp32, to derive another tiny model from."""
    return AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32), AutoTokenizer.from_pretrained(str(src))


def _save(model, tokenizer, dest: Path) -> Path:
    """Save a derived model with ``tokenizer`` and the tiny models' generation config to ``dest``."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    model.eval()
    _set_generation_config(model, tokenizer)
    model.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))
    return dest


def _with_layers(model, num_layers: int):
    """A model of ``model``'s architecture with ``num_layers`` decoder layers, holding ``model``'s weights
    for every layer both have (fewer: the first ones kept; more: the added ones left at their init)."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        layer_types = list(layer_types)
        config.layer_types = (layer_types + [layer_types[-1]] * num_layers)[:num_layers]
    resized = type(model)(config)
    missing, unexpected = resized.load_state_dict(model.state_dict(), strict=False)
    kept = min(num_layers, model.config.num_hidden_layers)
    for name in (*missing, *unexpected):  # only whole layers past those kept may differ
        assert name.startswith("model.layers.") and int(name.split(".")[2]) >= kept, (missing, unexpected)
    return resized


def perturb_model(
    src: Path,
    dest: Path,
    noise: float = DEFAULT_PERTURB_NOISE,
    seed: int = 0,
) -> Path:
    """Copy ``src`` adding Gaussian noise of relative scale ``noise`` to every weight.

    For each tensor W: W' = W + noise * std(W) * N(0, 1)  (norm weights, which
    have zero std, are perturbed relative to their mean magnitude).
    """
    model, tokenizer = _load_for_copy(src)
    _add_noise(model, noise, seed)
    return _save(model, tokenizer, dest)


def truncate_model(
    src: Path,
    dest: Path,
    num_layers: int = 1,
    noise: float = 0.0,
    seed: int = 0,
) -> Path:
    """Copy ``src`` keeping only its first ``num_layers`` decoder layers.

    Embeddings, final norm and lm_head are shared with ``src`` (a "layer-skip"
    draft), so the smaller model still agrees partially with the original.
    Optional relative Gaussian ``noise`` is added afterwards.
    """
    model, tokenizer = _load_for_copy(src)
    small = _with_layers(model, num_layers)
    if noise:
        _add_noise(small, noise, seed)
    return _save(small, tokenizer, dest)


@torch.no_grad()
def deepen_model(src: Path, dest: Path, extra_layers: int = 14) -> Path:
    """Copy ``src`` with ``extra_layers`` more decoder layers that add nothing to the residual stream.

    Each added layer's attention output and MLP down projections are zero, so ``x + 0 = x`` exactly
    and the copy computes ``src``'s logits bit for bit in fp32, at several times its cost a step: a
    target whose draft (``src`` itself) agrees with it on every token and is genuinely cheaper, as a
    real pair's draft is. With ``src`` as its own target, whether drafting pays is a coin toss of the
    host's timing (draft and target cost the same).
    """
    model, tokenizer = _load_for_copy(src)
    layers = model.config.num_hidden_layers
    deep = _with_layers(model, layers + extra_layers)
    for layer in deep.model.layers[layers:]:
        for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
            for parameter in projection.parameters():  # its bias too, where the architecture has one
                parameter.zero_()
    return _save(deep, tokenizer, dest)


# --------------------------------------------------------------------------
# Measurement helpers (used by tests and for calibrating the constants above)
# --------------------------------------------------------------------------


def load_model(path: Path, device: str = "cpu"):
    """Load ``(model, tokenizer)`` from a directory written by this module."""
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return model, tok


@torch.no_grad()
def greedy_continuation(model, tokenizer, prompt: str, steps: int = 30, device: str = "cpu") -> torch.Tensor:
    """Prompt ids + ``steps`` greedy tokens (manual loop, no eos stopping)."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids.to(device)
    for _ in range(steps):
        nxt = model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=-1)
    return ids[0]


@torch.no_grad()
def greedy_agreement(
    target,
    draft,
    tokenizer,
    prompts: Sequence[str] = TINY_PROMPTS,
    steps: int = 30,
    device: str = "cpu",
) -> float:
    """Teacher-forced next-token argmax agreement along the target's greedy path."""
    agree = total = 0
    for prompt in prompts:
        n_prompt = len(tokenizer(prompt).input_ids)
        seq = greedy_continuation(target, tokenizer, prompt, steps, device)
        x = seq[None, :-1]
        t = target(x).logits[0].argmax(-1)[n_prompt - 1 :]
        d = draft(x).logits[0].argmax(-1)[n_prompt - 1 :]
        agree += int((t == d).sum())
        total += t.numel()
    return agree / total


@torch.no_grad()
def mean_max_prob(model, tokenizer, prompts: Sequence[str] = TINY_PROMPTS, steps: int = 30, device: str = "cpu") -> float:
    """Mean (over positions) max softmax probability along greedy continuations."""
    vals = []
    for prompt in prompts:
        seq = greedy_continuation(model, tokenizer, prompt, steps, device)
        probs = model(seq[None]).logits[0].softmax(-1)
        vals.append(probs.max(-1).values.mean())
    return float(torch.stack(vals).mean())
