#!/usr/bin/env bash
# Cheap identities against the references: for each attack kind, a `sim` run with
# K of its workers hostile beside the honest run of the same seed. Prints a table:
# the final val loss and its gap to the honest run, the norm bound's lowest value
# from round 5 on over its value at the end of round 4, the hostile contributions
# averaged, and the share of rounds from 6 to the one before the last whose
# contribution from each honest worker was averaged, in its round or carried into
# the next (the lowest of them).
#
#   bench/sleepers.sh [--nodes 8] [--hostile 3] [--rounds 14] [--tau 20]
#                     [--kinds "sleeper:4:zero ..."] [--encodings "sparse fp32"]
#                     [--out DIR] [--bin PATH] [-- SIM FLAGS (e.g. --screen norm)]
#
# `replay` runs one replay:K group (NODES − K + 1 nodes: as many identities).
set -euo pipefail
cd "$(dirname "$0")/.."
ENCODINGS="sparse fp32"
KINDS="sleeper:4:zero sleeper:4:huge copy replay timing early"
NODES=8
HOSTILE=3
ROUNDS=14
TAU=20
OUT=$(mktemp -d)
BIN=target/release/pcp-node
EXTRA=()
while (($#)); do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --hostile) HOSTILE=$2; shift 2 ;;
    --encodings) ENCODINGS=$2; shift 2 ;;
    --kinds) KINDS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --tau) TAU=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "sleepers.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# the shepherd's own screen, as these figures were measured, unless the flags after
# `--` name committees (open runs default to --screeners 3)
case " ${EXTRA[*]} " in *" --screeners "*) ;; *) EXTRA+=(--screeners 0) ;; esac
[ -x "$BIN" ] || { echo "sleepers.sh: no $BIN; cargo build --release -p pcp-node" >&2; exit 2; }
DATA=${PCP_DATA:-../shared/data/tiny_shakespeare.txt}
[ -f "$DATA" ] || DATA=.data/tiny_shakespeare.txt
mkdir -p "$OUT"
FIRST=$((NODES - HOSTILE)) # workers FIRST .. NODES-1 are hostile

run() { # encoding kind
  local enc=$1 kind=$2 dir="$OUT/$1-$2" nodes=$NODES flags=()
  case "$kind" in
    honest) ;;
    replay) nodes=$((NODES - HOSTILE + 1)); flags=(--hostile "replay:$HOSTILE:$((nodes - 1))") ;;
    *) for n in $(seq "$FIRST" $((NODES - 1))); do flags+=(--hostile "$kind:$n"); done ;;
  esac
  rm -rf "$dir"; mkdir -p "$dir"
  "$BIN" sim --nodes "$nodes" --rounds "$ROUNDS" --tau "$TAU" --encoding "$enc" --seed 1337 --data "$DATA" \
    "${flags[@]}" --data-dir "$dir" --events "$dir/events.jsonl" "${EXTRA[@]}" \
    >"$dir/stdout" 2>"$dir/stderr" || { echo "$enc $kind: sim failed (see $dir/stderr)" >&2; return 1; }
}

summary() { # encoding kind
  python3 - "$OUT/$1-$2" "$OUT/$1-honest" "$2" "$FIRST" "$NODES" "$HOSTILE" <<'PY'
import json, sys, pathlib
d, h, kind, first, nodes, k = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3], *map(int, sys.argv[4:])
ev = [json.loads(l) for l in open(d / "events.jsonl")]
rounds = [e for e in ev if e["event"] == "round_completed"]
val = rounds[-1]["val_loss"]
honest = [json.loads(l) for l in open(h / "events.jsonl") if '"round_completed"' in l]
gap = 100 * (val - honest[-1]["val_loss"]) / honest[-1]["val_loss"]
workers = {e["worker"]: e["peer"] for e in ev if e["event"] == "worker_started"}
if kind == "replay":
    bad = {p for w, p in workers.items() if w >= nodes - k}
elif kind == "honest":
    bad = set()
else:
    bad = {p for w, p in workers.items() if w >= first}
good = {p for p in workers.values() if p not in bad}
b4 = rounds[3]["norm_bound"] if len(rounds) > 3 else float("nan")
low = min((r["norm_bound"] for r in rounds[4:]), default=float("nan"))
averaged = sum(1 for r in rounds for p in r["peers"] if p in bad)
# a worker's contribution to round r counts if round r averaged it, or round r + 1
# (which lists it as carried: it came after r closed); so the last round is left out
nxt = {r["round"]: r for r in rounds}
late = [r for r in rounds[:-1] if r["round"] >= 6]
def averaged_in(p, r):
    return p in r["peers"] or p in nxt.get(r["round"] + 1, {}).get("carried", [])
share = min((sum(averaged_in(p, r) for r in late) / max(len(late), 1) for p in good), default=1.0)
print(f"{val:.4f}\t{gap:+.2f}%\t{low / b4:.2f}\t{averaged}\t{share:.2f}")
PY
}

printf 'encoding\tattack\tval loss\tvs honest\tlowest bound / round 4\thostile averaged\thonest averaged (rounds 6 to last-1)\n'
for enc in $ENCODINGS; do
  run "$enc" honest
  printf '%s\thonest\t%s\n' "$enc" "$(summary "$enc" honest)"
  for kind in $KINDS; do
    run "$enc" "$kind" && printf '%s\t%s\t%s\n' "$enc" "$kind" "$(summary "$enc" "$kind")"
  done
done
echo "runs in $OUT" >&2
