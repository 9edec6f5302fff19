"""No op reads a device tensor on the host (a synchronisation) on the GPU path.

Meta tensors stand in for CUDA tensors: they have shapes and dtypes but no values, so anything that
would synchronise with a GPU (``bool(t.any())``, ``.item()``, ``.tolist()``, ``int(t)``,
``nonzero``) raises on them. Each op's validation, dispatch and torch backend (the backend that runs
on any device), forward and backward, runs here on meta inputs; a reintroduced host read fails.
The Triton launchers cannot run on meta tensors, so their sources are checked for host reads.
"""
import ast
from pathlib import Path

import pytest
import torch

from megalodon_kernels import ops

META = dict(device="meta")
OPS_DIR = Path(ops.__file__).resolve().parent


def real(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device="meta", requires_grad=True)


def cplx(*shape):
    return torch.randn(*shape, dtype=torch.complex64, device="meta", requires_grad=True)


CASES = {
    "timestep_norm": lambda: ops.timestep_norm(
        real(2, 8, 16), real(16), real(16), 4, torch.zeros(2, dtype=torch.int64, **META), real(2, 4), real(2, 4),
        torch.zeros(2, 8, dtype=torch.bool, **META), backend="torch"),
    "attention causal": lambda: ops.attention(real(1, 8, 2, 16), real(1, 8, 2, 16), real(1, 8, 2, 16), causal=True,
                                              backend="torch"),
    "attention chunk dropkey": lambda: ops.attention(real(1, 8, 2, 16), real(1, 8, 2, 16), real(1, 8, 2, 16),
                                                     chunk_size=4, block_causal=True, dropkey_p=0.1, seed=1,
                                                     backend="torch"),
    "attention laplace": lambda: ops.attention(real(1, 8, 2, 16), real(1, 12, 2, 16), real(1, 12, 2, 8),
                                               attn_fn="laplace", backend="torch"),
    "dropkey_softmax": lambda: ops.dropkey_softmax(real(1, 2, 8, 8), True, 0.1, 3, backend="torch"),
    "rotary": lambda: ops.rotary(real(1, 8, 2, 16), torch.arange(8, **META), backend="torch"),
    "rotary xpos": lambda: ops.rotary(real(1, 8, 2, 16), torch.arange(8, **META), xpos_scale_base=512.0,
                                      backend="torch"),
    "fftconv": lambda: ops.fftconv(real(2, 3, 40), real(3, 40), backend="torch"),
    "cema_kernel": lambda: ops.cema_kernel(real(3, 4), cplx(3, 4), cplx(3, 4), 40, cplx(2, 3, 4), backend="torch"),
    "ema_hidden": lambda: ops.ema_hidden(real(2, 3, 40), real(3, 4), cplx(3, 4), cplx(2, 3, 4), backend="torch"),
    "cema": lambda: ops.cema(real(2, 3, 40), real(3, 4), cplx(3, 4), cplx(3, 4), real(3), cplx(2, 3, 4),
                             return_state=True, backend="torch"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_forward_and_backward_never_read_a_device_tensor(name):
    out = CASES[name]()
    outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
    assert outs and all(o.device.type == "meta" for o in outs)
    loss = sum(o.real.sum() if o.is_complex() else o.sum() for o in outs if o.requires_grad)
    loss.backward()


def test_a_host_read_fails_on_meta_tensors():
    # what the test above relies on: the reads it guards against raise on meta tensors
    t = torch.zeros(3, dtype=torch.int64, device="meta")
    for read in (lambda: bool((t < 0).any()), lambda: t.sum().item(), lambda: t.tolist(), lambda: int(t[0]),
                 lambda: t.nonzero()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


def test_prev_count_check_is_unchanged_on_cpu():
    x = torch.randn(2, 4, 8)
    with pytest.raises(ValueError, match=r"prev_count must be >= 0 \(a number of steps already seen\)"):
        ops.timestep_norm(x, torch.ones(8), torch.zeros(8), 2, prev_count=torch.tensor([0, -1]))


#: tensor methods whose result is read on the host
HOST_READS = {"item", "tolist", "nonzero", "cpu", "numpy"}


def _host_reads(path: Path) -> list[str]:
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in HOST_READS:
            bad.append(f"{path.relative_to(OPS_DIR.parent)}:{node.lineno} .{f.attr}()")
        # bool(t.any()), int(t.sum()), float(t.max()): a reduction read on the host
        if isinstance(f, ast.Name) and f.id in ("bool", "int", "float") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and \
                    arg.func.attr in ("any", "all", "sum", "max", "min", "amax", "amin"):
                bad.append(f"{path.relative_to(OPS_DIR.parent)}:{node.lineno} {f.id}(....{arg.func.attr}())")
    return bad


def test_triton_launchers_read_no_device_tensor():
    bad = [b for path in sorted(OPS_DIR.glob("*/triton_impl.py")) for b in _host_reads(path)]
    assert not bad, "host reads of device tensors in Triton launchers:\n" + "\n".join(bad)
