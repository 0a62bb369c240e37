#!/usr/bin/env python3
"""Exports a PyTorch or JAX model's loss as a StableHLO module that pcp trains.

    .venv/bin/python tools/export_model.py --framework torch|jax \\
        --model-file my_gpt.py --class-name MyGPT \\
        --batch-size 8 --block-size 64 -o my_gpt.mlir [--kwarg vocab_size=256]
    pcp-node train --model my_gpt.mlir --steps 1000

The module's entry is `@main(params..., idx, targets) -> loss`: every
parameter is a float32 argument (in the model's own order), then the
`[batch, block]` input tokens and targets (int64 from PyTorch, int32 from
JAX), and it returns the scalar loss. pcp differentiates it, fuses AdamW in
and compiles it with IREE; it initialises the parameters itself from their
shapes (matrices N(0, 0.02), a vector followed by one of the same length a
LayerNorm's weight 1 and bias 0, any other vector 0), and this tool warns
when that differs from the model's own initialisation.

PyTorch (`pip install torch torch-mlir`; scripts/setup.sh installs both): the
class is built with no arguments (or `--kwarg`s) and `forward(idx, targets)`
returns the loss. The module is made stateless with `torch.func.functional_call`,
so parameters are arguments rather than constants; buffers become constants.
It is exported in eval mode (no dropout) by `torch.export` and lowered to
StableHLO by torch-mlir.

JAX: the class is built the same way, `init(key)` returns the parameters as
a pytree (nested dicts, lists and tuples of float arrays; dicts keep their
insertion order) and `loss(params, idx, targets)` (or `__call__`) returns the
loss. It is lowered with `jax.jit(...).lower(...)`.
"""

import argparse
import ast
import importlib.util
import inspect
import math
import sys
from pathlib import Path


