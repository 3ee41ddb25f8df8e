"""Model and tokenizer loading shared by the draft and target services.

A model *spec* is one of (checked in this order):

1. an embedded alias (see :data:`specmesh.loading.embedded.EMBEDDED_MODELS`);
2. an existing ``.gguf`` file;
3. an existing directory (a transformers checkpoint, or a directory holding
   exactly one ``.gguf`` file);
4. a hub id of the form ``org/name`` that is not an existing path.

Embedded models are GGUF files; transformers de-quantizes GGUF into torch
tensors on every load, which takes minutes on a small CPU. The first
load therefore saves the converted fp32 model (safetensors, no pickle) and the
tokenizer next to the assembled GGUF, and later loads read those instead.
fp32 is stored because de-quantized values are exact in fp32 but not in bf16,
so a cached load is bit-identical to a fresh GGUF load.

torch and transformers are imported lazily (inside functions): importing them
costs several seconds, and spec resolution, fingerprints and the fast test
suite do not need them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from specmesh.loading.embedded import (EMBEDDED_MODELS, ModelIntegrityError, ModelNotFoundError, get_embedded,
                                       resolve_embedded)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ModelIntegrityError", "ModelNotFoundError", "ResolvedSpec", "resolve_spec",
    "load_model", "load_tokenizer", "vocab_fingerprint", "eos_token_ids", "context_window",
]

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_MARKER = "specmesh-source.json"
_FALLBACK_CONTEXT = 2048


@dataclass(frozen=True)
class ResolvedSpec:
    """Where a spec points: ``source`` for ``from_pretrained`` plus optional ``gguf_file``."""

    spec: str
    kind: str  # "embedded" | "gguf" | "dir" | "hub"
    source: str
    gguf_file: str | None = None
    alias: str | None = None
    trust_remote_code: bool = False  # run a checkpoint's own modeling code (a directory or hub id only)

    def pretrained_kwargs(self) -> dict[str, Any]:
        """Keyword args common to every ``from_pretrained`` call for this spec."""
        kwargs: dict[str, Any] = {"trust_remote_code": self.trust_remote_code}
        if self.gguf_file is not None:
            kwargs["gguf_file"] = self.gguf_file
        return kwargs

    def model_kwargs(self) -> dict[str, Any]:
        """Extra args for loading the model (not the tokenizer).

        GGUF weights are always de-quantized into a plain dense model: with the
        optional ``kernels`` package transformers would otherwise keep packed
        GGUF blocks on some devices, which changes numerics per machine and
        cannot be saved to our converted cache.
        """
        if self.gguf_file is None:
            return {}
        from transformers import GgufConfig

        return {"quantization_config": GgufConfig(dequantize=True)}


def _unknown(spec: str) -> ModelNotFoundError:
    known = ", ".join(sorted(EMBEDDED_MODELS))
    return ModelNotFoundError(
        f"unknown model {spec!r}: not an embedded alias ({known}), not a directory, "
        "not a .gguf file, and not a hub id of the form org/name"
    )


def resolve_spec(spec: str) -> ResolvedSpec:
    """Classify a spec without loading anything (embedded aliases get assembled/verified)."""
    if spec in EMBEDDED_MODELS:
        gguf = resolve_embedded(spec)
        return ResolvedSpec(spec, "embedded", str(gguf.parent), gguf.name, alias=spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ResolvedSpec(spec, "gguf", str(path.parent), path.name)
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ResolvedSpec(spec, "gguf", str(path), ggufs[0].name)
        return ResolvedSpec(spec, "dir", str(path))
    if not path.exists() and _HUB_ID.fullmatch(spec):
        return ResolvedSpec(spec, "hub", spec)
    raise _unknown(spec)


def _auto(name: str) -> Any:
    """``AutoTokenizer`` / ``AutoModelForCausalLM``, imported only when needed."""
    import transformers

    return getattr(transformers, name)


def _from_pretrained(loader: Callable[..., Any], resolved: ResolvedSpec, **kwargs: Any) -> Any:
    """Call a transformers loader, turning "cannot find it" failures into ModelNotFoundError."""
    try:
        return loader(resolved.source, **resolved.pretrained_kwargs(), **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(
            f"could not load model {resolved.spec!r} ({resolved.kind}) from {resolved.source}: {exc}"
        ) from exc


# --- converted cache for embedded GGUF models -------------------------------------------


def _cache_dir_for(alias: str, what: str) -> Path:
    """Directory of a derived artefact (``tokenizer`` or ``model``) next to the GGUF."""
    gguf = resolve_embedded(alias)
    return gguf.parent / f"{what}-{get_embedded(alias).sha256[:16]}"


def _marker(alias: str) -> dict[str, str]:
    """What a derived cache was built from; any change invalidates the cache."""
    import torch
    import transformers

    return {"gguf_sha256": get_embedded(alias).sha256,
            "transformers": transformers.__version__, "torch": torch.__version__.split("+")[0]}


def _cache_valid(path: Path, alias: str) -> bool:
    """A cache dir is usable only if complete (marker written last) and built from our GGUF."""
    try:
        return json.loads((path / _MARKER).read_text(encoding="utf-8")) == _marker(alias)
    except (OSError, ValueError):
        return False


def _publish_dir(build: Callable[[Path], None], final: Path, alias: str) -> None:
    """Build a directory in a temp location, then swap it into place atomically.

    Readers never observe a half-written cache; if another process publishes
    first we keep theirs and drop ours.
    """
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build(tmp)
        (tmp / _MARKER).write_text(json.dumps(_marker(alias), sort_keys=True), encoding="utf-8")
        os.chmod(tmp, 0o755)  # mkdtemp makes 0700
        if final.exists():
            stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=final.parent))
            os.replace(final, stale / final.name)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(tmp, final)
    except OSError:
        if not _cache_valid(final, alias):
            raise
        logger.info("another process published %s first; using it", final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _embedded_tokenizer(alias: str) -> PreTrainedTokenizerBase:
    """Tokenizer of an embedded model, from the cache (~0.5 s) or parsed from GGUF (~12 s)."""
    cached = _cache_dir_for(alias, "tokenizer")
    if _cache_valid(cached, alias):
        return _auto("AutoTokenizer").from_pretrained(str(cached), trust_remote_code=False)
    resolved = resolve_spec(alias)
    logger.info("parsing tokenizer of %s from GGUF (first use)", alias)
    tokenizer = _from_pretrained(_auto("AutoTokenizer").from_pretrained, resolved)
    try:
        _publish_dir(tokenizer.save_pretrained, cached, alias)
    except OSError as exc:  # a read-only cache must not prevent serving
        logger.warning("could not cache tokenizer of %s: %s", alias, exc)
    return tokenizer


def _embedded_model(alias: str, dtype: torch.dtype) -> PreTrainedModel:
    """Model of an embedded alias, from the converted cache or de-quantized from GGUF."""
    import torch

    cached = _cache_dir_for(alias, "model")
    if _cache_valid(cached, alias):
        return _auto("AutoModelForCausalLM").from_pretrained(str(cached), dtype=dtype,
                                                             trust_remote_code=False)
    resolved = resolve_spec(alias)
    logger.info("de-quantizing %s from GGUF (first use; cached afterwards)", alias)
    model = _from_pretrained(_auto("AutoModelForCausalLM").from_pretrained, resolved,
                             dtype=torch.float32, **resolved.model_kwargs())
    # The GGUF metadata only carries <|im_end|>; restore upstream's generation eos list.
    model.generation_config.eos_token_id = list(get_embedded(alias).eos_token_ids)
    try:
        _publish_dir(lambda d: model.save_pretrained(d, safe_serialization=True), cached, alias)
    except (OSError, ValueError) as exc:  # ValueError: transformers refuses to serialize
        logger.warning("could not cache converted model %s: %s", alias, exc)
    return model.to(dtype)


# --- public API --------------------------------------------------------------------------


def load_tokenizer(spec: str) -> PreTrainedTokenizerBase:
    """Load only the tokenizer for ``spec`` (cheap: used for vocab checks and clients)."""
    resolved = resolve_spec(spec)
    if resolved.alias is not None:
        return _embedded_tokenizer(resolved.alias)
    return _from_pretrained(_auto("AutoTokenizer").from_pretrained, resolved)


def load_model(spec: str, device: str = "cpu", dtype: torch.dtype | None = None, trust_remote_code: bool = False
               ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load ``(model, tokenizer)`` for ``spec``: eval mode, no grads, on ``device`` in ``dtype``.

    ``dtype=None`` means ``torch.float32`` (the default is spelled ``None`` only
    so that importing this module does not import torch). ``trust_remote_code`` runs the
    modeling code a directory or hub checkpoint ships (its config.json's ``auto_map``); the
    tokenizer never runs code.
    """
    resolved = resolve_spec(spec)  # before importing torch: bad specs fail fast
    model_spec = resolved  # the tokenizer loads from `resolved`, which never runs code
    if resolved.kind in ("dir", "hub"):
        model_spec = replace(resolved, trust_remote_code=trust_remote_code)
    _refuse_untrusted_code(model_spec)
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if resolved.alias is not None:
        tokenizer = _embedded_tokenizer(resolved.alias)
        model = _embedded_model(resolved.alias, dtype)
    else:
        tokenizer = _from_pretrained(_auto("AutoTokenizer").from_pretrained, resolved)
        model = _from_pretrained(_auto("AutoModelForCausalLM").from_pretrained, model_spec,
                                 dtype=dtype, **model_spec.model_kwargs())
    if device == "auto":
        model = _shard_over_gpus(model.to(dtype=dtype))
    else:
        model = model.to(device=torch.device(device), dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    logger.info("loaded %s (%s) on %s as %s", spec, resolved.kind, device, dtype)
    return model, tokenizer


def _refuse_untrusted_code(resolved: ResolvedSpec) -> None:
    """A local checkpoint that maps its model to its own code loads only when its code is trusted."""
    config = Path(resolved.source) / "config.json"
    if resolved.kind != "dir" or resolved.trust_remote_code or not config.is_file():
        return
    try:
        auto_map = json.loads(config.read_text(encoding="utf-8")).get("auto_map") or {}
    except (OSError, ValueError, AttributeError):
        return  # transformers reports an unreadable config itself
    if "AutoModelForCausalLM" in auto_map:
        raise ModelNotFoundError(
            f"model {resolved.spec!r} runs its own code ({auto_map['AutoModelForCausalLM']} in its config.json): "
            "load it only if you trust that code, with --trust-remote-code")


def chat_token_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids of chat `messages` ({"role", "content"}) through the tokenizer's chat template,
    ending with the assistant's generation prompt. Raises ValueError without a template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    ids = encoded["input_ids"]
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def _shard_over_gpus(model: PreTrainedModel) -> PreTrainedModel:
    """Spread whole decoder layers evenly over every visible GPU (device "auto").

    A Ray replica with num_gpus=N sees exactly its N GPUs, so a large target spans
    them; accelerate's hooks move activations between layers (pipeline-style, one
    GPU busy at a time: memory capacity, not tensor parallelism).
    """
    import torch
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    if not torch.cuda.is_available():
        raise ValueError("device 'auto' shards the model over GPUs, but no CUDA device is visible")
    no_split = list(getattr(model, "_no_split_modules", None) or [])
    max_memory = get_balanced_memory(model, no_split_module_classes=no_split)
    device_map = infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split)
    logger.info("sharding over %d GPUs: %s", torch.cuda.device_count(), device_map)
    return dispatch_model(model, device_map=device_map)


