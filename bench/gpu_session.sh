#!/usr/bin/env bash
# One bounded GPU session on a machine with its own torch / Triton / CuPy and no network, run from the
# checkout with the header wheels in .whl/, fetched beforehand on a machine with network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#     -d .whl nvidia-cutlass==4.2.0.0 nvidia-cuda-cccl==13.0.85
#   OUT=dir bash bench/gpu_session.sh
# Installs the wheels into /tmp/mk-site, imports the checkout as megalodon_kernels through a link (no
# build), compiles every CUDA kernel for the device in parallel (bench/nvrtc_warm.py), then runs the
# self-check, the probe (bench/gpu_probe.py) and the tests marked `gpu`, each under its own timeout;
# every log lands in $OUT. Python runs from /tmp: the checkout root has a folder named cuda/, which
# would shadow the cuda-python namespace package CuPy imports.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-results}; mkdir -p "$OUT"; export PYTHONUNBUFFERED=1
ROOT=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mk-site .whl/*.whl \
    && export PYTHONPATH=/tmp/mk-site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p /tmp/mk-pkg && ln -sfn "$ROOT" /tmp/mk-pkg/megalodon_kernels && export PYTHONPATH=/tmp/mk-pkg:${PYTHONPATH:-}
cd /tmp
{ date; nvidia-smi -L; nproc; python3 -c "import megalodon_kernels, torch, triton, cupy; print('torch', torch.__version__, 'triton', triton.__version__, 'cupy', cupy.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; } 2>&1 | tee "$OUT/env.txt"
timeout "${WARM_S:-120}" python3 "$ROOT/bench/nvrtc_warm.py" 2>&1 | tail -30 | tee "$OUT/nvrtc_warm.txt"
timeout "${SELF_S:-120}" python3 -m megalodon_kernels > "$OUT/selfcheck.txt" 2>&1; echo "selfcheck rc $?" | tee -a "$OUT/selfcheck.txt"
grep -E "passed|NO " "$OUT/selfcheck.txt" | tail -20
timeout "${PROBE_S:-150}" python3 "$ROOT/bench/gpu_probe.py" 2>&1 | tee "$OUT/probe.txt"
TRITON_INTERPRET=0 timeout "${TESTS_S:-150}" python3 -m pytest -q -s -m gpu -p no:cacheprovider --rootdir "$ROOT" \
  -c "$ROOT/pyproject.toml" "$ROOT/tests/test_gpu.py" > "$OUT/gpu_tests.txt" 2>&1
grep -E "fwd .*tol|passed|failed|FAILED|Error" "$OUT/gpu_tests.txt" | tail -60
