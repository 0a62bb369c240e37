#!/usr/bin/env python3
"""The markdown report of bench/gpu_profile.sh from a run's raw files.

    python3 bench/gpu_report.py RAW [--plan PLAN.tsv]   # the report, on stdout
    python3 bench/gpu_report.py RAW --best              # the fastest bf16 variant, as shell lines

RAW holds meta.tsv and variants.tsv (from `prepare`), gpu.txt, bench-NAME.json
(iree-benchmark-module), ncu-NAME.csv (Nsight Compute's raw page), torch-P.txt and
torch-P-kernels.md. PLAN.tsv is `pcp-node bench gpu-plan --tsv`'s table: with it each
dispatch gets its compulsory bytes and roofline time; without it FLOPs come from
IREE's dispatch names and bytes are left out. Standard library only.
"""

import argparse
import csv
import json
import re
import statistics
import sys
from pathlib import Path

# (batch, block) of the presets, as `graph compile` builds them
SHAPES = {"nanogpt-small": (64, 32), "nanogpt-medium": (64, 128), "gpt2-124m": (8, 1024)}

# Datasheet peaks (dense): bf16 tensor TFLOP/s, f32 (no TF32) TFLOP/s, memory GB/s
PEAKS = {
    "H200": (989.4, 66.9, 4800.0),
    "H100 80GB HBM3": (989.4, 66.9, 3350.0),
    "H100": (989.4, 66.9, 3350.0),
    "A100": (312.0, 19.5, 2039.0),
}

SHAPE = re.compile(r"_((?:\d+x)+\d+)(?:_|$)")


def read_tsv(path):
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f, delimiter="\t"))


def meta(raw):
    m = {}
    p = raw / "meta.tsv"
    if p.exists():
        for line in p.read_text().splitlines():
            k, _, v = line.partition("\t")
            m[k] = v
    return m


def tokens_per_step(m):
    batch, block = SHAPES.get(m.get("model", ""), (0, 0))
    if m.get("batch", "preset") not in ("", "preset"):
        batch = int(m["batch"])
    return batch * block


def step_seconds(raw, name):
    """Median seconds per train_step call of bench-NAME.json, and how many were timed."""
    p = raw / f"bench-{name}.json"
    if not p.exists():
        return None, 0
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError:
        return None, 0
    unit = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    times, count = [], 0
    for b in data.get("benchmarks", []):
        if b.get("run_type") == "iteration" and "real_time" in b:
            times.append(b["real_time"] * unit.get(b.get("time_unit", "ns"), 1e-9))
            count += int(b.get("iterations", 1))
    return (statistics.median(times), count) if times else (None, 0)


def why_not_timed(raw, name):
    log = raw / f"bench-{name}.log"
    if not log.exists():
        return "not run (no time left)"
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()]
    bad = [l for l in lines if "error" in l.lower() or "UNAVAILABLE" in l or "INTERNAL" in l]
    return ("failed: " + (bad or lines or ["no output"])[-1][:200]).replace("|", "/")


def gpu(raw):
    text = (raw / "gpu.txt").read_text().strip() if (raw / "gpu.txt").exists() else ""
    name = text.split(",")[0].strip() if text and "nvidia-smi" not in text else ""
    peaks = next((v for k, v in PEAKS.items() if k in name), None)
    return text, name, peaks


def flops_from_name(kernel):
    """2·∏(loop ranges) for a contraction named by IREE (matmul, batch_matmul, contract), else None."""
    if not re.search(r"matmul|contract|conv", kernel):
        return None
    m = SHAPE.search(kernel.split("matmul")[-1] if "matmul" in kernel else kernel)
    if not m:
        return None
    n = 2
    for d in m.group(1).split("x"):
        n *= int(d)
    return n


def short(kernel):
    k = re.sub(r"^.*?\$async_dispatch_", "d", kernel)
    k = re.sub(r"^train_step_dispatch_", "d", k)
    return k if len(k) <= 80 else k[:77] + "..."


def ncu_rows(raw, name):
    """{kernel: [launches, seconds]} from ncu-NAME.csv, and the steps it covers."""
    p = raw / f"ncu-{name}.csv"
    if not p.exists():
        return None, 0
    lines = p.read_text(errors="replace").splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    if start is None:
        return None, 0
    rows = list(csv.reader(lines[start:]))
    head = rows[0]
    try:
        ki, ti = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
    except ValueError:
        return None, 0
    kernels = {}
    for r in rows[1:]:
        if len(r) <= max(ki, ti):
            continue
        try:
            ns = float(r[ti].replace(",", ""))
        except ValueError:
            continue  # the units row
        k = kernels.setdefault(r[ki], [0, 0.0])
        k[0] += 1
        k[1] += ns * 1e-9
    if not kernels:
        return None, 0
    return kernels, min(c for c, _ in kernels.values())


