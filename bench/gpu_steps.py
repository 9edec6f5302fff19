"""The steps of ``python -m megalodon_kernels.bench gpu`` (bench/gpu_run.py runs them in order).

Each step is ``step(run, limit_s) -> dict`` with ``summary`` (a few lines for the one-screen summary),
``files`` (what it wrote into ``run.out``) and its data; it raises on failure (the runner records
the failure and goes on). ``run.dry`` swaps the GPU for the CPU: the Triton interpreter, the CUDA
emulator, tiny shapes, a few kernels compiled for sm_90 offline.

Steps that run another program (NVRTC warm-up, self-check, gpu tests, autotune) start it in a
session of its own, from a folder outside the checkout (the checkout root holds a ``cuda/`` folder
that would shadow the ``cuda`` package CuPy imports), and kill the whole session at its time limit.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import megalodon_kernels

PACKAGE_DIR = Path(megalodon_kernels.__file__).resolve().parent
BENCH_DIR = Path(__file__).resolve().parent
OPS = ("cema_kernel", "ema_hidden", "fftconv", "cema", "timestep_norm", "attention", "dropkey_softmax", "rotary")
BACKENDS = ("cuda", "triton", "torch")
MODES = ("fwd", "bwd", "fwd+bwd")
#: the ops step's share for fftconv at many rows (bench/fftconv_rows.py): at most this many seconds
#: (the Triton JIT of the new tile sizes included, ~10-20 s per dtype) and at most this fraction of
#: the step's limit
FFTCONV_ROWS_S = 60.0
FFTCONV_ROWS_SHARE = 0.5


@dataclasses.dataclass
class Run:
    out: Path
    dry: bool
    deadline: float  # time.perf_counter() at which the budget ends
    device: torch.device
    results: dict = dataclasses.field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.perf_counter()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------ subprocesses
def child_env(run: Run, **extra) -> dict:
    """The environment of a child: this process's, with the folder that made ``megalodon_kernels``
    importable here on PYTHONPATH (the child starts elsewhere) and the dry run's interpreter flag."""
    env = dict(os.environ)
    roots = [os.path.abspath(p or ".") for p in sys.path if (Path(p or ".") / "megalodon_kernels").exists()]
    if roots:
        env["PYTHONPATH"] = os.pathsep.join(roots + [x for x in [env.get("PYTHONPATH")] if x])
    env["PYTHONUNBUFFERED"] = "1"
    env["TRITON_INTERPRET"] = "1" if run.dry else "0"
    env.update(extra)
    return env


def run_cmd(run: Run, cmd: list[str], log: str, limit_s: float, **env) -> tuple[int | None, str]:
    """(return code or None when killed at ``limit_s``, output) of ``cmd``; the output goes to ``run.out/log``."""
    path = run.out / log
    with open(path, "w") as f, tempfile.TemporaryDirectory() as cwd:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=child_env(run, **env),
                             start_new_session=True)
        # At the limit, SIGINT first: pytest then prints its failures so far and the self-check its
        # table, which a SIGKILL loses; what does not stop within the grace is killed.
        grace = min(5.0, 0.1 * limit_s)
        try:
            rc = p.wait(timeout=max(1.0, limit_s - grace))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            rc = None
    text = path.read_text(errors="replace")
    if rc is None:
        with open(path, "a") as f:
            f.write(f"\n[killed at its time limit of {limit_s:.0f} s]\n")
    return rc, text


