#!/usr/bin/env bash
# pcp vs the JAX and PyTorch references on one init (issue 3), then the step at
# scale against PyTorch SDPA (issue 40).
#   bench/compare.sh [--small-steps N] [--medium-steps N] [--skip-medium] [--skip-step] [--step-rounds N]
#                    [--table-rounds N]
# small: tokens/s (200 timed steps each) and a full run (default 1000 steps)
# for the final validation loss; medium: tokens/s only (20 timed steps). The
# tokens/s of that first table are each one's median over N rounds (3 by default)
# in which pcp, JAX and torch take turns.
# The step table: `pcp-node bench step` against bench/torch_step_memory.py with
# PyTorch's scaled_dot_product_attention, tokens/s and peak RSS of each process,
# at nanogpt-small, nanogpt-medium and gpt2-124m (batch 8 x 1024) in f32, and
# gpt2-124m in bf16 against torch CPU autocast where the CPU has AVX-512 BF16,
# in N rounds (3 by default) that alternate pcp and torch; each side's median.
# pcp's step is compiled once before it is measured (the artifact cache), so its
# peak is the step's, not the compiler's.
# Env: PCP_NODE (default target/release/pcp-node), DATA (the corpus),
# WORK (scratch: checkpoints, artifact cache, logs; default /tmp/pcpbench).
set -euo pipefail
cd "$(dirname "$0")/.."
PCP=${PCP_NODE:-target/release/pcp-node}
PY=${PYTHON:-.venv/bin/python}
DATA=${DATA:-../shared/data/tiny_shakespeare.txt}
WORK=${WORK:-/tmp/pcpbench}
SMALL_STEPS=1000
MEDIUM_TIMED=20
SMALL_TIMED=200
MEDIUM=1
STEP=1
STEP_ROUNDS=3
TABLE_ROUNDS=3
SEED=1337
while [ $# -gt 0 ]; do
    case $1 in
        --small-steps) SMALL_STEPS=$2; shift 2 ;;
        --medium-steps) MEDIUM_TIMED=$2; shift 2 ;;
        --skip-medium) MEDIUM=0; shift ;;
        --skip-step) STEP=0; shift ;;
        --step-rounds) STEP_ROUNDS=$2; shift 2 ;;
        --table-rounds) TABLE_ROUNDS=$2; shift 2 ;;
        *) echo "bench/compare.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ -x "$PCP" ] || { echo "bench/compare.sh: no pcp-node at $PCP (set PCP_NODE)" >&2; exit 1; }
"$PY" -c "import torch" 2>/dev/null || { echo "bench/compare.sh: torch missing; run bench/setup.sh" >&2; exit 1; }
mkdir -p "$WORK"
LOG="$WORK/logs"; mkdir -p "$LOG"

# pcp's hyper-parameters, spelled out so that the comparison does not depend
# on the binary's defaults; the references use the same values
# (bench/reference_common.py), and check_experiment verifies the run's.
CONFIG="$WORK/experiment.json"
"$PY" - "$CONFIG" <<'PYEOF'
import json, sys
sys.path.insert(0, "bench")
import reference_common as rc
json.dump(dict(learning_rate=rc.PEAK_LR, min_lr=rc.MIN_LR, warmup_steps=rc.WARMUP, beta1=rc.BETA1, beta2=rc.BETA2,
               eps=rc.EPS, weight_decay=rc.WEIGHT_DECAY, grad_clip=rc.GRAD_CLIP, val_fraction=rc.VAL_FRACTION,
               eval_batches=rc.EVAL_BATCHES, eval_interval=250), open(sys.argv[1], "w"), indent=1)
PYEOF

# Fails when the pcp checkpoint under $1 was trained with other hyper-parameters.
check_experiment() {
    "$PY" - "$1" "$CONFIG" <<'PYEOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
meta = json.loads((d / (d / "latest").read_text().strip() / "meta.json").read_text())
used, want = meta["meta"]["experiment"], json.load(open(sys.argv[2]))
bad = {k: (used.get(k), v) for k, v in want.items() if used.get(k) != v}
if bad:
    sys.exit(f"bench/compare.sh: pcp trained with other hyper-parameters (got, want): {bad}")
PYEOF
}

# The initial parameters, as pcp's seeded init writes them. `--steps 0`
# saves them as they are; older binaries save nothing there, and then one
# step at learning rate 0 (which leaves every parameter unchanged) does.
init_dir() {
    local model=$1 dir="$WORK/init-$1"
    rm -rf "$dir"
    "$PCP" train --model "nanogpt-$model" --steps 0 --seed $SEED --checkpoint-dir "$dir" \
        --data-dir "$WORK" --data "$DATA" >"$LOG/init-$model.log" 2>&1
    if [ ! -f "$dir/latest" ]; then
        rm -rf "$dir"
        "$PCP" train --model "nanogpt-$model" --steps 1 --lr 0 --seed $SEED --checkpoint-dir "$dir" \
            --data-dir "$WORK" --data "$DATA" >"$LOG/init-$model.log" 2>&1
    fi
    echo "$dir"
}

