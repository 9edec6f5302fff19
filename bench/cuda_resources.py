"""Resource table of every CUDA kernel (nvcc, offline) and run times in the CPU emulator.

    python -m megalodon_kernels.bench.cuda_resources [--arch 80 90] [--emulator]

Compiles the flash attention and dropkey_softmax instantiations of the launch descriptions with
``nvcc -cubin -arch=sm_XX -Xptxas -v`` (cuda/build.py; cached by source hash, no GPU needed) and
prints registers, spill bytes, static + worst-case dynamic shared memory against the per-block
limit; exit code 1 if any kernel spills or does not fit (every kernel through NVRTC: ``python -m
megalodon_kernels.cuda compile``). ``--emulator`` also times
each op's forward and backward in the SIMT emulator (CPU seconds; a functional check, not a
performance figure).
"""
from __future__ import annotations

import argparse
import sys
import time

from megalodon_kernels.cuda import build


def _family(kernel: str) -> str:
    return kernel.split("(")[0].split("<")[0].split("::")[-1].split()[-1]


def resource_rows(archs):
    from megalodon_kernels.ops.attention import cuda_impl as attention_cuda
    from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda

    rows = build.nvcc_resources_all(build.nvcc_sources(attention_cuda.KERNELS + dropkey_cuda.KERNELS), tuple(archs))
    fwd = max(attention_cuda.fwd_smem_bytes(e, D) for e, D in attention_cuda.FLASH)
    bwd = max(attention_cuda.bwd_smem_bytes(e, D) for e, D in attention_cuda.FLASH)
    return rows, {"flash_fwd_kernel": fwd, "flash_bwd_kv_kernel": bwd, "flash_bwd_q_kernel": bwd}


