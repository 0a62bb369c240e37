"""pcp's generated modules compile for GPU targets with the stock IREE 3.13
compiler (no GPU needed): one CUDA, one ROCm and one Vulkan target.

Each case is a small module (a JAX function, or StableHLO written as PyTorch
exports it) holding one pattern that IREE's GPU backends failed on before
graph/src/iree/legalize.rs rewrote it. `pcp-node graph compile --module grad`
(and `--module step`) must compile it for every target below, as a shepherd
does, and the gradients `pcp-node graph grad` writes must still match
`jax.grad` on llvm-cpu. Shapes are tiny but large enough to fail without the
rewrites.
"""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ATOL, RTOL, Compiled, check_grad, differentiate, run_pcp

rng = np.random.default_rng(3)

# (backend, target) as `pcp-node --backend B --target T` names them: one per vendor.
TARGETS = {
    "cuda-sm_80": ("cuda", "sm_80"),
    "rocm-gfx942": ("rocm", "gfx942"),
    "vulkan-rdna3": ("vulkan", "rdna3"),
}


def f32(*shape):
    return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)


def layer_norm(x, g):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * g


CASES = {
    # The gradient of `x - broadcast(mean(x))` w.r.t. the mean is
    # reduce_add(negate(g)); IREE folds it into an `acc - x` reduction with no
    # neutral element ("failed to get neutral element for reduction" on
    # CUDA/ROCm, "Failed to get an identity value" on Vulkan).
    "sum_of_negation": (lambda x: jnp.sum((x - jnp.mean(x, axis=-1, keepdims=True)) ** 2 * x), (f32(16, 32),)),
    "layer_norm": (lambda x, g: jnp.sum(jnp.tanh(layer_norm(x, g))), (f32(16, 32), f32(32))),
}

# Modules written as PyTorch exports them. IREE's SPIR-V backend failed on a
# reduction dispatch whose fused consumer recomputes a row-uniform index
# (from a gather, or from iotas): "failed to legalize operation
# 'memref.alloc'" (a memref<Nxindex> in workgroup memory). pcp now reads
# gathers and iotas through an optimization_barrier.

# An embedding lookup centred by its row mean (token ids used as gather
# indices directly).
EMBEDDING_CENTRED = """
func.func @main(%w: tensor<11x32xf32>, %ids: tensor<2x8xi64>) -> tensor<f32> {
  %z = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %c = stablehlo.constant dense<3.200000e+01> : tensor<2x8x32xf32>
  %x = "stablehlo.gather"(%w, %ids) <{dimension_numbers = #stablehlo.gather<offset_dims = [2], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 2>, indices_are_sorted = false, slice_sizes = array<i64: 1, 32>}> : (tensor<11x32xf32>, tensor<2x8xi64>) -> tensor<2x8x32xf32>
  %s = stablehlo.reduce(%x init: %z) applies stablehlo.add across dimensions = [2] : (tensor<2x8x32xf32>, tensor<f32>) -> tensor<2x8xf32>
  %b = stablehlo.broadcast_in_dim %s, dims = [0, 1] : (tensor<2x8xf32>) -> tensor<2x8x32xf32>
  %m = stablehlo.divide %b, %c : tensor<2x8x32xf32>
  %d = stablehlo.subtract %x, %m : tensor<2x8x32xf32>
  %t = stablehlo.tanh %d : tensor<2x8x32xf32>
  %q = stablehlo.multiply %t, %d : tensor<2x8x32xf32>
  %r = stablehlo.reduce(%q init: %z) applies stablehlo.add across dimensions = [0, 1, 2] : (tensor<2x8x32xf32>, tensor<f32>) -> tensor<f32>
  return %r : tensor<f32>
}
"""


def embedding_centred(w, ids):
    x = w[ids]
    d = x - jnp.sum(x, axis=-1, keepdims=True) / 32.0
    return jnp.sum(jnp.tanh(d) * d)


