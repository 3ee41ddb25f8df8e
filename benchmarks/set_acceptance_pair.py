"""A benchmark model pair at real sizes whose acceptance is set, not hoped for.

Random weights cannot show speculation paying: an unrelated draft is never accepted. This builds, on
the device and in its precision, a target of Qwen2.5-7B's shape and a draft of Qwen2.5-0.5B's shape
with random weights and one byte-level BPE tokenizer, whose forwards run the full network and then set
their greedy token by rule (modeling_set_acceptance.py, copied into each model directory): the target
walks a hash of (token, position); each draft proposes the target's token with probability alpha.

    python -m benchmarks.set_acceptance_pair /tmp/pair --device cuda --alpha 0.6 0.8
    specmesh bench --trust-remote-code --target /tmp/pair/target --draft /tmp/pair/draft-0.8 \\
        --device cuda --target-dtype bfloat16 --draft-dtype bfloat16 --ab --temperature 0

Writes DEST/tokenizer, DEST/target and DEST/draft-<alpha> for each alpha (the drafts share one weights
file). Loading them runs their code: they load only with an explicit --trust-remote-code.
What the pair measures: step costs and speculation at a known acceptance. What it cannot: a real
draft's acceptance, and greedy parity under numerical noise (the chosen token leads by a wide margin).

Emulated GPU regime (benchmark-only): `--profile NAME` (benchmarks/gpu_profiles.py) writes the profile's
target step table into the target's config and its draft table into each draft's, and builds one-layer
models on the test corpora: the real compute must stay small, well under the emulated step, so that the
forwards sleep out the GPU's step time and leave the CPU to the services, and several replicas fit on
two cores.

    python -m benchmarks.set_acceptance_pair /tmp/pair-h100 --profile h100-8b --alpha 0.8
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from benchmarks.gpu_profiles import PROFILES, scaled, to_config
from benchmarks.modeling_set_acceptance import SetAcceptanceConfig, SetAcceptanceForCausalLM
from benchmarks.random_pair import MAX_POSITIONS, SMALL_SHAPES, corpus
from benchmarks.tiny_models import build_tokenizer

HERE = Path(__file__).resolve().parent

SHAPES = {  # Qwen2.5-7B and Qwen2.5-0.5B
    "target": dict(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944),
    "draft": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864),
}
# --profile: one layer each, the least real compute a transformers forward can have (about 0.6 ms on a CPU
# core), so that the padded step is mostly sleep and the host's CPU stays with the services, as a GPU's
# host does. The emulated step's time comes from the profile, not from these shapes.
EMULATED_SHAPES = {
    "target": dict(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128),
    "draft": dict(hidden=32, layers=1, heads=4, kv_heads=2, intermediate=64),
}
QWEN_VOCAB = 152064  # the real models' output width: the output projection costs what theirs costs
MODELING_FILE = "modeling_set_acceptance.py"
AUTO_MAP = {"AutoConfig": "modeling_set_acceptance.SetAcceptanceConfig",
            "AutoModelForCausalLM": "modeling_set_acceptance.SetAcceptanceForCausalLM"}
BYTE_ALPHABET = 256  # byte-level BPE: the single-byte tokens follow the special ones


def ordinary_range(tokenizer) -> tuple[int, int]:
    """[low, high): token ids the rule may choose: past the special tokens and, where the vocabulary
    has merges enough, past the single bytes (a lone byte may be half a UTF-8 character)."""
    low = max(tokenizer.all_special_ids) + 1
    if len(tokenizer) - (low + BYTE_ALPHABET) >= 16:
        low += BYTE_ALPHABET
    return low, len(tokenizer)


def pair_config(role: str, shape: dict, tokenizer, vocab: int, alpha: float, seed: int,
                step_profile: dict | None = None) -> SetAcceptanceConfig:
    low, high = ordinary_range(tokenizer)
    return SetAcceptanceConfig(
        set_acceptance_role=role, alpha=alpha, steer_low=low, steer_high=high, steer_seed=seed,
        step_profile=step_profile,
        hidden_size=shape["hidden"], num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], intermediate_size=shape["intermediate"],
        max_position_embeddings=MAX_POSITIONS, vocab_size=max(vocab, len(tokenizer)), tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id, auto_map=AUTO_MAP)


def build_model(dest: Path, config: SetAcceptanceConfig, tokenizer, device: str, dtype: torch.dtype,
                seed: int) -> Path:
    """Random weights made on `device` in `dtype` (seconds for 7B on a GPU), saved with tokenizer and code."""
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = SetAcceptanceForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(dest), safe_serialization=True)
    tokenizer.save_pretrained(str(dest))
    shutil.copy(HERE / MODELING_FILE, dest / MODELING_FILE)
    del model
    return dest


def draft_at(alpha: float, first: Path, dest: Path) -> Path:
    """Another draft directory: `first`'s files (weights linked, not copied) with its own alpha."""
    dest.mkdir(parents=True, exist_ok=True)
    for path in first.iterdir():
        if path.name == "config.json":
            config = json.loads(path.read_text())
            (dest / path.name).write_text(json.dumps({**config, "alpha": alpha}, indent=2))
        elif path.suffix == ".safetensors":
            (dest / path.name).symlink_to(path.resolve())
        else:
            shutil.copy(path, dest / path.name)
    return dest


