#!/usr/bin/env bash
# Installs the PyTorch CPU build that bench/torch_reference.py needs into
# .venv, idempotently. PyPI's Linux x86-64 wheel is the CUDA build (the CPU
# build lives only on PyTorch's own index) and `pip install torch` also pulls
# several GB of nvidia-* and triton wheels. Instead torch goes in with
# --no-deps, its pure-Python dependencies are installed explicitly (pip then
# warns about the missing CUDA requirements; that is expected), and stubs
# stand in for the CUDA libraries that torch's libraries are linked against.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=2.15.0
PY=${PYTHON:-.venv/bin/python}
if [ ! -x "$PY" ]; then
    echo "bench/setup.sh: no $PY; run scripts/setup.sh first" >&2
    exit 1
fi
have() { "$PY" - "$1" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("torch") == sys.argv[1] else 1)
PYEOF
}
if ! have "$TORCH_VERSION"; then
    "$PY" -m pip install --quiet --no-deps "torch==$TORCH_VERSION"
fi
# What `import torch` and torch.optim need on a CPU-only machine.
"$PY" -m pip install --quiet filelock typing-extensions sympy mpmath networkx jinja2 markupsafe fsspec
# libtorch.so links libtorch_cuda.so, which links libcudart, cuBLAS, cuDNN,
# NCCL…: stubs (bench/cuda_stubs.py) satisfy the loader; CPU code never calls
# them, and torch.cuda.is_available() is False.
if ! "$PY" -c "import torch" 2>/dev/null; then
    LIB=$("$PY" -c "import importlib.util, os; print(os.path.join(os.path.dirname(importlib.util.find_spec('torch').origin), 'lib'))")
    BUILD=$(mktemp -d)
    "$PY" bench/cuda_stubs.py "$LIB" "$BUILD"
    rm -rf "$BUILD"
fi
"$PY" -c "import torch; x = torch.ones(2) @ torch.ones(2); assert x.item() == 2.0; print('torch', torch.__version__, 'ok, threads', torch.get_num_threads())"
