"""docs/architecture.md names the code a step runs through; every name it cites must exist (issue 50: it named a
`reference_logprobs` that did not exist and placed `update` in step.py). A name in backquotes is checked when it
looks like code: a dotted path into tether (`trainer.step.rl_step`), a class or one of its members
(`Reference.ref_logprobs`), a module file (`trainer/update.py`) or a config key (`trainer.staleness`)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = {p.name for p in (ROOT / "tether").iterdir() if p.is_dir() or p.suffix == ".py"}
PACKAGES = {p.removesuffix(".py") for p in PACKAGES}


def _classes() -> dict[str, list[str]]:
    """{class name: [modules that define it]} over tether/."""
    found: dict[str, list[str]] = {}
    for path in (ROOT / "tether").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for name in re.findall(r"^class (\w+)", path.read_text(), re.M):
            found.setdefault(name, []).append(module)
    return found


CLASSES = _classes()


def _defined() -> set[str]:
    """Every function, class, field and assigned name defined anywhere in tether/ (for bare names)."""
    import ast

    names: set[str] = set()
    for path in (ROOT / "tether").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


DEFINED = _defined()
FILE_SUFFIXES = {"py", "yaml", "json", "jsonl", "md", "png", "pt", "safetensors", "log", "gguf"}


def _config_key(name: str) -> bool:
    from tether.config.sections import Config

    node = Config()
    for part in name.split("."):
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return False
        node = getattr(node, part)
    return True


def _resolves(name: str) -> bool:
    if "." not in name:
        return name in DEFINED
    head, *rest = name.removeprefix("tether.").split(".")
    if name.startswith("tether.") and not rest:
        return importlib.util.find_spec(name) is not None
    if head in CLASSES:  # a class, or one of its members
        for module in CLASSES[head]:
            obj = getattr(importlib.import_module(module), head)
            if all(hasattr(obj, r) or r in getattr(obj, "__dataclass_fields__", {}) for r in rest[:1]):
                return True
        return False
    if head in PACKAGES:
        for cut in range(len(rest) + 1, 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(["tether", head, *rest[: cut - 1]]))
            except ImportError:
                continue
            for attr in rest[cut - 1 :]:
                if not hasattr(obj, attr):
                    return _config_key(name)
                obj = getattr(obj, attr)
            return True
    return _config_key(name)


def cited() -> list[str]:
    names = []
    prose = re.sub(r"```.*?```", "", DOC.read_text(), flags=re.S)  # code blocks are not citations
    for text in re.findall(r"`([^`\n]+)`", prose):
        text = re.sub(r"\(.*$", "", text)  # `rl_step(parts, counters, step)` names rl_step
        if " " in text:
            continue
        if text.endswith(".py") and "/" in text:
            names.append(text)
        elif text.rsplit(".", 1)[-1] in FILE_SUFFIXES:  # a file named in a package's row (`step.py`)
            continue
        elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+", text) or (text in CLASSES):
            names.append(text)
        elif re.fullmatch(r"[a-z]\w*_\w*", text):  # a bare snake_case name: a function, field or setting
            names.append(text)
    return sorted(set(names))


@pytest.mark.parametrize("name", cited())
def test_a_cited_name_exists(name):
    if name.endswith(".py"):
        found = (ROOT / name).exists() or any(
            p.as_posix().endswith("/" + name) for p in (ROOT / "tether").rglob("*.py")
        )
        assert found, f"{name}: no such file"
        return
    assert _resolves(name), f"docs/architecture.md cites `{name}`, which is not in tether"


def test_the_walk_cites_the_step_s_names():
    names = cited()
    assert len(names) > 40  # the walk, not an empty match
    for must in ("trainer.step.rl_step", "Reference.ref_logprobs", "trainer/update.py", "TrainerConfig.ratio_is_one"):
        assert must in names
