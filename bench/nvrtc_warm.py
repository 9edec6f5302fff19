"""Compile every CUDA kernel instantiation for one arch, one process per core, into the NVRTC disk
cache (so a timed session does not pay the compiles: the flash-attention ones take ~10-30 s each alone).

    python bench/nvrtc_warm.py [--arch 90] [--one-per-header] [--json]

``--arch`` defaults to the current GPU's; without a GPU it must be given (NVRTC compiles for any
sm_XX offline). ``--one-per-header`` compiles the first non-flash instantiation of each header only
(the dry run of ``python -m megalodon_kernels.bench gpu``). ``--json`` ends with one line
``JSON{...}``: arch, kernels, compiled, workers, seconds, origins (nvrtc / cache / prebuilt counts),
failed [(name, reason)].
"""
import argparse
import json
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed


def one(header, name, arch):
    from megalodon_kernels.cuda import nvrtc

    t = time.perf_counter()
    try:
        c = nvrtc.compile_kernel(header, name, arch)
        return name, time.perf_counter() - t, c.origin, None
    except Exception as e:
        return name, time.perf_counter() - t, None, f"{type(e).__name__}: {str(e)[:300]}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=None, help="compute capability as 80, 90, ... (default: this GPU's)")
    ap.add_argument("--one-per-header", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    from megalodon_kernels.cuda import instances

    arch = a.arch
    if arch is None:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device: give --arch (e.g. --arch 90)")
        major, minor = torch.cuda.get_device_capability()
        arch = 10 * major + minor
    ks = instances.all_kernels(arch)
    if a.one_per_header:
        seen = {}
        for k in ks:
            if "flash" not in k.header:
                seen.setdefault(k.header, k)
        ks = list(seen.values())
    ks.sort(key=lambda k: "flash" not in k.header)  # longest first
    t0 = time.perf_counter()
    failed, origins = [], Counter()
    workers = max(1, min(os.cpu_count() or 1, len(ks)))
    with ProcessPoolExecutor(max_workers=workers) as ex:
        futs = [ex.submit(one, k.header, k.name, arch) for k in ks]
        for f in as_completed(futs):
            name, dt, origin, err = f.result()
            if err:
                failed.append((name, err))
                print("FAIL", name, err, flush=True)
            else:
                origins[origin] += 1
    dt = time.perf_counter() - t0
    print(f"nvrtc warm: {len(ks)} instantiations for sm_{arch} in {dt:.1f}s on {workers} processes, "
          f"{len(failed)} failed ({dict(origins)})")
    if a.json:
        print("JSON" + json.dumps(dict(arch=arch, kernels=len(ks), compiled=len(ks) - len(failed), workers=workers,
                                       seconds=dt, origins=dict(origins), failed=failed)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
