"""Compact draft distributions, the detokenizer with stop strings, and the generated stubs."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestrator.serving.detokenizer import IncrementalDetokenizer
from specmesh.engine.distributions import TAIL_MASS, decode_distribution, encode_distribution
from specmesh.engine.sampling_params import SamplingParams
from specmesh.engine.sampling import logits_to_probs
from specmesh.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[1]


def fp16_rounded(probs: torch.Tensor) -> torch.Tensor:
    rounded = probs.half().float()
    return rounded / rounded.sum()


@pytest.mark.unit
def test_truncated_distribution_goes_sparse_and_round_trips_exactly():
    torch.manual_seed(0)
    probs = logits_to_probs(torch.randn(1, 1000), SamplingParams(0.8, top_k=10))[0]  # [V]
    wire = encode_distribution(probs)
    assert wire.WhichOneof("form") == "sparse" and len(wire.sparse.token_ids) == 10
    assert torch.equal(decode_distribution(wire, 1000), fp16_rounded(probs))


@pytest.mark.unit
def test_a_near_point_mass_travels_as_one_id():
    """A confident draft's q (every other entry far below fp16's range) costs one id and one probability,
    not 2 bytes per vocabulary entry: 152k of them would be 300 KB a draft token."""
    logits = torch.randn(1, 152064)
    logits[0, 7] = logits.max() + 30
    wire = encode_distribution(logits_to_probs(logits, SamplingParams(1.0))[0])
    assert wire.WhichOneof("form") == "sparse" and list(wire.sparse.token_ids) == [7]
    assert wire.ByteSize() < 16


@pytest.mark.unit
@pytest.mark.parametrize("scale", [4.0, 6.0, 8.0])
def test_the_dropped_tail_holds_at_most_tail_mass(scale):
    """Peaked distributions (large logit spread) drop their tail to go sparse; what the target tests is the
    decoded q', which the draft samples from, so only acceptance can change, by at most TAIL_MASS."""
    torch.manual_seed(int(scale))
    probs = logits_to_probs(torch.randn(1, 50000) * scale, SamplingParams(1.0))[0]  # [V]
    wire = encode_distribution(probs)
    decoded = decode_distribution(wire, 50000)
    kept = decoded > 0
    assert wire.WhichOneof("form") == "sparse" and int(kept.sum()) < 50000 // 4
    assert float(probs[~kept].sum()) <= TAIL_MASS
    assert torch.equal(decoded, fp16_rounded(torch.where(kept, probs, torch.zeros_like(probs))))
    assert float(torch.minimum(probs, decoded).sum()) >= 1 - TAIL_MASS - 1e-3  # the acceptance it allows


@pytest.mark.unit
def test_full_distribution_goes_dense_fp16():
    probs = logits_to_probs(torch.randn(1, 1000), SamplingParams(1.0))[0]
    wire = encode_distribution(probs)
    assert wire.WhichOneof("form") == "dense" and len(wire.dense.probs_fp16) == 2000
    decoded = decode_distribution(wire, 1000)
    assert abs(float(decoded.sum()) - 1) < 1e-5 and torch.allclose(decoded, probs, atol=1e-3)
    # a target with a larger vocabulary pads the draft's rows with zeros
    assert decode_distribution(wire, 1024)[1000:].eq(0).all()


@pytest.mark.unit
@pytest.mark.parametrize("wire", [
    common_pb2.TokenDistribution(),
    common_pb2.TokenDistribution(sparse=common_pb2.SparseDistribution(token_ids=[1, 2], probs=[1.0])),
    common_pb2.TokenDistribution(sparse=common_pb2.SparseDistribution(token_ids=[5000], probs=[1.0])),
    common_pb2.TokenDistribution(sparse=common_pb2.SparseDistribution(token_ids=[1], probs=[-1.0])),
    common_pb2.TokenDistribution(sparse=common_pb2.SparseDistribution(token_ids=[1], probs=[0.0])),
    common_pb2.TokenDistribution(dense=common_pb2.DenseDistribution(probs_fp16=b"\x00", vocab_size=1)),
    common_pb2.TokenDistribution(dense=common_pb2.DenseDistribution(probs_fp16=b"\x00\x7c", vocab_size=1)),
])
def test_malformed_distributions_are_refused(wire):
    with pytest.raises(ValueError):
        decode_distribution(wire, 1000)


def stream(tokenizer, prompt_ids, generated, stop=(), batch=3):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, stop)
    pieces, kept = [], []
    for start in range(0, len(generated), batch):
        chunk = generated[start:start + batch]
        text, consumed = detokenizer.add(chunk)
        pieces.append(text)
        kept += chunk[:consumed]
        if detokenizer.stopped:
            break
    pieces.append(detokenizer.finish())
    return "".join(pieces), kept


@pytest.mark.unit
def test_streamed_text_equals_full_decode(tiny_tokenizer):
    text = "def add(a, b):\n    return a + b  # ünïcode ✓"
    ids = tiny_tokenizer.encode(text)
    streamed, kept = stream(tiny_tokenizer, ids[:3], ids[3:])
    assert streamed == tiny_tokenizer.decode(ids[3:], skip_special_tokens=True) and kept == ids[3:]


@pytest.mark.unit
@pytest.mark.parametrize("stop", ["return", "a +", "\n"])
def test_stop_string_is_cut_with_the_tokens_after_it(tiny_tokenizer, stop):
    ids = tiny_tokenizer.encode("def add(a, b):\n    return a + b\nprint(add(1, 2))")
    full = tiny_tokenizer.decode(ids[2:], skip_special_tokens=True)
    streamed, kept = stream(tiny_tokenizer, ids[:2], ids[2:], stop=[stop, "never-there"], batch=1)
    assert streamed == full[: full.index(stop)]
    assert stop in tiny_tokenizer.decode(kept) and stop not in tiny_tokenizer.decode(kept[:-1])


def test_generated_stubs_are_up_to_date(tmp_path):
    protos = sorted((ROOT / "protos" / "specmesh" / "v1").glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'protos'}", f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)], check=True)
    generated = sorted(p.name for p in (tmp_path / "specmesh" / "v1").iterdir())
    match, mismatch, missing = filecmp.cmpfiles(tmp_path / "specmesh" / "v1", ROOT / "specmesh" / "v1", generated,
                                                shallow=False)
    assert not mismatch and not missing, "run: python -m grpc_tools.protoc -Iprotos --python_out=. " \
                                         "--pyi_out=. --grpc_python_out=. protos/specmesh/v1/*.proto"