# Softmax under a causal mask built from iotas, as in the attention of
# ../shared/models/nanogpt_medium.mlir (its backward failed).
CAUSAL_SOFTMAX = """
func.func @main(%s: tensor<1x64x64xf32>, %v: tensor<1x64x64xf32>) -> tensor<f32> {
  %i1 = stablehlo.iota dim = 1 : tensor<64x64xi64>
  %i0 = stablehlo.iota dim = 0 : tensor<64x64xi64>
  %le = stablehlo.compare LE, %i1, %i0, SIGNED : (tensor<64x64xi64>, tensor<64x64xi64>) -> tensor<64x64xi1>
  %one = stablehlo.constant dense<1.000000e+00> : tensor<64x64xf32>
  %zero = stablehlo.constant dense<0.000000e+00> : tensor<64x64xf32>
  %m = stablehlo.select %le, %one, %zero : tensor<64x64xi1>, tensor<64x64xf32>
  %masked = stablehlo.compare EQ, %m, %zero, FLOAT : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xi1>
  %mb = stablehlo.broadcast_in_dim %masked, dims = [1, 2] : (tensor<64x64xi1>) -> tensor<1x64x64xi1>
  %ninf = stablehlo.constant dense<0xFF800000> : tensor<1x64x64xf32>
  %x = stablehlo.select %mb, %ninf, %s : tensor<1x64x64xi1>, tensor<1x64x64xf32>
  %lo = stablehlo.constant dense<0xFF800000> : tensor<f32>
  %z = stablehlo.constant dense<0.000000e+00> : tensor<f32>
  %mx = stablehlo.reduce(%x init: %lo) applies stablehlo.maximum across dimensions = [2] : (tensor<1x64x64xf32>, tensor<f32>) -> tensor<1x64xf32>
  %mxb = stablehlo.broadcast_in_dim %mx, dims = [0, 1] : (tensor<1x64xf32>) -> tensor<1x64x64xf32>
  %d = stablehlo.subtract %x, %mxb : tensor<1x64x64xf32>
  %e = stablehlo.exponential %d : tensor<1x64x64xf32>
  %se = stablehlo.reduce(%e init: %z) applies stablehlo.add across dimensions = [2] : (tensor<1x64x64xf32>, tensor<f32>) -> tensor<1x64xf32>
  %seb = stablehlo.broadcast_in_dim %se, dims = [0, 1] : (tensor<1x64xf32>) -> tensor<1x64x64xf32>
  %p = stablehlo.divide %e, %seb : tensor<1x64x64xf32>
  %q = stablehlo.multiply %p, %v : tensor<1x64x64xf32>
  %r = stablehlo.reduce(%q init: %z) applies stablehlo.add across dimensions = [0, 1, 2] : (tensor<1x64x64xf32>, tensor<f32>) -> tensor<f32>
  return %r : tensor<f32>
}
"""


def causal_softmax(s, v):
    t = s.shape[-1]
    keep = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    return jnp.sum(jax.nn.softmax(jnp.where(keep[None], s, -jnp.inf), axis=-1) * v)


# name: (StableHLO text, JAX reference, arguments; integer ones are data)
HAND_WRITTEN = {
    "embedding_centred": (EMBEDDING_CENTRED, embedding_centred, (f32(11, 32), rng.integers(0, 11, (2, 8)).astype(np.int64))),
    "causal_softmax": (CAUSAL_SOFTMAX, causal_softmax, (f32(1, 64, 64), f32(1, 64, 64))),
}


def compile_for(model: pathlib.Path, target: str, *extra: str):
    """`pcp-node graph compile MODEL --backend B --target T`, or a test failure naming IREE's error."""
    backend, name = TARGETS[target]
    out = model.with_suffix(f".{target}.vmfb")
    proc = run_pcp("graph", "compile", str(model), "--backend", backend, "--target", name, *extra, "-o", str(out))
    if proc.returncode != 0:
        pytest.fail(f"{model} does not compile for {target}: {proc.stderr.strip()[-2000:]}")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Every case as a StableHLO file, and `pcp-node graph grad` of it."""
    out = tmp_path_factory.mktemp("gpu_grad")
    paths = {}
    texts = {name: jax.jit(fn, keep_unused=True).lower(*args).as_text() for name, (fn, args) in CASES.items()}
    texts.update({name: text for name, (text, _, _) in HAND_WRITTEN.items()})
    for name, text in texts.items():
        src, dst = out / f"{name}.mlir", out / f"{name}_grad.mlir"
        src.write_text(text)
        differentiate(src, dst)
        paths[name] = (src, dst)
    return paths


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("name", sorted(CASES) + sorted(HAND_WRITTEN))
def test_gradient_compiles_for_gpu(sources, name, target):
    compile_for(sources[name][0], target, "--module", "grad")


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_still_matches_jax(name):
    fn, args = CASES[name]
    check_grad(fn, *args)


@pytest.mark.parametrize("name", sorted(HAND_WRITTEN))
def test_hand_written_gradient_still_matches_jax(sources, name):
    _, reference, args = HAND_WRITTEN[name]
    got = Compiled(sources[name][1])("main_grad", *args)
    floats = [i for i, a in enumerate(args) if a.dtype == np.float32]
    jax_args = [a.astype(np.int32) if a.dtype == np.int64 else a for a in args]
    loss, grads = jax.value_and_grad(reference, argnums=tuple(floats))(*jax_args)
    assert len(got) == 1 + len(floats)
    np.testing.assert_allclose(got[0], np.asarray(loss), rtol=RTOL, atol=ATOL, err_msg="loss")
    for k, (g_pcp, g_jax) in enumerate(zip(got[1:], grads)):
        np.testing.assert_allclose(g_pcp, np.asarray(g_jax), rtol=RTOL, atol=ATOL, err_msg=f"gradient {k}")


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_train_step_compiles_for_gpu(sources, target):
    """The fused train step (AdamW, clipping) of the embedding module."""
    compile_for(sources["embedding_centred"][0], target, "--clip-norm", "1.0")
