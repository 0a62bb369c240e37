#!/usr/bin/env bash
# Per-dispatch time of a model's fused training step on the cpu, from IREE's HAL
# profiler: which fused kernels (matmuls, softmax, layout changes…) the step spends
# its time in.
#
#   bench/profile_step.sh [nanogpt-small|nanogpt-medium|gpt2-124m|MODEL.mlir] [REPETITIONS]
#
# It writes the step module with `pcp-node graph step`, compiles it with the tuned cpu
# flags (`graph::Target::tuned_flags`: data tiling and microkernels, what pcp uses for
# modules with mostly ≥128-wide matmuls such as nanogpt-medium; set PLAIN=1 for the
# plain flags pcp uses for narrower ones such as nanogpt-small), runs it with
# `iree-benchmark-module` on splat inputs with
# `--device_profiling_mode=host-execution`, and prints each dispatch's and each kind of
# dispatch's time, averaged over the steps run but the first (the profile also
# counts the WARMUP seconds of steps, 5 by default, that steady the benchmark's
# timing). Dispatches overlap on the two workers, so their sum exceeds the step's
# wall time. glibc keeps freed blocks (as pcp's `HostAllocator` does), so only
# the first step faults its pages in (1.6 M faults for gpt2-124m, none after),
# which makes the dispatches that first write fresh memory (AdamW's) look up to 20×
# slower: that step is left out. FLUSH_MS
# (200 by default) is how often the profile is drained; a profile that dropped
# records is refused.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${1:-nanogpt-medium}
REPS=${2:-4}
PCP_NODE=${PCP_NODE:-target/release/pcp-node}
VENV_BIN=${VENV_BIN:-.venv/bin}
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
for tool in iree-compile iree-benchmark-module iree-profile; do
    [ -x "$VENV_BIN/$tool" ] || { echo "error: $VENV_BIN/$tool not found (run scripts/setup.sh)" >&2; exit 1; }
done
[ -x "$PCP_NODE" ] || { echo "error: $PCP_NODE not found (cargo build --release -p pcp-node)" >&2; exit 1; }

FLAGS=(--iree-hal-target-backends=llvm-cpu --iree-llvmcpu-target-cpu=host)
if [ -z "${PLAIN:-}" ]; then
    FLAGS+=(--iree-opt-data-tiling=true --iree-llvmcpu-enable-ukernels=mmt4d,pack --iree-llvmcpu-stack-allocation-limit=65536)
fi
# the process-wide option pcp sets (`graph::iree::MATMUL_TILE_BYTES`)
FLAGS+=(--iree-llvmcpu-matmul-tile-bytes=4194304)

# STEP_FLAGS: more `graph step` flags (`--attention naive`, `--recompute elementwise`, …)
# shellcheck disable=SC2086
"$PCP_NODE" graph step "$MODEL" ${STEP_FLAGS:-} -o "$WORK/step.mlir" >&2
"$VENV_BIN/iree-compile" "${FLAGS[@]}" "$WORK/step.mlir" -o "$WORK/step.vmfb"

# one splat input per train_step argument: small parameters, step 1, token ids 1
python3 - "$WORK/step.mlir" > "$WORK/inputs.flags" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
head = next(l for l in text.splitlines() if 'sym_name = "train_step"' in l)
args = re.search(r"function_type = \((.*?)\) ->", head).group(1)
for ty in re.findall(r"tensor<([^>]*)>", args):
    *dims, elem = ty.split("x")
    value = "1" if elem.startswith("i") or not dims else "0.001"
    print(f"--input={'x'.join(dims + [elem])}={value}")
EOF

export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=4294967295:glibc.malloc.trim_threshold=68719476736
"$VENV_BIN/iree-benchmark-module" --module="$WORK/step.vmfb" --function=train_step \
    --flagfile="$WORK/inputs.flags" --device=local-task --benchmark_min_warmup_time="${WARMUP:-5}" --benchmark_repetitions="$REPS" \
    --device_profiling_mode=host-execution --device_profiling_output="$WORK/step.ireeprof" \
    --device_profiling_flush_interval_ms="${FLUSH_MS:-200}" 2>&1 |
    grep -E "real_time_(mean|median)" || true
# The profiler's buffer holds 16,384 events (gpt2-124m's step has about 4,900
# dispatches); the periodic flush drains it. Were records still dropped, late
# dispatches would be undercounted against the step count below: refuse.
dropped=$("$VENV_BIN/iree-profile" summary "$WORK/step.ireeprof" | grep -oE "dropped_records=[0-9]+" | head -1 | cut -d= -f2)
if [ "${dropped:-0}" != 0 ]; then
    echo "error: the profile dropped $dropped records; lower FLUSH_MS (now ${FLUSH_MS:-200}) or REPETITIONS/WARMUP" >&2
    exit 1
fi
# Per dispatch event, grouped by the step (submission) it ran in. The first step
# faults its pages in and is dropped when there are others: the figures are the
# mean of the steady steps.
"$VENV_BIN/iree-profile" dispatch --format=jsonl --dispatch_events "$WORK/step.ireeprof" | python3 -c '
import collections, json, re, sys
ms = collections.defaultdict(lambda: collections.defaultdict(float))
count = collections.defaultdict(lambda: collections.defaultdict(int))
for line in sys.stdin:
    e = json.loads(line)
    if e.get("type") == "host_dispatch_event":
        ms[e["key"]][e["submission_id"]] += e["duration_ns"] / 1e6
        count[e["key"]][e["submission_id"]] += 1
steps = sorted({s for per in ms.values() for s in per})
if not steps:
    sys.exit("error: the profile has no dispatch events")
kept = steps[1:] or steps
rows = [(sum(per[s] for s in kept) / len(kept), name, count[name][kept[-1]]) for name, per in ms.items()]
total = sum(r[0] for r in rows)
first = "" if kept is steps else f", the first of {len(steps)} dropped"
print(f"dispatch time per step: {total:.1f} ms (mean of {len(kept)} steps{first})")
kinds = collections.Counter()
for t, name, _ in rows:
    kind = "layout (encode)" if name.startswith("_encoding") else re.sub(r"_\d.*", "", re.sub(r".*dispatch_\d+_", "", name))
    kinds[kind] += t
for kind, t in kinds.most_common():
    print(f"{t:9.1f} ms {100 * t / total:5.1f}%  {kind}")
print()
for t, name, n in sorted(rows, reverse=True)[:25]:
    print(f"{t:9.1f} ms x{n:<3d} {name}")
'
echo "module, inputs and profile in $WORK" >&2
