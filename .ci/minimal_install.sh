#!/usr/bin/env bash
# CI, a minimal install (issue 44 item 1): what a CPU user gets from `pip install torch` and
# `pip install -e .`, without the test extra. Two stages in one fresh venv:
#   1. no Triton and no CuPy: the self-check runs the torch and cpu backends, and every backend that
#      cannot load says why in one reason (triton: "triton is not installed"; cuda: no CUDA device;
#      never an ImportError); then a handful of fast op and model tests on those backends;
#   2. Triton added, still no CuPy: the self-check with the Triton interpreter, and the dispatch tests.
# pytest and hypothesis (tests/conftest.py needs it) are installed for the tests only. The torch
# wheel comes from pip's cache. About 90 s on the idle 2-core CI machine.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { echo "== minimal install [${SECONDS}s]: $*"; }

venv="$(mktemp -d)/venv-minimal"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
out="$(mktemp -d)"

step "pip install torch==2.13.0; pip install -e . (no extras); pytest hypothesis"
pip install -q torch==2.13.0
pip install -q -e . pytest hypothesis
python - <<'EOF'
import importlib.util
for name in ("triton", "cupy", "transformers"):
    assert importlib.util.find_spec(name) is None, f"{name} is installed: this job needs an install without it"
EOF

# The report's reasons, checked: $1 = the self-check's output, $2 = what the triton column must say
check_report() {
  python - "$1" "$2" <<'EOF'
import re, sys
text, triton_want = open(sys.argv[1]).read(), sys.argv[2]
assert text.startswith("megalodon_kernels self-check\n"), "something printed above the report:\n" + text[:800]
assert "Warning" not in text and "Traceback" not in text, text
assert "cannot import" not in text, "a backend failed to import instead of saying why"
assert "pip install -e '.[cuda]'" not in text and "megalodon-kernels[cuda]" not in text, \
    "advice to install the cuda extra on a machine without an NVIDIA GPU"
table = text.split("backends on cpu", 1)[1].split("\n\n")[0].splitlines()[1:]
cols = table[0].split()
reasons = dict(re.findall(r"^  \((\d+)\) (.*(?:\n {6,}.*)*)", text, re.M))
reasons = {k: " ".join(v.split()) for k, v in reasons.items()}
refs = lambda cell: re.search(r"\(([\d, ]+)\)$", cell).group(1).split(", ") if cell.endswith(")") else []  # noqa: E731
for row in table[1:]:
    op = row.split()[0]
    cells = re.split(r"\s{2,}", row.strip())[1:]
    cell = dict(zip(cols[1:], cells))
    assert cell["torch"] == "yes", (op, cell)
    cuda = [reasons[n] for n in refs(cell["cuda"])]
    assert cell["cuda"].startswith("no") and len(cuda) == 1, (op, cuda)  # one reason, one sentence
    assert any(r.startswith(("the CUDA backend is unavailable: no CUDA device is visible", "no cuda implementation"))
               for r in cuda), (op, cuda)
    triton = [reasons[n] for n in refs(cell["triton"])]
    if triton_want == "absent":
        assert cell["triton"].startswith("no (") and triton == ["triton is not installed: pip install triton"], (op, triton)
    else:
        assert cell["triton"] == "yes" or " only (" in cell["triton"], (op, cell["triton"])
m = re.search(r"^(\d+) passed, 0 failed$", text, re.M)
assert m, "the self-check failed"
print(f"report checked: {len(table) - 1} ops, {m.group(1)} checks passed; triton {triton_want}, no CuPy")
EOF
}

step "1. no Triton, no CuPy: python -m megalodon_kernels"
python -m megalodon_kernels > "$out/selfcheck.txt" 2>&1 || { cat "$out/selfcheck.txt"; exit 1; }
check_report "$out/selfcheck.txt" absent || { cat "$out/selfcheck.txt"; exit 1; }

step "1. no Triton, no CuPy: op and model tests on the torch and cpu backends"
CI=1 python -m pytest -p no:cacheprovider -q -k "not triton and not cuda" \
    tests/test_selfcheck.py tests/test_front_door.py tests/test_rotary.py tests/test_packing.py tests/test_model.py

step "2. Triton, no CuPy: pip install triton==3.9.0; TRITON_INTERPRET=1 python -m megalodon_kernels"
pip install -q "triton==3.9.0"
TRITON_INTERPRET=1 python -m megalodon_kernels > "$out/selfcheck_triton.txt" 2>&1 \
  || { cat "$out/selfcheck_triton.txt"; exit 1; }
check_report "$out/selfcheck_triton.txt" present || { cat "$out/selfcheck_triton.txt"; exit 1; }

step "2. Triton, no CuPy: dispatch tests"
CI=1 python -m pytest -p no:cacheprovider -q tests/test_dispatch.py

deactivate
step "done"
