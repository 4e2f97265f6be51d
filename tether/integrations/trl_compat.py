"""Every place the TRL adapter (tether.integrations.trl) touches TRL beyond its public API.

Checked against trl 1.16.0 (the adapter warns outside trl>=1.16,<1.17). A new TRL release is a review
of this file: `GRPOTrainerHooks` is the only code that overrides or reads `GRPOTrainer`'s private
members, and it turns them into hooks that `TetherGRPOTrainer` implements.

1. Private methods overridden, each only to forward to a hook:
   `_calculate_rewards` (the rewards per function, gathered over processes) -> `on_rewards`;
   `_generate_and_score_completions` (the generation batch, a dict of columns) -> `on_generation_batch`;
   `_prepare_inputs` (the buffer of `steps_per_generation` chunks, refilled every
   `steps_per_generation * num_iterations` micro-steps) -> `on_new_buffer`;
   `_compute_loss(model, inputs)` -> `objective_loss`, with the log-probs and entropies from TRL's own
   `_get_per_token_logps_and_entropies` and TRL's router auxiliary loss for mixture-of-experts models, or, for an
   objective that reads more than the sampled tokens' log-probs (TROLL's sparse supports), from the adapter's own
   forward (`policy_forward`).
2. Private attributes read: `_step` (micro-steps taken), `_buffered_inputs` (the chunks), `_metrics`
   (mode -> name -> list of values, averaged by `log`).
3. Columns of TRL's generation batch: `prompt_ids`, `prompt_mask`, `completion_ids`, `completion_mask`,
   `tool_mask` (multi-turn), `advantages`, `old_per_token_logps`, `ref_per_token_logps`,
   `sampling_per_token_logps` (vLLM's), and the model inputs of `FORWARD_KEYS` (images).
4. Colocated vLLM's weight sync (`use_vllm=True, vllm_mode="colocate"`): `GRPOTrainer.vllm_generation` (TRL's
   `VLLMGeneration`), its `mode`, `llm` and `_iter_named_params()` (the policy's weights under vLLM's names, LoRA
   merged, gathered under FSDP or DeepSpeed), and its `sync_weights` method, which `sync_weights_with` replaces on
   the instance. TRL's own `sync_weights` pushes one tensor at a time through the vLLM model's `load_weights`;
   `GRPOTrainer` calls `vllm_generation.sync_weights()` before generating whenever the weights changed.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "tether.integrations.trl needs TRL: pip install 'tether[trl]' (tested with trl>=1.16,<1.17)"
    ) from err

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "GRPOTrainerHooks",
    "TESTED_TRL",
    "colocated_llm",
    "loss_mask",
    "sync_weights_with",
]

TESTED_TRL = ">=1.16,<1.17"
"""The TRL versions this file was checked against (1.16.0)."""

OLD_LOGPS, REF_LOGPS, SAMPLER_LOGPS = "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps"
"""Columns of a TRL batch: pi_old's log-probs (absent when a batch is used within one optimiser step),
the reference's (when TRL's beta != 0), and the sampler's (vLLM)."""

FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
"""Model inputs besides ids and attention mask that a TRL batch may carry (images), passed on as TRL does."""


def check_version() -> None:
    from packaging.specifiers import SpecifierSet

    if trl.__version__ not in SpecifierSet(TESTED_TRL):
        warnings.warn(
            f"tether.integrations.trl is tested with trl{TESTED_TRL}, found {trl.__version__}: it overrides "
            "private GRPOTrainer methods (tether/integrations/trl_compat.py), which may have changed",
            stacklevel=3,
        )


def loss_mask(inputs: dict) -> torch.Tensor:
    """(N, T) tokens that count: completion tokens, minus tool outputs in multi-turn batches."""
    mask = inputs["completion_mask"]
    return mask * inputs["tool_mask"] if "tool_mask" in inputs else mask


