"""Sizes a reader can hold (issue 50): no function of tether/ over 60 lines, no module over 500, no line past the
formatter's 120 characters (pyproject.toml). Met by splitting where a reader would split, never by joining lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "tether").rglob("*.py"))
MAX_FUNCTION, MAX_MODULE, MAX_LINE = 60, 500, 120


def test_no_function_is_over_60_lines():
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, long


def test_no_module_is_over_500_lines_and_no_line_over_120_characters():
    modules = [f"{p.relative_to(ROOT)} ({n})" for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_MODULE]
    lines = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in SOURCES
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > MAX_LINE
    ]
    assert not modules and not lines, (modules, lines)
