#!/usr/bin/env python3
"""PyTorch (eager) reference for pcp's built-in nanoGPT: torch.optim.AdamW
(weight decay on parameters of rank >= 2 only, via parameter groups) and
clip_grad_norm_, with pcp's hyper-parameters. Prints an eval line per
--eval-every, then tokens/s (steps after the first 3) and the final
validation loss. Install torch with bench/setup.sh.

Difference from pcp and bench/jax_reference.py: clip_grad_norm_ scales by
min(1, clip / (||g|| + 1e-6)); pcp uses min(1, clip / ||g||). The relative
change is at most 1e-6 / ||g||, far below the noise of a training run.

    .venv/bin/python bench/torch_reference.py --model small --steps 1000 --init DIR
"""

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_common as rc  # noqa: E402

args = rc.parse_args(__doc__.splitlines()[0])
rc.pin_threads(args.threads)

try:
    import torch  # noqa: E402
    import torch.nn.functional as F  # noqa: E402
except ImportError as e:
    raise SystemExit(f"cannot import torch ({e}); run bench/setup.sh")

torch.set_num_threads(args.threads)


def forward(p, cfg, idx, targets):
    n_layer, nh, d = cfg["n_layer"], cfg["n_head"], cfg["n_embd"]
    bsz, t = idx.shape
    x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:t]
    for i in range(n_layer):
        pre = f"transformer.h.{i}."
        h = F.layer_norm(x, (d,), p[pre + "ln_1.weight"], p[pre + "ln_1.bias"], eps=1e-5)
        qkv = F.linear(h, p[pre + "attn.c_attn.weight"], p[pre + "attn.c_attn.bias"])
        q, k, v = (z.view(bsz, t, nh, d // nh).transpose(1, 2) for z in qkv.split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(bsz, t, d)
        x = x + F.linear(y, p[pre + "attn.c_proj.weight"], p[pre + "attn.c_proj.bias"])
        h = F.layer_norm(x, (d,), p[pre + "ln_2.weight"], p[pre + "ln_2.bias"], eps=1e-5)
        h = F.gelu(F.linear(h, p[pre + "mlp.c_fc.weight"], p[pre + "mlp.c_fc.bias"]), approximate="tanh")
        x = x + F.linear(h, p[pre + "mlp.c_proj.weight"], p[pre + "mlp.c_proj.bias"])
    x = F.layer_norm(x, (d,), p["transformer.ln_f.weight"], p["transformer.ln_f.bias"], eps=1e-5)
    logits = F.linear(x, p["lm_head.weight"])
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    cfg = rc.PRESETS[args.model]
    corpus = rc.Corpus(args.data)
    init, source = rc.initial_params(args, cfg, corpus.vocab_size)
    params = {k: torch.tensor(v, requires_grad=True) for k, v in init.items()}
    n = sum(x.numel() for x in params.values())
    print(f"torch {torch.__version__} eager: nanogpt-{args.model} ({n} parameters), {source}, {args.steps} steps")
    decay = [p for p in params.values() if p.dim() >= 2]
    no_decay = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": rc.WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(rc.BETA1, rc.BETA2),
        eps=rc.EPS,
    )
    every = list(params.values())
    to_long = lambda a: torch.from_numpy(a).long()  # noqa: E731
    vals = [(to_long(x), to_long(y)) for x, y in rc.val_batches(corpus, cfg, args.seed, args.eval_batches)]
    data = rc.batches(corpus, cfg, args.seed)
    report = rc.Report(args, cfg, "torch")

    def validate():
        with torch.no_grad():
            return sum(forward(params, cfg, vx, vy).item() for vx, vy in vals) / len(vals)

    for t in range(1, args.steps + 1):
        x, y = next(data)
        x, y = to_long(x), to_long(y)
        lr = rc.learning_rate(t, args.steps, peak=args.lr)
        started = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr
        loss = forward(params, cfg, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(every, rc.GRAD_CLIP)
        opt.step()
        loss = loss.item()
        report.step(t, loss, time.perf_counter() - started)
        if report.eval_due(t):
            report.eval(t, loss, validate())
    if args.steps == 0 and not args.no_eval:  # evaluate the --init parameters as they are
        report.eval(0, float("nan"), validate())
    report.finish()


if __name__ == "__main__":
    main()
