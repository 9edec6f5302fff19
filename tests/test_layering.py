"""The package's import layering (docs/design.md, "Layering"), checked on the source itself.

Every ``import`` statement of every module is read with ``ast``, including imports inside functions
(a lazy import is still a dependency), and resolved to a ``megalodon_kernels.*`` module name; so is
every import by name (``importlib.import_module("megalodon_kernels....")``, ``__import__``, an
f-string's fixed prefix), which cannot dodge the rules. Across layers only public names are used:
``from <other layer> import _name`` and ``<other layer's module>._name`` fail too. The rules are
the ones a newcomer reads in docs/design.md; a new file that breaks one fails here with the file,
the line and the rule.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "megalodon_kernels"
STDLIB = set(sys.stdlib_module_names)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PKG, *parts])


def _sources() -> dict[str, Path]:
    found = {}
    for top in ("ops", "autotune", "reference", "model", "cuda", "bench"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "__pycache__" not in path.parts:
                found[_module_name(path)] = path
    for name in ("__init__.py", "__main__.py", "selfcheck.py"):
        found[_module_name(ROOT / name)] = ROOT / name
    return found


SOURCES = _sources()


#: functions that import a module named by their first argument
_BY_NAME = {"import_module", "__import__", "find_spec"}


def _named_module(node: ast.Call) -> str | None:
    """The module an import-by-name call names, when its first argument is a literal or an
    f-string (its fixed prefix up to the first placeholder, to the last whole name); else None."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in _BY_NAME or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = arg.value
    elif isinstance(arg, ast.JoinedStr):
        text = ""
        for part in arg.values:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                text = text.rsplit(".", 1)[0] if "." in text else ""
                break
            text += part.value
    else:
        return None
    return text if text == PKG or text.startswith(PKG + ".") else None


def _imports(module: str, path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, imported module, imported names) for every import in the file, by statement or by name."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            target = _named_module(node)
            if target is not None:
                out.append((node.lineno, target, ()))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = tuple(a.name for a in node.names)
            # ``from . import x`` imports the submodule x when there is one.
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in SOURCES]
            out += [(node.lineno, s, ()) for s in subs] or [(node.lineno, target, names)]
    return out


IMPORTS = {m: _imports(m, p) for m, p in SOURCES.items()}


def _inside(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


OPS = f"{PKG}.ops"
TUNING = f"{PKG}.autotune.tuning"
AUTOTUNE_RUNTIME = [f"{PKG}.autotune.{m}" for m in ("registry", "cache", "device", "shapes", "gpu_defaults")]


def _violations(sources, forbidden, allow=()):
    bad = []
    for module in sources:
        for line, target, _ in IMPORTS[module]:
            if _inside(target, *forbidden) and not _inside(target, *allow):
                bad.append(f"{SOURCES[module].relative_to(ROOT)}:{line} imports {target}")
    return bad


def _modules(prefix: str) -> list[str]:
    return [m for m in SOURCES if _inside(m, prefix)]


def test_the_sources_were_found():
    # A rule over an empty set would pass vacuously.
    for top in ("ops", "autotune", "reference", "model", "cuda", "bench"):
        assert _modules(f"{PKG}.{top}"), top
    assert any(_inside(t, OPS) for m in _modules(f"{PKG}.model") for _, t, _ in IMPORTS[m])


def test_ops_import_no_tooling_reference_or_model():
    bad = _violations(_modules(OPS), [f"{PKG}.bench", TUNING, f"{PKG}.autotune.__main__",
                                      f"{PKG}.reference", f"{PKG}.model", f"{PKG}.selfcheck"])
    assert not bad, "ops must not import tooling, references or the model:\n" + "\n".join(bad)


def _used_names(path: Path) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}