def colocated_llm(trainer: GRPOTrainer) -> Any:
    """TRL's colocated in-process `vllm.LLM` (item 4), or None when the trainer samples otherwise."""
    generation = getattr(trainer, "vllm_generation", None)
    if generation is None or generation.mode != "colocate":
        return None
    return generation.llm


def sync_weights_with(trainer: GRPOTrainer, push: Callable[[Any, list[tuple[str, torch.Tensor]]], None]) -> None:
    """Make the colocated engine's weight sync `push(llm, weights)`, all weights at once (item 4).

    The weights are TRL's own walk of the policy (`_iter_named_params`: vLLM's names, LoRA merged and unmerged
    again when the walk ends), copied as they are yielded, since the merged tensors change back afterwards."""
    generation = trainer.vllm_generation

    def sync_weights() -> None:
        weights = [(name, tensor.detach().clone()) for name, tensor in generation._iter_named_params()]
        push(generation.llm, weights)

    generation.sync_weights = sync_weights


class GRPOTrainerHooks(GRPOTrainer):
    """`GRPOTrainer` whose private extension points are forwarded to the hooks below (see the module docstring)."""

    # ------------------------------------------------------------ hooks

    def on_rewards(self, rewards_per_func: torch.Tensor) -> None:
        """The rewards (N_all, n_funcs) of a generation batch, gathered over processes; NaN: unscorable."""

    def on_generation_batch(self, batch: dict) -> dict:
        """This process's generation batch (columns of N rows), returned with any columns added."""
        return batch

    def on_new_buffer(self, chunks: list[dict]) -> None:
        """A new generation batch was split into `steps_per_generation` chunks, one per micro-step."""

    def policy_forward(self, model: Any, inputs: dict) -> Any:
        """The adapter's own forward of `model` on the micro-batch `inputs`: (log-probs, entropies, extra), or None
        for TRL's helper (then `extra` is None)."""
        return None

    def objective_loss(self, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor, extra: Any = None):
        """The loss of one micro-batch `inputs`, from its log-probs and entropies (N, T) with gradient (and what
        `policy_forward` gave beside them)."""
        raise NotImplementedError

    @property
    def micro_step(self) -> int:
        """Micro-steps (accumulation steps) taken so far in training."""
        return self._step

    def set_logged_metric(self, mode: str, name: str, value: float) -> None:
        """Make `value` the one value TRL's `log` averages for metric `name` in this log period."""
        self._metrics[mode][name] = [value]

    # ------------------------------------------------------------ TRL's private methods

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self.on_rewards(rewards)
        return rewards

    def _generate_and_score_completions(self, inputs):
        return self.on_generation_batch(super()._generate_and_score_completions(inputs))

    def _prepare_inputs(self, generation_batch):
        spg = self.args.steps_per_generation
        fresh = self.model.training and (self._step % (spg * self.num_iterations) == 0 or self._buffered_inputs is None)
        inputs = super()._prepare_inputs(generation_batch)
        if fresh:
            self.on_new_buffer(list(self._buffered_inputs))
        return inputs

    def _compute_loss(self, model: Any, inputs: dict) -> torch.Tensor:
        own = self.policy_forward(model, inputs)
        if own is not None:
            return self.objective_loss(inputs, *own)
        completion_ids = inputs["completion_ids"]
        ids = torch.cat([inputs["prompt_ids"], completion_ids], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        lp, ent, aux = self._get_per_token_logps_and_entropies(
            model,
            ids,
            attention,
            completion_ids.size(1),
            compute_entropy=True,
            compute_aux_loss=self.aux_loss_enabled,
            **{k: inputs.get(k) for k in FORWARD_KEYS},
        )
        loss = self.objective_loss(inputs, lp, ent)
        if self.aux_loss_enabled:  # a mixture-of-experts router loss, scaled as TRL scales it
            train = self.model.training
            loss = loss + self.router_aux_loss_coef * aux / (self.current_gradient_accumulation_steps if train else 1)
        return loss
