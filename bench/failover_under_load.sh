#!/usr/bin/env bash
# The multi-process failover test, RUNS times in a row, while LOAD processes keep
# every core busy (`yes > /dev/null`): a failover that misses its bounds under load
# would miss them on volunteers' machines. Stops at the first failure.
#
#   bench/failover_under_load.sh                 # 5 runs, one busy loop per core
#   RUNS=10 TEST=a_leader_cut_off_from_its_workers_is_replaced TARGET=failover_cli bench/failover_under_load.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
LOAD=${LOAD:-$(nproc)}
TARGET=${TARGET:-diloco_cli}
TEST=${TEST:-a_candidate_leads_when_the_shepherd_dies_and_the_old_shepherd_steps_down}
cargo test -q -p pcp-node --test "$TARGET" --no-run 2>/dev/null
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for _ in $(seq "$LOAD"); do
  yes > /dev/null &
  pids+=($!)
done
echo "load: $LOAD busy loops on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs))"
for i in $(seq "$RUNS"); do
  start=$(date +%s)
  if cargo test -q -p pcp-node --test "$TARGET" "$TEST" -- --exact > "/tmp/failover-under-load-$i.log" 2>&1; then
    echo "run $i/$RUNS: passed in $(( $(date +%s) - start )) s"
  else
    echo "run $i/$RUNS: FAILED after $(( $(date +%s) - start )) s; log: /tmp/failover-under-load-$i.log"
    grep -E "panicked|assert" "/tmp/failover-under-load-$i.log" | head -5
    exit 1
  fi
done
echo "$RUNS of $RUNS passed"
