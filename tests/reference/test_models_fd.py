"""PCP's exported nanoGPT modules import, differentiate, and their gradients
agree with central finite differences of the compiled forward."""

import pathlib
import re
import tempfile

import numpy as np
import pytest

from conftest import SHARED, Compiled, differentiate

MODELS = ["nanogpt_small", "nanogpt_medium"]


def arg_types(mlir: str):
    signature = re.search(r"func\.func @main\((.*?)\)\s*->", mlir, re.S).group(1)
    return [(tuple(int(d) for d in dims.split("x") if d), elem) for dims, elem in re.findall(r"tensor<((?:\d+x)*)(\w+)>", signature)]


def random_args(types, rng):
    params, data = [], []
    for shape, elem in types:
        if elem.startswith("f"):
            scale = 1.0 if len(shape) == 1 else 0.1
            base = 1.0 if len(shape) == 1 else 0.0
            params.append((base + scale * rng.standard_normal(shape)).astype(np.float32))
        else:
            data.append(rng.integers(0, 65, size=shape).astype(np.int64))
    return params, data


@pytest.mark.parametrize("name", MODELS)
def test_gradient_matches_finite_differences(name):
    path = SHARED / "models" / f"{name}.mlir"
    if not path.exists():
        pytest.fail(f"{path} is missing")
    rng = np.random.default_rng(1234)
    params, data = random_args(arg_types(path.read_text()), rng)
    with tempfile.TemporaryDirectory() as tmp:
        out = pathlib.Path(tmp, "grad.mlir")
        summary = differentiate(path, out)
        ratio = float(re.search(r"\(([\d.]+)x\)", summary).group(1))
        assert ratio <= 3.0, f"gradient op count is {ratio}x the forward's"
        module = Compiled(out)
    loss, *grads = module("main_grad", *params, *data)
    assert len(grads) == len(params)
    assert np.isfinite(loss) and all(np.all(np.isfinite(g)) for g in grads)
    forward = lambda ps: float(module("main", *ps, *data)[0])
    np.testing.assert_allclose(forward(params), loss, rtol=1e-5)

    def directional(direction, eps):
        plus = [(p + eps * d).astype(np.float32) for p, d in zip(params, direction)]
        minus = [(p - eps * d).astype(np.float32) for p, d in zip(params, direction)]
        return (forward(plus) - forward(minus)) / (2 * eps)

    # Along each parameter's own gradient: the derivative there is |g_k|.
    for k, g in enumerate(grads):
        norm = float(np.linalg.norm(g))
        if norm < 1e-6:
            continue
        direction = [np.zeros_like(p) for p in params]
        direction[k] = g / norm
        fd = directional(direction, 1e-2)
        assert abs(fd - norm) <= 2e-3 + 2e-2 * norm, f"param {k}: finite difference {fd} vs |grad| {norm}"

    # Along random directions across all parameters.
    for _ in range(3):
        direction = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
        total = np.sqrt(sum(float(np.sum(d * d)) for d in direction))
        direction = [d / total for d in direction]
        analytic = sum(float(np.sum(g * d)) for g, d in zip(grads, direction))
        fd = directional(direction, 1e-2)
        assert abs(fd - analytic) <= 2e-3 + 2e-2 * abs(analytic), f"random direction: finite difference {fd} vs analytic {analytic}"
