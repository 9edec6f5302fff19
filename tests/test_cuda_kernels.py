"""The CUDA kernels in the emulator: every ``__global__`` kernel of cuda/*.cuh is instantiated by
some op's launch description (KERNELS, or EMULATOR_KERNELS for the emulator-only configurations,
in ops/<op>/cuda_impl.py), and every one of those instantiations is launched by some test.

The op tests (tests/test_<op>.py) run the CUDA backend and its kernels in the emulator (cuda/emu)
through the launch descriptions; conftest.py records every call of the emulator extension, among
them the launches by name expression.
"""
import re
from pathlib import Path

import pytest

GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)\s*\(")


def kernel_headers():
    from megalodon_kernels.cuda import build

    return sorted(build.CUDA_DIR.glob("*.cuh"))


def _template(name: str) -> str:
    return re.match(r"(?:\w+::)*(\w+)<", name).group(1)


def test_every_kernel_is_instantiated_by_a_launch_description():
    from megalodon_kernels.cuda import build
    from megalodon_kernels.cuda.instances import described_kernels

    defined = {k for path in kernel_headers() for k in GLOBAL.findall(path.read_text())}
    kernels = described_kernels(emulator=True)
    print(f"{len(defined)} __global__ kernels, {len(kernels)} instantiations")
    assert defined
    assert not sorted(defined - {_template(k.name) for k in kernels}), "kernels never instantiated"
    assert not sorted({_template(k.name) for k in kernels} - defined), "KERNELS names a kernel no header defines"
    # no compiled launchers are left: the ops' kernels reach both runtimes only through the descriptions
    assert not sorted(build.CUDA_DIR.glob("*.cu")), "a .cu launcher outside the launch descriptions"


def test_every_kernel_ran_in_the_emulator(ext, request):
    # conftest.py moves this test to the end of the session: the launches of every test file
    # accumulate in the emulator extension's launch log.
    tests = Path(__file__).parent
    files = {Path(str(item.fspath)).name for item in request.session.items}
    missing = sorted({p.name for p in tests.glob("test_*.py")} - files)
    if missing or request.config.option.keyword or request.config.option.markexpr:
        pytest.skip(f"kernel coverage needs the whole test suite in the run; missing {missing or 'a -k/-m selection'}")
    from megalodon_kernels.cuda.instances import described_kernels

    by_name = {args[0] for func, args, _, _ in ext.launch_log if func == "launch_kernel"}
    wanted = {k.name for k in described_kernels(emulator=True)}
    print(f"{len(wanted)} instantiations, {len(wanted & by_name)} launched")
    missing = sorted(wanted - by_name)
    assert not missing, f"instantiations never launched in the emulator: {missing}"