def build_pair(dest: Path, alphas: list[float], device: str = "cpu", dtype: str = "float32",
               small: bool = False, vocab: int = 32768, seed: int = 0, profile: str | None = None,
               time_scale: float = 1.0) -> dict[str, Path]:
    """DEST/target and DEST/draft-<alpha> for each alpha; their directories by name.

    `profile`: a name in gpu_profiles.PROFILES; its forwards are padded to that GPU's step times
    (emulated), and the models are one layer each whatever `small` says: their own compute must stay small.
    `time_scale`: the profile's times multiplied by it (gpu_profiles.scaled), where this host's smallest
    forward would overrun the profile's shortest step."""
    if profile is not None and profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {', '.join(sorted(PROFILES))}")
    steps = PROFILES[profile] if profile is not None else None
    small = small or steps is not None
    started = time.perf_counter()
    tokenizer = build_tokenizer(dest / "tokenizer", vocab_size=vocab, corpus=corpus(small))
    shapes = EMULATED_SHAPES if steps is not None else SMALL_SHAPES if small else SHAPES
    width = len(tokenizer) if small else QWEN_VOCAB
    torch_dtype = getattr(torch, dtype)
    target_config = pair_config("target", shapes["target"], tokenizer, width, 1.0, seed,
                                to_config(scaled(steps.target, time_scale)) if steps else None)
    built = {"target": build_model(dest / "target", target_config, tokenizer, device, torch_dtype, seed=1)}
    first = None
    for alpha in alphas:
        name = f"draft-{alpha:g}"
        if first is None:
            config = pair_config("draft", shapes["draft"], tokenizer, width, alpha, seed,
                                 to_config(scaled(steps.draft, time_scale)) if steps else None)
            first = built[name] = build_model(dest / name, config, tokenizer, device, torch_dtype, seed=2)
        else:
            built[name] = draft_at(alpha, first, dest / name)
    sizes = {name: sum(p.stat().st_size for p in path.glob("*.safetensors") if not p.is_symlink()) / 1e9
             for name, path in built.items()}
    print(f"set-acceptance pair in {dest}: tokenizer {len(tokenizer)} tokens, output width {width}, "
          f"{dtype}, built on {device} in {time.perf_counter() - started:.1f} s"
          + (f", step times emulated as {profile} x{time_scale:g}" if profile else "") + "; weights GB "
          + ", ".join(f"{name} {size:.2f}" for name, size in sizes.items()), flush=True)
    return built


def main(argv: list[str] | None = None) -> dict[str, Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path, help="folder for tokenizer/, target/ and draft-<alpha>/")
    parser.add_argument("--alpha", type=float, nargs="+", default=[0.6, 0.8],
                        help="each draft's rate of agreement with the target's greedy token")
    parser.add_argument("--device", default="cpu", help="where the random weights are made (cuda: seconds for 7B)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--small", action="store_true", help="test-sized models and the test corpora only")
    parser.add_argument("--seed", type=int, default=0, help="of the target's walk")
    parser.add_argument("--profile", choices=sorted(PROFILES),
                        help="emulate this GPU's step times (benchmarks/gpu_profiles.py) with one-layer models")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="multiply the profile's step times by this (a host too slow for its shortest step)")
    args = parser.parse_args(argv)
    if not all(0.0 <= alpha <= 1.0 for alpha in args.alpha):
        parser.error(f"--alpha must lie in [0, 1], got {args.alpha}")
    return build_pair(args.dest, args.alpha, args.device, args.dtype, args.small, seed=args.seed,
                      profile=args.profile, time_scale=args.time_scale)


if __name__ == "__main__":
    main()
