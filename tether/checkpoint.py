"""Checkpoints: safetensors weights + optimizer, scheduler, RNG and data state, written atomically.

Layout of RUN_DIR/checkpoints/step_000040/:
    model/            `save_pretrained` (safetensors) weights and the tokenizer
    reference.safetensors   the reference/anchor weights, when a reference model is in use
    state.pt          optimizer, scheduler, RNG states, data position, step (tensors and
                      plain Python only, so it loads with `torch.load(weights_only=True)`)
A checkpoint is written into a temporary directory and renamed into place, so a kill during
the write never leaves a half checkpoint that resume would pick up.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

_STEP_DIR = re.compile(r"^step_(\d+)$")


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def save(
    run_dir: Path, step: int, model, tokenizer, state: dict[str, Any], reference=None, keep_last: int = 2
) -> Path:
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    if reference is not None:
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp / "reference.safetensors"))
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest(run_dir: Path) -> Optional[Path]:
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def load_state(ckpt: Path) -> dict[str, Any]:
    """The trainer state; weights_only=True, so a checkpoint cannot run code when loaded."""
    return torch.load(ckpt / "state.pt", weights_only=True, map_location="cpu")


def load_reference(ckpt: Path, reference) -> None:
    path = ckpt / "reference.safetensors"
    if path.exists():
        reference.load_state_dict(load_file(str(path)))