# ------------------------------------------------------------------------------------ 1. environment
def _timed(fn, device, reps):
    fn()
    sync(device)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        ts.append(time.perf_counter() - t0)
    return min(ts)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 5) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), the best of ``reps``."""
    src = torch.empty(nbytes // 4, device=device, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _timed(lambda: dst.copy_(src), device, reps)


def matmul_flops(device: torch.device, n: int, dtype: torch.dtype, reps: int = 3) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / _timed(lambda: a @ b, device, reps)


def _version(module: str) -> str:
    try:
        return importlib.import_module(module).__version__
    except Exception as exc:  # optional dependencies: say why they are missing
        return f"not importable ({type(exc).__name__})"


def _nvidia_smi() -> dict:
    q = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"nvidia-smi": f"not run ({type(exc).__name__})"}
    first = (r.stdout.strip().splitlines() or [""])[0]
    return dict(zip(q.split(","), (v.strip() for v in first.split(","))))


def flops(x: float) -> str:
    return f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def step_env(run: Run, limit_s: float) -> dict:
    from megalodon_kernels.cuda import nvrtc

    dev = run.device
    data = {"megalodon_kernels": megalodon_kernels.__version__, "python": sys.version.split()[0],
            "torch": torch.__version__, "torch cuda": torch.version.cuda, "triton": _version("triton"),
            "cupy": _version("cupy"), "numpy": _version("numpy"), "cpu cores": os.cpu_count()}
    try:
        data["nvrtc"] = "%d.%d" % nvrtc.nvrtc_version()
    except Exception as exc:
        data["nvrtc"] = f"unavailable ({type(exc).__name__})"
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        data.update(device=p.name, capability=f"sm_{p.major}{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), clocks=_nvidia_smi(),
                    tf32_matmul=torch.backends.cuda.matmul.allow_tf32)
        copy_bytes, n = 1 << 30, 8192
    else:
        data.update(device="cpu (dry run: no GPU)", capability="-", clocks={})
        copy_bytes, n = 1 << 25, 256
    data["copy_bytes"] = copy_bytes
    data["d2d_bytes_per_s"] = copy_bandwidth(dev, copy_bytes)
    data["matmul_n"] = n
    data["fp32_flops"] = matmul_flops(dev, n, torch.float32)
    data["bf16_flops"] = matmul_flops(dev, n, torch.bfloat16)
    (run.out / "env.json").write_text(json.dumps(data, indent=1, default=str))
    clk = data["clocks"]
    summary = [f"{data['device']} {data['capability']}, torch {data['torch']} (CUDA {data['torch cuda']}), "
               f"triton {data['triton']}, cupy {data['cupy']}, NVRTC {data['nvrtc']}",
               f"copy {data['d2d_bytes_per_s'] / 1e9:.1f} GB/s (read+write, {copy_bytes >> 20} MiB); matmul "
               f"{n}^3 fp32 {flops(data['fp32_flops'])}, bf16 {flops(data['bf16_flops'])}"]
    if clk.get("clocks.sm"):
        summary.append(f"clocks: SM {clk['clocks.sm']} (max {clk.get('clocks.max.sm')}), memory {clk.get('clocks.mem')}, "
                       f"power {clk.get('power.draw')} / {clk.get('power.limit')}, {clk.get('temperature.gpu')} C")
    return dict(summary=summary, files=["env.json"], data=data)


# ------------------------------------------------------------------------------------ 2. NVRTC
def step_nvrtc(run: Run, limit_s: float) -> dict:
    if run.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(run.device)
        args = ["--arch", str(10 * major + minor)]
    else:
        args = ["--arch", "90", "--one-per-header"]
    rc, text = run_cmd(run, [sys.executable, str(BENCH_DIR / "nvrtc_warm.py"), *args, "--json"], "nvrtc.txt", limit_s)
    found = [json.loads(line[4:]) for line in text.splitlines() if line.startswith("JSON")]
    if not found:
        raise RuntimeError(f"nvrtc_warm.py gave no result (rc {rc}; nvrtc.txt)")
    d = found[-1]
    summary = [f"{d['compiled']}/{d['kernels']} kernels for sm_{d['arch']} in {d['seconds']:.1f} s on {d['workers']} "
               f"processes ({d['origins']}), {len(d['failed'])} failed"]
    summary += [f"  FAILED {name}: {why[:150]}" for name, why in d["failed"][:3]]
    if rc != 0:
        summary.append(f"  exit status {rc}")
    return dict(summary=summary, files=["nvrtc.txt"], data=d, failed=bool(d["failed"]) or rc != 0)


# ------------------------------------------------------------------------------------ 3. self-check
def step_selfcheck(run: Run, limit_s: float) -> dict:
    rc, text = run_cmd(run, [sys.executable, "-m", "megalodon_kernels"], "selfcheck.txt", limit_s)
    m = re.search(r"(\d+) passed, (\d+) failed", text)
    if not m:
        raise RuntimeError(f"the self-check printed no result (rc {rc}; selfcheck.txt)")
    passed, failed = int(m.group(1)), int(m.group(2))
    dev = "cuda" if run.device.type == "cuda" else "cpu"
    on_dev = [line for line in text.splitlines() if re.match(rf"\S+\s+\S+\s+{dev}\S*\s", line)]
    bad = [line.split()[:4] for line in on_dev if " NO " in line]
    summary = [f"{passed} passed, {failed} failed ({len(on_dev)} checks on {dev})"]
    summary += ["  NO " + " ".join(b) for b in bad[:4]]
    return dict(summary=summary, files=["selfcheck.txt"], data=dict(passed=passed, failed=failed, rc=rc),
                failed=failed > 0 or rc != 0)


# ------------------------------------------------------------------------------------ 4. gpu tests
def step_tests(run: Run, limit_s: float) -> dict:
    tests = PACKAGE_DIR / "tests" / "test_gpu.py"
    if not tests.exists():
        return dict(summary=[f"not run: {tests} is not there (run from a checkout)"], files=[], skipped=True)
    # with the documentation's GPU blocks (tests/test_docs.py, mark "gpu": docs/ci.md)
    docs = PACKAGE_DIR / "tests" / "test_docs.py"
    cmd = [sys.executable, "-m", "pytest", "-v", "-rs", "-s", "--tb=short", "-m", "gpu", "-p", "no:cacheprovider",
           "--rootdir", str(PACKAGE_DIR), "-c", str(PACKAGE_DIR / "pyproject.toml"), str(tests),
           *([str(docs)] if docs.exists() else []), "--junitxml", str(run.out / "gpu_tests.xml")]
    # the gpu tests need compiled Triton: never the interpreter, not even in the dry run
    rc, text = run_cmd(run, cmd, "gpu_tests.txt", limit_s, TRITON_INTERPRET="0")
    tail = text.splitlines()[-1:] if rc is not None else []
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)", " ".join(tail))}
    if not counts:
        # killed at the limit (no summary line): count the verbose per-test results printed so far
        # (pytest names the files relative to its working folder, ``../../<checkout>/tests/...``; with
        # -s a test's prints sit between its name and its outcome)
        for outcome in re.findall(r"^\S*tests/test_\w+\.py::\S+ .*?(PASSED|FAILED|SKIPPED|ERROR)", text, re.M | re.S):
            counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
    if not counts:
        raise RuntimeError(f"pytest printed no result (rc {rc}; gpu_tests.txt)")
    failed = [line for line in text.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if rc is None:
        failed += [line.split(" ", 1)[0] for line in text.splitlines()
                   if re.match(r"\S*tests/test_\w+\.py::", line) and line.rstrip().endswith(("FAILED", "ERROR"))]
    summary = [", ".join(f"{v} {k}" for k, v in counts.items()) + ("" if rc is not None else " (stopped at its limit)")]
    if run.device.type != "cuda":
        summary[0] += " (no CUDA device: the gpu tests skip; on a GPU they run)"
    summary += ["  " + line[:150] for line in failed[:4]]
    return dict(summary=summary, files=["gpu_tests.txt", "gpu_tests.xml"], data=dict(counts=counts, rc=rc),
                failed=bool(failed) or rc not in (0, 5))


# ------------------------------------------------------------------------------------ 5. per-op times
def shape_set(run: Run):
    """(name, ShapeSet) the op step measures: the device's paper-7B set on a GPU, a tiny one in the dry run."""
    from megalodon_kernels.bench.shapes import BENCH_SETS

    if run.device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(run.device)
        name = "h100" if major >= 9 else "a100"
        return name, BENCH_SETS[name]
    return "dry", dataclasses.replace(BENCH_SETS["cpu"], name="dry", D=8, N=4, G=2, H=1, dz=16, dv=16, chunk=32,
                                      lengths=(64,), tokens=64, dtypes=("float32",))