def emulator_times():
    import torch

    from megalodon_kernels.cuda.launch import EmulatorLauncher
    from megalodon_kernels.ops.attention import cuda_impl as attention_cuda
    from megalodon_kernels.ops.cema_kernel import cuda_impl as cema_cuda
    from megalodon_kernels.ops.dropkey_softmax import cuda_impl as dropkey_cuda
    from megalodon_kernels.ops.ema_hidden import cuda_impl as hidden_cuda
    from megalodon_kernels.ops.fftconv import cuda_impl as fftconv_cuda
    from megalodon_kernels.ops.rotary import cuda_impl as rotary_cuda, rotation_tables
    from megalodon_kernels.ops.timestep_norm import cuda_impl as tsn_cuda

    emu = EmulatorLauncher(build.load_emulator())
    g = torch.Generator().manual_seed(0)
    out = []

    def timed(name, shape, fn):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        out.append((name, shape, time.perf_counter() - t0, time.process_time() - c0))

    for dt in (torch.float32, torch.bfloat16):
        tag = str(dt).replace("torch.", "")
        s = torch.randn(2, 4, 64, 64, generator=g).to(dt)
        y = dropkey_cuda.softmax_fwd(emu, s, causal=True, dropkey_p=0.1, seed=1)
        timed(f"dropkey_softmax fwd {tag}", "(2,4,64,64)",
              lambda: dropkey_cuda.softmax_fwd(emu, s, causal=True, dropkey_p=0.1, seed=1))
        timed(f"dropkey_softmax bwd {tag}", "(2,4,64,64)", lambda: dropkey_cuda.softmax_bwd(emu, s, y, causal=True))
        x = torch.randn(2, 256, 4, 64, generator=g).to(dt)
        cos, sin = rotation_tables(torch.arange(256), 64, 10000.0, None, False, torch.float32)
        timed(f"rotary fwd {tag}", "(2,256,4,64)", lambda: rotary_cuda.rotary(emu, x, cos, sin, False))
        B, L, D, G = 2, 512, 64, 4
        x = torch.randn(B, L, D, generator=g).to(dt)
        args = (torch.ones(D), torch.zeros(D), torch.zeros(B, dtype=torch.int64), torch.zeros(B, G), torch.ones(B, G),
                torch.zeros(B, L, dtype=torch.bool), G, 1e-5)
        res = tsn_cuda.launch_fwd(emu, x, *args)
        timed(f"timestep_norm fwd {tag}", f"({B},{L},{D}) G={G}", lambda: tsn_cuda.launch_fwd(emu, x, *args))
        timed(f"timestep_norm bwd {tag}", f"({B},{L},{D}) G={G}",
              lambda: tsn_cuda.launch_bwd(emu, x, torch.zeros(B, G), torch.zeros(B, G), res[4], G))
        for L in (1024, 16384, 65536):  # one block up to 16384, the multi-pass FFT above
            x = torch.randn(1, 1, L, generator=g).to(dt)
            k = torch.randn(1, L, generator=g)
            timed(f"fftconv fwd {tag}", f"(1,1,{L})", lambda: fftconv_cuda.launch_fwd(emu, x, k))
            timed(f"fftconv bwd {tag}", f"(1,1,{L})", lambda: fftconv_cuda.launch_bwd(emu, x, x, k))
        B, D, N, L = 2, 16, 16, 4096
        x = torch.randn(B, D, L, generator=g).to(dt)
        p = torch.rand(D, N, generator=g)
        log_q = torch.complex(-torch.rand(D, N, generator=g) * 0.01, torch.rand(D, N, generator=g) * 3.0)
        gamma = torch.randn(D, N, dtype=torch.complex64, generator=g)
        hx = torch.randn(B, D, N, dtype=torch.complex64, generator=g)
        h, V, W = hidden_cuda.launch_fwd(emu, x, p, log_q, hx, weighted=True)
        timed(f"ema_hidden fwd {tag}", f"({B},{D},{L}) N={N}", lambda: hidden_cuda.launch_fwd(emu, x, p, log_q, hx, True))
        timed(f"ema_hidden bwd {tag}", f"({B},{D},{L}) N={N}",
              lambda: hidden_cuda.launch_bwd(emu, torch.ones_like(h), p, log_q, hx, V, W, L))
    k, b = cema_cuda.launch_fwd(emu, p, log_q, gamma, L, hx)
    timed("cema_kernel fwd float32", f"({B},{D},{L}) N={N}", lambda: cema_cuda.launch_fwd(emu, p, log_q, gamma, L, hx))
    timed("cema_kernel bwd float32", f"({B},{D},{L}) N={N}",
          lambda: cema_cuda.launch_bwd(emu, torch.ones_like(k), torch.ones_like(b), p, log_q, gamma, L, hx))
    q, k_, v = (torch.randn(1, 128, 2, 64, generator=g) for _ in range(3))
    kw = dict(scale=0.125, causal=True, chunk_size=None, block_causal=False, dropkey_p=0.1, seed=1, attn_fn="softmax")
    o, lse = attention_cuda.flash_fwd(emu, q, k_, v, **kw)
    timed("attention flash fwd float32", "(1,128,2,64)", lambda: attention_cuda.flash_fwd(emu, q, k_, v, **kw))
    timed("attention flash bwd float32", "(1,128,2,64)",
          lambda: attention_cuda.flash_bwd(emu, torch.ones_like(o), q, k_, v, o, lse, **kw))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="CUDA kernel resources (nvcc -Xptxas -v) and emulator run times")
    ap.add_argument("--arch", nargs="*", type=int, default=[80, 90], choices=sorted(build.SMEM_LIMIT))
    ap.add_argument("--emulator", action="store_true", help="also time every op in the CPU emulator")
    a = ap.parse_args(argv)
    rows, dyn = resource_rows(a.arch)
    print(f"{'kernel':<58} {'arch':<6} {'regs':>4} {'spill':>5} {'static':>7} {'dynamic':>8} {'total':>7} "
          f"{'limit':>7}  status")
    bad = 0
    for r in sorted(rows, key=lambda r: (r.source, _family(r.kernel), r.kernel, r.arch)):
        d = dyn.get(_family(r.kernel), 0)
        total = r.static_smem + d
        status = []
        if r.spill_stores or r.spill_loads:
            status.append("SPILLS")
        if total > build.SMEM_LIMIT[r.arch]:
            status.append("SMEM")
        bad += bool(status)
        name = r.kernel.split("(")[0].replace("void ", "").replace("mk::", "").replace("__nv_bfloat16", "bf16")
        print(f"{name:<58} sm_{r.arch:<3} {r.registers:>4} {r.spill_stores + r.spill_loads:>5} {r.static_smem:>7} "
              f"{d:>8} {total:>7} {build.SMEM_LIMIT[r.arch]:>7}  {', '.join(status) or 'ok'}")
    print(f"\n{len(rows)} kernel variants, {bad} flagged (dynamic = worst case of the launch description, "
          f"flash attention's tiles; every kernel through NVRTC: python -m megalodon_kernels.cuda compile)")
    if a.emulator:
        print(f"\n{'emulator run':<28} {'shape':<18} {'wall s':>8} {'cpu s':>8}")
        for name, shape, wall, cpu in emulator_times():
            print(f"{name:<28} {shape:<18} {wall:>8.3f} {cpu:>8.3f}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
