#!/usr/bin/env bash
# One unattended check of a GPU backend, end to end, for the day a GPU machine is lent
# (at most 30 minutes, 10 a command, no network). Copy the release binary, the
# repository and the IREE compiler library (see docs/gpus.md, "Checking a borrowed GPU"), then:
#
#   bench/gpu_check.sh --backend cuda --out /tmp/gpu-check      # rocm, vulkan alike
#
# Parts, each under its own `timeout` (a hang costs that part only), about 9 minutes:
#   devices   `pcp-node devices`
#   parity    nanogpt-small from one seed, N steps on the backend and on cpu: every
#             step's loss within 1e-3 relative (bf16: 3e-2 a step, 3e-3 on average)
#   speed     tokens/s of the training step (gpt2-124m on cuda/rocm), beside PyTorch
#             eager and torch.compile on the same GPU when torch is installed
#   mixed     a `sim` with one worker on the backend and one on cpu, both contributing
#             every round
#   screen    a `sim` whose shepherd screens every contribution (the score screen, no
#             committees) with its own engine on the backend: its seconds a contribution
#   screen-host   one screen's parts on the device (`pcp-node bench screen`, the speed
#             part's model): a sparse contribution uploaded as its kept entries and
#             scattered there, and the same made dense: host seconds and forward passes
#   profile   the fused step under IREE's HAL profiler: the three slowest dispatches
#             (needs iree-benchmark-module and iree-profile: .venv/bin or PATH)
#   parity-bf16, speed-bf16   the same with --precision bf16 (parity against cpu bf16)
# It writes $OUT/gpu_check.md (a markdown table), $OUT/gpu_check.json and each part's
# log; it never reads stdin. It exits 1 when a parity row fails or a part other than
# the PyTorch comparison did not run.
#
# Sizes are flags, with defaults per backend (vulkan is sized for lavapipe, Mesa's CPU
# Vulkan, where one nanogpt-small step at batch 64 takes about 20 s):
#   --parity-steps N --parity-batch B   cuda/rocm 200 and 64 (the preset's); vulkan 3 and 2
#   --speed-model M --speed-steps N --speed-batch B   cuda/rocm gpt2-124m, 20, the preset's;
#                                       vulkan nanogpt-small, 2, 2
#   --sim-rounds R --sim-tau T --sim-batch B   cuda/rocm 3, 10, 16; vulkan 3, 3, 2
#   --profile-batch B                   cuda/rocm the preset's; vulkan 2
#   --target T                          the device target (default: detected)
#   --no-profile                        skip the profile part
#   --no-torch                          skip the PyTorch comparison (bench/gpu_profile.sh times it)
set -uo pipefail
cd "$(dirname "$0")/.."
exec </dev/null

BACKEND=cuda OUT="" TARGET="" PROFILE=1 TORCH=1
PARITY_STEPS="" PARITY_BATCH="" SPEED_MODEL="" SPEED_BATCH="" SPEED_STEPS="" SIM_ROUNDS="" SIM_TAU="" SIM_BATCH="" PROFILE_BATCH=""
while [ $# -gt 0 ]; do
    case "$1" in
        --backend) BACKEND=$2; shift 2 ;;
        --out) OUT=$2; shift 2 ;;
        --target) TARGET=$2; shift 2 ;;
        --parity-steps) PARITY_STEPS=$2; shift 2 ;;
        --parity-batch) PARITY_BATCH=$2; shift 2 ;;
        --speed-model) SPEED_MODEL=$2; shift 2 ;;
        --speed-steps) SPEED_STEPS=$2; shift 2 ;;
        --speed-batch) SPEED_BATCH=$2; shift 2 ;;
        --sim-rounds) SIM_ROUNDS=$2; shift 2 ;;
        --sim-tau) SIM_TAU=$2; shift 2 ;;
        --sim-batch) SIM_BATCH=$2; shift 2 ;;
        --profile-batch) PROFILE_BATCH=$2; shift 2 ;;
        --no-profile) PROFILE=0; shift ;;
        --no-torch) TORCH=0; shift ;;
        -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$BACKEND" in
    cuda|rocm) D=(200 64 gpt2-124m 20 3 10 16 "" "") ;;
    vulkan) D=(3 2 nanogpt-small 2 3 3 2 2 2) ;;
    *) echo "error: --backend must be cuda, rocm or vulkan" >&2; exit 2 ;;
