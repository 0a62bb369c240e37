#!/usr/bin/env bash
# Screening committees under a round that arrives at once: a nanogpt-small shepherd
# with committees of 3 (`--screeners 3`), no spot checks and no probation, against
# `pcp-node loadtest --screen-ms MS`: WORKERS synthetic workers that send random
# pseudo-gradients together and sit on the committees, each answering a screen
# request after MS milliseconds with losses that pass it (they compute nothing, so
# a spot check would catch them all). Prints the loadtest's table, then, from the
# shepherd's events, each round's contributions, who decided their screens, and
# the share of them screened: decided by a committee or the shepherd, or refused
# by rule before any screen (sitting out, late), as against accepted unscreened
# past the shepherd's budget (`screen_round`'s `skipped`).
#
#   bench/committees.sh [WORKERS] [ROUNDS] [MS] [-- shepherd flags...]
#
# Defaults: 1000 workers, 6 rounds, 200 ms. Results under $OUT (a temporary
# directory unless set). docs/threat-model.md has the figures.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${1:-1000}
ROUNDS=${2:-6}
MS=${3:-200}
shift $(($# < 3 ? $# : 3))
[ "${1:-}" = "--" ] && shift
BIN=target/release/pcp-node
[ -x "$BIN" ] || { echo "committees.sh: no $BIN; cargo build --release -p pcp-node" >&2; exit 2; }
DATA=${PCP_DATA:-../shared/data/tiny_shakespeare.txt}
[ -f "$DATA" ] || DATA=.data/tiny_shakespeare.txt
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
"$BIN" --shepherd --pow-bits 0 --listen /ip4/127.0.0.1/tcp/0 --data "$DATA" --data-dir "$OUT/shepherd" \
  --events "$OUT/shepherd.jsonl" --rounds "$ROUNDS" --tau 20 --min-workers "$WORKERS" --screeners 3 \
  --screen-spot-rate 0 --probation-rounds 0 --heartbeat-timeout-ms 10000 "$@" \
  >"$OUT/shepherd.out" 2>"$OUT/shepherd.err" &
SPID=$!
trap 'kill $SPID 2>/dev/null || true' EXIT
ADDR=
for _ in $(seq 600); do
  ADDR=$(grep -o '/ip4/127.0.0.1/tcp/[0-9]*/p2p/[A-Za-z0-9]*' "$OUT/shepherd.out" 2>/dev/null | head -1 || true)
  [ -n "$ADDR" ] && break
  sleep 0.5
done
[ -n "$ADDR" ] || { echo "committees.sh: the shepherd never listened (see $OUT/shepherd.err)" >&2; exit 1; }
# twice as many payloads as workers: no two contributions of a round are the same bytes
"$BIN" loadtest --shepherd "$ADDR" --workers "$WORKERS" --rounds "$ROUNDS" --step-ms 20 --screen-ms "$MS" \
  --payloads $((2 * WORKERS)) --timeout-s 1800 --shepherd-pid "$SPID" --json "$OUT/loadtest.json" \
  --data-dir "$OUT/synthetic" >"$OUT/loadtest.out" 2>"$OUT/loadtest.err" || true
cat "$OUT/loadtest.out"
python3 - "$OUT/shepherd.jsonl" <<'PY'
import collections, json, sys
events = [json.loads(line) for line in open(sys.argv[1])]
received = collections.Counter(e["round"] for e in events if e["event"] == "contribution_received")
decided = collections.defaultdict(collections.Counter)
for e in events:
    if e["event"] == "screen_decided":
        decided[e["round"]][e["source"] + (f" ({e['why']})" if e["why"] else "")] += 1
skipped = {e["round"]: e["skipped"] for e in events if e["event"] == "screen_round"}
print("round  contributions  accepted unscreened  screened  decided by")
for r in sorted(received):
    n, s = received[r], skipped.get(r, 0)
    share = 100.0 * (n - s) / n if n else 100.0
    print(f"{r:>5}  {n:>13}  {s:>19}  {share:>7.1f}%  {dict(decided[r])}")
PY
echo "results in $OUT"
