#!/usr/bin/env bash
# One bounded GPU session on a machine with its own torch / Triton / CuPy and no network, without
# installing anything: run from the checkout with the header wheels in .whl/, fetched beforehand on a
# machine with network (docs/gpu.md):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#     -d .whl nvidia-cutlass==4.2.0.0 nvidia-cuda-cccl==13.0.85
#   OUT=dir [BUDGET_S=480] bash bench/gpu_session.sh
# Unpacks the wheels into /tmp/mk-site, imports the checkout as megalodon_kernels through a link (no
# build), then runs `python -m megalodon_kernels.bench gpu` (bench/gpu_run.py: environment, NVRTC
# warm-up, self-check, gpu tests, per-op times, model vs Transformer, autotune) into $OUT. Python runs
# from /tmp: the checkout root has a folder named cuda/, which would shadow the cuda-python namespace
# package CuPy imports.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-results}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); export PYTHONUNBUFFERED=1
ROOT=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mk-site .whl/*.whl \
    && export PYTHONPATH=/tmp/mk-site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p /tmp/mk-pkg && ln -sfn "$ROOT" /tmp/mk-pkg/megalodon_kernels && export PYTHONPATH=/tmp/mk-pkg:${PYTHONPATH:-}
cd /tmp
{ date; nvidia-smi -L; nproc; } > "$OUT/session_env.txt" 2>&1
python3 -m megalodon_kernels.bench gpu --out "$OUT" --budget-s "${BUDGET_S:-480}"