esac
PARITY_STEPS=${PARITY_STEPS:-${D[0]}} PARITY_BATCH=${PARITY_BATCH:-${D[1]}}
SPEED_MODEL=${SPEED_MODEL:-${D[2]}} SPEED_STEPS=${SPEED_STEPS:-${D[3]}}
SIM_ROUNDS=${SIM_ROUNDS:-${D[4]}} SIM_TAU=${SIM_TAU:-${D[5]}} SIM_BATCH=${SIM_BATCH:-${D[6]}}
SPEED_BATCH=${SPEED_BATCH:-${D[7]}} PROFILE_BATCH=${PROFILE_BATCH:-${D[8]}}
OUT=${OUT:-bench/gpu_check-$BACKEND-$(date +%Y%m%d-%H%M%S)}
BIN=${PCP_NODE:-target/release/pcp-node}
VENV_BIN=${VENV_BIN:-.venv/bin}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
WORK="$OUT/work"   # one data directory: compiled artifacts are shared between parts
mkdir -p "$WORK"
RESULTS="$OUT/results.tsv"
: > "$RESULTS"
[ -x "$BIN" ] || { echo "error: $BIN not found (cargo build --release -p pcp-node, or set PCP_NODE)" >&2; exit 2; }
DEV=(--backend "$BACKEND")
[ -n "$TARGET" ] && DEV+=(--target "$TARGET")
# the corpus: the demo one when present, else this repository's README (any text trains)
DATA=()
if [ ! -f ../shared/data/tiny_shakespeare.txt ] && [ ! -f .data/tiny_shakespeare.txt ]; then
    DATA=(--data "$PWD/README.md")
fi
START=$(date +%s)

# record PART STATUS DETAIL: one row of the table
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$(printf '%s' "$3" | tr '\t\n|' '  /')" >> "$RESULTS"; echo "[$(( $(date +%s) - START )) s] $1: $2 — $3" >&2; }

# the per-step losses of a `train --events` file, one per line
losses() { grep '"event":"step"' "$1" | sed -E 's/.*"loss":([-0-9.eE+naNinf]+).*/\1/'; }

# train BACKEND PRECISION NAME: PARITY_STEPS steps of nanogpt-small from seed 7
train() {
    local backend=$1 precision=$2 name=$3 dev=(--backend "$1")
    [ "$backend" != cpu ] && dev=("${DEV[@]}")
    timeout "${PART_TIMEOUT:-150}" "$BIN" train --model nanogpt-small --steps "$PARITY_STEPS" --batch "$PARITY_BATCH" \
        --seed 7 --eval-every 0 --precision "$precision" "${dev[@]}" "${DATA[@]}" --data-dir "$WORK" \
        --checkpoint-dir "$WORK/ckpt-$name" --events "$OUT/$name.jsonl" > "$OUT/$name.log" 2>&1
}

