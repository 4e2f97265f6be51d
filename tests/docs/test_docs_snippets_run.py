"""Every ```python and ```bash block in docs/ runs as written (issue 24, item 17), as the README's
Python blocks do (tests/docs/test_readme_blocks_run.py).

A block may carry a marker, an HTML comment on the line just above its fence:
- `<!-- docs-test: skip (REASON) -->`: not run; REASON says why (needs a GPU, the network, a Ray
  cluster, or it is a fragment of a larger program). A skip without a reason is an error.
- `<!-- docs-test: slow -->`: run only in the full suite (it trains a model for a while).
- `<!-- docs-test: config -->` (bash only): each `tether train` / `tether compare` line's config is
  loaded and validated (keys, presets, objectives), without training: the commands take minutes.
Unmarked Python blocks of one file run in order in one namespace, so a later block may use an
earlier block's names, in a scratch directory (relative paths such as runs/ land there). Unmarked
bash blocks run with `bash -e` there, the venv's bin first on PATH.
"""

from __future__ import annotations

import os
import re
import shlex
import types
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").rglob("*.md"))
FENCE = re.compile(
    r"(?:^<!-- docs-test: (?P<marker>[^>]*?) -->\n)?^```(?P<lang>python|bash)\n(?P<code>.*?)^```", re.M | re.S
)


def blocks(path: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, marker, code) of each python/bash block of `path`."""
    text = path.read_text()
    return [
        (text[: m.start("code")].count("\n"), m["lang"], (m["marker"] or "").strip(), m["code"])
        for m in FENCE.finditer(text)
    ]


ALL = [(path, *b) for path in DOCS for b in blocks(path)]
# What a doc's blocks must have shown, beyond running: (check of the namespace, what it proves).
EXPECT = {
    "trl.md": (
        lambda ns: ns["clipped"][0] == 0 and ns["clipped"][-1] > 0,
        "num_iterations=2: the first pass is on-policy, the second clips (issue 24, item 19)",
    ),
}


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT / "docs"))


def test_every_marker_is_known_and_every_skip_says_why():
    assert ALL, "no blocks found"
    for path, line, lang, marker, _ in ALL:
        where = f"{_id(path)}:{line}"
        assert marker in ("", "slow", "config") or re.fullmatch(r"skip \(.+\)", marker), f"{where}: {marker!r}"
        assert marker != "config" or lang == "bash", f"{where}: 'config' is for bash blocks"


def _python_files():
    files = sorted({path for path, _, lang, marker, _ in ALL if lang == "python" and not marker.startswith("skip")})
    return [
        pytest.param(
            p,
            id=_id(p),
            marks=[pytest.mark.slow] * any(m == "slow" for q, _, lang, m, _ in ALL if q == p and lang == "python"),
        )
        for p in files
    ]


@pytest.mark.parametrize("path", _python_files())
def test_the_python_blocks_of_a_doc_run_in_order(path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # A real module in sys.modules: a dataclass defined in a doc looks its module up there.
    module = types.ModuleType("__docs__")
    monkeypatch.setitem(sys.modules, "__docs__", module)
    namespace = module.__dict__
    for line, lang, marker, code in blocks(path):
        if lang == "python" and not marker.startswith("skip"):
            # Pad with blank lines so a traceback names the line in the .md file.
            exec(compile("\n" * line + code, str(path), "exec"), namespace)
    if _id(path) in EXPECT:
        check, what = EXPECT[_id(path)]
        assert check(namespace), what


def _bash_params():
    out = []
    for path, line, lang, marker, code in ALL:
        if lang == "bash" and not marker.startswith("skip"):
            out.append(
                pytest.param(
                    path, marker, code, id=f"{_id(path)}:{line}", marks=[pytest.mark.slow] * (marker == "slow")
                )
            )
    return out


def _config_check(command: str) -> None:
    """Load and validate the config of one `tether train` / `tether compare` command line."""
    from tether import objectives
    from tether.cli import _split_config_args
    from tether.config.loading import load_config

    words = shlex.split(command, comments=True)
    if words[:2] not in (["tether", "train"], ["tether", "compare"]) or {"--resume", "--help-config"} & set(words):
        return
    args, names, rest = iter(words[2:]), [], []
    for word in args:
        if word.startswith("--"):
            value = next(args)
            if word == "--objectives":
                names = value.split(",")
        else:
            rest.append(word)
    path, overrides = _split_config_args(rest)
    cfg = load_config(str(ROOT / path) if path else None, overrides)
    for name in names:
        objectives.build(load_config(str(ROOT / path) if path else None, [*overrides, f"objective={name}"]).objective)
    assert cfg.trainer.total_steps > 0


@pytest.mark.parametrize("path, marker, code", _bash_params())
def test_a_bash_block_runs(path, marker, code, tmp_path):
    if marker == "config":
        lines = code.replace("\\\n", " ").splitlines()
        checked = [line for line in lines if line.strip().startswith("tether ")]
        assert checked, "a config block names no tether command"
        for line in checked:
            _config_check(line)
        return
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-e", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_config_check_fails_on_a_bad_key_or_objective():
    from tether.schema import ConfigError

    _config_check("tether train objective=dapo trainer.total_steps=3   # a comment")  # a good line passes
    with pytest.raises(ConfigError, match="total_steps"):
        _config_check("tether train trainer.totl_steps=3")
    with pytest.raises(ConfigError):
        _config_check("tether compare configs/compare.yaml --objectives grpo,nonesuch --seeds 2")
