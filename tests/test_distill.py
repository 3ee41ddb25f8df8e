"""`specmesh distill`: the acceptance replay equals real speculation, distillation raises a poor
draft's held-out acceptance, the distilled directory serves losslessly, and bad inputs fail clearly."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import torch
from harness import load, start_stack
from benchmarks.tiny_models import TINY_PROMPTS

from orchestrator.distill import defaults, teacher
from orchestrator.distill.acceptance import replay_rounds
from orchestrator.distill.draft_length import choose_k, position_rates, relative_speed
from orchestrator.distill.early_stopping import EarlyStopping
from orchestrator.distill.examples import DistillInputError, Example, check_token_ids, load_examples, split_examples
from orchestrator.distill.training import bucket_divergence
from orchestrator.cli import main as cli
from parity import target_greedy
from specmesh.loading.models import eos_token_ids, load_model, vocab_fingerprint
from target_service.disagreements import DisagreementLog, context_hash
from workloads import word_prompts


def no_progress(items, label):
    return items


def replayed_rounds(target_dir, draft_dir, device, prompts, k, max_tokens):
    """Per prompt: (the target's greedy continuation, the replayed AcceptanceStats)."""
    target, tokenizer = load(str(target_dir), device)
    draft, _ = load(str(draft_dir), device)
    ids = [tokenizer.encode(p) for p in prompts]
    continuations = teacher.greedy_continuations(target, ids, max_tokens, 8, 0, no_progress)  # [N, L]
    argmax = teacher.teacher_forced_argmax(draft, ids, continuations, 8, 0, no_progress, "draft")  # [N, L]
    target_eos, draft_eos = set(eos_token_ids(target, tokenizer)), set(eos_token_ids(draft, tokenizer))
    return [(c, replay_rounds(c, a, k, max_tokens, target_eos, draft_eos))
            for c, a in zip(continuations.tolist(), argmax.tolist())]


@pytest.mark.parametrize("k", [2, 5])
async def test_replayed_rounds_equal_served_speculation(tiny_llama_dir, tiny_llama_perturbed_dir, device, k):
    max_tokens = 24
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=k, device=device)
    try:
        served = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=max_tokens, temperature=0.0)
                                        for p in TINY_PROMPTS))
    finally:
        await stack.stop()
    replayed = replayed_rounds(tiny_llama_dir, tiny_llama_perturbed_dir, device, TINY_PROMPTS, k, max_tokens)
    for prompt, (token_ids, _, last), (continuation, stats) in zip(TINY_PROMPTS, served, replayed):
        assert token_ids == continuation[:len(token_ids)], prompt
        assert (stats.accepted_tokens, stats.rounds) == (last.stats.accepted_tokens, last.stats.rounds), prompt
        assert stats.tokens_per_round == pytest.approx(last.stats.tokens_per_round, rel=1e-6), prompt
    accepted = sum(stats.accepted_tokens for _, stats in replayed)
    assert 0 < accepted < sum(stats.draft_tokens for _, stats in replayed)  # partial: the runs matter


def test_replay_stops_at_the_targets_eos():
    eos = 0
    continuation = [5, 6, 7, eos, 9, 9, 9, 9]
    stats = replay_rounds(continuation, continuation, k=2, max_tokens=8, target_eos={eos}, draft_eos={eos})
    # one round: 6 and 7 accepted, the target adds eos, generation ends
    assert (stats.rounds, stats.accepted_tokens, stats.draft_tokens, stats.round_tokens) == (1, 2, 2, 3)


def test_divergences_vanish_only_when_the_draft_matches():
    logits = torch.randn(2, 3, 50)  # [B, L, V]
    probs = torch.softmax(logits, -1)
    top = probs.topk(8, dim=-1)
    for divergence in ("kl", "tvd"):
        same = bucket_divergence(logits, top.indices, top.values, divergence)  # [B, L]
        other = bucket_divergence(torch.randn(2, 3, 50), top.indices, top.values, divergence)
        assert same.abs().max() < 1e-5 and (other > 1e-3).all()


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, tiny_llama_dir, tiny_llama_unrelated_dir):
    """An unrelated (near-zero acceptance) draft distilled from tiny_llama with LoRA: (dir, report)."""
    root = tmp_path_factory.mktemp("distill")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(word_prompts(120, seed=1)) + "\n")
    output = root / "draft"
    code = cli.main(["distill", "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_unrelated_dir),
                     "--prompts", str(prompts), "--output", str(output), "--lora-rank", "16",
                     "--learning-rate", "1e-2", "--steps", "60", "--batch-size", "32", "--max-new-tokens", "16",
                     "--held-out-fraction", "0.25", "--k", "4", "--no-progress"])
    assert code == 0
    return output, json.loads((output / "distill_report.json").read_text())