def vocab_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """SHA-256 over the sorted vocabulary and added tokens.

    Draft and target must share token ids exactly or speculation silently
    mismatches; comparing one short string across gRPC is the cheap check.
    """
    digest = hashlib.sha256()
    for token, index in sorted(tokenizer.get_vocab().items()):
        digest.update(json.dumps([token, index], ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    digest.update(b"--added--\n")
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    for index in sorted(added):
        token = added[index]
        entry = [index, str(token), bool(getattr(token, "special", False))]
        digest.update(json.dumps(entry, ensure_ascii=False).encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def _as_id_list(value: Any) -> list[int]:
    """Normalise an eos setting (None, int, or list of ints) into a list."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """All ids that end generation: generation_config's eos plus the tokenizer's, deduplicated.

    Chat models often stop on a token (``<|im_end|>``) different from the
    tokenizer's nominal eos, so both sources are needed.
    """
    generation_config = getattr(model, "generation_config", None)
    ids = _as_id_list(getattr(generation_config, "eos_token_id", None))
    if not ids:
        ids = _as_id_list(getattr(model.config, "eos_token_id", None))
    ids += _as_id_list(tokenizer.eos_token_id)
    return list(dict.fromkeys(ids))


def context_window(model: PreTrainedModel) -> int:
    """Maximum sequence length the model supports (positions), with a conservative fallback."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    logger.warning("model config has no context length; assuming %d", _FALLBACK_CONTEXT)
    return _FALLBACK_CONTEXT
