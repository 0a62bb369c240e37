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
# `--device_profiling_mode=host-execution`, and prints `iree-profile statistics` per
# dispatch and per kind of dispatch, averaged over the steps run (the profile also
# counts the WARMUP seconds of steps, 5 by default, that steady the benchmark's
# timing). Dispatches overlap on the two workers, so their sum exceeds the step's
# wall time. glibc keeps freed blocks (as pcp's `HostAllocator` does), so only
# the first step faults its pages in (1.6 M faults for gpt2-124m, none after);
# with few steps that first one still weighs on the dispatches that first write
# fresh memory (AdamW's), so take more REPETITIONS for steady figures. FLUSH_MS
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
"$VENV_BIN/iree-profile" statistics "$WORK/step.ireeprof" | python3 -c '
import collections, re, sys
unit = {"ms": 1.0, "us": 1e-3, "ns": 1e-6}
raw = []
for line in sys.stdin:
    m = re.match(r"\s+host_execute (\S+)\s+count=(\d+) total=([\d.]+) (ms|us|ns)", line)
    if m:
        raw.append((float(m.group(3)) * unit[m.group(4)], m.group(1), int(m.group(2))))
# every dispatch runs at least once a step: the rarest one counts the steps profiled
steps = min(count for _, _, count in raw)
rows = [(ms / steps, name, count // steps) for ms, name, count in raw]
total = sum(r[0] for r in rows)
print(f"dispatch time per step: {total:.1f} ms (mean of {steps} steps, warmup included)")
kinds = collections.Counter()
for ms, name, _ in rows:
    kind = "layout (encode)" if name.startswith("_encoding") else re.sub(r"_\d.*", "", re.sub(r".*dispatch_\d+_", "", name))
    kinds[kind] += ms
for kind, ms in kinds.most_common():
    print(f"{ms:9.1f} ms {100 * ms / total:5.1f}%  {kind}")
print()
for ms, name, count in sorted(rows, reverse=True)[:25]:
    print(f"{ms:9.1f} ms x{count:<3d} {name}")
'
echo "module, inputs and profile in $WORK" >&2
