"""python -m megalodon_kernels.bench report|gpu ...

    report <pytest-benchmark json> [--out DIR] [--no-triton-bytes]   markdown + plots of a bench/ run
    gpu --out DIR [--budget-s 480] [--dry] [--steps ...]              the GPU acceptance run (bench/gpu_run.py)
"""
import sys

USAGE = ("usage: python -m megalodon_kernels.bench report <pytest-benchmark json> [--out DIR] [--no-triton-bytes]\n"
         "       python -m megalodon_kernels.bench gpu --out DIR [--budget-s 480] [--dry] [--steps STEP ...]")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(USAGE)
        print("\n  report  markdown tables and plots of a pytest-benchmark run of bench/ (its --help: the options)"
              "\n  gpu     the GPU acceptance run, or its CPU rehearsal with --dry (its --help: the options)")
        return 0
    if argv and argv[0] == "report":
        from .report import main as report_main

        return report_main(argv[1:])
    if argv and argv[0] == "gpu":
        from .gpu_run import main as gpu_main

        return gpu_main(argv[1:])
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