def _bound_names(path: Path, lineno: int) -> list[str]:
    """The names an import statement at ``lineno`` binds (its aliases)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno == lineno:
            return [(a.asname or a.name).split(".")[0] for a in node.names]
    return []


def test_imports_by_name_are_seen():
    # the rules below would pass vacuously if imports by name were not read
    def found(code: str) -> list[str]:
        return [_named_module(n) for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call)]

    assert found('importlib.import_module("megalodon_kernels.ops.cema.cuda_impl")') == [f"{OPS}.cema.cuda_impl"]
    assert found('import_module(f"megalodon_kernels.ops.{op}.cuda_impl")') == [OPS]
    assert found('__import__("megalodon_kernels.model")') == [f"{PKG}.model"]
    assert found('importlib.import_module(path)') == [None]
    assert found('importlib.import_module("numpy")') == [None]


def _layer(module: str) -> str:
    """The top folder of a module of the package (ops, autotune, cuda, model, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_reads(module: str) -> list[tuple[int, str, str, str]]:
    """(line, other layer's module, private name, how) for each private name ``module`` reads
    from another layer."""
    path = SOURCES[module]
    out, aliases = [], {}  # aliases: local name -> the other layer's module it is bound to
    for line, target, names in IMPORTS[module]:
        if not _inside(target, PKG) or _layer(target) in ("", _layer(module)):
            continue
        out += [(line, target, n, "imports") for n in names if _private(n) and f"{target}.{n}" not in SOURCES]
        for bound in _bound_names(path, line):
            aliases[bound] = target
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            out.append((node.lineno, aliases[node.value.id], node.attr, "reads"))
    return out


#: the runtime layers (tooling, bench and the CLIs, reaches into kernels by their private names to
#: compile and time them)
RUNTIME = [m for m in SOURCES if _layer(m) in ("ops", "cuda", "model", "reference")
           and m != f"{PKG}.cuda.__main__"] + AUTOTUNE_RUNTIME


def test_no_private_names_across_layers():
    """A runtime layer reads another layer's public names only: ``from <module of another layer>
    import _x`` and ``<alias of such a module>._x`` are refused (a module named with an
    underscore, such as ops/_packing.py, is shared and may be imported; its own underscore names
    are not)."""
    bad = [f"{SOURCES[module].relative_to(ROOT)}:{line} {how} {name} from {target}"
           for module in RUNTIME for line, target, name, how in _private_reads(module)]
    assert not bad, "another layer's private names:\n" + "\n".join(bad)


def test_no_op_imports_another_ops_private_names_or_package_for_a_side_effect():
    bad = []
    for module in _modules(OPS):
        if module == OPS:
            continue  # ops/__init__.py re-exports every op: that is its job
        mine = module.split(".")[2]
        used = None
        for line, target, names in IMPORTS[module]:
            if not _inside(target, OPS) or target.count(".") < 2:
                continue
            other = target.split(".")[2]
            if other.startswith("_") or other == mine or other == "dropkey_rule":
                continue  # shared ops-level modules (ops/_checks.py, ...) and the op's own files
            where = f"{SOURCES[module].relative_to(ROOT)}:{line}"
            private = [n for n in names if n.startswith("_")]
            if private:
                bad.append(f"{where} imports private {', '.join(private)} from {target}")
            used = _used_names(SOURCES[module]) if used is None else used
            unused = [n for n in _bound_names(SOURCES[module], line) if n not in used]
            if unused:
                bad.append(f"{where} imports {', '.join(unused)} from {target} without using it (a side effect)")
    assert not bad, "an op may use another op's public names only, and only to use them:\n" + "\n".join(bad)


def test_autotune_runtime_imports_no_op_and_no_tuning_tool():
    bad = _violations(AUTOTUNE_RUNTIME, [OPS, TUNING, f"{PKG}.reference", f"{PKG}.model", f"{PKG}.bench"])
    assert not bad, "the autotune runtime runs under every op call:\n" + "\n".join(bad)


def test_references_import_numpy_and_the_standard_library_only():
    bad = []
    for module in _modules(f"{PKG}.reference"):
        for line, target, _ in IMPORTS[module]:
            top = target.split(".")[0]
            if not (top in STDLIB or top == "numpy" or _inside(target, f"{PKG}.reference")):
                bad.append(f"{SOURCES[module].relative_to(ROOT)}:{line} imports {target}")
    assert not bad, "\n".join(bad)


def test_model_sits_on_the_ops_only():
    bad = _violations(_modules(f"{PKG}.model"), [f"{PKG}.autotune", f"{PKG}.bench", f"{PKG}.reference",
                                                  f"{PKG}.cuda"])
    assert not bad, "\n".join(bad)


def test_cuda_loader_imports_nothing_above_it():
    bad = _violations(_modules(f"{PKG}.cuda"), [OPS, f"{PKG}.model", f"{PKG}.autotune", f"{PKG}.bench",
                                                 f"{PKG}.reference"])
    assert not bad, "\n".join(bad)


def test_autotune_never_imports_the_model():
    bad = _violations(_modules(f"{PKG}.autotune"), [f"{PKG}.model"])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["model", "ops", "autotune", "cuda"])
def test_no_import_cycles_between_modules(package):
    """Module-level and lazy imports alike: a cycle means two files that cannot be read alone."""
    mods = _modules(f"{PKG}.{package}")
    graph = {m: {t for _, t, _ in IMPORTS[m] if t in SOURCES and t != m and not m.startswith(t + ".")}
             for m in mods}
    done, stack = set(), []

    def visit(m):
        if m in stack:
            cycle = stack[stack.index(m):] + [m]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if m in done:
            return
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            visit(t)
        stack.pop()
        done.add(m)

    for m in mods:
        visit(m)