def _time_case(fn, leaves, device, budget_s: float, min_reps: int, max_reps: int) -> dict:
    """{mode: [seconds per call]} of forward (no grad), backward alone, forward + backward."""
    def outs(o):
        o = o if isinstance(o, (tuple, list)) else (o,)
        return [t for t in o if isinstance(t, torch.Tensor) and t.requires_grad]

    t0 = time.perf_counter()
    first = outs(fn())  # compiles (Triton JIT, NVRTC) and allocates
    grads = [torch.randn_like(o) for o in first]
    torch.autograd.grad(first, leaves, grads, allow_unused=True)
    sync(device)
    res = {"first_call_s": time.perf_counter() - t0}
    for mode in MODES:
        ts, spent = [], time.perf_counter()
        while len(ts) < max_reps and (len(ts) < min_reps or time.perf_counter() - spent < budget_s):
            if mode == "fwd":
                sync(device)
                a = time.perf_counter()
                with torch.no_grad():
                    fn()
                sync(device)
            elif mode == "bwd":
                o = outs(fn())
                sync(device)
                a = time.perf_counter()
                torch.autograd.grad(o, leaves, grads, allow_unused=True)
                sync(device)
            else:
                sync(device)
                a = time.perf_counter()
                torch.autograd.grad(outs(fn()), leaves, grads, allow_unused=True)
                sync(device)
            ts.append(time.perf_counter() - a)
        res[mode] = ts
    return res


