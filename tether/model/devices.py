"""Where a model runs: the device a model of its size gets (`pick_device`, `place_model`: `auto` keeps a small
model on the CPU), whether a device name is one this machine has (`device_problem`), and torch's CPU threads
(`cpu_threads`). Each rule is applied here once, for the trainer and `tether eval` alike."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from ..schema import ConfigError


def pick_device(
    name: str,
    n_params: int,
    small_model_params: int,
    key: str = "trainer.device",
    small_key: str = "trainer.small_model_params",
) -> tuple[torch.device, str]:
    """The device for a model, and a log line when `auto` keeps a small model on the CPU
    (`key`, `small_key`: the settings the message names).

    A model of a few million parameters is launch-bound on a GPU: every step is thousands of tiny
    kernels, and 2 CPU cores run the README's main job faster (152 s against 226 s on an H100).
    """
    if name == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu"), ""
        if n_params < small_model_params:
            return torch.device("cpu"), (
                f"{key}=auto: running on the CPU, not the GPU: the model has {n_params / 1e6:.1f}M "
                f"parameters (< {small_key}={small_model_params:_}), too few to keep a GPU busy "
                f"(each step would be launch-bound, slower than the CPU); set {key}=cuda to use the GPU"
            )
        return torch.device("cuda"), ""
    problem = device_problem(name, key)
    if problem:
        raise ConfigError(problem)
    return torch.device(name), ""


def place_model(
    model: Any, name: str, small_model_params: int, key: str = "trainer.device", log: Callable[[str], Any] = print
) -> torch.device:
    """Move `model` (loaded on the CPU) to the device `name` picks for a model of its size
    (`pick_device`: `auto` keeps one under `small_model_params` parameters on the CPU, and `log`s
    why); returns that device. The one place the trainer and `tether eval` apply the rule."""
    device, why = pick_device(name, sum(p.numel() for p in model.parameters()), small_model_params, key)
    if why:
        log(why)
    model.to(device)
    return device


AUTO_THREADS_MAX = 8
"""trainer.threads=0 (auto) uses half the cores, at most this many."""


def cpu_threads(setting: int, cores: Optional[int] = None) -> tuple[int, str]:
    """torch's CPU threads for `trainer.threads` (0: auto) and a log line saying why, or (0, "") to
    keep torch's default (-1). Auto is half the cores this process may use, at least 1 and at most
    AUTO_THREADS_MAX: torch's default of every core makes each parallel region wait for its slowest
    thread, so one competing process (another run, a test suite, the verifier's worker) stalls them
    all (docs/performance.md, "CPU threads under contention"); past a few threads a small model's
    matmuls gain little."""
    if setting == -1:
        return 0, ""
    if setting > 0:
        return setting, ""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = min(AUTO_THREADS_MAX, max(1, cores // 2))
    return n, (
        f"torch threads: {n} of {cores} cores (trainer.threads=0: auto, half the cores, at most "
        f"{AUTO_THREADS_MAX}; -1 for torch's default of every core)"
    )


def device_problem(name: str, key: str = "trainer.device", available: bool = True) -> str:
    """Why `name` is not a device this machine can train on ("" when it is); with
    `available=False`, only whether it names a device at all (a config read on another machine)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        return f"{key}={name!r} is not a device; expected auto, cpu, cuda or cuda:N (e.g. cuda:0)"
    if not available:
        return ""
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            return f"{key}={name} but no CUDA device is available; use {key}=cpu (or auto)"
        if device.index is not None and device.index >= count:
            return f"{key}={name} but this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return f"{key}={name} but MPS (Apple GPU) is not available; use {key}=cpu (or auto)"
    return ""
