#!/usr/bin/env bash
# The three-candidate failover tests (node/tests/majority_cli.rs: a one-way cut,
# a SIGSTOP and a 2+1 partition of the leader, each in a network-namespace lab)
# RUNS times in a row, while LOAD busy loops (`yes > /dev/null`) keep the cores
# busy. Runs all RUNS (a failure does not stop it), then prints pass/fail counts
# per test and overall; exits 1 if any run failed. Needs root (network namespaces);
# PCP_REQUIRE_NETNS=1 makes a lab that cannot be built a failure, not a skip.
#
#   bench/majority_lab.sh                       # 5 runs, two busy loops
#   RUNS=10 LOAD=4 bench/majority_lab.sh
#   TEST=a_leader_paused bench/majority_lab.sh  # only the tests whose names contain it
#   PCP_NODE=/path/to/pcp-node bench/majority_lab.sh   # another build of the node
#
# Logs: $LOGS/run-N.log (default /tmp/majority-lab), each with the tests' timings.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-5}
LOAD=${LOAD:-2}
TEST=${TEST:-}
LOGS=${LOGS:-/tmp/majority-lab}
export PCP_REQUIRE_NETNS=1
mkdir -p "$LOGS"
cargo test -q -p pcp-node --test majority_cli --no-run 2>/dev/null
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT
for _ in $(seq "$LOAD"); do
  yes > /dev/null &
  pids+=($!)
done
echo "load: $LOAD busy loops on $(nproc) cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)); node: ${PCP_NODE:-the workspace build}"
declare -A pass fail
failed_runs=0
for i in $(seq "$RUNS"); do
  log="$LOGS/run-$i.log"
  start=$(date +%s)
  # --show-output: the passing tests' timings too, after the verdicts
  if cargo test -p pcp-node --test majority_cli -- --show-output --test-threads 1 $TEST > "$log" 2>&1; then
    echo "run $i/$RUNS: passed in $(( $(date +%s) - start )) s"
  else
    failed_runs=$((failed_runs + 1))
    echo "run $i/$RUNS: FAILED after $(( $(date +%s) - start )) s; log: $log"
    # each panic and its message (up to the backtrace)
    awk '/panicked at/ {p = 1; n = 0} /^stack backtrace|^note: / {p = 0} p && n++ < 16 {print "    " $0}' "$log"
  fi
  # each test's verdict, from libtest's lines (`test NAME ... ok` / `... FAILED`)
  while read -r name verdict; do
    case $verdict in
      ok) pass[$name]=$(( ${pass[$name]:-0} + 1 )) ;;
      FAILED) fail[$name]=$(( ${fail[$name]:-0} + 1 )) ;;
    esac
  done < <(sed -nE 's/^test ([a-z0-9_]+) \.\.\. (ok|FAILED)$/\1 \2/p' "$log")
  grep -E "^(cut |SIGSTOP|partition |the cluster ran|while it lasted|healed |after the heal|workers trained)" "$log" | sed 's/^/    /' || true
done
echo "per test (passed/failed of $RUNS):"
for name in $(printf '%s\n' "${!pass[@]}" "${!fail[@]}" | sort -u); do
  echo "  $name: ${pass[$name]:-0} passed, ${fail[$name]:-0} failed"
done
echo "$((RUNS - failed_runs)) of $RUNS runs passed"
[ "$failed_runs" -eq 0 ]