parity() {
    local precision=$1 part=$2
    if ! train "$BACKEND" "$precision" "$part-$BACKEND"; then
        record "$part" fail "the $BACKEND run failed: $(tail -1 "$OUT/$part-$BACKEND.log")"; return
    fi
    if ! train cpu "$precision" "$part-cpu"; then
        record "$part" fail "the cpu run failed: $(tail -1 "$OUT/$part-cpu.log")"; return
    fi
    # f32: every step within 1e-3. bf16: every step within 3e-2 and the mean within 3e-3,
    # since two bf16 runs differ by bf16 rounding itself: on the H100 (2026-11-27) cuda bf16
    # against cpu bf16 was 1.4e-2 worst, 1.4e-3 mean, and cpu bf16 against cpu f32 1.8e-2, 1.5e-3
    local verdict step_tol=1e-3 mean_tol=1e-3
    [ "$precision" = bf16 ] && { step_tol=3e-2; mean_tol=3e-3; }
    verdict=$(paste <(losses "$OUT/$part-$BACKEND.jsonl") <(losses "$OUT/$part-cpu.jsonl") |
        awk -v n="$PARITY_STEPS" -v step_tol="$step_tol" -v mean_tol="$mean_tol" '
        { d = $1 - $2; if (d < 0) d = -d; r = d / ($2 < 0 ? -$2 : $2); sum += r; if (r > worst) { worst = r; at = NR }
          if (!(r <= step_tol)) bad++; last1 = $1; last2 = $2 }
        END { if (NR != n) { printf "fail\t%d of %d steps compared", NR, n; exit }
              if (!(sum / NR <= mean_tol)) bad++
              printf "%s\t%d steps, worst relative difference %.2e at step %d (bound %s), mean %.2e (bound %s), last loss %.4f (%s) / %.4f (cpu)",
                     (bad ? "fail" : "pass"), NR, worst, at, step_tol, sum / NR, mean_tol, last1, "'"$BACKEND"'", last2 }')
    record "$part" "${verdict%%$'\t'*}" "${verdict#*$'\t'} ($precision)"
}

speed() {
    local precision=$1 part=$2 rate torch
    local batch=()
    [ -n "$SPEED_BATCH" ] && batch=(--batch "$SPEED_BATCH")
    if timeout "${PART_TIMEOUT:-150}" "$BIN" bench step --model "$SPEED_MODEL" --steps "$SPEED_STEPS" "${batch[@]}" --precision "$precision" \
        "${DEV[@]}" "${DATA[@]}" --data-dir "$WORK" > "$OUT/$part.log" 2>&1; then
        rate=$(awk '/^tokens\/s/ { print $2 }' "$OUT/$part.log")
        record "$part" pass "$SPEED_MODEL $precision on $BACKEND: $rate tokens/s ($SPEED_STEPS steps)"
    else
        record "$part" fail "$(tail -1 "$OUT/$part.log")"
    fi
    if [ "$TORCH" = 0 ]; then
        record "$part-torch" skipped "--no-torch"
    elif [ "$BACKEND" = vulkan ]; then
        record "$part-torch" skipped "PyTorch has no Vulkan device"
    elif ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' > /dev/null 2>&1; then
        record "$part-torch" skipped "torch is not installed here, or sees no GPU"
    elif torch=$(timeout "${PART_TIMEOUT:-150}" python3 bench/torch_gpu_step.py --model "$SPEED_MODEL" \
            --steps "$SPEED_STEPS" --precision "$precision" 2> "$OUT/$part-torch.log"); then
        record "$part-torch" pass "$torch"
    else
        record "$part-torch" fail "$(tail -1 "$OUT/$part-torch.log")"
    fi
}

mixed() {
    # both backends' contributions must be taken, and the shepherd validates on the GPU
    # (--shepherd-backend): the norm screen, since the loss screen may
    # refuse a few-step, tiny-batch update that moves the held-out loss by a hair
    # lockstep fp32 rounds: overlapped rounds are time-boxed, and lavapipe's worker is slow
    if ! timeout "${PART_TIMEOUT:-150}" "$BIN" sim --nodes 3 --rounds "$SIM_ROUNDS" --tau "$SIM_TAU" --batch "$SIM_BATCH" \
        --encoding fp32 --no-overlap --screen norm --worker-backend "1:$BACKEND" --shepherd-backend "$BACKEND" \
        "${DATA[@]}" --data-dir "$WORK" --events "$OUT/mixed.jsonl" \
        > "$OUT/mixed.log" 2>&1; then
        record mixed fail "$(tail -1 "$OUT/mixed.log")"; return
    fi
    local summary
    summary=$(python3 - "$OUT/mixed.jsonl" "$BACKEND" "$SIM_ROUNDS" <<'PY'
import json, math, sys
events = [json.loads(l) for l in open(sys.argv[1])]
backend, want = sys.argv[2], int(sys.argv[3])
named = lambda n: [e for e in events if e.get("event") == n]
on = lambda e: str(e.get("backend", e.get("engine", ""))).split(":")[0]
rounds = named("round_completed")
gpu = {e["peer"] for e in named("worker_joined") if on(e) == backend}
published = {on(e) for e in named("artifact_published")}
both = [r for r in rounds if r.get("contributors") == 2 and gpu & set(r.get("peers", []))]
validated = [r for r in rounds if math.isfinite(r.get("val_loss") or math.nan)]
engines = {e.get("engine", "").split(":")[0] for e in named("run_started")}
falls = len(rounds) > 1 and rounds[-1]["mean_loss"] < rounds[0]["mean_loss"]
ok = (len(rounds) == want and len(both) == want and len(validated) == want and engines == {backend}
      and {"cpu", backend} <= published and falls)
print("pass" if ok else "fail", end="\t")
if ok:
    print(f"{want} rounds, a {backend} and a cpu worker contributed to each, the shepherd validated on {backend}, "
          f"the mean loss fell from {rounds[0]['mean_loss']:.4f} to {rounds[-1]['mean_loss']:.4f}")
else:
    print(f"{len(rounds)} of {want} rounds, {len(both)} with both workers, {len(validated)} validated, "
          f"shepherd engines {sorted(engines)}, artifacts for {sorted(published)}, loss fell: {falls}")
PY
) || { record mixed fail "reading $OUT/mixed.jsonl"; return; }
    record mixed "${summary%%$'\t'*}" "${summary#*$'\t'}"
}

screen() {
    # the shepherd's score screen on the device (--shepherd-backend, --screeners 0): every
    # contribution that reached the screen scored there (screen_round: none skipped or
    # refused over budget); refusals are allowed, since a few-step, tiny-batch update may
    # move the loss by a hair, and so are refusals before any screen (a contribution late
    # for its round on a slow device, a key sitting out after a refusal)
    if ! timeout "${PART_TIMEOUT:-150}" "$BIN" sim --nodes 3 --rounds "$SIM_ROUNDS" --tau "$SIM_TAU" --batch "$SIM_BATCH" \
        --encoding fp32 --no-overlap --screen score --screeners 0 --worker-backend "1:$BACKEND" \
        --shepherd-backend "$BACKEND" "${DATA[@]}" --data-dir "$WORK" --events "$OUT/screen.jsonl" \
        > "$OUT/screen.log" 2>&1; then
        record screen fail "$(tail -1 "$OUT/screen.log")"; return
    fi
    local summary
    summary=$(python3 - "$OUT/screen.jsonl" "$BACKEND" "$SIM_ROUNDS" <<'PY'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1])]