def _install_emulator() -> str | None:
    """Route the dry run's ``backend="cuda"`` to the CUDA emulator when it is already built (building it
    takes minutes on a small machine: the dry run does not); else the reason it is left out."""
    from megalodon_kernels.cuda import build

    try:
        jobs = build._compile_jobs(build.cache_dir() / "emu" / "obj")
        missing = [src.name for src, _, obj in jobs if not obj.exists()]
    except Exception as exc:
        return f"the CUDA emulator's build could not be checked ({type(exc).__name__}: {exc})"
    if missing:
        return (f"the CUDA emulator is not built ({len(missing)} sources to compile): build it once with "
                "python -c 'from megalodon_kernels.cuda import build; build.load_emulator(verbose=True)'")
    from megalodon_kernels.bench import emulated_cuda

    emulated_cuda.install(verbose=False)
    return None


def step_ops(run: Run, limit_s: float) -> dict:
    from megalodon_kernels.bench import roofline
    from megalodon_kernels.autotune.shapes import OP_SHAPES

    end = time.perf_counter() + limit_s
    set_name, s = shape_set(run)
    dtype_name = s.dtypes[0]
    dtype = getattr(torch, dtype_name)
    dev = run.device
    no_cuda = None
    if dev.type != "cuda":
        no_cuda = _install_emulator()
    peak = run.results.get("env", {}).get("data", {}).get("d2d_bytes_per_s")
    budget, min_reps, max_reps = (0.05, 3, 50) if dev.type == "cuda" else (0.0, 1, 1)
    rows, skipped, not_reached = [], {}, []
    # cema at the probe shape first (issue 40's figure), the 7B shapes after the op rows (it reuses them)
    cema = _cema_points(run, s, rows, end, peak, (budget, min_reps, max_reps), probe=True)
    # fftconv at 8192 rows, L 1K-16K, bf16 and fp32 (issue 39's rows), within its own share of the
    # step's time: the loop below may use up the rest
    from megalodon_kernels.bench import fftconv_rows

    conv_end = min(end, time.perf_counter() + min(FFTCONV_ROWS_S, FFTCONV_ROWS_SHARE * limit_s))
    conv_rows, conv_skipped, conv_summary = fftconv_rows.measure(
        dev, peak, conv_end, _time_case, no_cuda, budget, min_reps, min(max_reps, 20))
    # every op at the shortest length first: when the time runs out, the longer lengths are what is missing
    for L in s.lengths:
        for op in OPS:
            make = importlib.import_module(f"megalodon_kernels.bench.test_{op}").make
            backends_of = importlib.import_module(f"megalodon_kernels.ops.{op}").BACKENDS
            shp = dict(OP_SHAPES[op](s, L))
            for backend in BACKENDS:
                if time.perf_counter() > end:
                    not_reached.append(f"{op} L={L} {backend}")
                    continue
                torch.manual_seed(0)
                try:
                    case = make(shp, dtype, dev)
                    why = [no_cuda] if backend == "cuda" and no_cuda else backends_of.reasons(backend, case.inputs)
                    if why:
                        skipped[f"{op} L={L} {backend}"] = "; ".join(why)
                        continue
                    t = _time_case(case.call[backend], case.leaves, dev, budget, min_reps, max_reps)
                except Exception as exc:
                    skipped[f"{op} L={L} {backend}"] = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
                    continue
                finally:
                    case = None
                    if dev.type == "cuda":
                        torch.cuda.empty_cache()
                ideal = roofline.ideal(op, shp, dtype_name)
                for mode in MODES:
                    ts = sorted(t[mode])
                    nb, fl = ideal["fwd" if mode == "fwd" else "bwd"]
                    if mode == "fwd+bwd":
                        nb, fl = nb + ideal["fwd"][0], fl + ideal["fwd"][1]
                    med = statistics.median(ts)
                    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]  # noqa: E731
                    rows.append(dict(op=op, provider=backend, kind="library", mode=mode, L=L, shape=shp,
                                     shape_set=set_name, dtype=dtype_name, device=dev.type, median=med, min=ts[0],
                                     p20=q(0.2), p80=q(0.8), reps=len(ts), first_call_s=t["first_call_s"],
                                     ideal_bytes=nb, ideal_flops=fl, bytes_per_s=nb / med,
                                     of_peak=(nb / med / peak) if peak else None))
    seven_b = _cema_points(run, s, rows, end, peak, (budget, min_reps, max_reps), probe=False)
    cema = {key: (cema[key] + seven_b[key]) if key == "points" else {**cema[key], **seven_b[key]} for key in cema}
    data = dict(shape_set=set_name, dtype=dtype_name, rows=rows, skipped=skipped, not_reached=not_reached,
                peak_bytes_per_s=peak, cema=cema, fftconv_rows=conv_rows, fftconv_rows_skipped=conv_skipped)
    (run.out / "ops.json").write_text(json.dumps(data, indent=1))
    summary = [f"shape set {set_name} ({dtype_name}): {len(rows) // 3} op x L x backend points timed, "
               f"{len(skipped)} refused or failed, {len(not_reached)} not reached in the step's time"]
    best = {}
    for r in rows:
        if r["mode"] == "fwd+bwd" and r["L"] == max(s.lengths):
            if r["op"] not in best or r["median"] < best[r["op"]]["median"]:
                best[r["op"]] = r
    for op, r in best.items():
        frac = f", {r['of_peak'] * 100:.0f}% of the copy peak" if r["of_peak"] else ""
        summary.append(f"  {op:<15} fwd+bwd L={r['L']}: best {r['provider']:<6} {r['median'] * 1e3:8.3f} ms, "
                       f"{r['bytes_per_s'] / 1e9:7.3g} GB/s ideal bytes{frac}")
    summary += cema_summary(cema)
    summary.append(f"fftconv at many rows (bench/fftconv_rows.py; {len(conv_skipped)} points refused or not "
                   "reached, reasons in ops.json):")
    summary += conv_summary
    every_skip = {**skipped, **conv_skipped}
    errors = [k for k, v in every_skip.items() if v.startswith("ERROR")]
    summary += [f"  ERROR {k}: {every_skip[k][6:120]}" for k in errors[:3]]
    return dict(summary=summary, files=["ops.json"], data=data, failed=bool(errors))