def plan_rows(path):
    rows = {}
    for r in read_tsv(Path(path)) if path else []:
        rows[r["dispatch"]] = r
    return rows


def fmt(x, nd=0):
    return "—" if x is None else f"{x:,.{nd}f}"


def report(raw, plan_path):
    m, out = meta(raw), []
    tokens = tokens_per_step(m)
    text, gname, peaks = gpu(raw)
    variants = read_tsv(raw / "variants.tsv")
    device = (raw / "device.txt").read_text().strip() if (raw / "device.txt").exists() else "?"
    out.append(f"# pcp's step on {gname or device}: {m.get('model', '?')}, {tokens:,} tokens a step")
    out.append("")
    out.append(f"- GPU: {text or 'unknown'}; host CPUs: "
               f"{(raw / 'cpus.txt').read_text().strip() if (raw / 'cpus.txt').exists() else '?'}")
    out.append(f"- Compiled on the CPU for `{m.get('backend', '?')}:{m.get('target', '?')}` by pcp {m.get('commit', '?')} "
               f"(`bench/gpu_profile.sh prepare`), timed with IREE 3.13's `iree-benchmark-module` "
               f"(`train_step`, splat inputs, the median of its timed calls)")
    if peaks:
        out.append(f"- Peaks used (datasheet, dense): bf16 {peaks[0]:g} TFLOP/s, f32 {peaks[1]:g} TFLOP/s, "
                   f"memory {peaks[2]:,.0f} GB/s")
    out.append("")

    torch = {}
    for p in ("bf16", "f32"):
        f = raw / f"torch-{p}.txt"
        t = f.read_text().strip() if f.exists() else "not run"
        e = re.search(r"eager ([\d,]+) tokens/s", t)
        c = re.search(r"torch\.compile ([\d,]+)", t)
        torch[p] = (float(e.group(1).replace(",", "")) if e else None,
                    float(c.group(1).replace(",", "")) if c else None, t)
    out.append("## pcp's step against PyTorch")
    out.append("")
    out.append("| precision | pcp tokens/s | step ms | PyTorch eager | torch.compile | pcp / eager | pcp / compile |")
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for p in ("bf16", "f32"):
        s, n = step_seconds(raw, p)
        rate = tokens / s if s else None
        eager, comp, _ = torch[p]
        ratio = lambda a, b: f"{a / b:.3f}×" if a and b else "—"  # noqa: E731
        label = "bf16 (autocast in PyTorch)" if p == "bf16" else "f32 (TF32 off in both)"
        out.append(f"| {label} | {fmt(rate)} | {fmt(s * 1e3 if s else None, 1)} | {fmt(eager)} | {fmt(comp)} | "
                   f"{ratio(rate, eager)} | {ratio(rate, comp)} |")
    s, n = step_seconds(raw, "bf16-npy-inputs")
    if s:
        base, _ = step_seconds(raw, "bf16")
        out.append("")
        out.append(f"The bf16 step with its arguments uploaded from .npy files (device-local buffers, as pcp's "
                   f"runtime makes them) instead of splat inputs: {s * 1e3:.1f} ms a step, {tokens / s:,.0f} tokens/s"
                   + (f" ({base / s:.2f}× the splat inputs' rate)." if base else "."))
    for p in ("bf16", "f32"):
        if torch[p][0] is None:
            out.append(f"\nPyTorch {p}: {torch[p][2][:300]}")
    out.append("")

    out.append("## Compile variants of the bf16 step")
    out.append("")
    base, _ = step_seconds(raw, "bf16")
    out.append("| variant | what changes | compile s | step ms | tokens/s | vs bf16 |")
    out.append("| --- | --- | --- | --- | --- | --- |")
    for v in variants:
        what = " ".join(x for x in (v["options"], v["env"], v["flags"]) if x) or "pcp's flags"
        if v["status"] != "ok":
            out.append(f"| {v['name']} | `{what}` | {v['seconds']} | {v['status']}: {v['detail'][:160]} | | |")
            continue
        s, n = step_seconds(raw, v["name"])
        if s is None:
            out.append(f"| {v['name']} | `{what}` | {v['seconds']} | {why_not_timed(raw, v['name'])} | | |")
            continue
        vs = f"{base / s:.2f}×" if base and v["precision"] == "bf16" else ""
        out.append(f"| {v['name']} | `{what}` | {v['seconds']} | {s * 1e3:.1f} ({n} calls) | {tokens / s:,.0f} | {vs} |")
    out.append("")

    plan = plan_rows(plan_path)
    for p in ("bf16", "f32"):
        status = (raw / f"ncu-{p}.status").read_text().strip() if (raw / f"ncu-{p}.status").exists() else None
        kernels, steps = ncu_rows(raw, p)
        if status is None and kernels is None:
            continue
        out.append(f"## Per-dispatch profile of the {p} step (Nsight Compute)")
        out.append("")
        if not kernels:
            log = raw / f"ncu-{p}.log"
            tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.exists() else []
            out.append(f"No profile: {status or 'no rows'}. {' / '.join(tail)[:400]}")
            out.append("")
            continue
        total = sum(t for _, t in kernels.values()) / steps
        s, _ = step_seconds(raw, p)
        launches = sum(c for c, _ in kernels.values()) / steps
        out.append(f"Each dispatch timed alone inside one real step (`ncu --metrics gpu__time_duration.sum "
                   f"--clock-control none --cache-control none`): {len(kernels)} distinct dispatches, "
                   f"{launches:,.0f} launches and {total * 1e3:,.1f} ms of kernel time a step"
                   + (f", against {s * 1e3:,.1f} ms a step timed without the profiler." if s else "."))
        peak_f = (peaks[0] if p == "bf16" else peaks[1]) if peaks else None
        mm = sum(t for k, (_, t) in kernels.items() if flops_from_name(k)) / steps
        out.append(f"Contractions (matmul dispatches) take {mm * 1e3:,.1f} ms ({100 * mm / total:.0f}%), "
                   f"everything else {(total - mm) * 1e3:,.1f} ms.")
        out.append("")
        out.append("| dispatch | launches | ms a step | share | GFLOP | TFLOP/s | % peak | MB | GB/s | % mem peak |")
        out.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        for k, (c, t) in rows[:40]:
            per = t / steps
            pr = plan.get(k) or plan.get(re.sub(r"^.*?\$", "", k)) or {}
            fl = float(pr["flops"]) if pr.get("flops") else flops_from_name(k)
            fl_step = fl * c / steps if fl else None
            by = float(pr["bytes"]) * c / steps if pr.get("bytes") else None
            tf = fl_step / per / 1e12 if fl_step else None
            gb = by / per / 1e9 if by else None
            out.append(f"| `{short(k)}` | {c / steps:g} | {per * 1e3:.3f} | {100 * per / total:.1f}% | "
                       f"{fmt(fl_step / 1e9 if fl_step else None, 1)} | {fmt(tf, 1)} | "
                       f"{fmt(100 * tf / peak_f if tf and peak_f else None, 1)} | {fmt(by / 1e6 if by else None, 1)} | "
                       f"{fmt(gb)} | {fmt(100 * gb / peaks[2] if gb and peaks else None, 1)} |")
        if len(rows) > 40:
            rest = sum(t for _, (_, t) in rows[40:]) / steps
            out.append(f"| {len(rows) - 40} others | | {rest * 1e3:.3f} | {100 * rest / total:.1f}% | | | | | | |")
        out.append("")
    for p in ("bf16", "f32"):
        f = raw / f"torch-{p}-kernels.md"
        if f.exists():
            out.append(f"## PyTorch's top kernels ({p})")
            out.append("")
            out.append(f.read_text().strip())
            out.append("")
    return "\n".join(out) + "\n"


