#!/usr/bin/env bash
# DiLoCo over shaped residential links: a shepherd and W workers, each a
# `pcp-node` process in its own network namespace, joined through a bridge in a
# hub namespace. Each worker's link is limited by tc tbf: UP from the worker,
# DOWN to it; the shepherd's link is not shaped. Four setups, one after another,
# on the same links: fp32, sparse, sparse + overlap, and sparse + overlap +
# FRAGMENTS Streaming DiLoCo fragments. Prints utilization (the workers' seconds in inner steps
# over wall seconds, from the shepherd's `round_completed`), bytes and val loss.
# Needs root (CAP_NET_ADMIN), ip and tc. No GPU.
#
#   bench/diloco_link.sh                                    # nanogpt-small, 3 workers, 1mbit up, 4mbit down, τ=20, 6 rounds
#   W=3 UP=1mbit DOWN=4mbit TAU=20 ROUNDS=6 bench/diloco_link.sh
#   SETUPS="fp32 sparse+overlap" FRAGMENTS=4 bench/diloco_link.sh
#   OUT=dir bench/diloco_link.sh                           # also writes dir/diloco_link.{md,json}
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$(realpath "${PCP_NODE:-target/release/pcp-node}")
[ -x "$BIN" ] || { echo "bench/diloco_link.sh: build first: cargo build --release -p pcp-node" >&2; exit 1; }
W=${W:-3}
UP=${UP:-1mbit}
DOWN=${DOWN:-4mbit}
TAU=${TAU:-20}
ROUNDS=${ROUNDS:-6}
MODEL=${MODEL:-nanogpt-small}
SETUPS=${SETUPS:-"fp32 sparse sparse+overlap sparse+overlap+fragments"}
FRAGMENTS=${FRAGMENTS:-2}
NICE=${NICE:-10}
SPARSE=${SPARSE:-sparse}   # the sparse setups' --encoding, e.g. sparse:k=128
TIMEOUT=${TIMEOUT:-900}
OUT=${OUT:-}
DATA=${DATA:-}
for c in ../shared/data/tiny_shakespeare.txt .data/tiny_shakespeare.txt; do
  [ -z "$DATA" ] && [ -f "$c" ] && DATA=$(realpath "$c")
done
[ -n "$DATA" ] || { echo "bench/diloco_link.sh: no corpus: run scripts/setup.sh" >&2; exit 1; }
command -v tc >/dev/null || { echo "bench/diloco_link.sh: tc not found (iproute2)" >&2; exit 1; }
export PCP_ARTIFACT_CACHE=${PCP_ARTIFACT_CACHE:-$HOME/.pcp/artifacts}
TAG=$$
HUB=pcpdlH$TAG
ns() { echo "pcpdl$1$TAG"; }
WORK=$(mktemp -d)
PIDS=()
stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
cleanup() {
  stop_all
  ip netns del "$HUB" 2>/dev/null || true
  for i in $(seq 0 "$W"); do ip netns del "$(ns "$i")" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

# the hub: a bridge; node i at 10.79.0.(i+1), veth h$i (hub side) and n$i (node side)
ip netns add "$HUB"
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" link set br0 up
for i in $(seq 0 "$W"); do
  n=$(ns "$i")
  ip netns add "$n"
  ip link add "h$i" netns "$HUB" type veth peer name "n$i" netns "$n"
  ip -n "$HUB" link set "h$i" master br0
  ip -n "$HUB" link set "h$i" up
  ip -n "$n" link set lo up
  ip -n "$n" addr add "10.79.0.$((i + 1))/24" dev "n$i"
  ip -n "$n" link set "n$i" up
  if [ "$i" -gt 0 ]; then
    # the worker's uplink leaves n$i; its downlink leaves the hub's h$i
    tc -n "$n" qdisc add dev "n$i" root tbf rate "$UP" burst 32kb latency 400ms
    tc -n "$HUB" qdisc add dev "h$i" root tbf rate "$DOWN" burst 32kb latency 400ms
  fi
done

wait_event() { # file, pattern, seconds
  for _ in $(seq $(($3 * 10))); do
    grep -q "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# one run: shepherd flags in $2…; prints nothing, leaves events in $WORK/$1
run_setup() {
  local name=$1
  shift
  local dir="$WORK/$name"
  mkdir -p "$dir"
  ip netns exec "$(ns 0)" "$BIN" --shepherd --pow-bits 0 --model "$MODEL" --tau "$TAU" --rounds "$ROUNDS" --min-workers "$W" \
    --data "$DATA" --listen /ip4/10.79.0.1/tcp/4700 --data-dir "$dir/shepherd" --events "$dir/shepherd.jsonl" \
    --no-tui "$@" >"$dir/shepherd.out" 2>"$dir/shepherd.log" &
  PIDS+=($!)
  wait_event "$dir/shepherd.jsonl" '"listening"' 120 || { echo "the shepherd did not start: $dir/shepherd.log" >&2; tail -5 "$dir/shepherd.log" >&2; exit 1; }
  local peer
  peer=$(grep -m1 -o '"peer":"[^"]*"' "$dir/shepherd.jsonl" | cut -d'"' -f4)
  for i in $(seq 1 "$W"); do
    # the workers yield the CPU to the shepherd: on separate machines its
    # aggregation and validation would not wait for their training
    ip netns exec "$(ns "$i")" nice -n "$NICE" "$BIN" --bootstrap "/ip4/10.79.0.1/tcp/4700/p2p/$peer" \
      --listen "/ip4/10.79.0.$((i + 1))/tcp/0" --data-dir "$dir/worker-$i" --events "$dir/worker-$i.jsonl" \
      --no-tui >"$dir/worker-$i.out" 2>"$dir/worker-$i.log" &
    PIDS+=($!)
  done
  wait_event "$dir/shepherd.jsonl" '"run_finished"' "$TIMEOUT" || echo "bench/diloco_link.sh: $name did not finish within ${TIMEOUT}s" >&2
  sleep 1
  stop_all
}

cpu=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)
echo "$W workers of $MODEL, links ${UP} up / ${DOWN} down, τ=$TAU, $ROUNDS rounds; $(nproc) cores: $cpu" >&2
for s in $SETUPS; do
  flags=()
  case $s in
    fp32) flags=(--encoding fp32 --no-overlap) ;;
    int8) flags=(--encoding int8 --no-overlap) ;;
    sparse) flags=(--encoding "$SPARSE" --no-overlap) ;;
    sparse+overlap) flags=(--encoding "$SPARSE" --overlap) ;;
    fp32+overlap) flags=(--encoding fp32 --overlap) ;;
    sparse+overlap+fragments) flags=(--encoding "$SPARSE" --overlap --fragments "$FRAGMENTS") ;;
    fp32+fragments) flags=(--encoding fp32 --no-overlap --fragments "$FRAGMENTS") ;;
    *) echo "bench/diloco_link.sh: unknown setup $s" >&2; exit 2 ;;
  esac
  echo "running $s…" >&2
  run_setup "$s" "${flags[@]}"