#: cema's own rows (issue 40): the H100 probe's shape (bench/results/gpu/h100_run1_probe.txt, fp32:
#: torch 3.35 / 11.0 ms there) and the set's paper-7B shapes, each backend and ``auto``
CEMA_PROBE = {"B": 2, "D": 256, "N": 16, "L": 4096}
#: auto last: at the probe it is timed after the backend it resolves to has run warm (in the H200's
#: run 4, timed first, auto (cuda) took 0.533 ms forward against 0.286 for the cuda row timed after it)
CEMA_PROVIDERS = ("cuda", "triton", "torch", "auto")


def _cema_points(run: Run, s, rows: list, end: float, peak, reps, probe: bool) -> dict:
    """{"points": [...], "skipped": {...}}: cema forward, backward and forward+backward per provider at the
    probe shape (fp32; ``probe``) or at the set's shapes (its dtype; the backends' times there are the op
    rows, only ``auto`` is timed again), each with ``auto``'s resolved backend, the ratio to the torch
    backend and the multiple of the bandwidth floor (ideal bytes at the measured copy bandwidth)."""
    from megalodon_kernels.autotune.shapes import OP_SHAPES
    from megalodon_kernels.bench import roofline
    from megalodon_kernels.bench.test_cema import make
    from megalodon_kernels.ops.cema import BACKENDS as cema_backends

    dev = run.device
    probe_shape = CEMA_PROBE if dev.type == "cuda" else {"B": 1, "D": 8, "N": 4, "L": 64}
    shapes = [("probe", probe_shape, "float32")] if probe else [
        (f"7B L={L}", dict(OP_SHAPES["cema"](s, L)), s.dtypes[0]) for L in s.lengths]
    points, skipped = [], {}
    for name, shp, dtype_name in shapes:
        dtype = getattr(torch, dtype_name)
        ideal = roofline.ideal("cema", shp, dtype_name)
        times = {}
        for provider in CEMA_PROVIDERS:
            timed = [r for r in rows if name != "probe" and r["op"] == "cema" and r["provider"] == provider
                     and r["shape"] == shp]
            if timed:
                times[provider] = {r["mode"]: r["median"] for r in timed}
                continue
            if time.perf_counter() > end:
                skipped[f"{name} {provider}"] = "not reached in the step's time"
                continue
            torch.manual_seed(0)
            try:
                case = make(shp, dtype, dev)
                if provider != "auto":
                    why = cema_backends.reasons(provider, case.inputs)
                    if why:
                        skipped[f"{name} {provider}"] = "; ".join(why)
                        continue
                else:
                    chosen = cema_backends.select("auto", case.inputs, device=dev, dtype=dtype).name
                t = _time_case(case.call[provider], case.leaves, dev, reps[0], reps[1], reps[2])
                times[provider] = {mode: statistics.median(t[mode]) for mode in MODES}
            except Exception as exc:
                skipped[f"{name} {provider}"] = f"ERROR {type(exc).__name__}: {str(exc)[:300]}"
            finally:
                case = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            if provider == "auto" and "auto" in times:
                times["auto"]["chosen"] = chosen
        form = _triton_cema_form(shp, dtype, dev)
        for provider, t in times.items():
            runs_triton = provider == "triton" or t.get("chosen") == "triton"
            for mode in MODES:
                nb = ideal["fwd"][0] if mode == "fwd" else ideal["bwd"][0] + (ideal["fwd"][0] if mode == "fwd+bwd" else 0)
                torch_t = times.get("torch", {}).get(mode)
                floor = nb / peak if peak else None
                points.append(dict(shape_name=name, shape=shp, dtype=dtype_name, provider=provider,
                                   chosen=t.get("chosen"), triton_form=form if runs_triton else None,
                                   mode=mode, median=t[mode], ideal_bytes=nb,
                                   vs_torch=(torch_t / t[mode]) if torch_t else None,
                                   of_peak=(floor / t[mode]) if floor else None,
                                   floor_multiple=(t[mode] / floor) if floor else None))
    return dict(points=points, skipped=skipped)


