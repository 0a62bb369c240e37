#!/usr/bin/env python3
"""Peak RSS and tokens/s of a PyTorch eager training step on the CPU, for
bench/memory.sh: the same nanoGPT shapes as pcp's presets (vocabulary 65, the demo
corpus's), AdamW, f32, random token ids. `--attention naive` materialises the
[batch, heads, T, T] scores as nanoGPT's reference code does; `sdpa` uses
PyTorch's fused scaled_dot_product_attention. `--warmup N` untimed steps come first (1 by default), as pcp's `bench step` runs 3
before it times. `--precision bf16` runs the forward
under CPU autocast to bf16 (matmuls and SDPA in bf16, weights and AdamW in f32), the
counterpart of pcp's `--precision bf16`. `--profile` also prints PyTorch's own
per-operator CPU times of the timed steps to stderr (`torch.profiler`), the
counterpart of pcp's `bench/profile_step.sh`. Prints one JSON line.

    python3 bench/torch_step_memory.py --model gpt2-124m --steps 3 --attention naive
"""

import argparse
import json
import math
import resource
import sys
import time

import torch
import torch.nn.functional as F

from torch_gpu_step import GPT, PRESETS, VOCAB, Block


class NaiveBlock(Block):
    """nanoGPT's reference attention: the [batch, heads, T, T] scores materialised."""

    def attend(self, q, k, v):
        t = q.shape[2]
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        return F.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt2-124m", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, help="sequences per step [default: the preset's]")
    p.add_argument("--attention", default="naive", choices=["naive", "sdpa"])
    p.add_argument("--precision", default="f32", choices=["f32", "bf16"])
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (pcp's bench step runs 3)")
    p.add_argument("--profile", action="store_true", help="per-operator CPU times of the timed steps, to stderr")
    a = p.parse_args()
    n_layer, nh, d, block, batch = PRESETS[a.model]
    batch = a.batch or batch
    torch.manual_seed(0)
    model = GPT(n_layer, nh, d, block, NaiveBlock if a.attention == "naive" else Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    idx = torch.randint(0, VOCAB, (batch, block + 1))
    x, y = idx[:, :-1], idx[:, 1:]
    losses = []

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16"):
            loss = model(x, y)
        loss.backward()
        opt.step()
        return loss.item()

    for _ in range(a.warmup):
        step()
    profiler = None
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CPU])
        profiler.__enter__()
    started = time.perf_counter()
    for _ in range(a.steps):
        losses.append(step())
    seconds = time.perf_counter() - started
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        print(f"per-operator self CPU time over {a.steps} step(s):\n{table}", file=sys.stderr)
    print(json.dumps({
        "framework": f"pytorch {torch.__version__} eager",
        "model": a.model,
        "attention": a.attention,
        "precision": a.precision,
        "batch": batch,
        "block": block,
        "steps": a.steps,
        "warmup": a.warmup,
        "tokens_per_s": batch * block * a.steps / seconds,
        # ru_maxrss is in KiB on Linux
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "last_loss": losses[-1],
    }))


if __name__ == "__main__":
    main()