def test_distillation_raises_held_out_acceptance(distilled, tiny_llama_dir):
    output, report = distilled
    assert (report["train_prompts"], report["validation_prompts"], report["held_out_prompts"]) == (78, 12, 30)
    assert report["after"]["acceptance_rate"] >= report["before"]["acceptance_rate"] + 0.15, report
    assert report["after"]["tokens_per_round"] > report["before"]["tokens_per_round"] * 1.3
    assert report["loss"]["last"] < report["loss"]["first"]
    for name in ("model.safetensors", "config.json", "tokenizer.json", "chat_template.jinja", "loss.png",
                 "distill_report.md"):
        assert (output / name).is_file(), name
    assert not (output / "adapter_config.json").exists()  # the LoRA adapter is merged into the weights
    model, tokenizer = load_model(str(output))
    assert vocab_fingerprint(tokenizer) == vocab_fingerprint(load(str(tiny_llama_dir), "cpu")[1])
    assert not any("lora" in name for name, _ in model.named_parameters())


async def test_serving_the_distilled_draft_keeps_greedy_parity(distilled, tiny_llama_dir, device):
    output, _ = distilled
    stack = await start_stack(tiny_llama_dir, output, k=4, device=device)
    try:
        results = await asyncio.gather(*(stack.generate(prompt=p, max_tokens=32, temperature=0.0)
                                         for p in TINY_PROMPTS))
    finally:
        await stack.stop()
    for prompt, (token_ids, _, last) in zip(TINY_PROMPTS, results):
        assert tuple(token_ids) == target_greedy(str(tiny_llama_dir), device, prompt, 32), prompt
        assert not last.stats.draft_fallback
    assert sum(last.stats.accepted_tokens for _, _, last in results) > 0


def write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("case, expected", [
    ("empty", "no prompts"),
    ("bad json line", "prompts.jsonl:2: not valid JSON"),
    ("jsonl without prompt", "prompts.jsonl:1: field 'prompt'"),
    ("log without context", "--disagreement-log-context"),
    ("missing output parent", "parent directory"),
    ("other vocabulary", "different vocabularies"),
])
def test_bad_inputs_fail_naming_the_problem(case, expected, tmp_path, capsys, tiny_llama_dir,
                                            other_vocab_model_dir):
    prompts, output, draft = tmp_path / "prompts.jsonl", tmp_path / "out", tiny_llama_dir
    prompts.write_text('{"prompt": "The quick brown fox"}\n{"prompt": "Once upon a time"}\n')
    if case == "empty":
        prompts.write_text("\n\n")
    elif case == "bad json line":
        prompts.write_text('{"prompt": "The quick brown fox"}\n{"prompt": "Once upon\n')
    elif case == "jsonl without prompt":
        prompts.write_text('{"text": "The quick brown fox"}\n')
    elif case == "log without context":
        write_log(prompts, [{"request_id": "r", "position": 4, "context_hash": "0" * 16, "draft_token_id": 3}])
    elif case == "missing output parent":
        output = tmp_path / "no" / "such" / "out"
    else:
        draft = other_vocab_model_dir
    code = cli.main(["distill", "--target", str(tiny_llama_dir), "--draft", str(draft), "--prompts", str(prompts),
                     "--output", str(output), "--no-progress"])
    error = capsys.readouterr().err
    assert code == 2 and expected in error, error
    assert not output.exists()


async def test_a_disagreement_log_with_contexts_becomes_distillation_prompts(tmp_path, tiny_llama_dir,
                                                                            tiny_llama_perturbed_dir, device):
    log_path = tmp_path / "disagreements.jsonl"
    log = DisagreementLog(log_path, max_per_second=1e6, include_context=True)
    stack = await start_stack(tiny_llama_dir, tiny_llama_perturbed_dir, k=4, device=device, disagreements=log)
    try:
        for prompt in TINY_PROMPTS[:4]:
            await stack.generate(prompt=prompt, max_tokens=24, temperature=0.0)
    finally:
        await stack.stop()
        log.close()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(records) > 3
    for record in records:  # the context is exactly what the hash was taken over
        assert len(record["context_token_ids"]) == record["position"]
        assert context_hash(record["context_token_ids"]) == record["context_hash"]
    _, tokenizer = load(str(tiny_llama_dir), device)
    examples = load_examples(log_path, tokenizer, max_prompt_tokens=1000)
    contexts = {r["context_hash"]: tuple(r["context_token_ids"]) for r in records}
    assert sorted(e.prompt_token_ids for e in examples) == sorted(contexts.values())
    with pytest.raises(DistillInputError, match="outside the vocabulary"):
        check_token_ids(examples, vocab_size=3)