def _triton_cema_form(shp: dict, dtype, dev) -> str:
    """Which form the Triton cema runs at this shape with its default config: "chunked C=<chunk>"
    (ops/cema/triton_chunked.py) or "fft" (the FFT convolution)."""
    from megalodon_kernels.ops.cema import triton_impl

    x = torch.empty(0, shp["D"], 1, dtype=dtype)
    p = torch.empty(shp["D"], shp["N"])
    cfg = triton_impl.DEFAULT_CONFIG
    return f"chunked C={cfg['chunk']}" if triton_impl.chunked_form(x, p, cfg) else "fft"


def cema_summary(cema: dict) -> list[str]:
    """One line per (shape, provider): fwd / bwd / fwd+bwd ms, x torch, multiple of the bandwidth floor."""
    lines = []
    by = {}
    for p in cema.get("points", []):
        by.setdefault((p["shape_name"], p["provider"]), {})[p["mode"]] = p
    for (name, provider), m in by.items():
        f, b, fb = (m.get(k) for k in MODES)
        chosen = f" ({f['chosen']})" if f and f.get("chosen") else ""
        cols = " / ".join(f"{x['median'] * 1e3:.3f}" if x else "-" for x in (f, b, fb))
        ratio = f", {fb['vs_torch']:.1f}x torch" if fb and fb.get("vs_torch") else ""
        floors = ", floor x " + "/".join(f"{x['floor_multiple']:.0f}" if x and x.get("floor_multiple") else "-"
                                         for x in (f, b))
        # the fraction of the measured copy bandwidth the ideal bytes reach, forward and forward+backward
        bw = ", copy BW " + "/".join(f"{100 * x['of_peak']:.1f}%" if x and x.get("of_peak") else "-" for x in (f, fb))
        form = f" [{f['triton_form']}]" if f and f.get("triton_form") else ""
        lines.append(f"  cema {name:<10} {provider + chosen:<13} fwd/bwd/both {cols} ms{ratio}{floors}{bw}{form}")
    return lines


