"""A tiny GPT in JAX, for `tools/export_model.py --framework jax`.

    .venv/bin/python tools/export_model.py --framework jax \
        --model-file tools/examples/tiny_jax.py --class-name TinyGPT \
        --batch-size 8 --block-size 32 -o tiny_jax.mlir

The exporter's contract: `TinyGPT()` builds the model (keyword arguments come
from `--kwarg NAME=VALUE`), `init(key)` returns its parameters as a pytree of
float arrays, and `loss(params, idx, targets)` takes two `[batch, block]`
int32 token arrays and returns the scalar cross-entropy loss. The parameters
become the module's arguments in the order `init` builds them (dicts in
insertion order, as PyTorch's `named_parameters`), each LayerNorm's gain
before its bias as pcp's shape-based initialisation expects.
"""

import jax
import jax.numpy as jnp


def _layer_norm(x, g, b, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


class TinyGPT:
    def __init__(self, vocab_size=65, block_size=64, n_embd=32, n_head=2, n_layer=1):
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_embd, self.n_head, self.n_layer = n_embd, n_head, n_layer

    def init(self, key):
        c, v = self.n_embd, self.vocab_size
        keys = iter(jax.random.split(key, 4 + 4 * self.n_layer))

        def normal(*shape):
            return 0.02 * jax.random.normal(next(keys), shape, jnp.float32)

        ln = {"g": jnp.ones(c), "b": jnp.zeros(c)}
        params = {"wte": normal(v, c), "wpe": normal(self.block_size, c)}
        for i in range(self.n_layer):
            params[f"h{i}"] = {
                "ln_1": dict(ln),
                "qkv": normal(c, 3 * c),
                "proj": normal(c, c),
                "ln_2": dict(ln),
                "fc": normal(c, 4 * c),
                "out": normal(4 * c, c),
            }
        params["ln_f"] = dict(ln)
        params["head"] = normal(c, v)
        return params

    def loss(self, params, idx, targets):
        b, t = idx.shape
        c, nh = self.n_embd, self.n_head
        x = params["wte"][idx] + params["wpe"][:t]
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        for i in range(self.n_layer):
            p = params[f"h{i}"]
            h = _layer_norm(x, p["ln_1"]["g"], p["ln_1"]["b"])
            q, k, v = jnp.split(h @ p["qkv"], 3, axis=-1)
            q, k, v = (z.reshape(b, t, nh, c // nh).transpose(0, 2, 1, 3) for z in (q, k, v))
            att = q @ k.transpose(0, 1, 3, 2) / (c // nh) ** 0.5
            att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
            y = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, c)
            x = x + y @ p["proj"]
            h = _layer_norm(x, p["ln_2"]["g"], p["ln_2"]["b"])
            x = x + jax.nn.gelu(h @ p["fc"], approximate=True) @ p["out"]
        logits = _layer_norm(x, params["ln_f"]["g"], params["ln_f"]["b"]) @ params["head"]
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()