median() { "$PY" -c 'import statistics, sys; print(statistics.median(map(float, sys.argv[1:])))' "$@"; }

field() { sed -n "s/^$1 *\([0-9.eE+-]*\).*/\1/p" "$2" | tail -1; }

run_model() {
    local model=$1 timed=$2 full=$3 init
    init=$(init_dir "$model")
    local round pcp_tps="" jax_tps="" torch_tps=""
    # pcp, JAX and torch take turns over the rounds; each one's median goes in the table
    for round in $(seq "$TABLE_ROUNDS"); do
        echo "== nanogpt-$model, round $round of $TABLE_ROUNDS: pcp bench step ($timed timed steps)" >&2
        "$PCP" bench step --model "nanogpt-$model" --steps "$timed" --data "$DATA" --data-dir "$WORK" \
            >"$LOG/pcp-bench-$model-$round.log" 2>&1
        pcp_tps="$pcp_tps $(field "tokens\/s" "$LOG/pcp-bench-$model-$round.log")"
        for impl in jax torch; do
            echo "== nanogpt-$model, round $round of $TABLE_ROUNDS: $impl reference ($timed timed steps)" >&2
            "$PY" bench/${impl}_reference.py --model "$model" --steps $((timed + 3)) --init "$init" --data "$DATA" \
                --no-eval >"$LOG/$impl-tps-$model-$round.log" 2>&1
        done
        jax_tps="$jax_tps $(field "tokens\/s" "$LOG/jax-tps-$model-$round.log")"
        torch_tps="$torch_tps $(field "tokens\/s" "$LOG/torch-tps-$model-$round.log")"
    done
    echo "nanogpt-$model tokens/s by round: pcp$pcp_tps; JAX$jax_tps; torch$torch_tps" >>"$LOG/rounds.txt"
    PCP_TPS=$(median $pcp_tps)
    JAX_TPS=$(median $jax_tps)
    TORCH_TPS=$(median $torch_tps)
    if [ "$full" -gt 0 ]; then
        echo "== nanogpt-$model: pcp train ($full steps)" >&2
        rm -rf "$WORK/run-$model"
        "$PCP" train --config "$CONFIG" --model "nanogpt-$model" --steps "$full" --seed $SEED --data "$DATA" \
            --data-dir "$WORK" --checkpoint-dir "$WORK/run-$model" --events "$LOG/pcp-train-$model.jsonl" \
            >"$LOG/pcp-train-$model.log" 2>&1
        check_experiment "$WORK/run-$model"
        # pcp's final parameters on the references' validation batches, which
        # removes the difference in validation sampling from the comparison.
        "$PY" bench/jax_reference.py --model "$model" --steps 0 --init "$WORK/run-$model" --data "$DATA" \
            >"$LOG/pcp-params-on-ref-val-$model.log" 2>&1
        PCP_XVAL=$(field "final val loss" "$LOG/pcp-params-on-ref-val-$model.log")
        PCP_VAL=$("$PY" -c "
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
with open(sys.argv[2], 'w') as curve:
    for e in ev:
        if e.get('event') == 'step':
            curve.write(json.dumps({'step': e['step'], 'loss': e['loss']}) + '\\n')
print([e for e in ev if e.get('event') == 'eval'][-1]['val_loss'])
" "$LOG/pcp-train-$model.jsonl" "$LOG/pcp-curve-$model.jsonl")
        for impl in jax torch; do
            echo "== nanogpt-$model: $impl reference ($full steps)" >&2
            "$PY" bench/${impl}_reference.py --model "$model" --steps "$full" --init "$init" --data "$DATA" \
                --curve "$LOG/$impl-curve-$model.jsonl" >"$LOG/$impl-train-$model.log" 2>&1
        done
        JAX_VAL=$(field "final val loss" "$LOG/jax-train-$model.log")
        TORCH_VAL=$(field "final val loss" "$LOG/torch-train-$model.log")
    else
        PCP_VAL=""; PCP_XVAL=""; JAX_VAL=""; TORCH_VAL=""
    fi
    "$PY" - "$model" "$PCP_TPS" "$JAX_TPS" "$TORCH_TPS" "$full" "$PCP_VAL" "$PCP_XVAL" "$JAX_VAL" "$TORCH_VAL" >>"$LOG/table.md" <<'PYEOF'
import sys
model, pcp, jax, torch, full, *vals = sys.argv[1:]
pcp, jax, torch = float(pcp), float(jax), float(torch)
row = f"| nanogpt-{model} | {pcp:.0f} | {jax:.0f} | {torch:.0f} | {pcp / max(jax, torch):.2f}× |"
if all(vals):
    p, x, j, t = map(float, vals)
    row += f" {p:.4f} | {x:.4f} | {j:.4f} | {t:.4f} | {100 * (p - j) / j:+.2f}% | {100 * (x - j) / j:+.2f}% |"
else:
    row += " – | – | – | – | – | – |"
print(row)
PYEOF
}

rm -f "$LOG/table.md" "$LOG/rounds.txt"
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
run_model small "$SMALL_TIMED" "$SMALL_STEPS"
[ "$MEDIUM" = 1 ] && run_model medium "$MEDIUM_TIMED" 0
echo
echo "load average before / after: $LOAD_BEFORE / $(cut -d' ' -f1-3 /proc/loadavg) (other processes skew tokens/s)"
echo "tokens/s on $(nproc) cores; val loss at step $SMALL_STEPS over 8 batches: 'pcp val' on pcp's own (ChaCha8) validation"
echo "batches, 'pcp val*' = pcp's final parameters on the references' batches (JAX and torch share NumPy-seeded batches)"
echo "tokens/s: each one's median over $TABLE_ROUNDS alternating rounds ($LOG/rounds.txt):"
sed 's/^/  /' "$LOG/rounds.txt"
echo "| model | pcp tok/s | JAX tok/s | torch tok/s | pcp / max | pcp val | pcp val* | JAX val | torch val | pcp vs JAX | pcp* vs JAX |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
cat "$LOG/table.md"

# runs a command; prints its peak RSS in bytes (the largest of its children's)
peak_rss() {
    "$PY" - "$@" <<'PYEOF'
import resource, subprocess, sys
r = subprocess.run(sys.argv[2:], stdout=open(sys.argv[1], "w"), stderr=subprocess.STDOUT)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(r.returncode)
PYEOF
}

step_row() {
    local model=$1 steps=$2 precision=$3 name log round rss
    name="$model-$precision"
    echo "== $model $precision: pcp bench step ($steps steps, compiled first)" >&2
    "$PCP" bench step --model "$model" --steps 1 --precision "$precision" --data "$DATA" --data-dir "$WORK" \
        >"$LOG/step-pcp-$name-compile.log" 2>&1
    rm -f "$LOG/step-$name.rounds"
    # pcp and torch take turns, so that a change in the machine's load between
    # them weighs on both: the table has each side's median over the rounds.
    for round in $(seq "$STEP_ROUNDS"); do
        log="$LOG/step-pcp-$name-$round.log"
        echo "== $model $precision, round $round of $STEP_ROUNDS: pcp bench step ($steps steps)" >&2
        rss=$(peak_rss "$log" "$PCP" bench step --model "$model" --steps "$steps" --precision "$precision" \
            --data "$DATA" --data-dir "$WORK")
        echo "{\"pcp_tokens_per_s\": $(field "tokens\/s" "$log"), \"pcp_peak_rss_bytes\": $rss}" >>"$LOG/step-$name.rounds"
        echo "== $model $precision, round $round of $STEP_ROUNDS: torch SDPA ($steps steps)" >&2
        "$PY" bench/torch_step_memory.py --model "$model" --steps "$steps" --attention sdpa \
            --precision "$precision" >>"$LOG/step-$name.rounds"
    done
    "$PY" - "$model" "$precision" "$LOG/step-$name.rounds" >>"$LOG/step.md" <<'PYEOF'
import json, statistics, sys
model, precision, path = sys.argv[1:]
lines = [json.loads(l) for l in open(path)]
pcp, torch = lines[0::2], lines[1::2]
tps = statistics.median(r["pcp_tokens_per_s"] for r in pcp)
ttps = statistics.median(r["tokens_per_s"] for r in torch)
rss = max(r["pcp_peak_rss_bytes"] for r in pcp) / 2**30
trss = max(r["peak_rss_bytes"] for r in torch) / 2**30
ratios = sorted(p["pcp_tokens_per_s"] / t["tokens_per_s"] for p, t in zip(pcp, torch))
spread = f"{ratios[0]:.2f}–{ratios[-1]:.2f}×" if len(ratios) > 1 else "–"
print(f"| {model} | {precision} | {tps:.0f} | {rss:.2f} | {ttps:.0f} | {trss:.2f} | {tps / ttps:.2f}× | {spread} | {rss / trss:.2f}× |")
PYEOF
}

if [ "$STEP" = 1 ]; then
    rm -f "$LOG/step.md"
    step_row nanogpt-small 200 f32
    step_row nanogpt-medium "$MEDIUM_TIMED" f32
    step_row gpt2-124m 3 f32
    grep -q avx512_bf16 /proc/cpuinfo && step_row gpt2-124m 3 bf16
    echo
    echo "CPU: $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(nproc) cores)"
    echo "The step against PyTorch $("$PY" -c 'import torch; print(torch.__version__)') eager with scaled_dot_product_attention"
    echo "(bf16: CPU autocast); $STEP_ROUNDS alternating rounds: tokens/s are each side's median, 'per round' the range"
    echo "of the rounds' ratios, peak RSS the largest of the rounds'; pcp's artifact compiled beforehand."
    echo "| model | precision | pcp tok/s | pcp peak GiB | torch SDPA tok/s | torch peak GiB | speed | per round | memory |"
    echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    cat "$LOG/step.md"
fi
echo "logs and loss curves: $LOG"
