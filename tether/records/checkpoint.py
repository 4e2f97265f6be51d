"""Checkpoints: safetensors weights + optimizer, scheduler, RNG and data state, written atomically.

Layout of RUN_DIR/checkpoints/step_000040/:
    model/            `save_pretrained` (safetensors) weights and the tokenizer
    reference.safetensors   the reference/anchor weights, when a reference model is in use
    state.pt          optimizer, scheduler, RNG states and the caller's state: the trainer's
                      `run.Counters` (step, data position, optimiser steps, ...), one key per
                      field, and the stale policies (tensors and plain Python only, so it
                      loads with `torch.load(weights_only=True)`)
    manifest.json     every file's size and sha256, written last; the held-out accuracy the
                      trainer measured at this step, when it passed one (`save(accuracy=...)`)
A checkpoint is written into a temporary directory and renamed into place, so a kill during
the write never leaves a half checkpoint that resume would pick up; the manifest catches a
checkpoint damaged afterwards (truncated copy, bad disk): resume verifies it and falls back to
the previous good checkpoint, and pruning never deletes the newest good one.

Pruning keeps the newest `keep_last` good checkpoints and, besides them, the one with the best
recorded accuracy (the earliest of equals), so `best(run_dir)` survives a long run; `latest` is
still the newest, and resume reads only that.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

from .. import faults

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
    run_dir: Path,
    step: int,
    model,
    tokenizer,
    state: dict[str, Any],
    reference=None,
    keep_last: int = 2,
    accuracy: Optional[float] = None,
) -> Path:
    """Write RUN_DIR/checkpoints/step_{step:06d} atomically, then prune (see the module docstring).

    accuracy: the held-out accuracy measured on the weights being saved, recorded in the manifest;
    the checkpoint with the best one is kept by pruning and returned by `best`. A non-finite value
    is not recorded.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp / "model", safe_serialization=True)
    tokenizer.save_pretrained(tmp / "model")
    faults.point("checkpoint")
    if reference is not None:
        save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(tmp / "reference.safetensors"))
    torch.save({**state, "step": step, "rng": rng_state()}, tmp / "state.pt")
    _write_manifest(tmp, step, accuracy)
    _fsync_tree(tmp)  # the data is on disk before the rename makes the checkpoint visible
    old = root / f".old_step_{step:06d}"
    if final.exists():  # a step redone after a resume: move the old copy aside, never delete first
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    _fsync(root)
    shutil.rmtree(old, ignore_errors=True)
    _prune(run_dir, keep_last)
    return final


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        _fsync(path)
    _fsync(root)


def remove_partial(run_dir: Path, log=print) -> None:
    """Delete what a kill during a checkpoint write left behind (`.tmp_step_*`, `.old_step_*`).

    A `.old_step_N` whose `step_N` is missing was caught between the two renames: it is the
    complete previous copy of step N, so it is put back rather than deleted.
    """
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    for path in sorted(root.iterdir()):
        if path.name.startswith(".old_step_") and not (root / path.name[len(".old_") :]).exists():
            path.rename(root / path.name[len(".old_") :])
        elif path.name.startswith((".tmp_step_", ".old_step_")):
            log(f"removing {path}: an interrupted checkpoint write")
            shutil.rmtree(path, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(ckpt: Path) -> list[Path]:
    return sorted(p for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")


def _write_manifest(ckpt: Path, step: int, accuracy: Optional[float] = None) -> None:
    files = {str(p.relative_to(ckpt)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in _files(ckpt)}
    meta: dict[str, Any] = {"step": step}
    if accuracy is not None and math.isfinite(accuracy):
        meta["accuracy"] = float(accuracy)
    (ckpt / "manifest.json").write_text(json.dumps({**meta, "files": files}, indent=1))


def recorded_accuracy(ckpt: Path) -> Optional[float]:
    """The held-out accuracy recorded with the checkpoint, or None (none passed, or no readable manifest)."""
    try:
        return json.loads((Path(ckpt) / "manifest.json").read_text()).get("accuracy")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None


def verify(ckpt: Path, checksums: bool = True) -> str:
    """'' when the checkpoint matches its manifest, else what is wrong with it."""
    manifest = ckpt / "manifest.json"
    if not manifest.exists():
        return "no manifest.json (the write was interrupted or the directory was copied partially)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError):
        return "manifest.json is unreadable"
    for rel, meta in files.items():
        path = ckpt / rel
        if not path.is_file():
            return f"{rel} is missing"
        if path.stat().st_size != meta["size"]:
            return f"{rel} has {path.stat().st_size} bytes, the manifest says {meta['size']} (truncated?)"
        if checksums and _sha256(path) != meta["sha256"]:
            return f"{rel} does not match its sha256 checksum (corrupt)"
    return ""


def _prune(run_dir: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints that pass a size check, and the best one by
    recorded accuracy; damaged ones are left for inspection and never counted as kept."""
    good = [c for c in list_checkpoints(run_dir) if not verify(c, checksums=False)]
    keep = _best_of(good)
    for ckpt in good[: max(len(good) - keep_last, 0)]:
        if ckpt != keep:
            shutil.rmtree(ckpt, ignore_errors=True)


def _best_of(ckpts: list[Path]) -> Optional[Path]:
    """The checkpoint with the highest recorded accuracy, the earliest of equals; None if none has one.

    `ckpts` is in step order, and max() returns the first of equal keys.
    """
    scored = [(acc, c) for c in ckpts if (acc := recorded_accuracy(c)) is not None]
    return max(scored, key=lambda s: s[0])[1] if scored else None


def step_of(ckpt: Path) -> int:
    """The step a checkpoint directory (`step_000050`) holds."""
    return int(_STEP_DIR.match(Path(ckpt).name).group(1))


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)]
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest(run_dir: Path, log=print) -> Optional[Path]:
    """The newest checkpoint that matches its manifest; damaged newer ones are reported and skipped."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        problem = verify(ckpt)
        if not problem:
            return ckpt
        log(f"warning: checkpoint {ckpt} is damaged ({problem}); falling back to the previous one")
    return None


def best(run_dir: Path, log=print) -> Optional[Path]:
    """The checkpoint with the best recorded accuracy (the earliest of equals) among those that match
    their manifest, damaged ones reported and skipped; None when no checkpoint has an accuracy."""
    good = []
    for ckpt in list_checkpoints(run_dir):
        problem = verify(ckpt)
        if problem:
            log(f"warning: checkpoint {ckpt} is damaged ({problem}); skipping it")
        else:
            good.append(ckpt)
    return _best_of(good)


def load_state(ckpt: Path) -> dict[str, Any]:
    """The trainer state; weights_only=True, so a checkpoint cannot run code when loaded."""
    return torch.load(ckpt / "state.pt", weights_only=True, map_location="cpu")


def load_reference(ckpt: Path, reference) -> None:
    path = ckpt / "reference.safetensors"
    if path.exists():
        reference.load_state_dict(load_file(str(path)))
