#!/usr/bin/env bash
# The simulator against the node at 100 and 300 workers (node/tests/calibration_cli.rs):
# `pcp-node loadtest` of gpt2-124m's shapes against a real shepherd, and `pcp-node
# simulate` of the same configuration, their round times within 25% of each other.
# CI runs the 100-worker test; the 300-worker one saturates the shepherd's two cores
# and is a benchmark run here. Prints each run's rounds, the simulator's round and
# the difference. docs/simulator.md has the figures.
#
#   bench/calibration.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --release -p pcp-node --test calibration_cli -- --include-ignored --test-threads 1 --nocapture 2>&1 |
  grep -E "workers: loadtest rounds|test result|panicked" | sed -E 's/; loadtest \{.*//'
