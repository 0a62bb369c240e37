"""The fused train_step: one step from identical parameters and data matches
a JAX implementation of the same optimizer to 1e-5."""

import pathlib
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import Compiled, pcp_node

rng = np.random.default_rng(7)


def mlp_loss(w1, b1, w2, x, y):
    # Integer arguments are data; floating-point ones are parameters.
    h = jnp.tanh((x.astype(jnp.float32) / 3.0) @ w1 + b1)
    logits = h @ w2
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))


PARAMS = [rng.normal(0, 0.5, (6, 8)).astype(np.float32), rng.normal(0, 0.5, (8,)).astype(np.float32), rng.normal(0, 0.5, (8, 5)).astype(np.float32)]
X = rng.integers(-3, 4, (4, 6)).astype(np.int32)
Y = rng.integers(0, 5, (4,)).astype(np.int32)


def build(*flags):
    text = jax.jit(mlp_loss).lower(*PARAMS, X, Y).as_text()
    tmp = tempfile.mkdtemp()
    src, out = pathlib.Path(tmp, "m.mlir"), pathlib.Path(tmp, "step.mlir")
    src.write_text(text)
    proc = subprocess.run([pcp_node(), "graph", "step", str(src), "-o", str(out), *flags], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return Compiled(out)


def clip(grads, max_norm):
    if max_norm is None:
        return grads
    norm = jnp.sqrt(sum(jnp.sum(g * g) for g in grads))
    scale = jnp.where(norm > max_norm, max_norm / norm, 1.0)
    return [g * scale for g in grads]


def adamw_reference(params, m, v, step, lr, b1, b2, eps, wd, max_norm=None):
    loss, grads = jax.value_and_grad(mlp_loss, argnums=(0, 1, 2))(*params, X, Y)
    grads = clip(grads, max_norm)
    out_p, out_m, out_v = [], [], []
    for p, g, mi, vi in zip(params, grads, m, v):
        mi = b1 * mi + (1 - b1) * g
        vi = b2 * vi + (1 - b2) * g * g
        mhat = mi / (1 - b1**step)
        vhat = vi / (1 - b2**step)
        decay = wd if p.ndim >= 2 else 0.0
        out_p.append(p - lr * (mhat / (jnp.sqrt(vhat) + eps) + decay * p))
        out_m.append(mi)
        out_v.append(vi)
    return out_p, out_m, out_v, loss


@pytest.mark.parametrize("clip_norm", [None, 0.05])
def test_adamw_steps_match_jax(clip_norm):
    flags = ["--beta1", "0.9", "--beta2", "0.95", "--eps", "1e-8", "--weight-decay", "0.1"]
    if clip_norm is not None:
        flags += ["--clip-norm", str(clip_norm)]
    module = build(*flags)
    params = [p.copy() for p in PARAMS]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    ref_p, ref_m, ref_v = params, m, v
    # Three steps: bias correction and state carried across steps both matter.
    for step in (1, 2, 3):
        lr = np.float32(1e-2)
        out = module("train_step", *params, *m, *v, np.float32(step), lr, X, Y)
        params, m, v, loss = out[0:3], out[3:6], out[6:9], out[9]
        ref_p, ref_m, ref_v, ref_loss = adamw_reference(ref_p, ref_m, ref_v, step, 1e-2, 0.9, 0.95, 1e-8, 0.1, clip_norm)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
        for got, want in zip(params + m + v, ref_p + ref_m + ref_v):
            np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-6)


def test_sgd_momentum_step_matches_jax():
    module = build("--optimizer", "sgd", "--momentum", "0.9", "--weight-decay", "0.01")
    bufs = [rng.normal(0, 0.1, p.shape).astype(np.float32) for p in PARAMS]
    out = module("train_step", *PARAMS, *bufs, np.float32(5), np.float32(0.1), X, Y)
    loss, grads = jax.value_and_grad(mlp_loss, argnums=(0, 1, 2))(*PARAMS, X, Y)
    for k, (p, g, buf) in enumerate(zip(PARAMS, grads, bufs)):
        g = g + (0.01 * p if p.ndim >= 2 else 0.0)
        new_buf = 0.9 * buf + g
        np.testing.assert_allclose(out[3 + k], new_buf, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(out[k], p - 0.1 * new_buf, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[6], loss, rtol=1e-5)


def test_eval_loss_is_the_forward():
    module = build()
    (loss,) = module("eval_loss", *PARAMS, X, Y)
    np.testing.assert_allclose(loss, mlp_loss(*PARAMS, X, Y), rtol=1e-5)
