#!/usr/bin/env bash
# The attacks of `sim --hostile` against the shepherd's defences: for each kind (and
# all mixed), a run with 2 of 5 workers hostile beside the honest run of the same
# seed, under sparse and fp32 encodings. Prints a table: the final val loss, its gap
# to the honest run, and what the events say of every hostile contribution
# (rejected, discounted, bounded or clipped) against how many it sent.
#
#   bench/hostile.sh [--encodings "sparse fp32"] [--kinds "inflate concentrate ..."]
#                    [--rounds 10] [--tau 20] [--out DIR] [--bin PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
ENCODINGS="sparse fp32"
KINDS="inflate concentrate late drag sybil flip noise sleeper:4:zero sleeper:4:huge copy replay timing early mixed"
ROUNDS=10
TAU=20
OUT=$(mktemp -d)
BIN=target/release/pcp-node
EXTRA=()
while (($#)); do
  case "$1" in
    --encodings) ENCODINGS=$2; shift 2 ;;
    --kinds) KINDS=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --tau) TAU=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "hostile.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
# the shepherd's own screen, as these figures were measured, unless the flags after
# `--` name committees (open runs default to --screeners 3)
case " ${EXTRA[*]} " in *" --screeners "*) ;; *) EXTRA+=(--screeners 0) ;; esac
[ -x "$BIN" ] || { echo "hostile.sh: no $BIN; cargo build --release -p pcp-node" >&2; exit 2; }
DATA=${PCP_DATA:-../shared/data/tiny_shakespeare.txt}
[ -f "$DATA" ] || DATA=.data/tiny_shakespeare.txt
mkdir -p "$OUT"

# workers 1-3 honest, 4 and 5 hostile (`sybil`: 3 identities each, 6 in all)
flags() {
  case "$1" in
    honest) ;;
    sybil) echo "--hostile sybil:3:4 --hostile sybil:3:5" ;;
    replay) echo "--hostile replay:3:4" ;;
    mixed) echo "--hostile inflate:4 --hostile concentrate:5 --hostile drag:6 --hostile sybil:2:7 --hostile flip:8" ;;
    *) echo "--hostile $1:4 --hostile $1:5" ;;
  esac
}

run() { # encoding kind
  local enc=$1 kind=$2 dir="$OUT/$1-$2" nodes=6
  [ "$kind" = mixed ] && nodes=9
  local overlap=(--no-overlap)
  # a late contribution is carried only in an overlapping run: its baseline overlaps too
  case "$kind" in late|honest-overlap) overlap=(--overlap) ;; esac
  [ "$kind" = honest-overlap ] && kind=honest
  rm -rf "$dir"; mkdir -p "$dir"
  # shellcheck disable=SC2046
  "$BIN" sim --nodes "$nodes" --rounds "$ROUNDS" --tau "$TAU" --encoding "$enc" --seed 1337 --data "$DATA" \
    "${overlap[@]}" $(flags "$kind") --data-dir "$dir" --events "$dir/events.jsonl" "${EXTRA[@]}" \
    >"$dir/stdout" 2>"$dir/stderr" || { echo "$enc $kind: sim failed (see $dir/stderr)" >&2; return 1; }
}

summary() { # encoding kind [baseline] -> val loss and the hostile peers' fate
  python3 - "$OUT/$1-$2" "$OUT/$1-${3:-honest}" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
ev = [json.loads(l) for l in open(d / "events.jsonl")]
val = [e["val_loss"] for e in ev if e["event"] == "round_completed"][-1]
honest_val = None
h = pathlib.Path(sys.argv[2]) / "events.jsonl"
if h.exists():
    honest_val = [json.loads(l)["val_loss"] for l in open(h) if '"round_completed"' in l][-1]
# hostile peers: the workers started as 4 and up
hostile = {e["peer"] for e in ev if e["event"] == "worker_started" and e["worker"] >= 4}
sent = sum(1 for e in ev if e["event"] == "contribution_received" and e["peer"] in hostile)
named = {}
for e in ev:
    if e.get("peer") not in hostile:
        continue
    key = (e.get("round"), e["peer"])
    if e["event"] == "contribution_rejected":
        named.setdefault(key, set()).add("rejected")
    elif e["event"] == "contribution_discounted":
        named.setdefault(key, set()).add("discounted")
    elif e["event"] in ("contribution_bounded", "contribution_clipped"):
        named.setdefault(key, set()).add("bounded")

# a late contribution refused on arrival is named too (contribution_received's reason)
for e in ev:
    if e["event"] == "contribution_received" and e["peer"] in hostile and not e["accepted"]:
        named.setdefault((e["round"], e["peer"]), set()).add("rejected")
# a contribution carried into the next round is named in that round's events
for e in ev:
    if e["event"] == "round_completed":
        for peer in e.get("carried", []):
            if (e["round"], peer) in named and (e["round"] - 1, peer) not in named:
                named[(e["round"] - 1, peer)] = set(named[(e["round"], peer)])
kinds = {}
for v in named.values():
    for k in v:
        kinds[k] = kinds.get(k, 0) + 1
gap = "" if honest_val is None else f"{100 * (val - honest_val) / honest_val:+.2f}%"
print(f"{val:.4f}\t{gap}\t{sent}\t{len(named)}\t" + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
PY
}

printf 'encoding\tattack\tval loss\tvs honest\thostile sent\tnamed\thow\n'
for enc in $ENCODINGS; do
  run "$enc" honest
  printf '%s\thonest\t%s\n' "$enc" "$(summary "$enc" honest)"
  for kind in $KINDS; do
    base=honest
    if [ "$kind" = late ]; then
      base=honest-overlap
      run "$enc" "$base" && printf '%s\t%s\t%s\n' "$enc" "$base" "$(summary "$enc" "$base")"
    fi
    run "$enc" "$kind" && printf '%s\t%s\t%s\n' "$enc" "$kind" "$(summary "$enc" "$kind" "$base")"
  done
done
echo "runs in $OUT" >&2
