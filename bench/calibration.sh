#!/usr/bin/env bash
# The simulator against the node at 100 and 300 workers (node/tests/calibration_cli.rs):
# `pcp-node loadtest` of gpt2-124m's shapes against a real shepherd, and `pcp-node
# simulate` of the same configuration, their round times within 25% of each other.
# That agreement is a timing of this machine's cores, which the shepherd shares with
# the synthetic workers: only this bench asserts it (PCP_CALIBRATION_BENCH). CI runs
# the 100-worker test for the rest (the shepherd's disk, every round aggregating
# what was sent on time); the 300-worker one runs only here. Prints each run's
# rounds, the simulator's round and the difference. docs/simulator.md has the figures.
#
#   bench/calibration.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PCP_CALIBRATION_BENCH=1 cargo test --release -p pcp-node --test calibration_cli -- --include-ignored --test-threads 1 --nocapture 2>&1 |
  grep -E "workers: loadtest rounds|test result|panicked" | sed -E 's/; loadtest \{.*//'