def test_distill_reads_prompt_token_ids(tmp_path, tiny_llama_dir):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6, 7]}\n{"prompt_token_ids": [5, 6, 7]}\n{"prompt_token_ids": [9]}\n')
    _, tokenizer = load(str(tiny_llama_dir), "cpu")
    assert [e.prompt_token_ids for e in load_examples(path, tokenizer, 2)] == [(6, 7), (9,)]
    path.write_text('{"prompt_token_ids": []}\n')
    with pytest.raises(DistillInputError, match="prompt_token_ids"):
        load_examples(path, tokenizer, 2)


def test_full_fine_tune_from_chat_prompts_under_bfloat16(tmp_path, tiny_llama_dir, tiny_llama_perturbed_dir):
    """Rank 0 trains every weight; chat messages go through the template; bf16 teacher and autocast."""
    prompts = tmp_path / "chat.jsonl"
    write_log(prompts, [{"messages": [{"role": "user", "content": p}]} for p in word_prompts(16, seed=2)])
    output = tmp_path / "draft"
    code = cli.main(["distill", "--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
                     "--prompts", str(prompts), "--output", str(output), "--lora-rank", "0", "--steps", "3",
                     "--batch-size", "16", "--max-new-tokens", "8", "--teacher-dtype", "bfloat16",
                     "--train-dtype", "bfloat16", "--on-policy-samples", "1", "--patience", "0", "--force",
                     "--no-progress"])
    assert code in (0, 3)  # three steps may not gain: --force writes the model either way
    report = json.loads((output / "distill_report.json").read_text())
    assert (report["train_prompts"], report["training_sequences"]) == (11, 22)  # target + on-policy per prompt
    before, _ = load(str(tiny_llama_perturbed_dir), "cpu")
    after, _ = load_model(str(output))
    changed = [name for name, weight in after.state_dict().items()
               if not torch.equal(weight, before.state_dict()[name])]
    assert after.dtype == torch.float32 and len(changed) == len(before.state_dict())


def run_defaults(tmp_path, target_dir, draft_dir, prompt_count, *flags):
    """`specmesh distill` with only the required flags (and `flags`): (exit code, output dir)."""
    tmp_path.mkdir(exist_ok=True)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(word_prompts(prompt_count, seed=3)) + "\n")
    output = tmp_path / "draft"
    code = cli.main(["distill", "--target", str(target_dir), "--draft", str(draft_dir), "--prompts", str(prompts),
                     "--output", str(output), "--no-progress", *flags])
    return code, output


def test_the_defaults_improve_a_poor_draft_on_80_prompts(tmp_path, capsys, tiny_llama_dir, tiny_llama_unrelated_dir):
    code, output = run_defaults(tmp_path, tiny_llama_dir, tiny_llama_unrelated_dir, 80)
    assert code == 0, capsys.readouterr().out
    report = json.loads((output / "distill_report.json").read_text())
    settings = report["settings"]
    assert (settings["lora_rank"], settings["learning_rate"]) == (0, 1e-3)  # a tiny draft: full fine-tune
    assert (report["train_prompts"], report["validation_prompts"], report["held_out_prompts"]) == (56, 8, 16)
    assert 1 <= settings["k"] <= 7 and settings["k_source"] == "chosen on the validation prompts"
    before, after = report["before"], report["after"]
    assert after["acceptance_rate"] >= before["acceptance_rate"] + 0.15, report
    assert after["tokens_per_round"] >= 1.1 * before["tokens_per_round"], report
    assert report["improved"] and (output / "model.safetensors").is_file()
    assert report["early_stopping"]["evaluations"][0][0] == 0  # the untrained draft was scored too


def test_a_draft_that_cannot_improve_exits_3_and_writes_nothing_unless_forced(tmp_path, capsys, tiny_llama_dir):
    """The target as its own draft accepts everything already: training can only match it."""
    code, output = run_defaults(tmp_path / "plain", tiny_llama_dir, tiny_llama_dir, 24, "--max-new-tokens", "12")
    printed = capsys.readouterr().out
    assert code == 3 and "NO GAIN" in printed, printed
    assert not output.exists()
    code, output = run_defaults(tmp_path / "forced", tiny_llama_dir, tiny_llama_dir, 24, "--max-new-tokens", "12",
                                "--force")
    report = json.loads((output / "distill_report.json").read_text())
    assert code == 3 and (output / "model.safetensors").is_file()
    assert (report["improved"], report["written"]) == (False, True)
    assert report["after"]["acceptance_rate"] == report["before"]["acceptance_rate"] > 0.9


