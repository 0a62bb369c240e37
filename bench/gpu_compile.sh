#!/usr/bin/env bash
# Compiles pcp's training module (`graph compile`, the shepherd's code path) for
# every GPU target a run may meet, and prints a markdown table of compile seconds
# and artifact sizes, or the error. No GPU needed: IREE cross-compiles.
#
#   bench/gpu_compile.sh                          # the full matrix
#   MODELS="nanogpt-small" TARGETS="cuda:sm_80 rocm:gfx942" bench/gpu_compile.sh
#   MODULE=grad bench/gpu_compile.sh              # the @main_grad module instead
#   PRECISIONS="f32 bf16" MODELS=gpt2-124m TARGETS="cpu:host rocm:gfx942" bench/gpu_compile.sh
#
# A cpu cell says `plain flags` where the step was compiled without IREE's data
# tiling: by rule for a module too narrow to gain from it (nanogpt-small), and
# otherwise because IREE refused the tuned flags (graph/src/compile.rs).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${PCP_NODE:-target/release/pcp-node}
[ -x "$BIN" ] || cargo build --release -p pcp-node
SHARED=$(cd .. && pwd)/shared/models
MODELS=${MODELS:-"nanogpt-small nanogpt-medium gpt2-124m $SHARED/nanogpt_small.mlir $SHARED/nanogpt_medium.mlir"}
TARGETS=${TARGETS:-"cuda:sm_80 cuda:sm_86 cuda:sm_89 cuda:sm_90a rocm:gfx90a rocm:gfx942 rocm:gfx1100 vulkan:rdna3 vulkan:ampere metal:macos cpu:host"}
MODULE=${MODULE:-step}
PRECISIONS=${PRECISIONS:-f32}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

printf '| model |'; for t in $TARGETS; do printf ' %s |' "$t"; done; echo
printf '| --- |'; for _ in $TARGETS; do printf ' --- |'; done; echo
for model in $MODELS; do
  for precision in $PRECISIONS; do
    name=$(basename "$model")
    [ "$PRECISIONS" = f32 ] || name="$name $precision"
    printf '| %s |' "$name"
    for t in $TARGETS; do
      backend=${t%%:*}; target=${t#*:}
      if "$BIN" graph compile "$model" --module "$MODULE" --backend "$backend" --target "$target" \
          --precision "$precision" -o "$out/a.vmfb" > "$out/log" 2>&1; then
        secs=$(grep -o 'compiled in [0-9.]* s' "$out/log" | grep -o '[0-9.]*')
        mb=$(grep -o '[0-9.]* MB' "$out/log" | head -1)
        plain=""
        if [ "$backend" = cpu ] && ! grep -q -- '--iree-opt-data-tiling=true' "$out/log"; then plain=", plain flags"; fi
        printf ' %s s, %s%s |' "$secs" "$mb" "$plain"
      else
        printf ' fails: %s |' "$(grep -m1 -o 'error: .*' "$out/log" | cut -c8-90 | tr '|' '/')"
      fi
    done
    echo
  done
done
