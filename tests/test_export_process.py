"""torch.export across processes (README, "Deployment"): a program saved here loads and runs in a
fresh interpreter that imports only ``torch`` and ``megalodon_kernels``, the import the README names.

``import megalodon_kernels`` does not import the ops (the package root puts a namespace on
``torch.ops`` that registers them on first lookup, see __init__.py); the child checks that too, so
the test shows that the lookup ``torch.export.load`` makes is what registers them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from megalodon_kernels.model import Megalodon, get_config
from support import perturb_

CHILD = textwrap.dedent("""
    import json, sys
    import torch, megalodon_kernels
    ops_before = "megalodon_kernels.ops" in sys.modules
    torch.set_num_threads(int(sys.argv[3]))
    program = torch.export.load(sys.argv[1])
    saved = torch.load(sys.argv[2])
    with torch.no_grad():
        out = program.module()(saved["tokens"])
    diff = float((out - saved["eager"]).abs().max())
    print(json.dumps({"ops_before_load": ops_before, "diff": diff, "shape": list(out.shape),
                      "equal": bool(torch.equal(out, saved["eager"]))}))
""")


def test_saved_program_loads_and_runs_in_a_fresh_process(tmp_path):
    torch.manual_seed(0)
    model = perturb_(Megalodon(get_config("tiny")), 100).eval()
    tokens = torch.randint(0, 256, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        eager = model(tokens)
        program = torch.export.export(model, (tokens,))
    torch.export.save(program, tmp_path / "model.pt2")
    torch.save({"tokens": tokens, "eager": eager}, tmp_path / "io.pt")

    # cwd outside the checkout: the child imports the installed package, as a user's process would
    done = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "model.pt2"), str(tmp_path / "io.pt"),
                           str(torch.get_num_threads())], cwd=tmp_path, env=dict(os.environ),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ops_before_load"] is False, "import megalodon_kernels imported the ops eagerly"
    assert result["shape"] == list(eager.shape)
    # Same ops, same backend resolution, same thread count: the same numbers. The bound is the one
    # the in-process round trip in tests/test_compile.py uses, for a backend another process may pick.
    assert result["diff"] <= 1e-6 * float(eager.abs().max()), result
