"""python -m megalodon_kernels.bench report <pytest-benchmark json> [--out DIR]"""
import sys

from .report import main as report_main

USAGE = "usage: python -m megalodon_kernels.bench report <pytest-benchmark json> [--out DIR] [--no-triton-bytes]"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "report":
        print(USAGE, file=sys.stderr)
        return 2
    return report_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
