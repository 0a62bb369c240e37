"""Shared pieces of bench/jax_reference.py and bench/torch_reference.py.

Both references train pcp's built-in nanoGPT (graph/src/models/nanogpt.rs)
with pcp's defaults (node/src/config.rs, node/src/train.rs): the same
configuration presets, char vocabulary, 90/10 split, learning-rate schedule
and AdamW hyper-parameters. Data batches come from a seeded NumPy generator,
so the two references see identical batches (pcp's own sampler uses ChaCha8
and draws different windows from the same split).
"""

import argparse
import json
import math
import os
from pathlib import Path

import numpy as np

PRESETS = {
    "small": dict(n_layer=2, n_head=4, n_embd=64, block_size=32, batch_size=64),
    "medium": dict(n_layer=4, n_head=8, n_embd=256, block_size=128, batch_size=64),
}

# node/src/config.rs defaults.
PEAK_LR = 3e-3
MIN_LR = 1e-4
WARMUP = 100
BETA1, BETA2, EPS = 0.9, 0.99, 1e-8
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
VAL_FRACTION = 0.1
EVAL_BATCHES = 8
WARMUP_STEPS_UNTIMED = 3

DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "tiny_shakespeare.txt"


def parse_args(description):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", choices=sorted(PRESETS), default="small")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (the first 3 are not timed)")
    p.add_argument("--init", type=Path, help="a pcp checkpoint (directory or step-N directory) to start from")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the text corpus")
    p.add_argument("--eval-every", type=int, default=250, help="evaluate every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=EVAL_BATCHES)
    p.add_argument("--no-eval", action="store_true", help="skip evaluation (throughput runs)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="CPU threads [default: all cores]")
    p.add_argument("--seed", type=int, default=1337, help="data order, and the init when --init is absent")
    p.add_argument("--lr", type=float, default=PEAK_LR, help="peak learning rate")
    p.add_argument("--curve", type=Path, help='write {"step":N,"loss":F} JSONL of the training loss here')
    args = p.parse_args()
    if args.steps < 0 or args.threads < 1:
        p.error("--steps must be >= 0 and --threads >= 1")
    return args


def pin_threads(n):
    """Restricts this process to the first n CPUs (before the framework starts its pools)."""
    if hasattr(os, "sched_setaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[: max(1, n)])


def learning_rate(step, total, peak=PEAK_LR, min_lr=MIN_LR, warmup=WARMUP):
    """pcp's schedule: linear warmup to `peak`, then cosine to `min_lr` at `total`; step is 1-based."""
    if warmup > 0 and step <= warmup:
        return peak * step / warmup
    span = max(total - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return min_lr + 0.5 * (peak - min_lr) * (1.0 + math.cos(math.pi * progress))


class Corpus:
    """Char-tokenized text: vocabulary = sorted unique characters, 90/10 split."""

    def __init__(self, path):
        text = Path(path).read_text(encoding="utf-8")
        chars = sorted(set(text))
        index = {c: i for i, c in enumerate(chars)}
        tokens = np.fromiter((index[c] for c in text), dtype=np.int32, count=len(text))
        boundary = int(len(tokens) * (1.0 - VAL_FRACTION))
        self.vocab_size = len(chars)
        self.train = tokens[:boundary]
        self.val = tokens[boundary:]


def windows(data, rng, batch, block):
    """`batch` random windows of `block + 1` tokens: (inputs, targets), int32 [batch, block]."""
    starts = rng.integers(0, len(data) - block, size=batch)
    idx = starts[:, None] + np.arange(block + 1)[None, :]
    w = data[idx]
    return np.ascontiguousarray(w[:, :-1]), np.ascontiguousarray(w[:, 1:])


def batches(corpus, cfg, seed):
    rng = np.random.default_rng(seed)
    while True:
        yield windows(corpus.train, rng, cfg["batch_size"], cfg["block_size"])


def val_batches(corpus, cfg, seed, n):
    """The same fixed validation batches at every evaluation."""
    rng = np.random.default_rng(seed ^ 0x5EED0F7A1)
    return [windows(corpus.val, rng, cfg["batch_size"], cfg["block_size"]) for _ in range(max(1, n))]


def param_shapes(cfg, vocab):
    """nanoGPT state-dict names and shapes, in pcp's order (PyTorch [out, in] linears)."""
    d, t = cfg["n_embd"], cfg["block_size"]
    shapes = {"transformer.wte.weight": (vocab, d), "transformer.wpe.weight": (t, d)}
    for i in range(cfg["n_layer"]):
        p = f"transformer.h.{i}"
        for name, shape in [
            ("ln_1.weight", (d,)), ("ln_1.bias", (d,)),
            ("attn.c_attn.weight", (3 * d, d)), ("attn.c_attn.bias", (3 * d,)),
            ("attn.c_proj.weight", (d, d)), ("attn.c_proj.bias", (d,)),
            ("ln_2.weight", (d,)), ("ln_2.bias", (d,)),
            ("mlp.c_fc.weight", (4 * d, d)), ("mlp.c_fc.bias", (4 * d,)),
            ("mlp.c_proj.weight", (d, 4 * d)), ("mlp.c_proj.bias", (d,)),
        ]:
            shapes[f"{p}.{name}"] = shape
    shapes["transformer.ln_f.weight"] = (d,)
    shapes["transformer.ln_f.bias"] = (d,)
    shapes["lm_head.weight"] = (vocab, d)
    return shapes


def gpt2_init(cfg, vocab, seed):
    """GPT-2 initialisation: N(0, 0.02), residual projections N(0, 0.02/sqrt(2L)), LayerNorm 1/0, biases 0."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg, vocab).items():
        if name.endswith(".bias"):
            params[name] = np.zeros(shape, np.float32)
        elif ".ln_" in name:
            params[name] = np.ones(shape, np.float32)
        else:
            std = 0.02 / math.sqrt(2 * cfg["n_layer"]) if name.endswith("c_proj.weight") else 0.02
            params[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return params


def load_pcp_checkpoint(path, cfg, vocab):
    """The parameters of a pcp checkpoint: meta.json (`offset` in bytes, `len` in f32 elements) + tensors.bin."""
    path = Path(path)
    if not (path / "meta.json").is_file():
        latest = path / "latest"
        if not latest.is_file():
            raise SystemExit(f"--init {path}: no meta.json and no latest file (not a pcp checkpoint)")
        path = path / latest.read_text().strip()
    meta = json.loads((path / "meta.json").read_text())
    raw = np.fromfile(path / "tensors.bin", dtype="<f4")
    entries = {t["name"]: t for t in meta["tensors"]}
    params = {}
    for name, shape in param_shapes(cfg, vocab).items():
        if name not in entries:
            raise SystemExit(f"--init {path}: no tensor {name!r} (another model or vocabulary?)")
        e = entries[name]
        if tuple(e["shape"]) != shape:
            raise SystemExit(f"--init {path}: {name} has shape {e['shape']}, expected {list(shape)}")
        start = e["offset"] // 4
        params[name] = raw[start : start + e["len"]].reshape(shape).copy()
    if meta.get("step", 0) != 0:
        print(f"note: {path} is from step {meta['step']}; only its parameters are loaded (AdamW state starts at 0)")
    return params


def initial_params(args, cfg, vocab):
    if args.init is not None:
        return load_pcp_checkpoint(args.init, cfg, vocab), f"pcp checkpoint {args.init}"
    return gpt2_init(cfg, vocab, args.seed), f"GPT-2 init, seed {args.seed}"


class Report:
    """Eval lines, the loss curve and the final throughput line, shared by both references."""

    def __init__(self, args, cfg, name):
        self.args, self.cfg, self.name = args, cfg, name
        self.curve = open(args.curve, "w") if args.curve else None
        self.timed_seconds = 0.0
        self.timed_steps = 0
        self.final_val = None

    def step(self, step, loss, seconds):
        if step > WARMUP_STEPS_UNTIMED:
            self.timed_seconds += seconds
            self.timed_steps += 1
        if self.curve:
            self.curve.write(json.dumps({"step": step, "loss": loss}) + "\n")
        if not math.isfinite(loss):
            raise SystemExit(f"loss became {loss} at step {step}")

    def eval_due(self, step):
        if self.args.no_eval:
            return False
        every = self.args.eval_every
        return (every > 0 and step % every == 0) or step == self.args.steps

    def eval(self, step, train_loss, val_loss):
        self.final_val = val_loss
        print(f"step {step}: train loss {train_loss:.4f} val loss {val_loss:.4f}", flush=True)

    def finish(self):
        if self.curve:
            self.curve.close()
        tokens = self.timed_steps * self.cfg["batch_size"] * self.cfg["block_size"]
        rate = tokens / self.timed_seconds if self.timed_seconds > 0 else float("nan")
        print(f"tokens/s {rate:.0f} ({self.timed_steps} timed steps, {self.args.threads} threads)")
        if self.final_val is not None:
            print(f"final val loss {self.final_val:.4f}")
