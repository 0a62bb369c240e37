"""Helpers for the JAX reference tests: export with JAX, differentiate with
`pcp-node graph grad`, compile and run with IREE, compare with `jax.grad`."""

import os
import pathlib
import subprocess
import tempfile

import jax
import numpy as np
import pytest

jax.config.update("jax_platforms", "cpu")

import iree.compiler as ireec  # noqa: E402
import iree.runtime as ireert  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
RTOL, ATOL = 1e-4, 1e-5


def pcp_node() -> str:
    path = os.environ.get("PCP_NODE", str(ROOT / "target" / "release" / "pcp-node"))
    if not pathlib.Path(path).exists():
        pytest.fail(f"pcp-node binary not found at {path}; run `cargo build --release -p pcp-node` first")
    return path


def run_pcp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([pcp_node(), *args], capture_output=True, text=True, timeout=300)


def differentiate(mlir_path: pathlib.Path, out_path: pathlib.Path, entry: str = "main") -> str:
    proc = run_pcp("graph", "grad", str(mlir_path), "--entry", entry, "-o", str(out_path))
    if proc.returncode != 0:
        raise AssertionError(f"pcp-node graph grad failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


# graph::Target::tuned_flags for cpu (graph/src/compile.rs)
TUNED_CPU_FLAGS = [
    "--iree-opt-data-tiling=true",
    "--iree-llvmcpu-enable-ukernels=mmt4d,pack",
    "--iree-llvmcpu-stack-allocation-limit=65536",
]


class Compiled:
    """A compiled module with its functions callable on numpy arrays."""

    def __init__(self, mlir_path: pathlib.Path):
        # pcp's own cpu flags (graph::Target::flags, then tuned_flags), with the same
        # fallback to the plain flags when IREE refuses the tuned ones
        plain = ["--iree-llvmcpu-target-cpu=host"]
        try:
            vmfb = ireec.compile_file(
                str(mlir_path), target_backends=["llvm-cpu"], extra_args=plain + TUNED_CPU_FLAGS
            )
        except ireec.CompilerToolError:
            vmfb = ireec.compile_file(str(mlir_path), target_backends=["llvm-cpu"], extra_args=plain)
        config = ireert.Config("local-task")
        self.ctx = ireert.SystemContext(config=config)
        self.ctx.add_vm_module(ireert.VmModule.copy_buffer(self.ctx.instance, vmfb))

    def __call__(self, name: str, *args):
        result = self.ctx.modules.module[name](*args)
        if isinstance(result, (tuple, list)):
            return [np.asarray(r.to_host() if hasattr(r, "to_host") else r) for r in result]
        return [np.asarray(result.to_host() if hasattr(result, "to_host") else result)]


def float_args(args):
    return [i for i, a in enumerate(args) if np.issubdtype(np.asarray(a).dtype, np.floating)]


def check_grad(fn, *args, rtol=RTOL, atol=ATOL, reference=None):
    """Exports `fn`, differentiates it with pcp and checks against jax.grad
    of `reference` (default: `fn` itself)."""
    args = [np.asarray(a) for a in args]
    text = jax.jit(fn, keep_unused=True).lower(*args).as_text()
    with tempfile.TemporaryDirectory() as tmp:
        src, out = pathlib.Path(tmp, "f.mlir"), pathlib.Path(tmp, "g.mlir")
        src.write_text(text)
        differentiate(src, out)
        got = Compiled(out)("main_grad", *args)
    argnums = tuple(float_args(args))
    loss, grads = jax.value_and_grad(reference or fn, argnums=argnums)(*args)
    assert len(got) == 1 + len(argnums), f"expected loss + {len(argnums)} gradients, got {len(got)} results"
    np.testing.assert_allclose(got[0], np.asarray(loss), rtol=rtol, atol=atol, err_msg="loss")
    for k, (g_pcp, g_jax) in enumerate(zip(got[1:], grads)):
        assert g_pcp.shape == np.shape(g_jax), f"gradient {k}: shape {g_pcp.shape} vs {np.shape(g_jax)}"
        np.testing.assert_allclose(g_pcp, np.asarray(g_jax), rtol=rtol, atol=atol, err_msg=f"gradient of argument {argnums[k]}")
    return got
