"""Is a step slow the first time its attention shape is met on this GPU (cuDNN attention builds a plan per shape)?

A random Qwen2.5-1.5B-shaped model in bf16; for distinct prompt lengths: a prefill, then a 4-row verify
step over its cache (first time at that shape), the same shape again, and a one-row step. Each length runs
under three SDPA settings in turn: torch's default backend choice, cuDNN attention disabled, and only
flash + memory-efficient. Prints the median ms of each (and the slowest).

    python docs/results/gpu-2026-11-26/attention_shapes.py cuda   # cpu: a 2-layer smoke run

Its H100 figures are h100-attention-shapes.txt, beside it.
"""
from __future__ import annotations

import statistics
import sys
import time

import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from specmesh.loading.hf_compat import cache_kwargs

dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
cfg = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  intermediate_size=8960, vocab_size=14400, max_position_embeddings=4096)
if dev == "cpu":
    cfg.num_hidden_layers = 2
cfg._attn_implementation = "sdpa"
torch.manual_seed(0)
with torch.device(dev):  # initialised on the device: seconds, not a minute on the CPU
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
print("torch", torch.__version__, "cudnn sdp enabled:", torch.backends.cuda.cudnn_sdp_enabled() if dev != "cpu" else None)

def sync():
    if dev != "cpu":
        torch.cuda.synchronize()

@torch.inference_mode()
def timed(ids, cache):
    sync(); t = time.perf_counter()
    out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=ids.shape[1])
    out.logits.float().cpu(); sync()
    return 1000 * (time.perf_counter() - t)

def setting(name):
    if dev == "cpu":
        return
    torch.backends.cuda.enable_cudnn_sdp(name == "default")
    torch.backends.cuda.enable_math_sdp(name != "flash+efficient")

results = {n: {"prefill": [], "verify4 first": [], "verify4 again": [], "one row": []}
           for n in ("default", "no cudnn", "flash+efficient")}
warm = torch.randint(0, 14000, (1, 64), device=dev)
timed(warm, DynamicCache())
lengths = list(range(101, 101 + 3 * 14, 3))  # distinct: every setting meets new shapes
for i, length in enumerate(lengths):
    for name in results:
        setting(name)
        n = length + {"default": 0, "no cudnn": 1, "flash+efficient": 2}[name] * 1000
        ids = torch.randint(0, 14000, (1, n), device=dev)
        cache = DynamicCache()
        r = results[name]
        r["prefill"].append(timed(ids, cache))
        r["verify4 first"].append(timed(ids[:, :4], cache)); cache.crop(-4)
        r["verify4 again"].append(timed(ids[:, :4], cache)); cache.crop(-4)
        r["one row"].append(timed(ids[:, :1], cache))
for name, r in results.items():
    print(f"{name:16s}", "  ".join(f"{k} {statistics.median(v):6.1f} (max {max(v):6.1f})" for k, v in r.items()))
