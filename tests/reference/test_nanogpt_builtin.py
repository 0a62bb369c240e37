"""pcp's built-in nanoGPT (graph/src/models/nanogpt.rs) agrees with an
independent JAX implementation: the loss and logits of the small preset, and
the loss, logits and pcp-differentiated gradients of a tiny configuration."""

import json
import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT, Compiled

RTOL, ATOL = 1e-4, 1e-5


@pytest.fixture(scope="module")
def emitted(tmp_path_factory):
    """Runs the Rust integration test that writes the modules and their parameter specs
    (release, with the whole workspace's features: the build scripts/test.sh made)."""
    out = tmp_path_factory.mktemp("nanogpt")
    env = dict(os.environ, PCP_EMIT_DIR=str(out))
    proc = subprocess.run(
        ["cargo", "test", "-q", "--release", "--workspace", "--test", "emit_nanogpt", "--", "--nocapture"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    if proc.returncode != 0:
        pytest.fail(f"emitting nanoGPT failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return out


def load(emitted, name):
    spec = json.loads((emitted / f"{name}.json").read_text())
    return spec["config"], spec["params"]


def random_params(specs, rng):
    """Seeded parameters around their GPT-2 initialisation, perturbed so that
    LayerNorm weights and biases are not all ones and zeros."""
    params = []
    for p in specs:
        shape, init = tuple(p["shape"]), p["init"]
        noise = rng.standard_normal(shape)
        if init["kind"] == "normal":
            # Larger than GPT-2's std so that attention is far from uniform.
            value = 5 * init["std"] * noise
        elif init["kind"] == "ones":
            value = 1.0 + 0.1 * noise
        else:
            value = 0.05 * noise
        params.append(value.astype(np.float32))
    return params


def random_batch(config, rng):
    shape = (config["batch_size"], config["block_size"])
    ids = rng.integers(0, config["vocab_size"], size=shape).astype(np.int32)
    targets = rng.integers(0, config["vocab_size"], size=shape).astype(np.int32)
    return ids, targets


def jax_logits(config, names, params, ids):
    """nanoGPT's forward pass (model.py), written with stock JAX ops."""
    p = dict(zip(names, params))
    bias = config["bias"]
    n_head, d = config["n_head"], config["n_embd"]
    B, T = ids.shape

    def linear(x, prefix):
        y = x @ p[f"{prefix}.weight"].T
        return y + p[f"{prefix}.bias"] if bias else y

    def layer_norm(x, prefix):
        mean = jnp.mean(x, axis=-1, keepdims=True)
        var = jnp.var(x, axis=-1, keepdims=True)
        y = (x - mean) / jnp.sqrt(var + 1e-5) * p[f"{prefix}.weight"]
        return y + p[f"{prefix}.bias"] if bias else y

    x = p["transformer.wte.weight"][ids] + p["transformer.wpe.weight"][:T]
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    for i in range(config["n_layer"]):
        h = f"transformer.h.{i}"
        q, k, v = jnp.split(linear(layer_norm(x, f"{h}.ln_1"), f"{h}.attn.c_attn"), 3, axis=-1)
        heads = lambda t: t.reshape(B, T, n_head, d // n_head).transpose(0, 2, 1, 3)
        q, k, v = heads(q), heads(k), heads(v)
        att = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(d // n_head)
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, d)
        x = x + linear(y, f"{h}.attn.c_proj")
        m = jax.nn.gelu(linear(layer_norm(x, f"{h}.ln_2"), f"{h}.mlp.c_fc"), approximate=True)
        x = x + linear(m, f"{h}.mlp.c_proj")
    x = layer_norm(x, "transformer.ln_f")
    return x @ p["lm_head.weight"].T


def jax_loss(config, names, params, ids, targets):
    logp = jax.nn.log_softmax(jax_logits(config, names, params, ids), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def test_small_preset_loss_and_logits(emitted):
    config, specs = load(emitted, "nanogpt_small")
    assert (config["n_layer"], config["n_embd"], config["n_head"], config["block_size"]) == (2, 64, 4, 32)
    rng = np.random.default_rng(2024)
    params = random_params(specs, rng)
    ids, targets = random_batch(config, rng)
    names = [p["name"] for p in specs]
    module = Compiled(emitted / "nanogpt_small.mlir")

    (loss,) = module("main", *params, ids, targets)
    want = jax_loss(config, names, params, ids, targets)
    np.testing.assert_allclose(loss, np.asarray(want), rtol=RTOL, err_msg="loss")

    (logits,) = module("logits", *params, ids)
    want = jax_logits(config, names, params, ids)
    assert logits.shape == (config["batch_size"], config["block_size"], config["vocab_size"])
    np.testing.assert_allclose(logits, np.asarray(want), rtol=RTOL, atol=ATOL, err_msg="logits")


def test_tiny_gradients_match_jax_grad(emitted):
    config, specs = load(emitted, "nanogpt_tiny")
    rng = np.random.default_rng(7)
    params = random_params(specs, rng)
    ids, targets = random_batch(config, rng)
    names = [p["name"] for p in specs]

    (logits,) = Compiled(emitted / "nanogpt_tiny.mlir")("logits", *params, ids)
    np.testing.assert_allclose(logits, np.asarray(jax_logits(config, names, params, ids)), rtol=RTOL, atol=ATOL)

    loss, *grads = Compiled(emitted / "nanogpt_tiny_grad.mlir")("main_grad", *params, ids, targets)
    want_loss, want_grads = jax.value_and_grad(lambda ps: jax_loss(config, names, ps, ids, targets))(params)
    np.testing.assert_allclose(loss, np.asarray(want_loss), rtol=RTOL, err_msg="loss")
    assert len(grads) == len(params)
    for name, got, want in zip(names, grads, want_grads):
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, np.asarray(want), rtol=RTOL, atol=ATOL, err_msg=f"gradient of {name}")


def test_fused_attention_gradients_at_1024_match_the_naive_form(emitted):
    """Attention at T = 1024 (8 causal strips of 128 rows, probabilities
    recomputed from the log-sum-exp) against the naive form that keeps the
    T x T probabilities: every gradient within 1e-5 of the largest element,
    and both against jax.grad."""
    config, specs = load(emitted, "nanogpt_long")
    rng = np.random.default_rng(11)
    params = random_params(specs, rng)
    ids, targets = random_batch(config, rng)
    names = [p["name"] for p in specs]
    fused_loss, *fused = Compiled(emitted / "nanogpt_long_grad.mlir")("main_grad", *params, ids, targets)
    naive_loss, *naive = Compiled(emitted / "nanogpt_long_naive_grad.mlir")("main_grad", *params, ids, targets)
    np.testing.assert_allclose(fused_loss, naive_loss, rtol=1e-5, err_msg="loss")
    for name, f, n in zip(names, fused, naive):
        scale = float(np.max(np.abs(n)))
        worst = float(np.max(np.abs(f - n))) / max(scale, 1e-30)
        assert worst <= 1e-5, f"gradient of {name}: {worst:.2e} of its largest element"
    _, want = jax.value_and_grad(lambda ps: jax_loss(config, names, ps, ids, targets))(params)
    for name, f, w in zip(names, fused, want):
        np.testing.assert_allclose(f, np.asarray(w), rtol=RTOL, atol=ATOL, err_msg=f"gradient of {name}")
