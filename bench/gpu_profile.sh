#!/usr/bin/env bash
# A per-dispatch profile of pcp's training step on a lent GPU, prepared here and run
# there in one call (docs/gpus.md, "Profiling the step on a lent GPU").
#
#   bench/gpu_profile.sh prepare [--model gpt2-124m] [--backend cuda] [--target sm_80] [--dir .gpuprof]
#       Here, no GPU needed: compiles the step at bf16 and f32 and the bf16 compile
#       variants below with `pcp-node graph compile` (the shepherd's code path), writes
#       the train_step inputs, copies IREE's runtime tools, and packs it all into
#       DIR/bundle.tar.xz (carry DIR).
#   bench/gpu_profile.sh run [--dir .gpuprof] [--out DIR] [--device cuda] [--budget 500] [--torch full|eager|none]
#       There: times every compiled variant with iree-benchmark-module, takes a
#       per-dispatch profile of the bf16 step under Nsight Compute (ncu; its kernels
#       are IREE's dispatches, timed inside the real step), times PyTorch eager and
#       torch.compile on the same shapes (f32 with TF32 off, bf16 autocast) with its
#       top kernels (torch.profiler), and writes OUT/gpu_profile.md, OUT/best.env (the
#       fastest bf16 variant's settings) and OUT/raw.tar.xz. Each part runs under the
#       time left of --budget seconds; a part that cannot run says why in the report.
#   bench/gpu_profile.sh pack
#       prepare (unless .gpuprof has a bundle), then the compiler (xz) into .gpuprof
#       and the stripped pcp-node (xz) into .gpubin, and prints the two device calls:
#       the profile, then bench/gpu_check.sh with the profile's best settings.
#   bench/gpu_profile.sh report RAW [PLAN.tsv]
#       Renders the markdown report again from a run's raw files (and a gpu-plan table).
#   bench/gpu_profile.sh dry-run
#       prepare and run for Vulkan on nanogpt-small at batch 1: on Mesa's lavapipe it
#       checks the whole script without a GPU (scripts/test.sh runs it).
#
# Never reads stdin. PCP_NODE names the binary (default target/release/pcp-node).
set -uo pipefail
cd "$(dirname "$0")/.."
exec </dev/null
BIN=${PCP_NODE:-target/release/pcp-node}

# name|precision|pcp-node graph compile options|environment|IREE session flags (PCP_IREE_GPU_FLAGS)
# The first two are the step as pcp compiles it today; the rest are bf16 variants.
# Codegen options (--iree-codegen-*, --iree-llvmgpu-*) are process-wide in IREE's
# library, so they go in PCP_IREE_GLOBAL_FLAGS; pipeline options are session flags.
VARIANTS=(
  "bf16|bf16|||"
  "f32|f32|||"
  "bf16-naive-attention|bf16|--attention naive||"
  "bf16-strips-256|bf16||PCP_ATTENTION_STRIP_ROWS=256|"
  "bf16-strips-512|bf16||PCP_ATTENTION_STRIP_ROWS=512|"
  "bf16-tile-and-fuse|bf16||PCP_IREE_GLOBAL_FLAGS=--iree-codegen-llvmgpu-use-tile-and-fuse-matmul=true|"
  "bf16-vector-distribute|bf16||PCP_IREE_GLOBAL_FLAGS=--iree-codegen-llvmgpu-use-vector-distribution=true|"
  "bf16-prefetch-3|bf16||PCP_IREE_GLOBAL_FLAGS=--iree-llvmgpu-prefetch-num-stages=3|"
  "bf16-aggressive-fusion|bf16|||--iree-dispatch-creation-enable-aggressive-fusion=true"
  "bf16-single-use-fusion|bf16|||--iree-dispatch-creation-fuse-multi-use=false"
  "bf16-data-tiling|bf16|||--iree-opt-data-tiling=true"
)

die() { echo "gpu_profile: $*" >&2; exit 2; }
say() { echo "[gpu_profile $(( $(date +%s) - START ))s] $*" >&2; }
START=$(date +%s)

