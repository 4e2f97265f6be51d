"""The one-off checks that guard each fast path of the model layer: before a path is trusted on a model, it runs
once beside the plain forward on a few real tokens, and a model where the two disagree runs the plain forward.

    the fused LM head        hidden @ head.weight against the model's own logits   (`causal_lm.fused_reason`)
    shared prompts           the KV-cache forward against the full one             (`causal_lm.shared_prompt_reason`)
    packing                  the packed forward against the padded one             (`packing.packing_reason`)

One tolerance for all three (`TOLERANCE`): the largest difference at the compared positions, relative to the
largest magnitude there (at least 1), must be within 1e-4 in float32 or float64 and 2e-2 in half precision, which
is rounding, while a model that ignores an attention mask or computes its logits another way (a logit soft-cap, a
scaled head) is off by far more. Each model is probed once; the reason stays with it (a weak reference)."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}
HALF_PRECISION_TOLERANCE = 2e-2
"""Relative tolerance of a probe: 1e-4 in float32 and float64 (rounding), 2e-2 in bf16 and fp16."""


def disagreement(
    ours: torch.Tensor, plain: torch.Tensor, keep: torch.Tensor | None, dtype: torch.dtype, what: str
) -> str:
    """ "" when `ours` equals `plain` at the positions `keep` (all when None) to the tolerance of a model computing
    in `dtype`, else the reason to fall back: "`what` by <the largest difference>"."""
    tol = TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)
    a, b = ours.float(), plain.float()
    if keep is not None:
        a, b = a[keep], b[keep]
    err = (a - b).abs().max().item()
    scale = max(b.abs().max().item(), 1.0)
    return "" if err <= tol * scale else f"{what} by {err:.3g}"


class Probed:
    """The reasons found per model: `reason(model)` ("" before the probe, or when the fast path agreed),
    `once(model, probe)`, which runs `probe()` the first time a model is seen and keeps its reason, and `forget`
    (a model changed in place, e.g. a hook added, is probed again)."""

    def __init__(self) -> None:
        self._found: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()

    def reason(self, model: Any) -> str:
        return self._found.get(model, "")

    def once(self, model: Any, probe: Callable[[], str]) -> str:
        if model not in self._found:
            self._found[model] = probe()
        return self._found[model]

    def forget(self, model: Any) -> None:
        self._found.pop(model, None)