done

python3 - "$WORK" "$W" "$UP" "$DOWN" "$TAU" "$ROUNDS" "$cpu" "$OUT" $SETUPS <<'PY'
import json, os, sys
work, w, up, down, tau, rounds, cpu, out = sys.argv[1:9]
setups = sys.argv[9:]
def events(path):
    try:
        return [json.loads(l) for l in open(path) if l.strip()]
    except FileNotFoundError:
        return []
rows = []
for s in setups:
    shep = events(f"{work}/{s}/shepherd.jsonl")
    done = [e for e in shep if e["event"] == "round_completed"]
    sent = []
    for i in range(1, int(w) + 1):
        sent += [e for e in events(f"{work}/{s}/worker-{i}.jsonl") if e["event"] == "contribution_sent"]
    train = sum(e.get("train_s", 0) for e in sent)
    wall = sum(e.get("wall_s", 0) for e in sent)
    # the first contribution's wall time includes joining and the first fetch
    later = [e for e in sent if e["round"] > 1]
    util_after = sum(e.get("train_s", 0) for e in later) / max(1e-9, sum(e.get("wall_s", 0) for e in later))
    late = sum(1 for i in range(1, int(w) + 1) for e in events(f"{work}/{s}/worker-{i}.jsonl") if e["event"] == "update_late")
    merged = [e["after_steps"] for i in range(1, int(w) + 1) for e in events(f"{work}/{s}/worker-{i}.jsonl") if e["event"] == "update_merged"]
    rows.append({
        "setup": s, "rounds": len(done),
        "utilization": train / wall if wall else None,
        "utilization_after_round_1": util_after if later else None,
        "up_bytes_per_round": sum(e["bytes_up"] for e in sent) / max(1, len(sent)),
        "peak_up_bytes_per_sync": max((e["bytes_up"] for e in sent), default=0),
        "down_bytes_per_round": sum(e["bytes_down"] for e in sent) / max(1, len(sent)),
        "val_loss": done[-1]["val_loss"] if done else None,
        "seconds": (done[-1]["t"] - shep[0]["t"]) if done else None,
        "updates_late": late,
        "steps_before_merge": sum(merged) / len(merged) if merged else None,
        # time-boxed rounds (overlap): the share of τ's steps the contributions ran
        "steps_of_tau": sum(e["tokens"] for e in sent) / (len(sent) * max(e["tokens"] for e in sent)) if sent else None,
    })
base = next((r["val_loss"] for r in rows if r["setup"] == "fp32"), None)
fmt = lambda v, f: "—" if v is None else f.format(v)
lines = [f"{w} workers, links {up} up / {down} down, τ={tau}, {rounds} rounds; {cpu}", "",
         "| setup | syncs | utilization | after sync 1 | up / worker / sync (peak) | down / worker / sync | val loss | vs fp32 | wall s | late updates | steps before merge | steps run (of τ) |",
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
for r in rows:
    rel = None if base is None or r["val_loss"] is None else (r["val_loss"] / base - 1) * 100
    lines.append(f"| {r['setup']} | {r['rounds']} | {fmt(r['utilization'] and r['utilization'] * 100, '{:.1f}%')} | "
                 f"{fmt(r['utilization_after_round_1'] and r['utilization_after_round_1'] * 100, '{:.1f}%')} | "
                 f"{r['up_bytes_per_round'] / 1e3:.1f} kB ({r['peak_up_bytes_per_sync'] / 1e3:.1f}) | {r['down_bytes_per_round'] / 1e3:.1f} kB | "
                 f"{fmt(r['val_loss'], '{:.4f}')} | {fmt(rel, '{:+.1f}%')} | {fmt(r['seconds'], '{:.0f}')} | {r['updates_late']} | "
                 f"{fmt(r['steps_before_merge'], '{:.1f}')} | {fmt(r['steps_of_tau'] and r['steps_of_tau'] * 100, '{:.0f}%')} |")
print("\n".join(lines))
if out:
    os.makedirs(out, exist_ok=True)
    open(f"{out}/diloco_link.md", "w").write("\n".join(lines) + "\n")
    json.dump(rows, open(f"{out}/diloco_link.json", "w"), indent=1)
PY