def best(raw):
    """Shell lines naming the fastest bf16 variant that pcp-node can be told by environment."""
    base, _ = step_seconds(raw, "bf16")
    pick = ("bf16", "", "", base)
    for v in read_tsv(raw / "variants.tsv"):
        if v["precision"] != "bf16" or v["status"] != "ok" or v["options"]:
            continue
        s, _ = step_seconds(raw, v["name"])
        if s and base and s < 0.97 * base and s < (pick[3] or 1e9):
            pick = (v["name"], v["env"], v["flags"], s)
    name, env, flags, s = pick
    lines = [f"PCP_BEST_VARIANT={name}", f"PCP_IREE_GPU_FLAGS='{flags}'"]
    lines += [f"export {e}" for e in env.split() if e]
    if s and base:
        lines.append(f"PCP_BEST_GAIN={base / s:.3f}")
    return "\n".join(lines) + "\nexport PCP_IREE_GPU_FLAGS\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("raw", type=Path)
    p.add_argument("--plan")
    p.add_argument("--best", action="store_true")
    a = p.parse_args()
    if not a.raw.is_dir():
        sys.exit(f"gpu_report: {a.raw} is not a directory of raw results")
    sys.stdout.write(best(a.raw) if a.best else report(a.raw, a.plan))


if __name__ == "__main__":
    main()