prepare() {
    local model=gpt2-124m backend=cuda target="" dir=.gpuprof batch="" only="" add=0
    while [ $# -gt 0 ]; do
        case "$1" in
            --model) model=$2; shift 2 ;;
            --backend) backend=$2; shift 2 ;;
            --target) target=$2; shift 2 ;;
            --dir) dir=$2; shift 2 ;;
            --batch) batch=$2; shift 2 ;;
            --only) only=$2; shift 2 ;;   # a space-separated list of variant names
            --add) add=1; shift ;;        # keep DIR's bundle and add (or redo) the variants named
            *) die "prepare: unknown argument $1" ;;
        esac
    done
    [ -x "$BIN" ] || die "$BIN not found (cargo build --release -p pcp-node, or set PCP_NODE)"
    [ -z "$target" ] && [ "$backend" = cuda ] && target=sm_80
    local topt=()
    [ -n "$target" ] && topt=(--target "$target")
    local tools
    tools=$(ls -d .venv/lib/python3*/site-packages/iree/_runtime_libs 2>/dev/null | head -1)
    [ -n "$tools" ] && [ -x "$tools/iree-benchmark-module" ] || die "no iree-benchmark-module in .venv (run scripts/setup.sh)"
    mkdir -p "$dir" || die "cannot create $dir"
    local stage base_sum=""
    stage=$(mktemp -d) || die "mktemp failed"
    mkdir -p "$stage/bin"
    cp "$tools/iree-benchmark-module" "$tools/iree-run-module" "$stage/bin/"
    local bopt=()
    [ -n "$batch" ] && bopt=(--batch "$batch")
    # one input per train_step argument: small parameters, step 1, token ids 1
    "$BIN" graph step "$model" "${bopt[@]}" -o "$stage/step.mlir" > /dev/null || die "graph step $model failed"
    grep 'sym_name = "train_step"' "$stage/step.mlir" | head -1 | sed -E 's/.*function_type = \(([^)]*)\) ->.*/\1/' |
        grep -oE 'tensor<[^>]*>' | sed -E 's/tensor<(.*)>/\1/' | while read -r ty; do
            elem=${ty##*x}; [ "$elem" = "$ty" ] && { echo "--input=$ty=0.001"; continue; }
            case "$elem" in i*) echo "--input=$ty=1" ;; *) echo "--input=$ty=0.001" ;; esac
        done > "$stage/inputs.flags"
    [ -s "$stage/inputs.flags" ] || die "no train_step signature in $stage/step.mlir"
    rm -f "$stage/step.mlir"
    printf 'name\tprecision\toptions\tenv\tflags\tstatus\tseconds\tbytes\tdetail\n' > "$stage/variants.tsv"
    if ((add)) && [ -f "$dir/bundle.tar.xz" ]; then
        local old
        old=$(mktemp -d) && tar -C "$old" -xJf "$dir/bundle.tar.xz" || die "cannot read $dir/bundle.tar.xz"
        for v in $(awk -F'\t' 'NR > 1 { print $1 }' "$old/variants.tsv"); do
            [[ " $only " == *" $v "* ]] && continue
            awk -F'\t' -v v="$v" '$1 == v' "$old/variants.tsv" >> "$stage/variants.tsv"
            [ -f "$old/$v.vmfb" ] && cp "$old/$v.vmfb" "$stage/"
        done
        base_sum=$( [ -f "$stage/bf16.vmfb" ] && md5sum < "$stage/bf16.vmfb")
        rm -rf "$old"
    fi
    printf 'model\t%s\nbackend\t%s\ntarget\t%s\nbatch\t%s\ncommit\t%s\n' "$model" "$backend" "$target" "${batch:-preset}" \
        "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" > "$stage/meta.tsv"
    local v name precision options env flags
    for v in "${VARIANTS[@]}"; do
        IFS='|' read -r name precision options env flags <<< "$v"
        if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then continue; fi
        local t0 status detail bytes=0 seconds sum
        t0=$(date +%s.%N)
        # shellcheck disable=SC2086 # options and env are word lists by design
        if out=$(env $env PCP_IREE_GPU_FLAGS="$flags" "$BIN" graph compile "$model" --backend "$backend" "${topt[@]}" \
                --precision "$precision" $options "${bopt[@]}" -o "$stage/$name.vmfb" 2>&1); then
            status=ok detail=""
            bytes=$(stat -c %s "$stage/$name.vmfb")
            sum=$(md5sum < "$stage/$name.vmfb")
            if [ "$name" = bf16 ]; then base_sum=$sum
            elif [ "$precision" = bf16 ] && [ "$sum" = "$base_sum" ]; then
                status=same detail="byte-identical to bf16 (the flag is IREE's default here)"; rm -f "$stage/$name.vmfb"
            fi
        else
            status=refused detail=$(printf '%s' "$out" | grep -m1 -iE 'error|could not' | cut -c1-300)
            rm -f "$stage/$name.vmfb"
        fi
        seconds=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$precision" "$options" "$env" "$flags" "$status" "$seconds" "$bytes" \
            "$(printf '%s' "$detail" | tr '\t\n' '  ')" >> "$stage/variants.tsv"
        say "prepare $name: $status ($seconds s)${detail:+ $detail}"
    done
    grep -q "^bf16	.*	ok	" "$stage/variants.tsv" || die "the base bf16 step did not compile (see $stage/variants.tsv)"
    tar -C "$stage" -cJf "$dir/bundle.tar.xz" . || die "cannot write $dir/bundle.tar.xz"
    cp "$stage/variants.tsv" "$dir/variants.tsv"
    rm -rf "$stage"
    say "wrote $dir/bundle.tar.xz ($(du -h "$dir/bundle.tar.xz" | cut -f1)); carry $dir"
}

