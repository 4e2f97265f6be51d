"""Every seed a training run derives, in one place, each from the stream it belongs to.

Two roots (`trainer.seed` and `trainer.sampling_seed`), and the streams drawn from them:

    init and data   trainer.seed            the warm start and LoRA initialisation (`torch.manual_seed`), the
                                            warm start's batches (`sft_batch`), the prompt order
                                            (`trainer.data.PromptStream`)
    sampling        trainer.sampling_seed   the rollout tokens of each step (`rollout`, its refill rounds
                    (None: trainer.seed)    `refill`) and the order of the mini-batches (`minibatch_order`)

Keeping sampling apart lets `tether compare --null-control` rerun a method from the same initial model, data
order and held-out set with an independent sampling stream: an A/A pair that shows the noise floor of a
comparison. With `sampling_seed` unset, every seed is what it was before the key existed.
"""

from __future__ import annotations

from ..config.sections import TrainerConfig

ROLLOUT, REFILL, MINIBATCH = 1_000_003, 7919, 7_000_003
"""The multipliers that keep the streams of different steps and rounds apart."""


def sampling_root(t: TrainerConfig) -> int:
    """The root of the sampling stream: `trainer.sampling_seed`, or `trainer.seed` when unset."""
    return t.seed if t.sampling_seed is None else t.sampling_seed


def rollout(root: int, step: int) -> int:
    """The sampling seed of RL step `step` (its first round), from the sampling root."""
    return root * ROLLOUT + step


def refill(seed: int, round: int) -> int:
    """Round `round` of dynamic sampling's refills (0: the first) of a step sampled with `seed`."""
    return seed + REFILL * round


def sft_batch(seed: int, step: int) -> int:
    """The seed of the warm start's (supervised) training batch at SFT step `step` (`trainer.sft`)."""
    return seed * ROLLOUT + step


def data_chunk(seed: int, chunk: int) -> int:
    """The seed of chunk `chunk` of an unbounded task's prompt stream (`trainer.data.PromptStream`)."""
    return seed * ROLLOUT + chunk


def minibatch_order(root: int, step: int) -> int:
    """The seed of the order in which step `step` splits its batch into mini-batches."""
    return root * MINIBATCH + step
