"""The CUDA kernels in the emulator: every ``__global__`` kernel and every template instantiation the
launchers take (cuda/*.cu, cuda/*.cuh) or the ops' launch descriptions list (KERNELS in
ops/<op>/cuda_impl.py) must be launched by some test.

The op tests (tests/test_<op>.py) run the CUDA backend and its kernels in the emulator (cuda/emu);
conftest.py records, for every launcher call, the MK_LAUNCH names it launched and the call's
dtype codes, which name the instantiation that ran.
"""
import re
from pathlib import Path

import pytest

# ------------------------------------------------------------------------------------------------
# coverage: every kernel and instantiation in cuda/ was launched by the tests of this session
# ------------------------------------------------------------------------------------------------

GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s+)?(\w+)\s*\(")
# the launchers instantiate a template by taking its address: `const auto name = &kernel<args>;`,
# then launch it with MK_LAUNCH(name, ...), the name the emulator reports
SITE = re.compile(r"const\s+auto\s+(\w+)\s*=\s*&(?:\w+::)*(\w+)<([^;]*)>\s*;")
LAUNCH = re.compile(r"MK_LAUNCH\(\s*(\w+)\s*,")

ELEMENT = {0: "float32", 1: "bfloat16", 4: "float64"}  # mk::DType codes (cuda/common.cuh)
ACC = {"float32": "float32", "bfloat16": "float32", "float64": "float64"}  # acc_t<T>
ATTN_ELEMENT = {0: "float32", 1: "bfloat16", 2: "float16", 3: "bfloat16-mma.sync-emulated"}  # flash codes
# Values the template parameters take, as the dispatch around the launchers gives them:
# T (MK_DISPATCH_FLOAT_BF16_DOUBLE), A = acc_t<T>, R (dispatch_real / float or double launch),
# XT x R (ema_hidden: x's type with the coefficients' real type; float64 x with float32
# coefficients is refused), C = flash config (flash::dispatch: fp32 only in the emulator and not
# at D = 256; code 3 at D = 64 only), G = which of dk / dv the flash kv kernel computes.
DOMAIN = {
    "T": [("float32",), ("bfloat16",), ("float64",)],
    "A": [("float32",), ("float64",)],
    "R": [("float32",), ("float64",)],
    "R, R": [("float32", "float32"), ("float64", "float64")],  # cema_kernel's analysis: dk/db in R
    "XT, R": [(x, r) for x in ("float32", "bfloat16", "float64") for r in ("float32", "float64")
              if (x, r) != ("float64", "float32")],
    "C": [(e, d) for e in ("float32", "bfloat16", "float16") for d in (64, 128, 256) if (e, d) != ("float32", 256)]
    + [("bfloat16-mma.sync-emulated", 64)],
}
DOMAIN["C, G"] = [(e, d, g) for e, d in DOMAIN["C"] for g in ("dv", "dk")]
#: the template parameters that vary with the call (the others are constants at the site)
TYPE_PARAMETERS = ("T", "A", "R", "XT", "C", "G")
# where each launcher (cuda/bindings.cpp) takes its codes: element dtype, real dtype, flash
# element code and padded head dim (positional index; keyword name where it has a default)
CODES = {
    "cema_kernel_fwd": dict(real=0), "cema_kernel_bwd": dict(real=0),
    "ema_hidden_fwd": dict(dtype=0, real=1), "ema_hidden_bwd": dict(real=0),
    "flash_attention_fwd": dict(attn=0, D=10), "flash_attention_bwd": dict(attn=0, D=14),
}


def call_codes(func, args, kwargs):
    """{dtype, real, attn, D} of one launcher call (real defaults to the accumulation type)."""
    out = {}
    for key, where in CODES.get(func, dict(dtype=0)).items():
        index, keyword, default = where if isinstance(where, tuple) else (where, None, None)
        out[key] = args[index] if index < len(args) else kwargs.get(keyword, default)
    element = ELEMENT.get(out.get("dtype"))
    return dict(element=element, real=ELEMENT.get(out["real"]) if "real" in out else ACC.get(element),
                attn=ATTN_ELEMENT.get(out.get("attn")), D=out.get("D"))


def kernel_sources():
    from megalodon_kernels.cuda import build

    return sorted([*build.CUDA_DIR.glob("*.cu"), *build.CUDA_DIR.glob("*.cuh")])


def instantiation_sites():
    """{launch name: (kernel, template parameters)} over cuda/*.cu and cuda/*.cuh."""
    sites = {}
    for path in kernel_sources():
        for name, kernel, params in SITE.findall(path.read_text()):
            assert name not in sites, f"two instantiations launched as {name}: the emulator could not tell them apart"
            typed = [p.strip() for p in params.split(",") if p.strip() in TYPE_PARAMETERS]
            sites[name] = (kernel, ", ".join(typed))
    return sites


def launched_instantiations(log, sites):
    """{(launch name, parameter values)} from conftest's record of the launcher calls."""
    seen = set()
    for func, args, kwargs, launched in log:
        c = call_codes(func, args, kwargs)
        dk_dv = iter(("dv", "dk") if launched.count("flash_bwd_kv") == 2 else ("dk",))
        for name in launched:
            if name not in sites:
                continue
            value = {
                "": (), "T": (c["element"],), "A": (ACC.get(c["element"]),),
                "R": (c["real"],), "R, R": (c["real"], c["real"]),
                "XT, R": (c["element"], c["real"]), "C": (c["attn"], c["D"]),
                # the launcher runs dv (when dv is not empty) and then dk, both as flash_bwd_kv
                "C, G": (c["attn"], c["D"], next(dk_dv, None)),
            }[sites[name][1]]
            seen.add((name, value))
    return seen


def described_kernels():
    """{kernel base name} of the instantiations the ops' launch descriptions list (KERNELS)."""
    from megalodon_kernels.cuda.instances import described_kernels

    return {re.match(r"(?:\w+::)*(\w+)<", k.name).group(1) for k in described_kernels()}


def test_every_kernel_is_instantiated_and_launched_by_name():
    defined, launches, sites = set(), set(), instantiation_sites()
    for path in kernel_sources():
        text = path.read_text()
        defined |= set(GLOBAL.findall(text))
        launches |= set(LAUNCH.findall(text))
    print(f"{len(defined)} __global__ kernels, {len(sites)} instantiation sites")
    assert defined and sites
    instantiated = {kernel for kernel, _ in sites.values()} | described_kernels()
    assert not sorted(defined - instantiated), "kernels never instantiated"
    assert not sorted(set(sites) - launches), "instantiations never launched by MK_LAUNCH"
    assert not sorted(launches - set(sites)), "MK_LAUNCH of a name that is not an instantiation site"
    unknown = {params for _, params in sites.values()} - set(DOMAIN) - {""}
    assert not unknown, f"template parameters without a known domain: {unknown}; extend DOMAIN"
    for path in kernel_sources():  # the T domain is that of MK_DISPATCH_FLOAT_BF16_DOUBLE
        assert not re.search(r"(?<!define )MK_DISPATCH_FLOAT_BF16\(", path.read_text()), \
            f"{path.name} dispatches T without double: DOMAIN['T'] would name an instantiation that does not exist"


def test_every_kernel_ran_in_the_emulator(ext, request):
    # conftest.py moves this test to the end of the session: the launches of every test file
    # accumulate in the emulator extension's launch log.
    tests = Path(__file__).parent
    files = {Path(str(item.fspath)).name for item in request.session.items}
    missing = sorted({p.name for p in tests.glob("test_*.py")} - files)
    if missing or request.config.option.keyword or request.config.option.markexpr:
        pytest.skip(f"kernel coverage needs the whole test suite in the run; missing {missing or 'a -k/-m selection'}")
    sites = instantiation_sites()
    wanted = {(name, value) for name, (_, params) in sites.items() for value in (DOMAIN[params] if params else [()])}
    ran = launched_instantiations(ext.launch_log, sites)
    missing = sorted(wanted - ran)
    print(f"{len(wanted)} instantiations, {len(wanted & ran)} launched")
    assert not missing, f"instantiations never executed in the emulator: {missing}"
    # the launch descriptions' instantiations, launched by name expression
    from megalodon_kernels.cuda.instances import described_kernels

    by_name = {args[0] for func, args, _, _ in ext.launch_log if func == "launch_kernel"}
    missing = sorted({k.name for k in described_kernels()} - by_name)
    assert not missing, f"KERNELS entries never launched in the emulator: {missing}"
