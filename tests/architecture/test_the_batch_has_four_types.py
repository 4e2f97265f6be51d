"""The batch between sampler and loss is what docs/architecture.md's table (between the `batch-types` markers) says:
at most four types, each a dataclass in the module the table names, each tensor field with a `jaxtyping` shape;
the tokens that count have one name (`loss_mask`) on every type that carries them, and the retired names
(`Scored`, `Tokens.mask`, `TokenBatch.mask`, `RolloutBatch.loss_mask`, `trained_mask`) exist nowhere.
(`tests/trainer/test_step_shapes.py` checks the shapes themselves in a training run.)"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def table() -> list[tuple[str, str]]:
    """[(type, module file)] of the table between the markers."""
    text = DOC.read_text()
    body = text[text.index("<!-- batch-types -->") : text.index("<!-- /batch-types -->")]
    return re.findall(r"^\| `(\w+)` \| `([\w/]+\.py)` \|", body, re.M)


def test_the_table_lists_at_most_four_types_and_each_is_where_it_says():
    rows = table()
    assert 1 <= len(rows) <= 4, rows
    for name, path in rows:
        module = importlib.import_module("tether." + path.removesuffix(".py").replace("/", "."))
        cls = getattr(module, name)
        assert dataclasses.is_dataclass(cls) and cls.__module__ == module.__name__, name


def test_every_tensor_field_of_the_batch_types_has_a_shape():
    for name, path in table():
        source = (ROOT / "tether" / path).read_text()
        (node,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == name]
        fields = {
            f.target.id: ast.unparse(f.annotation)
            for f in node.body
            if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)
        }
        bare = [f for f, a in fields.items() if re.search(r"\b(torch\.)?Tensor\b", a) and "[Tensor," not in a]
        assert not bare, f"{name}: tensor fields without a jaxtyping shape: {bare}"
        assert any("[Tensor," in a for a in fields.values()), name


def test_the_tokens_that_count_have_one_name():
    from tether.model.causal_lm import Tokens
    from tether.objectives import TokenBatch
    from tether.rollout import RolloutBatch

    names = {cls.__name__: {f.name for f in dataclasses.fields(cls)} for cls in (Tokens, TokenBatch, RolloutBatch)}
    assert "loss_mask" in names["Tokens"] and "loss_mask" in names["TokenBatch"]
    assert "mask" not in names["Tokens"] and "mask" not in names["TokenBatch"]
    # the rollout's masks say what they are: every real token, and the tokens the policy sampled
    assert {"mask", "policy_mask"} <= names["RolloutBatch"] and "loss_mask" not in names["RolloutBatch"]


def test_the_retired_names_are_gone():
    retired = re.compile(r"\bclass Scored\b|\btrained_mask\b|\bTokens\.mask\b|\bTokenBatch\.mask\b|\bkept_mask\b")
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in list((ROOT / "tether").rglob("*.py")) + list((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if retired.search(line)
    ]
    assert not hits, hits
