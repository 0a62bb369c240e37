#!/usr/bin/env bash
# Runs every check CI runs: formatting, structure, lints, Rust tests, JAX reference tests.
# Run scripts/setup.sh once first.
#
# One build of one profile, release, for all of it. The lints run inside the test
# build: clippy-driver compiles the workspace's own crates (RUSTC_WORKSPACE_WRAPPER,
# as `cargo clippy` runs it, with its `-D warnings`), so the dependencies and IREE's
# runtime compile once, and no separate check build reads them again. The tests
# time the code users run, and those that need an optimized binary
# (`#[cfg_attr(debug_assertions, ignore = ...)]`: the simulator's calibration, the
# 4,097 hellos, the failover under a flood) run with the rest. A later plain
# `cargo build --release` recompiles the workspace's crates (not their dependencies)
# without the wrapper.
set -euo pipefail
cd "$(dirname "$0")/.."
export PCP_REQUIRE_NETNS=1 # node/tests/failover_cli.rs and nat_cli.rs: fail, not skip, where network namespaces (or nftables NAT) cannot be built
cargo fmt --all -- --check
# no import circles, no function in node/ or bootstrap/ over 120 lines, no file over
# 900, no decision on a reason's text, no history in the docs
python3 scripts/check-structure.py
RUSTC_WORKSPACE_WRAPPER="$(rustc --print sysroot)/bin/clippy-driver"
export RUSTC_WORKSPACE_WRAPPER
export CLIPPY_ARGS="-D__CLIPPY_HACKERY__warnings__CLIPPY_HACKERY__" # cargo clippy's encoding of `-- -D warnings`
[ -x "$RUSTC_WORKSPACE_WRAPPER" ] || { echo "error: $RUSTC_WORKSPACE_WRAPPER not found (rustup component add clippy)" >&2; exit 2; }
# every target linted and built (benches and examples too), then the tests run
cargo test --release --workspace --all-targets --no-run
cargo test --release --workspace --no-fail-fast
# the reference tests drive the release binary the tests built (and `cargo test
# --release` for the emitted nanoGPT, built above)
PCP_NODE="$PWD/target/release/pcp-node" .venv/bin/python -m pytest -q tests/reference
# the GPU check's dry run on lavapipe (Vulkan on the CPU), on the binary the tests
# built: every part but the PyTorch comparison runs, and parity passes
# (bench/gpu_check.sh exits 1 otherwise)
gpu_check_out=$(mktemp -d)
PCP_NODE="$PWD/target/release/pcp-node" bench/gpu_check.sh --backend vulkan --out "$gpu_check_out"
rm -rf "$gpu_check_out"
# the GPU profile's dry run on lavapipe: it compiles nanogpt-small's step at bf16 and
# f32, times both with IREE's benchmark tool and writes the report (no ncu, no torch)
PCP_NODE="$PWD/target/release/pcp-node" bench/gpu_profile.sh dry-run