# ------------------------------------------------------------------------------------ 6. model
#: what torch's profiler library (Kineto) writes to stderr from C++ at every start and stop, at any
#: KINETO_LOG_LEVEL: progress markers, not messages
_KINETO_MARKERS = ("USDT:", "STAGE:")


@contextlib.contextmanager
def _without_kineto_markers():
    """Runs the block with file descriptor 2 sent to a temporary file, then writes back to stderr
    every line but Kineto's markers: warnings and errors printed meanwhile still show."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(_KINETO_MARKERS)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def _gemm_share(model, tokens, device) -> float | None:
    """1 - GEMM time / all op time of one training step, from the torch profiler (device time on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(BENCH_DIR))
    from cpu_step import GEMM_OPS

    from megalodon_kernels.bench.vs_transformer import step

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _without_kineto_markers(), profile(activities=acts) as prof:
        step(model, tokens)
        sync(device)
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    evs = prof.key_averages()
    total = sum(getattr(e, key, 0) for e in evs)
    gemm = sum(getattr(e, key, 0) for e in evs if e.key in GEMM_OPS)
    return (total - gemm) / total if total else None


def _within(end: float, notes: list, label: str, measure):
    """``measure()`` if the step's time (``end``, perf_counter) is not over, else None with a note;
    an exception becomes a note too, so one failed measurement does not end the step."""
    if time.perf_counter() > end:
        notes.append(f"{label}: not reached in the step's time")
        return None
    try:
        return measure()
    except Exception as exc:
        notes.append(f"{label}: ERROR {type(exc).__name__}: {str(exc)[:200]}")
        return None



