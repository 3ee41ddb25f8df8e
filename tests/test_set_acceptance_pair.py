"""The set-acceptance benchmark pair (benchmarks/set_acceptance_pair.py) at test size: its drafts agree
with the target's greedy token at the rate they were built for, in transformers and served, and a
model that ships its own code loads only with --trust-remote-code."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from harness import start_stack
from specmesh.loading.models import ModelNotFoundError, load_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["def add(a, b):", "class Counter:", "the quick brown fox"]
K = 4
MAX_TOKENS = 48


def load_builder():
    spec = importlib.util.spec_from_file_location("benchmarks_set_acceptance_pair",
                                                  ROOT / "benchmarks" / "set_acceptance_pair.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    return load_builder().build_pair(tmp_path_factory.mktemp("set-pair"), [0.0, 0.8, 1.0], small=True)


def hf(path: Path):
    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True).eval()


def target_outputs(pair) -> tuple[object, list[list[int]], list[torch.Tensor]]:
    """The tokenizer, each prompt's ids, and the target's greedy sequences (prompt included)."""
    tokenizer = AutoTokenizer.from_pretrained(str(pair["target"]))
    target = hf(pair["target"])
    prompts = [tokenizer.encode(prompt) for prompt in PROMPTS]
    with torch.inference_mode():
        outputs = [target.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[0] for ids in prompts]
    return tokenizer, prompts, outputs


def expected_acceptance(alpha: float, k: int) -> float:
    """Accepted over drafted tokens at a fixed k when each proposal agrees with probability alpha."""
    return sum(alpha ** i for i in range(1, k + 1)) / k


def test_each_draft_agrees_with_the_targets_greedy_token_at_its_alpha(pair):
    _, prompts, outputs = target_outputs(pair)
    for alpha, name in ((0.0, "draft-0"), (0.8, "draft-0.8"), (1.0, "draft-1")):
        draft = hf(pair[name])
        agreed = total = 0
        with torch.inference_mode():
            for ids, sequence in zip(prompts, outputs):
                proposals = draft(sequence[None]).logits[0, len(ids) - 1:-1].argmax(-1)  # [generated]
                agreed += int((proposals == sequence[len(ids):]).sum())
                total += len(sequence) - len(ids)
        assert total == len(PROMPTS) * MAX_TOKENS  # the target's walk never meets its end-of-sequence token
        assert abs(agreed / total - alpha) < 0.07, (name, agreed / total)


def test_transformers_assisted_generation_with_the_draft_gives_the_targets_output(pair):
    tokenizer, prompts, outputs = target_outputs(pair)
    target, draft = hf(pair["target"]), hf(pair["draft-0.8"])
    with torch.inference_mode():
        for ids, sequence in zip(prompts, outputs):
            assisted = target.generate(torch.tensor([ids]), assistant_model=draft, max_new_tokens=MAX_TOKENS,
                                       do_sample=False, pad_token_id=tokenizer.pad_token_id)[0]
            assert torch.equal(assisted, sequence)


def test_a_model_that_ships_its_own_code_loads_only_when_trusted(pair):
    with pytest.raises(ModelNotFoundError, match="--trust-remote-code"):
        load_model(str(pair["target"]))
    model, _ = load_model(str(pair["target"]), trust_remote_code=True)
    assert type(model).__name__ == "SetAcceptanceForCausalLM"


async def test_served_greedy_output_is_the_targets_at_the_set_acceptance(pair):
    _, prompts, outputs = target_outputs(pair)
    stack = await start_stack(pair["target"], pair["draft-0.8"], k=K, trust_remote_code=True)
    try:
        drafted = accepted = 0
        for prompt, ids, sequence in zip(PROMPTS, prompts, outputs):
            tokens, _, last = await stack.generate(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0)
            assert tokens == sequence[len(ids):].tolist()
            drafted += last.stats.draft_tokens
            accepted += last.stats.accepted_tokens
    finally:
        await stack.stop()
    assert abs(accepted / drafted - expected_acceptance(0.8, K)) < 0.08, accepted / drafted


def test_specmesh_bench_serves_and_assists_with_the_pair_only_with_trust_remote_code(pair, tmp_path):
    """The flag reaches both services (child processes) and the in-process peer."""
    command = [sys.executable, "-m", "orchestrator.cli.main", "bench", "--target", str(pair["target"]),
               "--draft", str(pair["draft-0.8"]), "--num-speculative-tokens", str(K), "--speculation-policy",
               "fixed", "--kinds", "code", "--num-prompts", "2", "--max-tokens", "24", "--max-concurrency", "1",
               "--temperature", "0", "--peer-k", str(K), "--num-warmups", "0", "--result-dir", str(tmp_path / "out")]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    refused = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=240)
    assert refused.returncode != 0 and "--trust-remote-code" in refused.stdout + refused.stderr
    done = subprocess.run([*command, "--trust-remote-code"], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    modes = json.loads((tmp_path / "out" / "result.json").read_text())["configurations"][0]["modes"]
    assert modes["on"]["overall"]["completed"] == modes[f"peer k={K}"]["overall"]["completed"] == 2
    assert abs(modes["on"]["overall"]["acceptance_rate"] - expected_acceptance(0.8, K)) < 0.15
