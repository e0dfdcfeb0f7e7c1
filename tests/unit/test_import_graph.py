"""The package's import graph is a one-way street.

Layers, lowest first: ``hla_sp.config`` and ``hla_sp.kernels`` < ``hla_sp.ops`` <
``hla_sp.parallel`` < ``hla_sp.nn`` < ``hla_sp.hf`` < ``hla_sp.megatron_patch`` <
``hla_sp.launch``, whose subpackages are layered in turn (see ``LAYERS``).
A module may import its own layer or a lower one, never a higher one, not even
lazily inside a function or under ``TYPE_CHECKING``. The sources are read with
``ast``, each folder named by its import name as ``[tool.setuptools.package-dir]``
maps it (``kernels/`` is ``hla_sp.kernels``), so nothing is imported to check.

Print the edges between packages: ``python tests/unit/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # the dev extra brings tomli on 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]

# Lowest first; a module's layer is that of its longest matching prefix.
LAYERS: dict[str, int] = {
    "hla_sp.config": 0,
    "hla_sp.kernels": 0,
    "hla_sp.ops": 1,
    "hla_sp.parallel": 2,
    "hla_sp.nn": 3,
    "hla_sp.testing": 3,
    "hla_sp.hf": 4,  # the Hugging Face model: plain PyTorch over nn, no megatron
    "hla_sp.megatron_patch": 5,
    # launch/, by subpackage: the known errors and the extras' check; the flags, the
    # sections' base and TrainConfig, which holds one section from each owner below (each
    # owner's section module sits on this floor, so the owners can read TrainConfig); the
    # process groups and the job's failures; the data; the model; the checkpoints; the
    # checks across sections; a checkpoint out of the trainer (export, generate), which the
    # trainer's closing lines may name; the trainer; eval; the sweep; the console script
    # and the documented `python -m` modules.
    "hla_sp.launch": 6,
    "hla_sp.launch.config": 7,
    "hla_sp.launch.model.config": 7,
    "hla_sp.launch.train.config": 7,
    "hla_sp.launch.distributed.config": 7,
    "hla_sp.launch.data.config": 7,
    "hla_sp.launch.checkpoint.config": 7,
    "hla_sp.launch.distributed": 8,
    "hla_sp.launch.data": 9,
    "hla_sp.launch.model": 10,
    "hla_sp.launch.checkpoint": 11,
    "hla_sp.launch.checks": 12,
    "hla_sp.launch.export": 13,
    "hla_sp.launch.train": 14,
    "hla_sp.launch.eval": 15,
    "hla_sp.launch.sweep": 16,
    "hla_sp.launch.cli": 17,
    "hla_sp.launch.torchrun": 17,
    "hla_sp.launch.make_dataset": 17,
    "hla_sp.launch.ray_sweep": 17,
    "hla_sp": 18,  # the package facade (hla_sp/__init__.py) re-exports from below
}


def source_roots() -> dict[str, Path]:
    """Import name -> folder, from pyproject's package list and package-dir."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = tool.get("package-dir", {})
    roots = {}
    for pkg in tool["packages"]:
        folder = mapped.get(pkg)
        if folder is None:
            parent = next((p for p in mapped if pkg.startswith(p + ".")), None)
            if parent is None:
                folder = pkg.replace(".", "/")
            else:
                folder = mapped[parent] + "/" + pkg[len(parent) + 1 :].replace(".", "/")
        roots[pkg] = ROOT / folder
    return roots


