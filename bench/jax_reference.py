#!/usr/bin/env python3
"""JAX reference for pcp's built-in nanoGPT: one jax.jit'd train step
(forward, gradient, global-norm clipping and AdamW, written out by hand) with
pcp's hyper-parameters. Prints an eval line per --eval-every, then tokens/s
(steps after the first 3) and the final validation loss.

    .venv/bin/python bench/jax_reference.py --model small --steps 1000 --init DIR
"""

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_common as rc  # noqa: E402

args = rc.parse_args(__doc__.splitlines()[0])
rc.pin_threads(args.threads)  # before XLA sizes its thread pools

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_platforms", "cpu")

LN_EPS = 1e-5


def layer_norm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + LN_EPS) * w + b


def linear(x, w, b=None):
    y = x @ w.T  # PyTorch layout [out, in]
    return y if b is None else y + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def make_loss(cfg):
    n_layer, nh, d = cfg["n_layer"], cfg["n_head"], cfg["n_embd"]
    hd = d // nh

    def loss_fn(p, idx, targets):
        bsz, t = idx.shape
        x = p["transformer.wte.weight"][idx] + p["transformer.wpe.weight"][:t][None]
        causal = jnp.tril(jnp.ones((t, t), bool))
        for i in range(n_layer):
            pre = f"transformer.h.{i}."
            h = layer_norm(x, p[pre + "ln_1.weight"], p[pre + "ln_1.bias"])
            qkv = linear(h, p[pre + "attn.c_attn.weight"], p[pre + "attn.c_attn.bias"])
            qkv = qkv.reshape(bsz, t, 3, nh, hd)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            att = jnp.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(hd)
            att = jnp.where(causal, att, -jnp.inf)
            att = jax.nn.softmax(att, axis=-1)
            y = jnp.einsum("bhij,bjhd->bihd", att, v).reshape(bsz, t, d)
            x = x + linear(y, p[pre + "attn.c_proj.weight"], p[pre + "attn.c_proj.bias"])
            h = layer_norm(x, p[pre + "ln_2.weight"], p[pre + "ln_2.bias"])
            h = gelu_tanh(linear(h, p[pre + "mlp.c_fc.weight"], p[pre + "mlp.c_fc.bias"]))
            x = x + linear(h, p[pre + "mlp.c_proj.weight"], p[pre + "mlp.c_proj.bias"])
        x = layer_norm(x, p["transformer.ln_f.weight"], p["transformer.ln_f.bias"])
        logits = linear(x, p["lm_head.weight"])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)
        return nll.mean()

    return loss_fn


def make_step(loss_fn):
    grad_fn = jax.value_and_grad(loss_fn)

    def step(params, m, v, idx, targets, t, lr):
        loss, g = grad_fn(params, idx, targets)
        # Global-norm clipping as pcp does it: scale = min(1, clip / ||g||), no epsilon.
        norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(g)))
        scale = jnp.where(norm > rc.GRAD_CLIP, rc.GRAD_CLIP / norm, 1.0)
        bc1 = 1.0 - rc.BETA1**t
        bc2_root = jnp.sqrt(1.0 - rc.BETA2**t)
        new_p, new_m, new_v = {}, {}, {}
        for name, p in params.items():
            gi = g[name] * scale
            mi = rc.BETA1 * m[name] + (1.0 - rc.BETA1) * gi
            vi = rc.BETA2 * v[name] + (1.0 - rc.BETA2) * gi * gi
            decayed = p * (1.0 - lr * rc.WEIGHT_DECAY) if p.ndim >= 2 else p
            new_p[name] = decayed - (lr / bc1) * mi / (jnp.sqrt(vi) / bc2_root + rc.EPS)
            new_m[name], new_v[name] = mi, vi
        return new_p, new_m, new_v, loss

    return jax.jit(step, donate_argnums=(0, 1, 2))


def main():
    cfg = rc.PRESETS[args.model]
    corpus = rc.Corpus(args.data)
    init, source = rc.initial_params(args, cfg, corpus.vocab_size)
    params = {k: jnp.asarray(v) for k, v in init.items()}
    m = {k: jnp.zeros_like(v) for k, v in params.items()}
    v = {k: jnp.zeros_like(x) for k, x in params.items()}
    n = sum(int(np.prod(x.shape)) for x in params.values())
    print(f"jax {jax.__version__}: nanogpt-{args.model} ({n} parameters), {source}, {args.steps} steps")
    loss_fn = make_loss(cfg)
    step_fn = make_step(loss_fn)
    eval_fn = jax.jit(loss_fn)
    vals = [(jnp.asarray(x), jnp.asarray(y)) for x, y in rc.val_batches(corpus, cfg, args.seed, args.eval_batches)]
    data = rc.batches(corpus, cfg, args.seed)
    report = rc.Report(args, cfg, "jax")

    def validate(params):
        return float(np.mean([float(eval_fn(params, vx, vy)) for vx, vy in vals]))

    for t in range(1, args.steps + 1):
        x, y = next(data)
        lr = rc.learning_rate(t, args.steps, peak=args.lr)
        started = time.perf_counter()
        params, m, v, loss = step_fn(params, m, v, x, y, jnp.float32(t), jnp.float32(lr))
        loss = float(loss)  # waits for the step
        report.step(t, loss, time.perf_counter() - started)
        if report.eval_due(t):
            report.eval(t, loss, validate(params))
    if args.steps == 0 and not args.no_eval:  # evaluate the --init parameters as they are
        report.eval(0, float("nan"), validate(params))
    report.finish()


if __name__ == "__main__":
    main()