# left: seconds of the run's budget still unspent
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
# within N CMD…: CMD under timeout min(N, time left − 15 s); 124 when no time is left
within() {
    local want=$1 have; shift
    have=$(( $(left) - 15 ))
    (( have < 5 )) && return 124
    (( want < have )) && have=$want
    timeout "$have" "$@"
}

run() {
    local dir=.gpuprof out="" device=cuda torch=full
    BUDGET=500
    while [ $# -gt 0 ]; do
        case "$1" in
            --dir) dir=$2; shift 2 ;;
            --out) out=$2; shift 2 ;;
            --device) device=$2; shift 2 ;;
            --budget) BUDGET=$2; shift 2 ;;
            --torch) torch=$2; shift 2 ;;   # full (eager and torch.compile), eager, or none
            *) die "run: unknown argument $1" ;;
        esac
    done
    out=${out:-bench/gpu_profile-$device-$(date +%Y%m%d-%H%M%S)}
    [ -f "$dir/bundle.tar.xz" ] || die "$dir/bundle.tar.xz not found (bench/gpu_profile.sh prepare, then carry $dir)"
    mkdir -p "$out/raw" || die "cannot create $out"
    out=$(cd "$out" && pwd)
    local raw=$out/raw work
    work=$(mktemp -d) || die "mktemp failed"
    tar -C "$work" -xJf "$dir/bundle.tar.xz" || die "$dir/bundle.tar.xz is not a readable bundle"
    cp "$work/variants.tsv" "$work/meta.tsv" "$raw/"
    local tool=$work/bin/iree-benchmark-module
    echo "$device" > "$raw/device.txt"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv,noheader > "$raw/gpu.txt" 2>&1
    else
        echo "no nvidia-smi on this machine" > "$raw/gpu.txt"
    fi
    nproc > "$raw/cpus.txt"

    local quick=0 warmup=0.5
    [ "$device" != cuda ] && [ "$device" != hip ] && quick=1 warmup=0
    # time NAME ITERATIONS REPETITIONS SECONDS: one compiled variant's train_step
    # (a fifth argument names other inputs and a sixth the result's name)
    bench() {
        local name=$1 n=$2 reps=$3 secs=$4 inputs=${5:-$work/inputs.flags} as=${6:-$1}
        within "$secs" "$tool" --device="$device" --module="$work/$name.vmfb" --function=train_step \
            --flagfile="$inputs" --benchmark_min_warmup_time=$warmup --benchmark_min_time="${n}x" \
            --benchmark_repetitions="$reps" --benchmark_out="$raw/bench-$as.json" --benchmark_out_format=json \
            > "$raw/bench-$as.log" 2>&1
        local status=$?
        say "bench $as: exit $status"
    }
    # the same inputs as .npy files: IREE uploads those into device-local buffers, as
    # pcp's runtime does, where a splat input may be generated in host-visible memory
    npy_inputs() {
        local py=python3
        [ -x .venv/bin/python ] && py=.venv/bin/python
        mkdir -p "$work/npy"
        "$py" - "$work/inputs.flags" "$work/npy" > "$work/inputs-npy.flags" 2> "$raw/npy-inputs.log" <<'PY'
import sys
import numpy as np
flags, out = sys.argv[1], sys.argv[2]
for i, line in enumerate(open(flags)):
    ty, _, value = line.strip()[len("--input="):].rpartition("=")
    *dims, elem = ty.split("x")
    dtype = {"f32": np.float32, "i32": np.int32, "i64": np.int64}[elem]
    fill = float(value) if elem.startswith("f") else int(value)
    np.save(f"{out}/{i}.npy", np.full([int(d) for d in dims], fill, dtype=dtype))
    print(f"--input=@{out}/{i}.npy")
PY
    }
    local ok
    ok=$(awk -F'\t' 'NR > 1 && $6 == "ok" { print $1 }' "$work/variants.tsv")
    # the step as pcp compiles it, then the PyTorch comparison, then the profile, then variants
    for name in bf16 f32; do
        grep -qx "$name" <<< "$ok" || continue
        if ((quick)); then bench "$name" 1 1 120
        elif [ "$name" = f32 ]; then bench "$name" 3 2 60
        else bench "$name" 10 3 60; fi
    done
    if grep -qx bf16 <<< "$ok"; then
        if npy_inputs; then
            if ((quick)); then bench bf16 1 1 120 "$work/inputs-npy.flags" bf16-npy-inputs
            else bench bf16 10 3 60 "$work/inputs-npy.flags" bf16-npy-inputs; fi
        else
            say "no .npy inputs: $(tail -1 "$raw/npy-inputs.log")"
        fi
        rm -rf "$work/npy"
    fi
    torch_part() {
        local precision=$1 extra=${2:-}
        [ "$torch" = none ] && { echo "skipped: --torch none" > "$raw/torch-$precision.txt"; return; }
        [ "$torch" = eager ] && extra=--eager-only
        if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' > /dev/null 2>&1; then
            echo "skipped: torch is not installed here, or sees no GPU" > "$raw/torch-$precision.txt"; return
        fi
        local model
        model=$(awk -F'\t' '$1 == "model" { print $2 }' "$work/meta.tsv")
        within 150 python3 bench/torch_gpu_step.py --model "$model" --steps 10 --precision "$precision" $extra \
            --profile "$raw/torch-$precision-kernels.md" > "$raw/torch-$precision.txt" 2> "$raw/torch-$precision.log" ||
            echo "failed: $(tail -1 "$raw/torch-$precision.log")" >> "$raw/torch-$precision.txt"
        say "torch $precision: $(head -c 200 "$raw/torch-$precision.txt")"
    }
    profile() {
        local name=$1
        if ! command -v ncu > /dev/null; then echo "skipped: no ncu (Nsight Compute) on this machine" > "$raw/ncu-$name.status"; return; fi
        [ "$device" = cuda ] || { echo "skipped: ncu profiles CUDA only" > "$raw/ncu-$name.status"; return; }
        within 150 ncu --metrics gpu__time_duration.sum --clock-control none --cache-control none --launch-count 20000 \
            -f -o "$raw/ncu-$name" "$tool" --device="$device" --module="$work/$name.vmfb" --function=train_step \
            --flagfile="$work/inputs.flags" --benchmark_min_warmup_time=0 --benchmark_min_time=1x --benchmark_repetitions=1 \
            > "$raw/ncu-$name.log" 2>&1
        local status=$?
        if [ -f "$raw/ncu-$name.ncu-rep" ]; then
            ncu -i "$raw/ncu-$name.ncu-rep" --csv --page raw --print-units base > "$raw/ncu-$name.csv" 2> "$raw/ncu-$name.import.log"
            rm -f "$raw/ncu-$name.ncu-rep"
        fi
        echo "exit $status" > "$raw/ncu-$name.status"
        say "ncu $name: exit $status, $(wc -l < "$raw/ncu-$name.csv" 2>/dev/null || echo 0) rows"
    }
    for name in $ok; do
        case "$name" in bf16|f32) continue ;; esac
        if ((quick)); then bench "$name" 1 1 120; else bench "$name" 5 2 45; fi
    done
    if grep -qx bf16 <<< "$ok"; then profile bf16; else echo "skipped: the bf16 step did not compile" > "$raw/ncu-bf16.status"; fi
    torch_part bf16
    # f32: eager only (the comparison the issue sets; torch.compile was 1.02x eager in f32 on the H200)
    torch_part f32 --eager-only
    if grep -qx f32 <<< "$ok" && (( $(left) > 120 )); then profile f32; fi

    python3 bench/gpu_report.py "$raw" > "$out/gpu_profile.md" 2> "$out/report.log" || say "the report failed: $(tail -1 "$out/report.log")"
    python3 bench/gpu_report.py "$raw" --best > "$out/best.env" 2>> "$out/report.log" || true
    tar -C "$out" -cJf "$out/raw.tar.xz" raw && rm -rf "$raw"
    rm -rf "$work"
    cat "$out/gpu_profile.md"
    say "wrote $out/gpu_profile.md"
}