backend, rounds = sys.argv[2], int(sys.argv[3])
named = lambda n: [e for e in events if e.get("event") == n]
engine = next((e.get("engine", "") for e in named("run_started")), "")
screens, closed = named("screen_round"), named("round_completed")
short = [s["round"] for s in screens if s["skipped"] or s["over_budget"]]
ok = engine.split(":")[0] == backend and len(closed) == rounds and len(screens) == rounds and not short
n = sum(s["screened"] for s in screens)
secs = sum(s["seconds"] for s in screens)
print("pass" if ok else "fail", end="\t")
print(f"{len(closed)} of {rounds} rounds on a {engine or 'no'} shepherd engine, {n} contributions screened "
      f"({secs / max(n, 1):.2f} s each), "
      f"rounds that passed or refused a contribution unscreened: {short or 'none'}")
PY
) || { record screen fail "reading $OUT/screen.jsonl"; return; }
    record screen "${summary%%$'\t'*}" "${summary#*$'\t'}"
}

screen_host() {
    local batch=() vocab=() rows
    [ -n "$SPEED_BATCH" ] && batch=(--batch "$SPEED_BATCH")
    [ "$SPEED_MODEL" = gpt2-124m ] && vocab=(--vocab 50257)
    if ! timeout "${PART_TIMEOUT:-150}" "$BIN" bench screen --model "$SPEED_MODEL" "${vocab[@]}" "${batch[@]}" --screens 3 \
        "${DEV[@]}" --data-dir "$WORK" > "$OUT/screen-host.log" 2>&1; then
        record screen-host fail "$(tail -1 "$OUT/screen-host.log")"; return
    fi
    # "sparse  made upload host passes" and "made dense  made upload host passes"
    rows=$(awk '$1 == "sparse" { printf "kept entries: host %s s (made %s s, upload %s s), 3 passes %s s; ", $4, $2, $3, $5 }
                $1 == "made" { printf "made dense: host %s s, 3 passes %s s", $5, $6 }' "$OUT/screen-host.log")
    case "$rows" in
        kept*) record screen-host pass "$SPEED_MODEL on $BACKEND, $rows" ;;
        *) record screen-host fail "no row of kept entries (see screen-host.log)" ;;
    esac
}

