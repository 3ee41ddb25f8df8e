"""The `specmesh` command as a user runs it: serve in one process, generate from another."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

from serve_cli import ROOT, specmesh, start_serve


def test_serve_then_generate_json(tiny_llama_dir, tiny_llama_perturbed_dir):
    process, endpoint, lines = start_serve("--target", str(tiny_llama_dir), "--draft", str(tiny_llama_perturbed_dir),
                                       "--num-speculative-tokens", "3", "--metrics-port", "-1",
                                       # a draft as large as the target never pays: the default policy would not draft
                                       "--speculation-policy", "fixed")
    try:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        done = subprocess.run(specmesh("generate", "--endpoint", endpoint, "--max-tokens", "12", "--json",
                                       "def add(a, b):"), capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert set(result) == {"text", "token_ids", "finish_reason", "stats"}
        assert 0 < len(result["token_ids"]) <= 12 and result["finish_reason"] in ("stop", "length")
        assert {"draft_tokens", "accepted_tokens", "acceptance_rate", "rounds", "target_forward_passes",
                "ttft_ms", "tpot_ms", "e2e_ms"} <= set(result["stats"])
        assert result["stats"]["draft_tokens"] > 0
        for process_name in ("draft", "target", "orchestrator"):  # each froze its start-up heap before ready
            assert any(f"{process_name}: " in line and "left out of garbage collection" in line for line in lines)
        http = re.search(r"OpenAI API (\S+)", "\n".join(lines)).group(1)
        models = json.loads(urllib.request.urlopen(f"{http}/models", timeout=30).read())
        assert models["data"][0]["id"] == str(tiny_llama_dir)
        bad = subprocess.run(specmesh("generate", "--endpoint", endpoint, "--max-tokens", "0", "hi"),
                             capture_output=True, text=True, env=env, timeout=60)
        assert bad.returncode == 2 and "INVALID_ARGUMENT" in bad.stderr and "max_tokens" in bad.stderr
        listed = subprocess.run(specmesh("replicas", "--endpoint", endpoint), capture_output=True, text=True, env=env,
                                timeout=60)
        # each replica with what it runs: the target in float32 (--dtype's default), the draft as auto resolved
        assert listed.returncode == 0 and re.search(r"target-0 .*\(float32, (onednn|torch) linear\)", listed.stdout)
        assert re.search(r"draft-0 .*\((int8|float32|bfloat16), (onednn|torch) linear\)", listed.stdout), listed.stdout
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


def test_unknown_model_fails_fast(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(specmesh("serve", "--port", "0", "--target", str(tmp_path / "nope"), "--draft", "none"),
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "target failed to start" in done.stderr and "nope" in done.stderr


def test_the_client_commands_load_neither_torch_nor_transformers():
    """`specmesh generate` and the other client commands start in about a second, not the ten that
    importing the serving code takes; `serve` still parses its whole set of flags."""
    code = ("import sys\nfrom orchestrator.cli.main import CLIENT_COMMANDS, main\n"
            "for command in CLIENT_COMMANDS:\n"
            "    try:\n        main([command, '--help'])\n    except SystemExit as exit_:\n"
            "        assert exit_.code == 0, command\n"
            "print(sorted(name for name in ('torch', 'transformers', 'ray') if name in sys.modules))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    assert "usage: specmesh rollout" in done.stdout and done.stdout.strip().splitlines()[-1] == "[]"
    serve_help = subprocess.run(specmesh("serve", "--help"), capture_output=True, text=True, timeout=300, cwd=ROOT,
                                env=env)
    assert serve_help.returncode == 0 and "--num-speculative-tokens" in serve_help.stdout
