"""CPU of the emulated pair's steering per forward, by role and kept rows:
    PYTHONPATH=TREE python docs/results/emulated-2026-12-02-round-overhead/steer_cost.py PAIR_DIR
(PAIR_DIR: the pair benchmarks.regime built under its --work, e.g. /tmp/specmesh-regime/h100-8b-x1)"""
import sys, time, torch
from transformers import AutoModelForCausalLM
for role in ("draft-0.8", "target"):
    model = AutoModelForCausalLM.from_pretrained(f"{sys.argv[1]}/{role}", trust_remote_code=True).eval()
    V = model.config.vocab_size
    for rows in (1, 5):
        logits = torch.randn(1, rows, V); tokens = torch.randint(300, 3000, (1, rows)); positions = torch.arange(100, 100 + rows)[None]
        with torch.inference_mode():
            for _ in range(50): model.steer(logits, tokens, positions)
            t = time.process_time()
            for _ in range(1000): model.steer(logits, tokens, positions)
        print(f"{role} rows {rows}: steer {(time.process_time() - t) * 1e3:.0f} us CPU each (V {V})")
