"""Every code block of README.md and docs/*.md runs as a reader would run it (issue 44).

``python`` blocks are executed, each in a fresh namespace (a block copied alone must work: its own
imports), in a temporary working directory, in file order. ``bash`` blocks, and the lines of
unlabelled blocks that start with ``python`` or ``torchrun``, are checked without being run: the
module or script each command names exists, each ``pip install`` of this project names extras
pyproject.toml defines. The README's set-up block, main job and test command are what CI itself
runs (.ci/run). Unlabelled blocks are otherwise text: diagrams, formulas, folder trees; so are
indented blocks, which are not read at all (commands go in fenced blocks).

A block that cannot run here says why, in an HTML comment on the line right above its fence
(invisible on the rendered page); several may be stacked:

    <!-- doc-test: continues -->              run in the namespace the file's previous python block left
    <!-- doc-test: slow: REASON -->           only with --stress (the long form of the suite)
    <!-- doc-test: gpu: REASON -->            only where torch.cuda.is_available(); carries the gpu marker
    <!-- doc-test: skip: REASON -->           never here (several processes, a fragment of an example, ...)

Pages other engineers own get the same marks from :data:`MARKS` below rather than in their text.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("continues", "slow", "gpu", "skip")
_MARK = re.compile(r"<!--\s*doc-test:\s*(\w+)\s*(?::\s*(.*?))?\s*-->\s*$")

#: marks for blocks of pages this file's author may not edit, by (page, the block's first line)
MARKS = {
    ("docs/distributed.md", "from torch.distributed.device_mesh import init_device_mesh"):
        [("skip", "needs torchrun with several processes (and CUDA as written): tests/test_distributed.py "
                  "and tests/test_fsdp.py run the same calls on a gloo mesh")],
    ("docs/huggingface.md", "out = model.generate(ids, max_new_tokens=32, return_dict_in_generate=True)"):
        [("skip", "a fragment: `model` and `ids` come from the page's text; tests/test_hf.py runs the "
                  "continuation on every supported transformers")],
}

#: blocks that read a folder the page assumes the reader has: made before the block runs (tmp cwd)
NEEDS_HF_FOLDER = {("docs/huggingface.md", 'import megalodon_kernels.model.hf  # registers model_type '
                                           '"megalodon" with the Auto classes')}


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marks: list = field(default_factory=list)  # [(kind, reason)]

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    def has(self, kind) -> str | None:
        return next((reason or "" for k, reason in self.marks if k == kind), None)


def blocks_of(path: Path) -> list[Block]:
    page = path.relative_to(ROOT).as_posix()
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\S*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        marks, j = [], i - 1
        while j >= 0 and _MARK.match(lines[j]):
            m = _MARK.match(lines[j])
            marks.insert(0, (m.group(1), m.group(2)))
            j -= 1
        end = next(k for k in range(i + 1, len(lines)) if lines[k].startswith(fence.group(1)))
        code = "\n".join(lines[i + 1:end]) + "\n"
        first = next((c for c in code.splitlines() if c.strip()), "")
        marks += MARKS.get((page, first), [])
        out.append(Block(page, i + 1, fence.group(2).lower(), code, marks))
        i = end + 1
    return out


BLOCKS = [b for p in PAGES for b in blocks_of(p)]
PYTHON = [b for b in BLOCKS if b.lang in ("python", "py")]
SHELL = [b for b in BLOCKS if b.lang in ("bash", "sh", "shell", "console", "")]


def test_every_mark_is_known_and_gives_a_reason():
    for b in BLOCKS:
        for kind, reason in b.marks:
            assert kind in KINDS, f"{b.id}: unknown doc-test mark {kind!r} (known: {KINDS})"
            assert kind == "continues" or (reason and len(reason) > 10), f"{b.id}: '{kind}' needs a reason"
    assert all(b.lang in ("python", "py", "bash", "sh", "shell", "console", "") for b in BLOCKS), \
        sorted({(b.id, b.lang) for b in BLOCKS if b.lang not in ("python", "bash", "")})
    known = {(b.page, next((c for c in b.code.splitlines() if c.strip()), "")) for b in BLOCKS}
    assert set(MARKS) | NEEDS_HF_FOLDER <= known, "a MARKS entry no longer matches a block"


# --- python blocks ---------------------------------------------------------------------------------

_NAMESPACES: dict[str, dict] = {}  # page -> the namespace its last python block left


def _params():
    for b in PYTHON:
        marks = []
        if b.has("gpu") is not None:
            marks.append(pytest.mark.gpu)
        yield pytest.param(b, id=b.id, marks=marks)


def _hf_folder(path: Path) -> None:
    """A tiny model saved as a transformers folder, as save_pretrained or the converter writes one."""
    import megalodon_kernels.model.hf as hf
    from megalodon_kernels.model import get_config

    hf.MegalodonForCausalLM(hf.MegalodonHFConfig.from_model_config(get_config("tiny"))).save_pretrained(path)


@pytest.mark.parametrize("block", list(_params()))
def test_python_block(block: Block, request, tmp_path, monkeypatch):
    if block.has("skip") is not None:
        pytest.skip(f"{block.id}: {block.has('skip')}")
    if block.has("gpu") is not None and not torch.cuda.is_available():
        pytest.skip(f"{block.id} needs an NVIDIA GPU: {block.has('gpu')}")
    if block.has("slow") is not None and not request.config.getoption("--stress"):
        pytest.skip(f"{block.id} is slow, run with --stress: {block.has('slow')}")
    monkeypatch.chdir(tmp_path)
    if (block.page, block.code.splitlines()[0]) in NEEDS_HF_FOLDER:
        _hf_folder(tmp_path / "path" / "to" / "megalodon-hf")
    if block.has("continues") is not None:
        if block.page not in _NAMESPACES:
            pytest.skip(f"{block.id} continues a block of {block.page} that did not run here")
        namespace = _NAMESPACES[block.page]
    else:
        namespace = {"__name__": "__doc_block__"}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small tensors; a second, busy core only adds waits
    try:
        exec(compile(block.code, block.id, "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
        if "torch.compile" in block.code:
            torch._dynamo.reset()  # the block's compiled graphs are not the later tests' business
    _NAMESPACES[block.page] = namespace


# --- shell blocks: what each command names exists ------------------------------------------------

def _extras() -> set[str]:
    """The extras' names in pyproject.toml (read by hand: tomllib is Python 3.11+, we support 3.10)."""
    text = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]", 1)[1]
    text = re.split(r"^\[", text, flags=re.M)[0]
    return set(re.findall(r"^([\w-]+)\s*=\s*\[", text, flags=re.M))


