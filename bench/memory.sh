#!/usr/bin/env bash
# Peak memory of a training step: `pcp-node train` against PyTorch eager at the same
# shape, one after the other on this machine (never at once: each may need most of it).
#
#   bench/memory.sh                      # gpt2-124m, batch 8 x 1024, 3 steps
#   MODEL=nanogpt-medium STEPS=20 RECOMPUTE="none attention blocks" TORCH=naive bench/memory.sh
#
# pcp's figure is the peak RSS of the whole `pcp-node train` process (compile,
# load and steps; the step's micro-batches are chosen from the available memory,
# or FREE_MEMORY=8GB); PyTorch's is its process's (bench/torch_step_memory.py),
# with nanoGPT's naive attention and with fused SDPA. Prints a Markdown table.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${MODEL:-gpt2-124m}
steps=${STEPS:-3}
recompute=${RECOMPUTE:-none}
python=.venv/bin/python
cargo build --release -p pcp-node >&2
bin=target/release/pcp-node
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# runs a command; prints its peak RSS in bytes (the largest of its children's)
peak() {
  "$python" - "$@" <<'PY'
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(r.returncode)
PY
}

gib() { awk -v b="$1" 'BEGIN { printf "%.2f", b / 1073741824 }'; }

cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')
echo "CPU: $cpu ($(nproc) cores), $(awk '/MemTotal/ { printf "%.1f GiB", $2 / 1048576 }' /proc/meminfo)"
echo
echo "| run | peak RSS (GiB) | tokens/s | micro-batches |"
echo "| --- | --- | --- | --- |"
for r in $recompute; do
  dir="$work/pcp-$r"
  mkdir -p "$dir"
  flags=(train --model "$model" --steps "$steps" --recompute "$r" --eval-every 0 --data-dir "$dir" --events "$dir/events.jsonl")
  [ -n "${FREE_MEMORY:-}" ] && flags+=(--free-memory "$FREE_MEMORY")
  bytes=$(peak "$bin" "${flags[@]}")
  summary=$("$python" - "$dir/events.jsonl" <<'PY'
import json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
rate = [e for e in events if e["event"] == "step"][-1]["tokens_per_s"]
plan = [e for e in events if e["event"] == "micro_batches"][0]
print("{:.0f} | {} x {}".format(rate, plan["micro_batches"], plan["micro_batch"]))
PY
)
  echo "| pcp-node train --model $model --recompute $r | $(gib "$bytes") | $summary |"
done
for attention in ${TORCH:-naive sdpa}; do
  "$python" bench/torch_step_memory.py --model "$model" --steps "$steps" --attention "$attention" | "$python" -c '
import json, sys
r = json.loads(sys.stdin.read())
print("| {}, {} attention | {:.2f} | {:.0f} | 1 x {} |".format(
    r["framework"], r["attention"], r["peak_rss_bytes"] / 2**30, r["tokens_per_s"], r["batch"]))'
done