def modules() -> dict[str, Path]:
    """Every module of the package: import name -> file."""
    out = {}
    for pkg, folder in source_roots().items():
        for f in sorted(folder.glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = f
    return out


def imports_of(name: str, path: Path) -> set[str]:
    """Absolute names of the hla_sp modules ``path`` imports, wherever the import sits."""
    is_pkg = path.stem == "__init__"
    base = name if is_pkg else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                parts = base.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                mod = ".".join(parts + ([mod] if mod else []))
            found.add(mod)
            # `from pkg import sub` imports the submodule sub
            found.update(f"{mod}.{a.name}" for a in node.names)
    known = modules()
    return {m for m in found if m in known and m != name}


def layer(module: str) -> tuple[str, int]:
    """The layer prefix that ``module`` belongs to, and its rank."""
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return best, LAYERS[best]


def edges() -> list[tuple[str, str]]:
    """(importer, imported) for every import between two modules of the package."""
    return sorted((a, b) for a, path in modules().items() for b in imports_of(a, path))


def test_roots_follow_package_dir() -> None:
    roots = source_roots()
    assert roots["hla_sp.kernels"] == ROOT / "kernels"
    assert roots["hla_sp.launch"] == ROOT / "launch"
    assert roots["hla_sp.megatron_patch"] == ROOT / "megatron_patch"
    mods = modules()
    assert "hla_sp.kernels.chunk" in mods and "hla_sp.ops.dispatch" in mods
    # the reader sees lazy imports: one known to sit inside a function
    assert "hla_sp.megatron_patch.specs" in imports_of(
        "hla_sp.megatron_patch.routing", mods["hla_sp.megatron_patch.routing"]
    )


def test_no_upward_import() -> None:
    upward = [
        f"{a} -> {b}" for a, b in edges() if layer(b)[1] > layer(a)[1]
    ]
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_kernels_only_through_dispatch() -> None:
    """Outside the kernels package, only hla_sp.ops.dispatch imports it."""
    users = {
        a for a, b in edges()
        if layer(b)[0] == "hla_sp.kernels" and layer(a)[0] != "hla_sp.kernels"
    }
    assert users <= {"hla_sp.ops.dispatch"}, users


def module_edges() -> set[tuple[str, str]]:
    """(importer, imported) between modules, where ``from pkg import sub`` of a submodule
    counts as importing ``sub`` only: the package's ``__init__`` runs first either way,
    and counting it would make every facade that re-exports its submodules a circle."""
    known = modules()
    out = set()
    for name, path in known.items():
        base = name if path.stem == "__init__" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found = {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    parts = base.split(".")
                    parts = parts[: len(parts) - (node.level - 1)]
                    mod = ".".join(parts + ([mod] if mod else []))
                subs = {f"{mod}.{a.name}" for a in node.names} & set(known)
                found = subs if len(subs) == len(node.names) else {mod} | subs
            else:
                continue
            out.update((name, m) for m in found if m in known and m != name)
    return out


def circles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm),
    lazy imports and TYPE_CHECKING imports included."""
    graph: dict[str, list[str]] = {m: [] for m in modules()}
    for a, b in module_edges():
        graph[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_circles() -> None:
    """No two modules of the package import each other, even through others, even
    lazily (inside a function or under TYPE_CHECKING)."""
    found = circles()
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_operators_have_no_circle() -> None:
    """The operator floor is circle-free: the table is a leaf, one runner runs it."""
    ops = [c for c in circles() if any(m.startswith("hla_sp.ops") for m in c)]
    assert not ops, ops
    assert "hla_sp.ops.runner" not in {b for a, b in module_edges() if a == "hla_sp.ops.table"}


MAX_LINES = 400


def test_no_file_over_400_lines() -> None:
    """Small modules whose names say what they hold: none of the package's files grows
    past MAX_LINES (split it where its parts have names of their own)."""
    long = {m: n for m, p in modules().items()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_config_is_torch_free() -> None:
    """hla_sp.config is read by flag parsers that must not pay for importing torch."""
    tree = ast.parse(modules()["hla_sp.config"].read_text())
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in names if m.split(".")[0] in ("torch", "hla_sp")}, names


def package_edges() -> Counter[tuple[str, str]]:
    """Number of module imports between two different layer prefixes."""
    return Counter(
        (layer(a)[0], layer(b)[0]) for a, b in edges() if layer(a)[0] != layer(b)[0]
    )


if __name__ == "__main__":
    for (a, b), n in sorted(package_edges().items()):
        mark = "  UPWARD" if LAYERS[b] > LAYERS[a] else ""
        print(f"{a:24s} -> {b:24s} {n:3d}{mark}")
    sys.exit(0)
