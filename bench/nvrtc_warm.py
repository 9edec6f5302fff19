"""Compile every CUDA kernel instantiation for this GPU's arch, one process per core (fills the NVRTC
disk cache before a timed session: the flash-attention instantiations take ~10-30 s each alone).

    python bench/nvrtc_warm.py
"""
import sys, time, os
from concurrent.futures import ProcessPoolExecutor, as_completed
import torch
from megalodon_kernels.cuda import instances, nvrtc

def one(k, arch):
    t = time.perf_counter()
    try:
        c = nvrtc.compile_kernel(k.header, k.name, arch)
        return k.name, time.perf_counter() - t, None
    except Exception as e:
        return k.name, time.perf_counter() - t, f"{type(e).__name__}: {str(e)[:300]}"

if __name__ == "__main__":
    major, minor = torch.cuda.get_device_capability()
    arch = 10 * major + minor
    ks = instances.all_kernels()
    # longest first (flash attention)
    ks.sort(key=lambda k: "flash" not in k.header)
    t0 = time.perf_counter()
    fails = 0
    with ProcessPoolExecutor(max_workers=os.cpu_count()) as ex:
        futs = [ex.submit(one, k, arch) for k in ks]
        for f in as_completed(futs):
            name, dt, err = f.result()
            if err: fails += 1; print("FAIL", name, err)
    print(f"nvrtc warm: {len(ks)} instantiations for sm_{arch} in {time.perf_counter()-t0:.1f}s, {fails} failed")
