#!/usr/bin/env bash
# DiLoCo on nanogpt-small (CPU): 4 workers for R rounds of τ inner steps (`pcp-node sim`,
# real nodes on loopback), against one worker trained for the same number of inner steps
# and one worker trained on 4x the batch, with the same schedule and validation batches.
#
#   bench/diloco.sh            # R=10, τ=50
#   R=20 TAU=25 bench/diloco.sh
set -euo pipefail
cd "$(dirname "$0")/.."
R=${R:-10}
TAU=${TAU:-50}
WORKERS=${WORKERS:-4}
BIN=target/release/pcp-node
[ -x "$BIN" ] || cargo build --release -p pcp-node
DATA=${DATA:-}
for c in ../shared/data/tiny_shakespeare.txt .data/tiny_shakespeare.txt; do
  [ -z "$DATA" ] && [ -f "$c" ] && DATA=$c
done
[ -n "$DATA" ] || { echo "no corpus: run scripts/setup.sh" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
steps=$((R * TAU))
warmup=$((steps / 20 < 100 ? steps / 20 : 100))
# the schedule `sim` uses: peak 3e-3, floor 3e-4, warmup min(steps/20, 100)
cat > "$tmp/experiment.json" <<JSON
{"model": "nanogpt-small", "learning_rate": 0.003, "min_lr": 0.0003, "warmup_steps": $warmup,
 "eval_interval": 0, "eval_batches": 8}
JSON
export PCP_ARTIFACT_CACHE=${PCP_ARTIFACT_CACHE:-$HOME/.pcp/artifacts}

start=$(date +%s.%N)
"$BIN" sim --nodes $((WORKERS + 1)) --rounds "$R" --tau "$TAU" --encoding fp32 --no-overlap --screeners 0 --data "$DATA" \
  --data-dir "$tmp/sim" --events "$tmp/sim.jsonl" >&2
t_sim=$(echo "$(date +%s.%N) - $start" | bc)
start=$(date +%s.%N)
"$BIN" train --config "$tmp/experiment.json" --steps "$steps" --data "$DATA" \
  --data-dir "$tmp/one" --events "$tmp/one.jsonl" >&2
t_one=$(echo "$(date +%s.%N) - $start" | bc)
start=$(date +%s.%N)
"$BIN" train --config "$tmp/experiment.json" --steps "$steps" --batch $((64 * WORKERS)) --data "$DATA" \
  --data-dir "$tmp/big" --events "$tmp/big.jsonl" >&2
t_big=$(echo "$(date +%s.%N) - $start" | bc)

python3 - "$tmp" "$R" "$TAU" "$WORKERS" "$t_sim" "$t_one" "$t_big" <<'PY'
import json, sys
tmp, R, tau, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
secs = [float(x) for x in sys.argv[5:8]]
def events(name):
    return [json.loads(l) for l in open(f"{tmp}/{name}.jsonl") if l.strip()]
sim = [e for e in events("sim") if e["event"] == "round_completed"]
def final_eval(name):
    return [e for e in events(name) if e["event"] == "eval"][-1]["val_loss"]
sent = sum(e["bytes_in"] for e in sim) / max(1, sum(e["contributors"] for e in sim))
rows = [
    (f"DiLoCo: {workers} workers x {R} rounds of tau={tau}", sim[-1]["val_loss"], R * tau, workers * R * tau * 64, secs[0]),
    (f"1 worker, {R * tau} steps, batch 64", final_eval("one"), R * tau, R * tau * 64, secs[1]),
    (f"1 worker, {R * tau} steps, batch {64 * workers}", final_eval("big"), R * tau, R * tau * 64 * workers, secs[2]),
]
print(f"| run | val loss | inner steps | sequences | seconds |")
print(f"| --- | --- | --- | --- | --- |")
for name, val, steps, seqs, s in rows:
    print(f"| {name} | {val:.4f} | {steps} | {seqs} | {s:.0f} |")
print(f"\nDiLoCo: {sent / 1e6:.2f} MB of pseudo-gradient per worker per round; "
      f"{len(sim)} rounds, contributors per round: {[e['contributors'] for e in sim]}")
PY