# pack: what two device calls carry, and the two commands, printed
pack() {
    local dir=.gpuprof bin=.gpubin lib
    local built
    built=$(tar -xJOf "$dir/bundle.tar.xz" ./meta.tsv 2>/dev/null | awk -F'\t' '$1 == "commit" { print $2 }')
    if [ "$built" != "$(git rev-parse --short HEAD 2>/dev/null)" ]; then
        say "the bundle in $dir is ${built:-missing}, not HEAD's: preparing it again"
        prepare --dir "$dir" || exit 1
    fi
    lib=$(ls -d .venv/lib/python3*/site-packages/iree/compiler/_mlir_libs 2>/dev/null | head -1)
    [ -n "$lib" ] && [ -f "$lib/libIREECompiler.so" ] || die "no libIREECompiler.so in .venv (run scripts/setup.sh)"
    if [ ! -s "$dir/libIREECompiler.so.xz" ] || [ "$lib/libIREECompiler.so" -nt "$dir/libIREECompiler.so.xz" ]; then
        say "compressing libIREECompiler.so (about 5 minutes on one core)"
        xz -T0 -6 -c "$lib/libIREECompiler.so" > "$dir/libIREECompiler.so.xz.tmp" && mv "$dir/libIREECompiler.so.xz.tmp" "$dir/libIREECompiler.so.xz" ||
            die "cannot write $dir/libIREECompiler.so.xz"
    fi
    cp "$lib/iree-lld" "$dir/" || die "no iree-lld beside $lib/libIREECompiler.so"
    mkdir -p "$bin" || die "cannot create $bin"
    if [ ! -s "$bin/pcp-node.xz" ] || [ "$BIN" -nt "$bin/pcp-node.xz" ]; then
        say "stripping and compressing $BIN"
        strip -o "$bin/pcp-node" "$BIN" && xz -T0 -6 -f "$bin/pcp-node" || die "cannot write $bin/pcp-node.xz"
    fi
    local corpus=../shared/data/tiny_shakespeare.txt
    [ -f .data/tiny_shakespeare.txt ] || { [ -f "$corpus" ] && mkdir -p .data && cp "$corpus" .data/; }
    say "carry sizes: $(du -sh "$dir" | cut -f1) and $(du -sh "$bin" | cut -f1) (64 MiB a call, with the tracked tree)"
    cat <<CALLS
call 1, carry ["$dir"], timeout_s 370:
mkdir -p /tmp/iree; (xz -dc $dir/libIREECompiler.so.xz > /tmp/iree/libIREECompiler.so && cp $dir/iree-lld /tmp/iree/ && touch /tmp/iree/ready) & bench/gpu_profile.sh run --dir $dir --out \$OUT --device cuda --budget 320; cp \$OUT/best.env /tmp/pcp-best.env; wait

call 2 at once (the machine stays warm 30 s), carry ["$bin", ".data/tiny_shakespeare.txt"], timeout_s 300:
xz -dc $bin/pcp-node.xz > /tmp/pcp-node && chmod +x /tmp/pcp-node; . /tmp/pcp-best.env; export PCP_NODE=/tmp/pcp-node PCP_IREE_COMPILER_LIB=/tmp/iree/libIREECompiler.so; timeout 270 bench/gpu_check.sh --backend cuda --no-profile --no-torch --speed-steps 3 --out /tmp/check > \$OUT/check.log 2>&1; cp /tmp/check/gpu_check.md /tmp/check/gpu_check.json \$OUT/; tar -C /tmp/check --exclude=work -cJf \$OUT/check-logs.tar.xz .; tail -30 \$OUT/check.log
CALLS
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    pack) shift; pack ;;
    run) shift; run "$@" ;;
    report) shift; [ $# -ge 1 ] || die "report RAW [PLAN.tsv]"; raw=$1; shift
        if [ -f "$raw" ]; then t=$(mktemp -d); tar -C "$t" -xJf "$raw"; raw=$t/raw; fi
        python3 bench/gpu_report.py "$raw" ${1:+--plan "$1"} ;;
    dry-run) shift
        d=$(mktemp -d)
        prepare --model nanogpt-small --backend vulkan --batch 1 --dir "$d/prep" --only "bf16 f32" || exit 1
        run --dir "$d/prep" --out "$d/out" --device vulkan --budget 400 || exit 1
        for want in "pcp's step" "bf16" "f32" "PyTorch"; do
            grep -q "$want" "$d/out/gpu_profile.md" || die "dry run: the report has no '$want' ($d/out/gpu_profile.md)"
        done
        grep -qE '^\| bf16 [^|]*\| [0-9][0-9,]* \|' "$d/out/gpu_profile.md" || die "dry run: the bf16 step was not timed ($d/out)"
        say "dry run passed: $d/out/gpu_profile.md"; rm -rf "$d" ;;
    -h|--help|"") sed -n '2,28p' "$0" ;;
    *) die "unknown mode $1 (prepare, pack, run, report, dry-run)" ;;
esac
