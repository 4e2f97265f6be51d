"""The layout's rules, read from the code: every import of every module in tether/ (module top, function-local
and `if TYPE_CHECKING:` ones, parsed with ast) follows the allowed directions that docs/architecture.md lists
once, in its table between the `allowed-imports` markers; no module imports itself back through a circle; and a
function-local import is either a third-party package that is optional or slow to import (HEAVY), a line that
says why (`# lazy: REASON`), or in a module whose every command imports lazily by design (LAZY_MODULES)."""

from __future__ import annotations

import ast
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"

HEAVY = {
    "torch",
    "transformers",
    "huggingface_hub",
    "tokenizers",
    "safetensors",
    "vllm",
    "peft",
    "matplotlib",
    "wandb",
    "trl",
    "verl",
    "accelerate",
    "datasets",
    "gguf",
    "math_verify",
    "numpy",
    "pyarrow",
    "pandas",
    "packaging",
    "rich",
    "mpmath",
    "ray",
}
"""Third-party packages a function may import where it needs them: an optional extra (vllm, peft, trl, verl,
wandb, gguf, datasets, ...) or one whose import costs seconds (torch, transformers), which a config error, `tether
list` and `tether report` never pay."""

LAZY_MODULES = {
    "tether.cli": "each command imports what it runs after its arguments and config are checked, so `tether list`, "
    "`--help-config` and a config error never import torch (docs/performance.md, 'Time to an error')",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted((ROOT / "tether").rglob("*.py"))}


def imports(name: str, path: Path, known: set[str]):
    """(imported tether module, line, function-local?, justified?) for every import in the module."""
    src = path.read_text()
    lines = src.splitlines()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                justified = any("# lazy:" in lines[i - 1] for i in range(child.lineno, child.end_lineno + 1))
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                    third = child.names[0].name.split(".")[0]
                else:
                    base = child.module or ""
                    if child.level:
                        up = package[: len(package) - (child.level - 1)]
                        base = ".".join([*up, *([child.module] if child.module else [])])
                    targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
                    third = None if child.level else base.split(".")[0]
                for target in targets:
                    out.append((target, child.lineno, local, justified, third))
            visit(child, inner)

    visit(ast.parse(src), False)
    return out


def allowed_table() -> dict[str, set[str]]:
    """{unit: the units it may import} from docs/architecture.md (a unit: `core`, `config.sections`, ...)."""
    text = DOC.read_text()
    block = text.split("<!-- allowed-imports: begin -->")[1].split("<!-- allowed-imports: end -->")[0]
    table = {}
    for row in block.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        unit = cells[0].strip("`")
        table[unit] = set(re.findall(r"`([\w.*]+)`", cells[1]))
    return table


def unit_of(module: str, units) -> str | None:
    """The most specific unit a module belongs to: `tether.config.sections` -> `config.sections`."""
    rest = module.split(".", 1)[1] if "." in module else ""
    best = None
    for unit in units:
        if rest == unit or rest.startswith(unit + "."):
            best = unit if best is None or len(unit) > len(best) else best
    return best


def forbidden_arrows(edges, table) -> list[str]:
    """The imports across units that the table does not allow (the package root, `tether`, holds only the version
    and is open to every unit)."""
    bad = []
    for module, target, line in edges:
        a, b = unit_of(module, table), unit_of(target, table)
        if target == "tether" or a == b or "*" in table.get(a, ()):
            continue
        if b not in table.get(a, set()):
            bad.append(f"{module}:{line} imports {target}: {a} -> {b} is not an allowed direction")
    return bad


def circles(nodes, edges) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    graph = defaultdict(set)
    for a, b, _ in edges:
        graph[a].add(b)
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def strong(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            strong(v)
    return found


def _graph():
    mods = modules()
    edges, local = [], []
    for name, path in mods.items():
        for target, line, is_local, justified, third in imports(name, path, set(mods)):
            if target.startswith("tether"):
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in mods and target != name:
                    edges.append((name, target, line))
            if is_local:
                local.append((name, line, target, justified, third))
    return mods, edges, local


def test_every_package_and_top_level_module_has_a_row_in_the_table():
    table = allowed_table()
    units = {
        p.stem if p.is_file() else p.name
        for p in (ROOT / "tether").iterdir()
        if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())
    }
    assert units <= set(table), f"place these in docs/architecture.md's table: {sorted(units - set(table))}"


def test_no_import_goes_against_the_allowed_directions():
    _, edges, _ = _graph()
    assert forbidden_arrows(edges, allowed_table()) == []


def test_there_is_no_import_circle_between_modules_or_packages():
    mods, edges, _ = _graph()
    assert circles(list(mods), edges) == []
    table = allowed_table()
    units = [
        (unit_of(a, table) or a, unit_of(b, table) or b, line)
        for a, b, line in edges
        if b != "tether" and unit_of(a, table) != unit_of(b, table)
    ]
    # config.sections sits inside config: a package and its own part are not a circle
    units = [(a, b, line) for a, b, line in units if {a, b} != {"config", "config.sections"}]
    assert circles(sorted({u for a, b, _ in units for u in (a, b)}), units) == []


def test_a_function_local_import_says_why_it_is_local():
    _, _, local = _graph()
    unjustified = [
        f"{name}:{line} imports {target}"
        for name, line, target, justified, third in local
        if not justified and third not in HEAVY and name not in LAZY_MODULES
    ]
    assert unjustified == [], "import at the module top, or add `# lazy: REASON` (a cycle, an optional or slow package)"


def test_the_checks_catch_a_forbidden_arrow_and_a_circle():
    table = {"core": set(), "model": {"core"}, "trainer": {"core", "model"}}
    assert forbidden_arrows([("tether.model.x", "tether.core.y", 1)], table) == []
    assert forbidden_arrows([("tether.core.y", "tether.model.x", 3)], table) == [
        "tether.core.y:3 imports tether.model.x: core -> model is not an allowed direction"
    ]
    assert circles(["a", "b", "c"], [("a", "b", 1), ("b", "c", 1), ("c", "a", 1)]) == [["a", "b", "c"]]
    assert circles(["a", "b"], [("a", "b", 1)]) == []