profile() {
    local tools="${VENV_BIN}" driver=$BACKEND mode=dispatch-events batch=()
    [ -n "$PROFILE_BATCH" ] && batch=(--batch "$PROFILE_BATCH")
    [ "$BACKEND" = rocm ] && driver=hip
    [ -x "$tools/iree-benchmark-module" ] || tools=$(dirname "$(command -v iree-benchmark-module 2>/dev/null || echo /none/x)")
    if [ ! -x "$tools/iree-benchmark-module" ] || [ ! -x "$tools/iree-profile" ]; then
        record profile fail "no iree-benchmark-module and iree-profile (.venv/bin or PATH)"; return
    fi
    (
        set -e
        "$BIN" graph step nanogpt-small "${batch[@]}" -o "$OUT/step.mlir"
        "$BIN" graph compile nanogpt-small "${batch[@]}" "${DEV[@]}" -o "$OUT/step.vmfb"
        # one splat input per train_step argument: small parameters, step 1, token ids 1
        grep 'sym_name = "train_step"' "$OUT/step.mlir" | head -1 | sed -E 's/.*function_type = \(([^)]*)\) ->.*/\1/' |
            grep -oE 'tensor<[^>]*>' | sed -E 's/tensor<(.*)>/\1/' | while read -r ty; do
                elem=${ty##*x}; [ "$elem" = "$ty" ] && { echo "--input=$ty=0.001"; continue; }
                case "$elem" in i*) echo "--input=$ty=1" ;; *) echo "--input=$ty=0.001" ;; esac
            done > "$OUT/inputs.flags"
        "$tools/iree-benchmark-module" --module="$OUT/step.vmfb" --function=train_step --flagfile="$OUT/inputs.flags" \
            --device="$driver" --benchmark_min_warmup_time=0 --benchmark_repetitions=1 --benchmark_min_time=1x \
            --device_profiling_mode=$mode --device_profiling_output="$OUT/step.ireeprof"
        "$tools/iree-profile" statistics "$OUT/step.ireeprof" > "$OUT/profile.txt"
    ) > "$OUT/profile.log" 2>&1
    local status=$?
    # IREE 3.13's CUDA HAL prints this and captures nothing, whatever the exit status
    if grep -q "HAL-native profiling is not implemented" "$OUT/profile.log"; then
        record profile skipped "IREE 3.13's $driver HAL has no native profiling (UNIMPLEMENTED in ${driver}_device.c)"; return
    fi
    [ "$status" = 0 ] || { record profile fail "$(grep -m1 -i error "$OUT/profile.log" || tail -1 "$OUT/profile.log")"; return; }
    local top
    top=$(awk '/count=[0-9]+ total=/ { for (i = 1; i <= NF; i++) if ($i ~ /^total=/) { v = substr($i, 7); u = $(i + 1)
              ms = v * (u == "us" ? 1e-3 : u == "ns" ? 1e-6 : u == "s" ? 1e3 : 1); print ms "\t" $2 } }' "$OUT/profile.txt" |
          sort -t$'\t' -k1,1 -g -r | head -3 | awk -F'\t' '{ printf "%s%s %.2f ms", (NR > 1 ? "; " : ""), $2, $1 }')
    if [ -n "$top" ]; then record profile pass "slowest dispatches (one step): $top"; else record profile fail "no dispatch times in the profile (see profile.txt)"; fi
}

# part NAME SECONDS FUNCTION ARGS…: a part under its own timeout
part() {
    local name=$1 seconds=$2; shift 2
    PART_TIMEOUT=$seconds "$@"
    grep -q "^$name	" "$RESULTS" || record "$name" fail "did not finish within $seconds s"
}

if timeout 30 "$BIN" devices > "$OUT/devices.txt" 2>&1; then
    line=$(grep -i -m1 -A1 "$BACKEND" "$OUT/devices.txt" | tr '\n' ' ')
    record devices pass "${line:-see devices.txt}"
else
    record devices fail "pcp-node devices failed"
fi
part parity 150 parity f32 parity
# speed: the compile is in the part (gpt2-124m with fused attention: 50 s on the lent
# H200's 16 cores), then 3 warmup and 20 timed steps of 1.9 s in f32; 90 s cut it short
part speed 180 speed f32 speed
part mixed 120 mixed
part screen 150 screen
part screen-host 150 screen_host
if [ "$PROFILE" = 1 ]; then part profile 90 profile; else record profile skipped "--no-profile"; fi
part parity-bf16 150 parity bf16 parity-bf16
part speed-bf16 180 speed bf16 speed-bf16

# the table and the JSON
{
    echo "# gpu_check: $BACKEND${TARGET:+ ($TARGET)}, $(date -u +%Y-%m-%d), $(( $(date +%s) - START )) s"
    echo
    echo "| part | result | detail |"
    echo "| --- | --- | --- |"
    awk -F'\t' '{ printf "| %s | %s | %s |\n", $1, $2, $3 }' "$RESULTS"
} > "$OUT/gpu_check.md"
awk -F'\t' -v backend="$BACKEND" -v target="$TARGET" -v secs="$(( $(date +%s) - START ))" '
    function esc(s) { gsub(/\\/, "\\\\", s); gsub(/"/, "\\\"", s); return s }
    BEGIN { printf "{\"backend\":\"%s\",\"target\":\"%s\",\"seconds\":%d,\"parts\":[", esc(backend), esc(target), secs }
    { printf "%s{\"part\":\"%s\",\"result\":\"%s\",\"detail\":\"%s\"}", (NR > 1 ? "," : ""), esc($1), esc($2), esc($3) }
    END { print "]}" }' "$RESULTS" > "$OUT/gpu_check.json"
cat "$OUT/gpu_check.md"
# fail on a failed part, or a skipped one other than the PyTorch comparison
if awk -F'\t' '$2 == "fail" || ($2 == "skipped" && $1 !~ /-torch$/ && $3 !~ /no native profiling/) { bad = 1 } END { exit !bad }' "$RESULTS"; then
    exit 1
fi