def step_model(run: Run, limit_s: float) -> dict:
    from megalodon_kernels.bench import vs_transformer as vt

    end = time.perf_counter() + limit_s
    dev = run.device
    if dev.type == "cuda":
        points, steps, ctx, new = (4096, 16384, 65536), 3, (4096, 16384, 65536), 32
    else:
        points, steps, ctx, new = (128,), 1, (32,), 2
    train, decode, notes = [], [], []
    for tokens in points:
        for kind in ("megalodon", "transformer"):
            r = _within(end, notes, f"train {kind} {tokens}", lambda: vt.measure(
                kind, 1, tokens, steps, dev, max_step_s=max(1.0, end - time.perf_counter())))
            if r is not None:
                r["tokens_per_s"] = tokens / r["step_s"] if r["step_s"] else None
                train.append(r)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    share = None
    if time.perf_counter() < end:
        try:
            model = vt.build("megalodon", dev)
            tok = torch.randint(0, vt.VOCAB, (1, points[0] + 1), device=dev)
            vt.step(model, tok)
            share = _gemm_share(model, tok, dev)
            del model
        except Exception as exc:
            notes.append(f"non-GEMM share: ERROR {type(exc).__name__}: {str(exc)[:200]}")
    for context in ctx:
        for kind in ("megalodon", "transformer"):
            r = _within(end, notes, f"decode {kind} at {context}", lambda: vt.decode_rate(kind, context, new, dev))
            if r is not None:
                decode.append(r)
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    data = dict(train=train, ratios=vt.ratios(train), non_gemm_share=share, decode=decode, notes=notes)
    (run.out / "model.json").write_text(json.dumps(data, indent=1))
    summary = []
    by = {(r["kind"], r["tokens"]): r for r in train}
    for tokens in points:
        m, t = by.get(("megalodon", tokens)), by.get(("transformer", tokens))
        cell = lambda r: (f"{r['tokens_per_s']:9.0f} tok/s {r['peak_bytes'] / 2**20:7.0f} MiB"  # noqa: E731
                          if r and r.get("tokens_per_s") else "        -")
        summary.append(f"  train {tokens:>6} tokens: megalodon {cell(m)} | transformer {cell(t)}")
    if share is not None:
        summary.append(f"  megalodon non-GEMM share of the step at {points[0]} tokens: {share:.2f}")
    dby = {(r["kind"], r["context"]): r for r in decode}
    for c in ctx:
        m, t = dby.get(("megalodon", c)), dby.get(("transformer", c))
        f = lambda r: f"{r['tokens_per_s']:8.1f} tok/s" if r else "       -"  # noqa: E731
        summary.append(f"  decode after {c:>6} tokens: megalodon {f(m)} | transformer {f(t)}")
    summary += ["  " + n for n in notes[:4]]
    return dict(summary=summary, files=["model.json"], data=data, failed=any("ERROR" in n for n in notes))


# ------------------------------------------------------------------------------------ 7. autotune
def step_autotune(run: Run, limit_s: float) -> dict:
    set_name = shape_set(run)[0] if run.device.type == "cuda" else "cpu"
    folder = run.out / "autotune"
    # The table is written after every op, so the ops go in the order a short budget should keep them:
    # the slowest to tune (attention: seconds per candidate at the paper shape) last.
    order = ["cema", "fftconv", "cema_kernel", "ema_hidden", "timestep_norm", "dropkey_softmax", "rotary",
             "attention"]
    args = ["--shapes", set_name, "--ops", *order, "--dtypes", "bfloat16", "--budget", "0.02", "--out", str(folder)]
    if run.device.type != "cuda":
        args = ["--shapes", "cpu", "--ops", "rotary", "--dtypes", "float32", "--budget", "0.002", "--out", str(folder)]
    rc, text = run_cmd(run, [sys.executable, "-m", "megalodon_kernels.autotune", "regenerate", *args],
                       "autotune.txt", limit_s)
    tables = sorted(folder.glob("*.json")) if folder.exists() else []
    files = ["autotune.txt"]
    summary = []
    for t in tables:
        entries = json.loads(t.read_text()).get("entries", {})
        shown = run_cmd(run, [sys.executable, "-m", "megalodon_kernels.autotune", "show", "--table", str(t)],
                        f"autotune_{t.stem}.txt", 60)[1]
        files += [f"autotune/{t.name}", f"autotune_{t.stem}.txt"]
        summary.append(f"{len(entries)} entries in autotune/{t.name} (shown in autotune_{t.stem}.txt)")
        del shown
    wrote = re.findall(r"\[(\w+)\] wrote (\d+)", text)
    if rc is None:
        summary.append(f"stopped at its time limit after {len(wrote)} op(s): the table keeps what was tuned")
    elif rc != 0:
        summary.append(f"exit status {rc}: see autotune.txt")
    if not tables:
        summary.append("no table written")
    return dict(summary=summary, files=files, data=dict(rc=rc, ops=wrote, tables=[t.name for t in tables]),
                failed=(rc not in (0, None)) or not tables)
