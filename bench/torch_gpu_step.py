#!/usr/bin/env python3
"""PyTorch training-step tokens/s on a GPU for bench/gpu_check.sh: the same nanoGPT
shapes as pcp's presets (vocabulary 65, the demo corpus's), AdamW, eager and
torch.compile, f32 (TF32 off) or bf16 autocast. Random token ids; prints one line.

    python3 bench/torch_gpu_step.py --model gpt2-124m --steps 20 --precision bf16
"""

import argparse
import time

import torch
import torch.nn.functional as F

PRESETS = {  # n_layer, n_head, n_embd, block, batch
    "nanogpt-small": (2, 4, 64, 32, 64),
    "nanogpt-medium": (4, 8, 256, 128, 64),
    "gpt2-124m": (12, 12, 768, 1024, 8),
}
VOCAB = 65


class Block(torch.nn.Module):
    def __init__(self, d, nh):
        super().__init__()
        self.nh = nh
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.c_attn, self.c_proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.c_fc, self.mlp_proj = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.nh, d // self.nh).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(d, 2))
        y = self.attend(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(torch.nn.Module):
    def __init__(self, n_layer, nh, d, block, block_type=Block):
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(VOCAB, d), torch.nn.Embedding(block, d)
        self.h = torch.nn.ModuleList(block_type(d, nh) for _ in range(n_layer))
        self.ln_f, self.head = torch.nn.LayerNorm(d), torch.nn.Linear(d, VOCAB, bias=False)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.h:
            x = blk(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def warm_step(model, batch, block, bf16):
    """One AdamW training step on random token ids, as a closure, after 3 warm-up calls."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    idx = torch.randint(0, VOCAB, (batch, block + 1), device="cuda")
    x, y = idx[:, :-1], idx[:, 1:]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return step


def tokens_per_s(model, batch, block, steps, bf16):
    step = warm_step(model, batch, block, bf16)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return batch * block * steps / (time.perf_counter() - started)


def top_kernels(model, batch, block, bf16, steps=3, rows=20):
    """The eager step's GPU kernels under torch.profiler, by time per step, as a markdown table."""
    from torch.profiler import ProfilerActivity, profile

    step = warm_step(model, batch, block, bf16)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0, 0.0])
            k[0] += 1
            k[1] += e.time_range.elapsed_us()
    total = sum(t for _, t in kernels.values())
    lines = [f"PyTorch eager, {'bf16 autocast' if bf16 else 'f32'}: {len(kernels)} kernels, "
             f"{sum(c for c, _ in kernels.values()) / steps:.0f} launches and {total / steps / 1e3:.2f} ms of kernel time a step",
             "", "| kernel | launches a step | ms a step | share |", "| --- | --- | --- | --- |"]
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:rows]:
        short = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{short.replace('|', '/')}` | {count / steps:g} | {us / steps / 1e3:.3f} | {100 * us / total:.1f}% |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(PRESETS), default="gpt2-124m")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", choices=["f32", "bf16"], default="f32")
    p.add_argument("--eager-only", action="store_true", help="skip torch.compile")
    p.add_argument("--profile", metavar="FILE", help="also write the eager step's top kernels (torch.profiler) as markdown")
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    n_layer, nh, d, block, batch = PRESETS[a.model]
    bf16 = a.precision == "bf16"
    torch.manual_seed(0)
    eager = tokens_per_s(GPT(n_layer, nh, d, block).cuda(), batch, block, a.steps, bf16)
    name = torch.cuda.get_device_name()
    # the eager figure first, on its own line: a torch.compile cut short by a timeout keeps it
    print(f"torch {torch.__version__} on {name}, {a.model} {a.precision}: eager {eager:,.0f} tokens/s", flush=True)
    if a.profile:
        with open(a.profile, "w") as f:
            f.write(top_kernels(GPT(n_layer, nh, d, block).cuda(), batch, block, bf16))
    if a.eager_only:
        compiled = "not run (--eager-only)"
    else:
        try:
            compiled = f"{tokens_per_s(torch.compile(GPT(n_layer, nh, d, block).cuda()), batch, block, a.steps, bf16):,.0f}"
        except Exception as e:  # noqa: BLE001 - torch.compile needs a compiler toolchain the machine may lack
            compiled = f"failed ({type(e).__name__})"
    print(f"torch {torch.__version__} on {name}, {a.model} {a.precision}: eager {eager:,.0f} tokens/s, torch.compile {compiled}")


if __name__ == "__main__":
    main()
