"""Every seed a training run derives, in one place, each from the stream it belongs to.

Three roots (`trainer.seed`, `trainer.sampling_seed` and `trainer.minibatch_seed`), and the streams drawn from
them:

    init and data   trainer.seed            the warm start and LoRA initialisation (`torch.manual_seed`), the
                                            warm start's batches (`sft_batch`), the prompt order
                                            (`trainer.data.PromptStream`)
    sampling        trainer.sampling_seed   the rollout tokens of each step (`rollout`, its refill rounds
                    (None: trainer.seed)    `refill`)
    mini-batches    trainer.minibatch_seed  the order of the mini-batches (`minibatch_order`)
                    (None: the sampling root)

Keeping the mini-batch order apart lets `tether compare --null-control` rerun a method from the same initial
model, data order, held-out set and sampling stream, changing only the order of its mini-batches: an A/A pair
coupled as the methods of one seed are (they share every stream), so its spread is the noise floor of the
claims' differences. `sampling_seed` alone draws an independent sampling stream (the harsher pair an earlier
null control used). With both unset, every seed is what it was before the keys existed.
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


def minibatch_root(t: TrainerConfig) -> int:
    """The root of the mini-batch order: `trainer.minibatch_seed`, or the sampling root when unset."""
    return sampling_root(t) if t.minibatch_seed is None else t.minibatch_seed


def minibatch_order(root: int, step: int) -> int:
    """The seed of the order in which step `step` splits its batch into mini-batches."""
    return root * MINIBATCH + step
