"""The trainer's section of the configuration (`trainer.*`): the budget, the update's shape, evaluation, checkpoints,
seeds and numerics; as plain values, a docstring under every field (tether.config.sections)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

SMALL_MODEL_PARAMS = 20_000_000
"""Below this many parameters `device=auto` keeps a model on the CPU (`trainer.small_model_params`)."""


@dataclass
class TrainerConfig:
    total_steps: int = 1000
    """Rollout steps (each: sample, score, then ppo_epochs x mini_batches optimiser steps)."""
    ppo_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 2
    """Optimiser steps per pass; >= 2 makes the ratio differ from 1 so clipping acts."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradient accumulation inside a mini-batch)."""
    micro_batch_tokens: int = 0
    """Real tokens (prompt, completion and environment tokens) per forward/backward instead of a row count: each
    mini-batch (and each log-prob pass) cut into as few micro-batches of at most this many tokens as it allows
    (a longer row alone), balanced so the last is not a straggler; the gradient is the same up to rounding.
    0: micro_batch_size rows. Pairs with `packing` (tether.model.packing)."""
    packing: bool = False
    """Padding-free forwards: each forward runs its rows' real tokens end to end in packed rows, position ids
    restarting per sequence and block-diagonal attention (sdpa/eager: a block mask; flash-attention: varlen), so
    no position is spent on padding; log-probs and gradients equal the padded ones up to rounding. Fused head only
    (a model whose head cannot be fused runs padded). With share_prompts, a packed row holds each prompt once for
    the samples it carries. docs/performance.md."""
    pack_width: int = 512
    """Tokens per packed row under `packing` (at least the longest row's; flash-attention packs everything in one
    row). sdpa and eager attend over every (query, key) pair of a packed row, masked or not, so a wider row packs
    tighter and shares a prompt among more samples for more attention arithmetic (docs/performance.md)."""
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    """Where pi_old's log-probs come from. recompute: a forward pass of the policy before the first
    update (exact). sampler: the engine's own log-probs of the sampled tokens, which skips that
    pass; the same policy and weights, so they differ only by the KV-cache decode's rounding
    (about 1e-6 with the hf engine). Needs rollout.top_p=1 and temperature > 0."""
    staleness: int = 0
    """Rollout lag s: the batch of RL step t is sampled by the policy of step t - s (the first s + 1 steps by
    the initial policy: step 1's updates start from it), as an asynchronous trainer with a fixed lag would
    produce it; deterministic, and part of the checkpoint. 0: on-policy sampling. The anchor pi_old is
    old_logprobs: recompute (decoupled) or sampler (bypass); docs/training.md, "Stale rollouts"."""
    overlap: bool = False
    """With staleness s >= 1, sample the batch of step t+1 in a background thread while step t trains (its
    sampler, the policy of step t+1-s, is known when step t starts): the same tokens, metrics and weights as
    without overlap, bitwise, for one more copy of the model in memory. rollout.engine=hf only.
    docs/training.md, "Stale rollouts"."""
    fused_logprobs: bool = True
    """Log-probs and entropy through tether.model.ops' chunked LM head, never holding the (N, T, V) logits
    (exact gradients); models whose head is not a plain linear layer fall back to their logits."""
    logprob_chunk_size: Optional[int] = None
    """Tokens per chunk of the fused head; null: about 256 MB of float32 logits per chunk."""
    mask_truncated: bool = False
    """Overlong filtering: a completion that ran out of rollout.max_new_tokens (finish reason `length`) leaves
    the loss; its reward still counts in its group's baseline (TRL's mask_truncated_completions, NeMo-RL's
    overlong_filtering, SkyRL's apply_overlong_filtering, AReaL's mask_no_eos_with_zero)."""
    share_prompts: bool = True
    """With the fused head, the samples of one prompt run that prompt through the model once and
    their completions on its copied KV cache: the same log-probs and gradients (up to rounding)
    with the prompt's compute divided by the group size. Off by itself under gradient
    checkpointing, or if a one-off check finds the model's cached forward differs."""
    lr: float = 5e-5
    """AdamW learning rate (RL on the tiny model collapses at 4e-4; 5e-5 learns steadily)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 2
    """Linear warmup in optimiser steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule after warmup."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm; 0 disables it."""
    skip_flat_steps: bool = True
    """Take no optimiser step in a rollout step whose every advantage is 0 (every group flat): no policy gradient
    is left, only the KL penalty's and entropy bonus's near-zero gradients, which Adam would scale into full-size
    steps (issue 49: kl/ref rose from 7e-14 to 6e-3 in 5 flat steps). false: update as in any other step."""
    ref_update_every: int = 0
    """Replace the reference/anchor model by the policy every K optimiser steps (0: never); [RPG] arXiv
    2505.17508 section 5, docs/algorithms/rpg.md "Iterative reference update".
    Checked once per rollout step, after its updates: the refresh happens at the end of the rollout
    step in which the optimiser-step count reaches a multiple of K, and takes effect from the next
    rollout step (whose reference log-probs are computed then)."""
    ref_update_kl: float = 0.0
    """...or when the mean `kl/ref` of the last 5 rollout steps exceeds this (0: never); also checked
    once per rollout step."""
    ref_update_mix: float = 1.0
    """a of the soft reference update at each refresh (ref_update_every / ref_update_kl): ref <- a * policy +
    (1 - a) * ref, weight by weight (TR-DPO, arXiv 2404.09656; TRL's ref_model_mixup_alpha, 0.6 there). 1.0: the
    reference becomes the policy (the hard copy). Refused under model.lora, whose reference cannot move."""
    entropy_target: Optional[float] = None
    """Adaptive entropy control (Skywork-OR1, arXiv 2505.22312; TRL's use_adaptive_entropy with entropy_target):
    each rollout step's entropy bonus is alpha = c * 1[e <= target], e the sampling policy's entropy estimated from
    the batch, -mean(log pi_sampler) of its tokens (policy/entropy_rollout; needs rollout.top_p=1 and temperature
    > 0); after a step that took an optimiser step, c moves by entropy_coef_step up (e < target) or down
    (e > target), within [entropy_coef_min, entropy_coef_max]. c starts at objective.entropy_coef and is
    checkpointed. The authors' target: 0.2 nats. null: off (docs/algorithms/entropy.md)."""
    entropy_coef_step: float = 0.0001
    """Delta, the change of the adaptive entropy coefficient per step (trainer.entropy_target; the authors'
    training scripts: 1e-4; TRL's default: 0.005)."""
    entropy_coef_min: float = 0.0
    """Lower bound of the adaptive entropy coefficient (the authors' training scripts: 0)."""
    entropy_coef_max: float = 0.005
    """Upper bound of the adaptive entropy coefficient (the authors' training scripts: 0.005; TRL's default: 1.0)."""
    eval_every: int = 50
    """Rollout steps between held-out evaluations (also at step 0 and the last step)."""
    step0_cache: Optional[str] = None
    """A directory where step 0's held-out evaluation is stored and reused by runs that start from the same
    model with the same evaluation settings (tether.trainer.step_zero says which settings); null: every run
    evaluates its own. `tether compare` sets OUT/step0, so that a comparison evaluates its initial model once."""
    eval_batch_size: int = 64
    """Held-out problems per greedy `generate` call at each evaluation (all `data.eval_size` at once made
    one batch of 8 GSM8K problems x 128 tokens take about 2 minutes on a loaded 2-core CPU, with memory
    growing with eval_size). Greedy completions do not depend on it, but for float rounding on near-ties."""
    save_every: int = 100
    """Rollout steps between checkpoints (also at the last step)."""
    keep_last: int = 2
    """Checkpoints kept; older ones are deleted."""
    max_nonfinite_steps: int = 3
    """Stop, with a checkpoint, after this many steps in a row with a skipped update (NaN/inf loss or gradient; skipped
    updates leave the weights unchanged)."""
    log_samples: int = 4
    """Completions per step written to samples.jsonl."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    sampling_seed: Optional[int] = None
    """Seed of the sampling stream alone (rollout tokens, mini-batch order); null: `seed`. Another value keeps the
    initial model, data order and held-out set and draws independent samples."""
    minibatch_seed: Optional[int] = None
    """Seed of the mini-batch order alone; null: the sampling stream's. Another value changes nothing but the order
    in which each batch is split into mini-batches: `tether compare --null-control`'s A/A arm."""
    device: str = "auto"
    """cpu, cuda, cuda:N or auto: cuda when available, except for models under
    `small_model_params` parameters, which train faster on the CPU (launch-bound on a GPU; a log
    line says so)."""
    small_model_params: int = SMALL_MODEL_PARAMS
    """With device=auto, models with fewer parameters stay on the CPU (0: always the GPU when there is one).
    The default tiny model (1,075,328 parameters) ran its 1000 steps in 152 s on 2 CPU cores against 226 s on an
    H100."""
    autocast: Literal["auto", "bf16", "off"] = "auto"
    """Mixed precision: bf16 runs every forward pass (rollout, log-probs, updates) under
    torch.autocast in bfloat16 on float32 master weights and optimiser state (model.dtype=auto then
    loads float32); auto is bf16 on CUDA and off on CPU; off runs in the weights' dtype."""
    threads: int = 0
    """torch CPU threads. 0: auto, half the cores this process may use, at least 1 and at most 8
    (torch's default of every core made a step 18x slower than 1 thread on a loaded 2-core CPU with
    one competing process: docs/performance.md, CPU threads under contention); -1: torch's default."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tb."""
    wandb: bool = False
    """Log to Weights & Biases (needs `pip install wandb`)."""
    wandb_project: str = "tether"
    """Weights & Biases project."""
    progress: bool = True
    """Show progress: a live bar on a terminal; plain log lines (every `log_every` steps and at each
    held-out evaluation) when the output is not a terminal (a file, nohup, Slurm, tee)."""
    log_every: int = 0
    """Rollout steps between plain progress lines when the output is not a terminal; 0: every step for runs of
    up to 100 steps, else a fortieth of the run (25 for 1000 steps). `log_every_steps` resolves it."""

    @property
    def log_every_steps(self) -> int:
        """`log_every`, with 0 resolved (its docstring)."""
        if self.log_every > 0:
            return self.log_every
        return 1 if self.total_steps <= 100 else max(1, self.total_steps // 40)

    @property
    def ratio_is_one(self) -> bool:
        """THE test of an inactive trust region: every update's ratio to pi_old is 1, since there is one optimiser
        step per rollout batch and pi_old is the policy it starts from (recomputed; or the sampler's own
        log-probs, which are the same policy when there is no staleness). `trainer.step` skips the old log-prob
        pass on it (when nothing stale needs logging), and `trainer.setup` warns of a trust region that cannot act."""
        return self.updates_per_batch == 1 and (self.old_logprobs == "recompute" or self.staleness == 0)

    @property
    def updates_per_batch(self) -> int:
        """Optimiser steps per rollout batch, ppo_epochs x mini_batches: with 1 every update is on-policy
        (ratio 1, pi_old is the policy being differentiated), and a trust region cannot act."""
        return self.ppo_epochs * self.mini_batches

    plots: bool = True
    """Write PNG plots of the metrics at the end."""
