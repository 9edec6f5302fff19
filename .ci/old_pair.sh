#!/usr/bin/env bash
# CI, the oldest supported pair (issue 28 item 1): torch 2.11 + Triton 3.6, pyproject's lower bounds
# and the oldest pair in _versions.py, in a fresh venv of its own; runs the version-sensitive subset:
# the self-check with the Triton interpreter, custom ops / torch.compile / torch.export
# (test_compile, test_export_process), dispatch, every op's Triton interpreter tests (-k triton,
# their CI sizes), the packed and streaming model and checkpointing. The newest pair (torch 2.13 +
# Triton 3.9) runs the full suite in .ci/run. Sized to ~10 minutes on 2 cores (measured: see the
# commit that added it); each pytest run is bounded by OLD_PAIR_TIMEOUT seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=2.11.0
TRITON=3.6.0
# Triton 3.6's interpreter fails with NumPy >= 2.4 (_versions.INTERPRETER_NUMPY_FIX: it int()s a
# one-element array); a user of this pair with the interpreter needs the same pin.
NUMPY="numpy<2.4"
limit="${OLD_PAIR_TIMEOUT:-900}"
step() { echo "== old pair [${SECONDS}s]: $*"; }

venv="$(mktemp -d)/venv-old-pair"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

step "set-up (torch $TORCH, triton $TRITON, $NUMPY)"
# PyPI has no CPU-only wheel of torch 2.11: this is its CUDA 13 build (it runs on CPU), which pins
# triton 3.6.0 itself.
pip install "torch==$TORCH" "triton==$TRITON" "$NUMPY"
pip install -e ".[test]" "torch==$TORCH" "triton==$TRITON" "$NUMPY"
python - "$TORCH" "$TRITON" <<'EOF'
import sys
import torch, triton
want_torch, want_triton = sys.argv[1:]
assert torch.__version__.split("+")[0] == want_torch and triton.__version__ == want_triton, (
    torch.__version__, triton.__version__)
EOF

step "python -m megalodon_kernels (TRITON_INTERPRET=1: the Triton kernels too)"
TRITON_INTERPRET=1 python -m megalodon_kernels

step "custom ops, compile, export, dispatch, model"
timeout "$limit" python -m pytest -p no:cacheprovider -q \
    tests/test_versions.py tests/test_compile.py tests/test_export_process.py tests/test_dispatch.py \
    tests/test_packed_model.py tests/test_model_streaming.py tests/test_model_checkpoint.py

step "every op's Triton interpreter tests"
timeout "$limit" python -m pytest -p no:cacheprovider -q -k triton \
    tests/test_attention.py tests/test_cema.py tests/test_cema_kernel.py tests/test_dropkey_softmax.py \
    tests/test_ema_hidden.py tests/test_fftconv.py tests/test_rotary.py tests/test_timestep_norm.py \
    tests/test_packed_attention.py tests/test_packed_cema.py tests/test_packed_ema_hidden.py \
    tests/test_packed_fftconv.py tests/test_packed_rotary.py tests/test_packed_timestep_norm.py \
    tests/test_triton_grids.py
step "done"