def fail(message):
    raise SystemExit(f"export_model.py: {message}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--framework", choices=["torch", "jax"], default="torch")
    p.add_argument("--model-file", required=True, type=Path, help="Python file that defines the model class")
    p.add_argument("--class-name", required=True, help="the model class in --model-file")
    p.add_argument("--batch-size", required=True, type=int, help="sequences per step (fixed in the module)")
    p.add_argument("--block-size", required=True, type=int, help="tokens per sequence (fixed in the module)")
    p.add_argument("-o", "--out", required=True, type=Path, help="the .mlir file to write")
    p.add_argument(
        "--kwarg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="keyword argument for the class's constructor (VALUE is a Python literal); repeatable",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the model's own initialisation (compared with pcp's)")
    args = p.parse_args(argv)
    if args.batch_size < 1 or args.block_size < 1:
        fail("--batch-size and --block-size must be at least 1")
    kwargs = {}
    for item in args.kwarg:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            fail(f"--kwarg {item!r} is not NAME=VALUE")
        try:
            kwargs[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[name] = value
    args.kwargs = kwargs
    return args


def load_class(path, name):
    if not path.is_file():
        fail(f"no model file {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    sys.path.insert(0, str(path.resolve().parent))
    spec.loader.exec_module(module)
    cls = getattr(module, name, None)
    if cls is None or not inspect.isclass(cls):
        fail(f"{path} defines no class {name}")
    return cls


def pcp_init(shapes):
    """pcp's initialisation from shapes alone (node/src/model.rs, `external_params`)."""
    kinds, i = [], 0
    while i < len(shapes):
        s = shapes[i]
        if len(s) == 1 and i + 1 < len(shapes) and shapes[i + 1] == s:
            kinds += ["ones", "zeros"]
            i += 2
            continue
        kinds.append("normal(0.02)" if len(s) >= 2 else "zeros")
        i += 1
    return kinds


def init_kind(values):
    """How a model initialised a tensor: ones, zeros, or something random."""
    flat = [float(x) for x in values]
    if all(x == 1.0 for x in flat):
        return "ones"
    if all(x == 0.0 for x in flat):
        return "zeros"
    return "random"


def check_init(names, shapes, values):
    """Warns where pcp's initialisation sets a scale (all ones) the model does not, or the reverse:
    a small random bias or weight where pcp puts zeros or N(0, 0.02) is immaterial."""
    differ = []
    for name, shape, pcp, own in zip(names, shapes, pcp_init(shapes), values):
        mine = init_kind(own)
        if (mine == "ones") != (pcp == "ones"):
            differ.append(f"{name} {list(shape)}: model {mine}, pcp {pcp}")
    if differ:
        print(
            "export_model.py: warning: pcp initialises parameters from their shapes and will set these "
            "differently from the model (keep each LayerNorm's weight right before its bias, and no other "
            "vector right before one of the same length):\n  " + "\n  ".join(differ),
            file=sys.stderr,
        )


def export_torch(args, cls):
    import logging

    # torch warns that the CUDA build's triton is missing (bench/setup.sh leaves it out)
    logging.getLogger("torch.utils.flop_counter").setLevel(logging.ERROR)
    try:
        import torch
        from torch_mlir import fx
    except ImportError as e:
        fail(f"cannot import torch and torch_mlir ({e}); run scripts/setup.sh or `pip install torch torch-mlir`")

    torch.manual_seed(args.seed)
    model = cls(**args.kwargs)
    if not isinstance(model, torch.nn.Module):
        fail(f"{args.class_name} is not a torch.nn.Module")
    model.eval()
    named = list(model.named_parameters())
    if not named:
        fail(f"{args.class_name} has no parameters")
    for name, p in named:
        if p.dtype != torch.float32:
            fail(f"parameter {name} is {p.dtype}; pcp trains float32 parameters")
    names = [n for n, _ in named]
    buffers = dict(model.named_buffers())

    class Stateless(torch.nn.Module):
        """forward(*params, idx, targets) -> loss, the model held outside the module tree."""

        def __init__(self):
            super().__init__()
            object.__setattr__(self, "inner", model)

        def forward(self, *args):
            params = dict(zip(names, args[: len(names)]))
            idx, targets = args[len(names) :]
            return torch.func.functional_call(self.inner, {**params, **buffers}, (idx, targets))

    tokens = torch.zeros(args.batch_size, args.block_size, dtype=torch.long)
    example = [p.detach().clone() for _, p in named] + [tokens, tokens.clone()]
    with torch.no_grad():
        loss = Stateless()(*example)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.dtype.is_floating_point):
        got = f"{loss.dtype} of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        fail(f"{args.class_name}.forward(idx, targets) must return a scalar float loss, got {got}")
    module = fx.export_and_import(Stateless(), *example, output_type="stablehlo", func_name="main")
    shapes = [tuple(p.shape) for _, p in named]
    values = [p.detach().flatten().tolist() for _, p in named]
    return str(module), names, shapes, values


def flatten(tree, prefix=""):
    """(name, leaf) pairs of a pytree of dicts (insertion order), lists and tuples."""
    if isinstance(tree, dict):
        return [pair for k, v in tree.items() for pair in flatten(v, f"{prefix}{k}.")]
    if isinstance(tree, (list, tuple)):
        return [pair for i, v in enumerate(tree) for pair in flatten(v, f"{prefix}{i}.")]
    return [(prefix[:-1], tree)]


def unflatten(tree, leaves):
    """`tree`'s structure with its leaves taken in order from the iterator `leaves`."""
    if isinstance(tree, dict):
        return {k: unflatten(v, leaves) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(unflatten(v, leaves) for v in tree)
    return next(leaves)


def export_jax(args, cls):
    try:
        import jax
        import jax.numpy as jnp
    except ImportError as e:
        fail(f"cannot import jax ({e}); run scripts/setup.sh")

    model = cls(**args.kwargs)
    if not callable(getattr(model, "init", None)):
        fail(f"{args.class_name} has no init(key) method returning the parameters")
    loss_fn = getattr(model, "loss", None) or (model if callable(model) else None)
    if loss_fn is None:
        fail(f"{args.class_name} has no loss(params, idx, targets) method")
    params = model.init(jax.random.PRNGKey(args.seed))
    named = flatten(params)
    if not named:
        fail(f"{args.class_name}.init returned no parameters")
    for name, leaf in named:
        if getattr(leaf, "dtype", None) != jnp.float32:
            fail(f"parameter {name or '<root>'} is {getattr(leaf, 'dtype', type(leaf).__name__)}; pcp trains float32")
    names = [n or "params" for n, _ in named]

    def main(*args_):
        p = unflatten(params, iter(args_[: len(named)]))
        idx, targets = args_[len(named) :]
        return loss_fn(p, idx, targets)

    tokens = jax.ShapeDtypeStruct((args.batch_size, args.block_size), jnp.int32)
    specs = [jax.ShapeDtypeStruct(leaf.shape, jnp.float32) for _, leaf in named] + [tokens, tokens]
    out = jax.eval_shape(main, *specs)
    if not (getattr(out, "shape", None) == () and jnp.issubdtype(out.dtype, jnp.floating)):
        fail(f"{args.class_name}.loss(params, idx, targets) must return a scalar float loss, got {out}")
    text = jax.jit(main).lower(*specs).as_text()
    shapes = [tuple(leaf.shape) for _, leaf in named]
    values = [jnp.ravel(leaf).tolist() for _, leaf in named]
    return text, names, shapes, values


def check_signature(text, n_params):
    """Parses the module with IREE's MLIR (pcp's importer) when available, checking `@main`."""
    try:
        from iree.compiler import ir
    except ImportError:
        return
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        try:
            module = ir.Module.parse(text)
        except Exception as e:  # noqa: BLE001 - the binding raises MLIRError, a plain Exception
            fail(f"IREE cannot parse the exported module: {' '.join(str(e).split())[:400]}")
        for op in module.body.operations:
            if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == "main":
                ftype = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
                inputs = [str(t) for t in ftype.inputs]
                results = [str(t) for t in ftype.results]
                if len(inputs) != n_params + 2 or results != ["tensor<f32>"]:
                    fail(f"@main is ({', '.join(inputs)}) -> ({', '.join(results)}), not (params..., idx, targets) -> f32")
                return
    fail("the exported module has no @main")


def main(argv=None):
    args = parse_args(argv)
    cls = load_class(args.model_file, args.class_name)
    export = export_torch if args.framework == "torch" else export_jax
    text, names, shapes, values = export(args, cls)
    check_signature(text, len(names))
    check_init(names, shapes, values)
    count = sum(math.prod(s) for s in shapes)
    header = [
        f"// Exported by pcp's tools/export_model.py from {args.model_file.name}:{args.class_name} ({args.framework}).",
        f"// @main(params..., idx, targets) -> loss; batch {args.batch_size}, block {args.block_size},"
        f" {len(names)} parameters ({count} values), in argument order:",
    ]
    header += [f"//   %arg{i}: {n} {list(s)}" for i, (n, s) in enumerate(zip(names, shapes))]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text("\n".join(header) + "\n" + text.rstrip("\n") + "\n")
    tmp.replace(args.out)
    print(
        f"wrote {args.out}: {len(names)} parameters ({count} values), batch {args.batch_size}, "
        f"block {args.block_size}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
