"""Fast, offline tests of embedded-model assembly, spec resolution and fingerprints.

No real model is touched: parts are a few bytes in a temp dir and fake part
"packages" are real dist-info directories put on ``sys.path``, so the
metadata-only lookup is exercised exactly as in production.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from specmesh.loading import embedded
from specmesh.loading.embedded import (EMBEDDED_MODELS, EmbeddedModel, EmbeddedPartsMissingError, ModelIntegrityError,
                                       ModelNotFoundError, assemble_parts, resolve_embedded, stamp_path,
                                       verify_or_reassemble)
from specmesh.loading.models import (context_window, eos_token_ids, load_model, load_tokenizer, resolve_spec,
                                     vocab_fingerprint)

pytestmark = pytest.mark.unit

PARTS = [b"alpha-", b"beta-", b"gamma"]
JOINED_SHA = hashlib.sha256(b"".join(PARTS)).hexdigest()


def _write_parts(directory: Path, chunks: list[bytes] = PARTS) -> list[Path]:
    paths = []
    for i, chunk in enumerate(chunks, start=1):
        path = directory / f"part{i:02d}.bin"
        path.write_bytes(chunk)
        paths.append(path)
    return paths


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# --- assemble_parts ------------------------------------------------------------------------


def test_assemble_in_order_matches_hash(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    assert assemble_parts(parts, dest, JOINED_SHA) == dest
    assert dest.read_bytes() == b"".join(PARTS)
    assert _leftovers(dest.parent) == []


def test_wrong_order_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(ModelIntegrityError, match="sha256"):
        assemble_parts(list(reversed(parts)), dest, JOINED_SHA)
    assert not dest.exists()
    assert _leftovers(dest.parent) == []


def test_wrong_hash_keeps_existing_dest_untouched(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path)
    dest = tmp_path / "model.gguf"
    dest.write_bytes(b"previous")
    with pytest.raises(ModelIntegrityError):
        assemble_parts(parts, dest, "0" * 64)
    assert dest.read_bytes() == b"previous"


# --- stamp-based re-verification ------------------------------------------------------------


def test_matching_stamp_skips_rehash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _write_parts(tmp_path)
    dest = tmp_path / "cache" / "model.gguf"
    verify_or_reassemble(parts, dest, JOINED_SHA)
    assert json.loads(stamp_path(dest).read_text())["sha256"] == JOINED_SHA

    def no_hash(path: Path) -> str:
        raise AssertionError("re-hashed although the stamp matched")

    monkeypatch.setattr(embedded, "hash_file", no_hash)
    monkeypatch.setattr(embedded, "assemble_parts", no_hash)
    assert verify_or_reassemble(parts, dest, JOINED_SHA) == dest


def test_changed_file_forces_rehash_and_repair(tmp_path: Path) -> None:
    parts = _write_parts(tmp_path)
    dest = tmp_path / "cache" / "model.gguf"
    verify_or_reassemble(parts, dest, JOINED_SHA)
    dest.write_bytes(b"X" * dest.stat().st_size)  # same size, different bytes and mtime
    os.utime(dest, ns=(0, 0))
    verify_or_reassemble(parts, dest, JOINED_SHA)
    assert dest.read_bytes() == b"".join(PARTS)


def test_missing_stamp_rehashes_valid_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parts = _write_parts(tmp_path)
    dest = tmp_path / "cache" / "model.gguf"
    verify_or_reassemble(parts, dest, JOINED_SHA)
    stamp_path(dest).unlink()
    calls: list[Path] = []
    real_hash = embedded.hash_file
    monkeypatch.setattr(embedded, "hash_file", lambda p: calls.append(p) or real_hash(p))
    verify_or_reassemble(parts, dest, JOINED_SHA)
    assert calls == [dest] and stamp_path(dest).is_file()


# --- resolve_embedded through real package metadata --------------------------------------------


def _fake_model(monkeypatch: pytest.MonkeyPatch, site: Path, install: int) -> EmbeddedModel:
    """Register a fake alias whose first ``install`` parts exist as dist-info packages."""
    model = EmbeddedModel(alias="fake-model", upstream="none/fake", role="draft",
                          dist_prefix="specmesh-fake-part", module_prefix="specmesh_fake_part",
                          num_parts=len(PARTS), version="0.1.0", sha256=JOINED_SHA,
                          filename="fake.gguf")
    for i, chunk in enumerate(PARTS[:install], start=1):
        rel = model.part_relpath(i)
        (site / rel).parent.mkdir(parents=True)
        (site / rel).write_bytes(chunk)
        info = site / f"specmesh_fake_part{i}-0.1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: specmesh-fake-part{i}\n"
                                       "Version: 0.1.0\n")
        (info / "RECORD").write_text(f"{rel},,\n{info.name}/METADATA,,\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setitem(EMBEDDED_MODELS, model.alias, model)
    return model


def test_resolve_embedded_via_metadata(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_model(monkeypatch, tmp_path / "site", install=len(PARTS))
    path = resolve_embedded("fake-model", cache_dir=tmp_path / "cache")
    assert path == tmp_path / "cache" / "fake-model" / "fake.gguf"
    assert path.read_bytes() == b"".join(PARTS)


def test_missing_part_package_says_how_to_install(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_model(monkeypatch, tmp_path / "site", install=len(PARTS) - 1)
    with pytest.raises(EmbeddedPartsMissingError, match=r"specmesh\[models\]"):
        resolve_embedded("fake-model", cache_dir=tmp_path / "cache")


def test_real_aliases_are_pinned() -> None:
    assert EMBEDDED_MODELS["qwen2.5-coder-1.5b"].num_parts == 22
    assert EMBEDDED_MODELS["qwen2.5-coder-0.5b"].num_parts == 6
    with pytest.raises(ModelNotFoundError, match="known"):
        resolve_embedded("qwen-typo")


# --- spec resolution ---------------------------------------------------------------------


def test_unknown_spec_is_model_not_found(tmp_path: Path) -> None:
    for spec in ["no-such-model", str(tmp_path / "missing.gguf"), str(tmp_path / "x.bin")]:
        with pytest.raises(ModelNotFoundError, match="not an embedded alias"):
            load_model(spec)
        with pytest.raises(ModelNotFoundError):
            load_tokenizer(spec)


def test_spec_classification(tmp_path: Path) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert resolve_spec(str(gguf)).gguf_file == "m.gguf"
    assert resolve_spec(str(tmp_path)).kind == "gguf"  # a dir holding exactly one .gguf
    (tmp_path / "config.json").write_text("{}")
    assert resolve_spec(str(tmp_path)).kind == "dir"
    assert resolve_spec("Qwen/Qwen2.5-Coder-0.5B-Instruct").kind == "hub"


# --- fingerprints, eos, context ------------------------------------------------------------


def _tokenizer(extra_sentence: str = "", added: list[str] | None = None):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["def quicksort ( arr ) :", "return sorted ( arr )", extra_sentence]
    raw.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="</s>")
    if added:
        tokenizer.add_tokens(added)
    return tokenizer


def test_vocab_fingerprint_same_vocab_same_value() -> None:
    first, second = _tokenizer(), _tokenizer()
    assert first is not second
    assert vocab_fingerprint(first) == vocab_fingerprint(second)
    assert len(vocab_fingerprint(first)) == 64


def test_vocab_fingerprint_changes_with_vocab() -> None:
    base = vocab_fingerprint(_tokenizer())
    assert vocab_fingerprint(_tokenizer("lambda yield")) != base
    assert vocab_fingerprint(_tokenizer(added=["<tool>"])) != base


def test_eos_token_ids_union() -> None:
    tokenizer = SimpleNamespace(eos_token_id=2)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 2]),
                            config=SimpleNamespace(eos_token_id=9))
    assert eos_token_ids(model, tokenizer) == [5, 2]
    model.generation_config.eos_token_id = 7
    assert eos_token_ids(model, tokenizer) == [7, 2]
    model.generation_config = None
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=None)) == [9]


def test_context_window() -> None:
    assert context_window(SimpleNamespace(config=SimpleNamespace(max_position_embeddings=32768))) \
        == 32768
    assert context_window(SimpleNamespace(config=SimpleNamespace(n_positions=1024))) == 1024
    assert context_window(SimpleNamespace(config=SimpleNamespace())) == 2048