def _check_python(argv: list[str], where: str) -> None:
    if argv[:1] == ["-m"]:
        module = argv[1]
        if module == "megalodon_kernels" or module.startswith("megalodon_kernels."):
            spec = importlib.util.find_spec(module)
        else:
            spec = importlib.util.find_spec(module.split(".")[0])
        assert spec is not None, f"{where}: no module {module}"
    elif argv and argv[0].endswith(".py"):
        assert (ROOT / argv[0]).is_file(), f"{where}: no script {argv[0]} in the checkout"


def check_command(line: str, where: str) -> None:
    words = shlex.split(line, comments=True)
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):  # VAR=value prefixes
        words = words[1:]
    if not words:
        return
    cmd, args = words[0], words[1:]
    if cmd == "python":
        _check_python(args, where)
    elif cmd == "torchrun":
        script = next((a for a in args if a.endswith(".py")), None)
        assert script and (ROOT / script).is_file(), f"{where}: torchrun of no script in the checkout"
    elif cmd == "bash":
        assert (ROOT / args[0]).is_file(), f"{where}: no script {args[0]}"
    elif cmd == "pip":
        assert args[:1] in (["install"], ["download"]), f"{where}: pip {args[:1]}"
        for a in args[1:]:
            if args[0] == "install" and (a.startswith(".") or "megalodon" in a):
                # the package is not on a registry: a checkout, "." or /path/to/megalodon-kernels,
                # with or without extras
                m = re.match(r"^(?:\.|/[\w./-]*megalodon-kernels)(?:\[([\w,\s-]+)\])?$", a)
                assert m, f"{where}: pip install {a!r} does not install from the checkout"
                unknown = {e.strip() for e in (m.group(1) or "").split(",") if e.strip()} - _extras()
                assert not unknown, f"{where}: no extra {unknown} in pyproject.toml"
    else:
        raise AssertionError(f"{where}: test_docs does not know how to check {cmd!r}; teach check_command "
                             "or mark the block")


def _commands(block: Block):
    """(line number, command) of a shell block, continuation lines joined; of an unlabelled block
    only the lines that start with python or torchrun (the rest is text)."""
    pending, start = "", None
    for n, raw in enumerate(block.code.splitlines(), block.line + 1):
        line = raw.strip()
        if block.lang == "" and not pending and not line.startswith(("python ", "torchrun ")):
            continue
        if not pending and (not line or line.startswith("#")):
            continue
        start = start or n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        yield start, pending + line
        pending, start = "", None


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in SHELL])
def test_shell_block_names_what_exists(block: Block):
    if block.has("skip") is not None:
        pytest.skip(f"{block.id}: {block.has('skip')}")
    for n, command in _commands(block):
        if block.lang == "":
            # a synopsis: [--opt ...] and a|b alternatives are not shell syntax
            command = re.sub(r"\[[^\]]*\]|\|\S*", "", command)
        check_command(command, f"{block.page}:{n}")


def test_readme_keeps_what_ci_runs():
    """.ci/run installs exactly as the README's set-up block says and runs its main job and test command."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    setup = 'pip install torch==2.13.0\npip install -e ".[test]"\n'
    assert f"```bash\n{setup}```" in readme and setup in ci
    for command in ("python -m megalodon_kernels", "python -m pytest"):
        assert f"```bash\n{command}\n```" in readme and f"\n{command}\n" in ci


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
