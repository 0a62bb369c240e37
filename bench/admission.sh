#!/usr/bin/env bash
# A run's admission under cheap identities, with real processes on this machine:
#
# 1. lockout: a nanogpt-small shepherd (--pow-bits 0, --min-workers 1); HELLOS
#    identities say one hello each and leave (`loadtest --leave-after-hello`); then
#    an honest CPU worker joins. Prints the hellos' answers, the shepherd's
#    `admission_held` at each close (hellos kept: live, waiting, left) and the
#    rounds the honest worker was averaged into.
# 2. announcements: a shepherd with --participants-inline INLINE against
#    `loadtest --workers WORKERS` for ROUNDS rounds: the rounds whose
#    announcement named a participants blob, and each round's contributions.
#
#   bench/admission.sh [--hellos 10000] [--workers 500] [--inline 100] [--rounds 3]
#                      [--only lockout|announcements] [--out DIR] [--bin PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
HELLOS=10000
WORKERS=500
INLINE=100
ROUNDS=3
ONLY=
OUT=$(mktemp -d)
BIN=target/release/pcp-node
while (($#)); do
  case "$1" in
    --hellos) HELLOS=$2; shift 2 ;;
    --workers) WORKERS=$2; shift 2 ;;
    --inline) INLINE=$2; shift 2 ;;
    --rounds) ROUNDS=$2; shift 2 ;;
    --only) ONLY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --bin) BIN=$2; shift 2 ;;
    *) echo "admission.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x "$BIN" ] || { echo "admission.sh: no $BIN; cargo build --release -p pcp-node" >&2; exit 2; }
DATA=${PCP_DATA:-../shared/data/tiny_shakespeare.txt}
[ -f "$DATA" ] || DATA=.data/tiny_shakespeare.txt
mkdir -p "$OUT"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT

shepherd() { # dir, flags...: starts a shepherd, sets ADDR and SPID
  local dir=$1; shift
  mkdir -p "$dir"
  "$BIN" --shepherd --pow-bits 0 --listen /ip4/127.0.0.1/tcp/0 --data "$DATA" --data-dir "$dir/shepherd" \
    --events "$dir/shepherd.jsonl" "$@" >"$dir/shepherd.out" 2>"$dir/shepherd.err" &
  SPID=$!
  PIDS+=("$SPID")
  for _ in $(seq 600); do
    ADDR=$(grep -o '/ip4/127.0.0.1/tcp/[0-9]*/p2p/[A-Za-z0-9]*' "$dir/shepherd.out" 2>/dev/null | head -1 || true)
    [ -n "$ADDR" ] && return 0
    sleep 0.5
  done
  echo "admission.sh: the shepherd in $dir never listened" >&2
  exit 1
}

if [ "$ONLY" != announcements ]; then
  d="$OUT/lockout"
  shepherd "$d" --rounds 4 --tau 5 --min-workers 1 --heartbeat-timeout-ms 3000
  start=$(date +%s)
  "$BIN" loadtest --shepherd "$ADDR" --workers "$HELLOS" --leave-after-hello --hello-concurrency 64 \
    --timeout-s 3600 --json "$d/hellos.json" --data-dir "$d/hellos" >"$d/hellos.out" 2>"$d/hellos.err"
  echo "lockout: $(cat "$d/hellos.out") ($(($(date +%s) - start)) s wall)"
  "$BIN" --bootstrap "$ADDR" --listen /ip4/127.0.0.1/tcp/0 --data-dir "$d/w1" --events "$d/w1.jsonl" \
    >"$d/w1.out" 2>"$d/w1.err" &
  PIDS+=("$!")
  wait "$SPID" || true
  python3 - "$d" <<'PY'
import json, sys, pathlib
d = pathlib.Path(sys.argv[1])
ev = [json.loads(l) for l in (d / "shepherd.jsonl").read_text().splitlines() if l.strip()]
joined = [e["peer"] for e in ev if e["event"] == "worker_joined"]
for e in ev:
    if e["event"] == "admission_held":
        print(f"  round {e['round']}: hellos kept {e['hellos']} (live {e['live']}, waiting {e['waiting']}, "
              f"left {e['left']}), joins in the last hour {e['joins_last_hour']}")
    if e["event"] == "round_completed":
        print(f"  round {e['round']}: averaged {len(e['peers'])} ({', '.join(e['peers'])}), val loss {e['val_loss']:.4f}")
print(f"  workers joined: {len(joined)}")
PY
fi

if [ "$ONLY" != lockout ]; then
  d="$OUT/announcements"
  shepherd "$d" --rounds "$ROUNDS" --tau 5 --min-workers "$WORKERS" --participants-inline "$INLINE" \
    --screen norm --no-copy-check --heartbeat-timeout-ms 10000
  "$BIN" loadtest --shepherd "$ADDR" --workers "$WORKERS" --rounds "$ROUNDS" --step-ms 200 --timeout-s 1800 \
    --shepherd-pid "$SPID" --json "$d/loadtest.json" --data-dir "$d/synthetic" >"$d/loadtest.out" 2>"$d/loadtest.err"
  echo "announcements: --participants-inline $INLINE, $WORKERS synthetic workers"
  sed 's/^/  /' "$d/loadtest.out"
fi
echo "results in $OUT"