def test_k_is_where_expected_tokens_per_second_peak():
    falling = [0.9, 0.9, 0.9, 0.3, 0.3, 0.3, 0.3]  # acceptance drops after the third position
    assert choose_k(falling, cost_ratio=0.1, k_max=7) == 3
    assert choose_k(falling, cost_ratio=1.0, k_max=7) == 1  # a draft as slow as the target: shortest rounds
    assert choose_k([0.95] * 7, cost_ratio=0.01, k_max=7) == 7
    assert choose_k([0.95] * 7, cost_ratio=0.01, k_max=4) == 4  # never past the server's most
    assert relative_speed(falling, 3, 0.1) == pytest.approx((1 + 0.9 + 0.81 + 0.729) / 1.3)


def test_k_follows_the_replayed_acceptance_per_position():
    """Every round of a draft that gets two tokens right and the third wrong: k = 2 at a cheap draft."""
    continuation = list(range(10, 60))
    draft = [token if (index - 1) % 3 != 2 else 0 for index, token in enumerate(continuation)]
    stats = replay_rounds(continuation, draft, k=7, max_tokens=50, target_eos=set(), draft_eos=set())
    rates = position_rates(stats, positions=7)
    assert rates[0] > 0.9 and rates[1] > 0.9 and rates[2] < 0.2
    assert choose_k(rates, cost_ratio=0.1, k_max=7) == 2


@pytest.mark.parametrize("prompts, train, validation, held_out, steps", [
    (50, 35, 5, 10, defaults.MIN_STEPS),  # a small set still gets a real budget (early stopping ends it)
    (50_000, 48_800, 200, 1000, defaults.MAX_STEPS),  # a huge one is capped, its evaluations too
])
def test_the_budget_grows_with_the_prompts_within_bounds(prompts, train, validation, held_out, steps):
    examples = [Example(str(i), (i,)) for i in range(prompts)]
    split = split_examples(examples, held_out_fraction=0.2, seed=0)
    assert [len(part) for part in split] == [train, validation, held_out]
    flags = argparse.Namespace(steps=None, epochs=None, batch_size=8, on_policy_samples=0)
    used = min(train, defaults.training_prompt_limit(flags))
    assert defaults.training_steps(flags, used) == steps
    assert steps * flags.batch_size >= used  # at least one pass over what was made into data
    assert defaults.evaluation_interval(validation, 8) * 5 <= steps


def test_the_method_and_rate_follow_the_drafts_size_unless_given():
    tiny, half_billion = 100_000, 494_000_000
    assert defaults.lora_rank_for(tiny, None) == 0 and defaults.lora_rank_for(half_billion, None) == 16
    assert defaults.lora_rank_for(half_billion, 0) == 0 and defaults.lora_rank_for(tiny, 8) == 8
    assert defaults.learning_rate_for(16, None) == defaults.LEARNING_RATE["lora"]
    assert defaults.learning_rate_for(0, 5e-4) == 5e-4


def test_early_stopping_keeps_the_best_weights_and_cuts_the_rate_before_stopping():
    model = torch.nn.Linear(2, 2)
    scores = iter([0.5, 0.7, 0.6, 0.6, 0.6, 0.65, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6])
    stopping = EarlyStopping(score=lambda m: next(scores), interval=1, patience=3, cuts_left=1)
    outcomes, best_weight = [], None
    for step in range(12):
        with torch.no_grad():
            model.weight.add_(1.0)  # every "step" changes the weights
        outcomes.append(stopping.evaluate(model, step))
        if outcomes[-1] == "improved":
            best_weight = model.weight.detach().clone()
        if outcomes[-1] == "stop":
            break
    assert outcomes == ["improved", "improved", "wait", "wait", "cut", "wait", "wait", "stop"]
    stopping.restore_best(model)
    assert torch.equal(model.weight, best_weight) and stopping.best == 0.7 and stopping.best_step == 1


def test_the_teacher_on_onednn_gives_the_same_reference_continuations(tiny_llama_dir):
    """distill puts the float32 teacher on the services' faster kernel where it is faster: the held-out
    reference (what greedy serving commits) must not change with the kernel."""
    from specmesh.loading.cpu_linear import OneDnnLinear, choose_cpu_linear, onednn_usable

    if not onednn_usable("cpu"):
        pytest.skip("no oneDNN on this CPU")
    prompts = [tuple(range(5 + i, 12 + 2 * i)) for i in range(6)]  # ragged lengths: padding is exercised
    model, _ = load_model(str(tiny_llama_dir))
    on_torch = teacher.greedy_continuations(model, prompts, 12, 4, 0, lambda items, label: items)
    assert choose_cpu_linear(model, "onednn", "cpu") == "onednn"
    assert any(isinstance(module, OneDnnLinear) for module in model.modules())
    on_onednn = teacher.greedy_continuations(model, prompts, 12, 4, 0, lambda items, label: items)
    assert torch.equal(on_torch, on_onednn)
