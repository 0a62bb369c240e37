#!/usr/bin/env bash
# Runs every check CI runs: formatting, structure, lints, Rust tests, JAX reference tests.
# Run scripts/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."
export PCP_REQUIRE_NETNS=1 # node/tests/failover_cli.rs and nat_cli.rs: fail, not skip, where network namespaces (or nftables NAT) cannot be built
cargo fmt --all -- --check
# no import circles between modules, no function in node/ or bootstrap/ over 120 lines
python3 scripts/check-structure.py
cargo clippy --workspace --all-targets -- -D warnings
cargo build -p pcp-node
cargo test --workspace --no-fail-fast
.venv/bin/python -m pytest -q tests/reference
# the GPU check's dry run on lavapipe (Vulkan on the CPU): every part but the PyTorch
# comparison runs, and parity passes (bench/gpu_check.sh exits 1 otherwise)
cargo build --release -p pcp-node
# the simulator against the node: loadtest and simulate at 100 and 300 workers agree
# within 25 % (minutes of the release binary, so after its build; see the test's docs)
PCP_NODE="$PWD/target/release/pcp-node" cargo test -p pcp-node --test calibration_cli -- --ignored --test-threads 1
# 4,097 one-time hellos, then an honest worker (minutes of the release binary)
PCP_NODE="$PWD/target/release/pcp-node" cargo test -p pcp-node --test trust_cli -- --ignored
# the failover test under a flood of 200 fresh keys (ten nodes' processes)
PCP_NODE="$PWD/target/release/pcp-node" cargo test -p pcp-node --test majority_cli -- --ignored
gpu_check_out=$(mktemp -d)
bench/gpu_check.sh --backend vulkan --out "$gpu_check_out"
rm -rf "$gpu_check_out"
