"""tether's objectives and advantage estimators as a verl plugin (verl >= 0.9, < 0.10).

Importing this module registers with verl

    policy losses          tether_<objective>   one per tether objective (`tether.objectives.names()`):
                                                tether_ppo_clip, tether_divergence_clip, tether_gspo,
                                                tether_luspo, tether_gmpo, tether_vespo, tether_reinforce,
                                                tether_cispo, tether_dro, tether_rpg, tether_etr,
                                                tether_dppo, tether_m2po, tether_sapo, tether_clip_cov,
                                                tether_kl_cov
                           tether_<preset>      one per preset (`tether.objectives.preset_names()`):
                                                tether_atr_grpo, tether_rpg_urkl, tether_dapo, ...
                                                `tether_<name>` runs what `objective: <name>` runs in
                                                tether's own config (a preset wins over an objective
                                                of the same name, as there)
    advantage estimators   tether_<estimator>   one per tether estimator (`tether.core.advantages.ADVANTAGES`):
                                                tether_grpo, tether_dr_grpo, tether_rloo, tether_reinforce_pp,
                                                tether_reinforce_pp_no_baseline, tether_grpo_batch_std,
                                                tether_maxrl

verl >= 0.9.1 imports it in every process that imports verl (the driver and every Ray worker)
through the `verl.plugins` entry point in tether's pyproject.toml; older versions import it
through VERL_USE_EXTERNAL_MODULES=tether.integrations.verl. docs/verl.md is the user's guide.
Every touchpoint into verl's internals (its registries, the `ppo_loss` wrapper, the micro-batch
fields, the `returns` slot, its config keys) is in `verl_compat.py`, with the verl version checked.

No math of its own. Per micro-batch, with l_t the tether objective's per-token loss and kl_t its
per-token KL penalty (`Objective.terms`: the same masking, group statistics and metrics as in
tether's trainer and the TRL adapter), m the response mask and c_t verl's rollout importance
weights (1 when absent):

    pg_loss = agg_loss(c_t l_t, m, loss_agg_mode, **global_batch_info)  [+ coef agg_loss(kl_t, ...)]

which is how verl's own losses reduce theirs, so the result is invariant to the data-parallel
size and the micro-batching in the same way.

Where this departs from tether's own trainer, and why:
1. Aggregation is verl's `agg_loss` with verl's global-batch normalisers. The objective's
   `aggregation` must name the same mode as `actor.loss_agg_mode` (an error says which to change),
   because verl also aggregates the entropy and KL terms with that mode; tether's `max_len` is
   verl's `actor.loss_scale_factor`.
2. ETR's group statistic nu_g - nu_bar comes from tether's advantage estimators, which compute it
   over the whole training batch on the driver (`tether.core.etr.etr_group_stats`, the function
   tether's trainer and the TRL adapter call once per rollout batch) and hand it to the loss in
   verl's `returns` slot. The loss cannot compute it: it sees micro-batches, whose groups verl's
   sequence-length balancing splits across ranks. The loss then runs the objective's own ETR
   surrogate with those statistics. `macro: implicit` and `reward_range` would need each group's
   rewards in the loss and are refused; `etr/nu_mean` and the pass-rate buckets are not logged.
3. verl's loss signature has no slot for the reference log-probs or `returns`. A pass-through
   wrapper around verl's `ppo_loss` publishes each micro-batch while the loss runs
   (`install_batch_hook`); objectives that need those fields raise an error naming the fix when
   they are missing.
4. The entropy bonus is verl's `actor.entropy_coeff` (the objective's `entropy_coef` must be 0),
   and verl's `clip_ratio*` keys are not read: the objective's `eps_*`, `delta`, ... are.
5. An objective that folds the rollout-correction weights into its own weight (VESPO, as the authors' verl recipe
   does) gets verl's rollout_is_weights as `TokenBatch.rollout_weights` instead of having them multiplied in.
6. `sampler_kl_coef` is refused: verl's loss signature has no sampler log-probs (`rollout_log_probs` reach
   the loss only in some of verl's paths), so the squared log-ratio to the sampler cannot be computed there.
   So is `top_entropy_frac` (no per-token entropy in the signature), and `distill`: verl distils with its own
   teacher workers (`distillation.*`). TROLL's sparse supports (`ObjectiveConfig.sparse_support`), which the
   signature lacks too, come through tether's hooks (verl_compat item 8): pi_old's sets from the driver's old
   pass, pi_theta on the supports from the FSDP engine's logits, on the path without remove-padding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from tether import objectives
from tether.core import aggregation as _agg
from tether.core.masked import masked_fraction, masked_mean
from tether.core.registry import unknown_name_message
from tether.schema import ConfigError

from .verl_estimators import ESTIMATORS, _make_estimator, group_shift  # noqa: F401  (group_shift: public)
from .verl_compat import (  # every touchpoint into verl's internals (versions checked there)
    PolicyLossConfig,
    agg_loss,
    batch_field,
    config_get,
    global_batch_info,
    guard_trl_probe,
    SUPPORT_OUTPUT,
    install_batch_hook,
    install_support_hooks,
    micro_batch,  # noqa: F401  (public: publish a micro-batch by hand, as the tests do)
    model_output_field,
    plain,
    register_estimator,
    register_loss,
)

PREFIX = "tether_"


def _objective_named(name: str) -> str:
    """The objective a preset or objective name selects, read from the preset file (nothing is built at import)."""
    spec = objectives.spec_mapping(name)
    return objectives.load_preset(name)["name"] if "preset" in spec else spec["name"]


LOSS_MODE_SPECS: dict[str, str] = {PREFIX + name: name for name in [*objectives.names(), *objectives.preset_names()]}
"""verl loss_mode -> the preset or objective it runs when `policy_loss.objective` is null: every objective and
every preset by its own name (tether_atr_grpo -> atr_grpo), as `objective: <name>` in tether's own config."""
LOSS_MODES: dict[str, str] = {mode: _objective_named(name) for mode, name in LOSS_MODE_SPECS.items()}
"""verl loss_mode -> the tether objective it runs (tether_atr_grpo -> divergence_clip)."""
HOOK_ENV = "TETHER_VERL_BATCH_HOOK"
"""Set to 0 to leave verl's ppo_loss unwrapped (objectives needing ref_log_prob or returns then fail)."""

_KEY = "actor_rollout_ref.actor.policy_loss"

# ---------------------------------------------------------------- config


@dataclass
class TetherPolicyLossConfig(PolicyLossConfig):
    """verl's policy-loss config plus the tether objective a `tether_*` loss_mode runs.

    From Hydra: `actor_rollout_ref.actor.policy_loss._target_=tether.integrations.verl.TetherPolicyLossConfig`,
    `...policy_loss.loss_mode=tether_rpg`, `+...policy_loss.objective=rpg_urkl`,
    `+...policy_loss.overrides={beta:0.001}` (docs/verl.md).
    """

    objective: Optional[str] = None
    """A tether preset (atr_grpo, rpg_urkl, etr, ...) or objective name; null: the one loss_mode names."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """Objective keys that replace the preset's values, e.g. {beta: 0.001, anchor: ref} (docs/algorithms/)."""

    def __post_init__(self):
        # verl instantiates the actor config on the driver to validate it: fail there, not at the first update.
        objective_from(self.loss_mode, self.objective, self.overrides)


_OBJECTIVES: dict[str, objectives.Objective] = {}


def objective_from(
    loss_mode: str, objective: Optional[str] = None, overrides: Optional[Mapping] = None
) -> objectives.Objective:
    """The tether objective that `loss_mode` runs, built once per distinct (objective, overrides)."""
    if loss_mode not in LOSS_MODES:
        raise ConfigError(f"{_KEY}.loss_mode: {unknown_name_message('tether loss mode', loss_mode, list(LOSS_MODES))}")
    overrides = plain(overrides or {})
    key = json.dumps([loss_mode, objective, overrides], sort_keys=True, default=repr)
    if key not in _OBJECTIVES:
        _OBJECTIVES[key] = _build(loss_mode, objective, overrides)
    return _OBJECTIVES[key]


def _build(loss_mode: str, objective: Optional[str], overrides: dict) -> objectives.Objective:
    name = LOSS_MODES[loss_mode]
    objective = objective or LOSS_MODE_SPECS[loss_mode]
    try:  # the overrides replace the values of `objective` (a preset or objective name)
        obj = objectives.build(overrides, default=objective)
    except (ConfigError, KeyError) as e:
        raise ConfigError(f"{_KEY}: {e}") from None
    if obj.name != name:
        fix = f"{PREFIX}{objective}" if PREFIX + objective in LOSS_MODES else f"{PREFIX}{obj.name}"
        raise ConfigError(
            f"{_KEY}.objective {objective!r} is tether objective {obj.name!r}, but loss_mode {loss_mode!r} "
            f"runs {name!r}; set loss_mode={fix}"
        )
    _refuse_what_verl_does_not_pass(obj)
    return _without_teacher(obj)


def _refuse_what_verl_does_not_pass(obj: objectives.Objective) -> None:
    """ConfigError for a setting the objective would need that verl's policy-loss signature does not carry (the
    entropy, the sampler's log-probs, a reward's parts, group statistics beyond nu_g - nu_bar) or that is verl's own
    there (rollout correction), each naming verl's way to get it."""
    cfg = obj.config
    if cfg.trains_entropy:
        raise ConfigError(f"{_KEY}: entropy_coef must be 0 under verl; use actor_rollout_ref.actor.entropy_coeff")
    if "entropy" in cfg.needs():  # verl computes the entropy, but its policy-loss signature does not pass it
        why = cfg.needs()["entropy"]
        raise ConfigError(
            f"{_KEY}: {why}, from the per-token entropy verl passes no policy loss; top_entropy_frac=null"
        )
    if cfg.reward_aggregation != "sum":
        raise ConfigError(
            f"{_KEY}: reward_aggregation={cfg.reward_aggregation!r} belongs to the advantage estimator under verl, "
            "which reads the reward's parts (algorithm.adv_estimator=gdpo with algorithm.gdpo_reward_keys); "
            "drop the override"
        )
    if cfg.rollout_correction is not None:
        raise ConfigError(
            f"{_KEY}: rollout_correction is verl's own under verl (algorithm.rollout_correction, e.g. its TIS or k3 "
            "rejection presets); the plugin multiplies verl's rollout_is_weights into the loss. Drop the override."
        )
    if cfg.sampler_kl_coef > 0:
        raise ConfigError(
            f"{_KEY}: sampler_kl_coef needs the sampler's log-probs in the loss, which verl's policy-loss signature "
            "does not carry; set sampler_kl_coef=0 (verl's algorithm.rollout_correction bounds the mismatch instead)"
        )
    if "sampler_logprobs" in cfg.needs():  # verl's policy-loss signature carries no rollout log-probs
        raise ConfigError(
            f"{_KEY}: objective {obj.name!r} with these settings reads the sampler's log-probs "
            f"({cfg.needs()['sampler_logprobs']}), which verl does not pass to a policy loss; use verl's "
            "algorithm.rollout_correction for the sampler mismatch (m2po: against=old)"
        )
    # Capabilities, not names: verl's `returns` slot carries one group statistic, nu_g - nu_bar,
    # computed by the tether_* estimators from the batch's observed reward range.
    unsupported = set(cfg.group_stats_needed()) - {"nu_shift"}
    if unsupported:
        raise ConfigError(
            f"{_KEY}: objective {obj.name!r} with these settings needs the group statistic(s) {sorted(unsupported)} "
            "inside the loss (ETR macro='implicit' needs each group's rewards), which verl does not pass; use "
            "macro=explicit (its statistic comes from a tether_* advantage estimator) or macro=off"
        )
    options = cfg.group_stats_options() if cfg.needs_group_stats() else {}
    if options:
        raise ConfigError(
            f"{_KEY}: {', '.join(options)} is not supported under verl: the tether_* advantage estimators compute "
            "the group statistics from the batch's rewards alone (nu_g from its observed reward range, for 0/1 "
            f"rewards the same as [0, 1]); set {', '.join(f'{k}=null' for k in options)}"
        )


def _without_teacher(obj: objectives.Objective) -> objectives.Objective:
    """`obj`, unless it distills: verl's policy-loss signature passes no teacher log-probs (departure 6)."""
    if obj.uses_teacher():
        raise ConfigError(
            f"{_KEY}: distill needs the teacher's log-probs in the loss, which verl's policy-loss signature does not "
            "pass; distillation is verl's own under verl (distillation.enabled with distillation.teacher_models and "
            "distillation.distillation_loss: loss_mode k1/k3/forward_kl_topk, use_policy_gradient, use_task_rewards), "
            "which supplies them. Drop distill (and the opd preset) from the tether objective"
        )
    return obj


def _objective_for(config: Any, loss_mode: str) -> objectives.Objective:
    policy_loss = config_get(config, "policy_loss")
    if policy_loss is not None and config_get(policy_loss, "loss_mode") == loss_mode:
        return objective_from(loss_mode, config_get(policy_loss, "objective"), config_get(policy_loss, "overrides"))
    return objective_from(loss_mode)


def sparse_size(actor_config: Any) -> Optional[objectives.SupportSize]:
    """The (top_k, mass) of the sets the actor's tether objective reads (TROLL), or None: what the driver's old pass
    asks the actor for (departure 6, verl_compat item 8)."""
    loss_mode = config_get(config_get(actor_config, "policy_loss"), "loss_mode")
    if loss_mode not in LOSS_MODES:
        return None
    return _objective_for(actor_config, loss_mode).config.sparse_support()


def _support(obj: objectives.Objective) -> dict:
    """TokenBatch's support fields for an objective with a sparse support, from the forward's model output."""
    if obj.config.sparse_support() is None:
        return {}
    support = model_output_field(SUPPORT_OUTPUT)
    if support is None:
        raise ValueError(
            f"tether objective {obj.name!r} reads pi_theta's log-probs on sparse supports, and verl's model output "
            "has none: the actor's old log-prob pass must run (not bypass mode), through verl's FSDP engine, with "
            f"tether's hooks installed ({HOOK_ENV} must not be 0)"
        )
    return support


# ---------------------------------------------------------------- fields of the micro-batch


def _reference(obj: objectives.Objective, like: torch.Tensor) -> torch.Tensor:
    ref = batch_field("ref_log_prob", like)
    if ref is None:
        why = obj.config.needs()["ref_logprobs"]
        raise ValueError(
            f"tether objective {obj.name!r} needs the reference log-probs ({why}), but verl's micro-batch has no "
            "'ref_log_prob'. verl computes them only when actor_rollout_ref.actor.use_kl_loss=True, which also adds "
            "verl's own low_var_kl loss unless actor_rollout_ref.actor.kl_loss_coef=0 (set both), or when "
            "algorithm.use_kl_in_reward=True, which also subtracts verl's KL from the rewards tether's estimators "
            "read unless algorithm.kl_ctrl.kl_coef=0 (set both); tether checks both coefficients at run time. "
            f"tether reads the log-probs through its ppo_loss hook ({HOOK_ENV} must not be 0). "
            "Or use anchor=old / kl_penalty.coef=0."
        )
    return ref


def _group_stats_from_batch(advantages: torch.Tensor, mask: torch.Tensor) -> objectives.GroupStats:
    """ETR's per-sequence nu_g - nu_bar, read from verl's `returns` (N, T), where the estimator put it."""
    return objectives.GroupStats.from_tokens(_group_shift_from_batch(advantages, mask), mask)


def _group_shift_from_batch(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    shift = batch_field("returns", advantages)
    fix = f"set algorithm.adv_estimator to one of {', '.join(ESTIMATORS)}, or the override macro=off"
    if shift is None:
        raise ValueError(
            "tether_etr with macro='explicit' needs each group's reward-variance share, which tether's advantage "
            f"estimators put in verl's 'returns' field, and the micro-batch has none ({HOOK_ENV} must not be 0); {fix}"
        )
    zero = torch.zeros_like(shift)
    copied = torch.equal(torch.where(mask, shift, zero), torch.where(mask, advantages, zero))
    if copied and bool((advantages[mask] != 0).any()):
        raise ValueError(
            "tether_etr with macro='explicit': verl's 'returns' equal the advantages, so they came from one of verl's "
            f"estimators, which do not compute ETR's group statistic; {fix}"
        )
    return shift


# ---------------------------------------------------------------- losses


def policy_loss(
    obj: objectives.Objective,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A built tether objective with verl's policy-loss signature and conventions.

    old_log_prob, log_prob, advantages, response_mask, rollout_is_weights: (N, T). `config` is
    verl's actor config; only its `global_batch_info` is read here.
    """
    batch_info = global_batch_info(config)
    _check_aggregation(obj, loss_agg_mode, batch_info)
    _check_no_hidden_kl_loss(obj, config)
    mask = response_mask.bool()
    adv = advantages.to(log_prob.dtype)
    ref = _reference(obj, log_prob) if obj.uses_reference() else batch_field("ref_log_prob", log_prob, required=False)
    stats = _group_stats_from_batch(adv, mask) if obj.needs_group_stats() else None
    # The objective's own per-token terms (masking, group statistics, KL penalty, metrics: one
    # implementation, Objective.terms); only the aggregation is verl's.
    folds = obj.config.folds_rollout_correction() and rollout_is_weights is not None  # departure 5
    terms = obj.terms(
        objectives.TokenBatch(
            logprobs=log_prob,
            old_logprobs=old_log_prob.to(log_prob.dtype),
            advantages=adv,
            loss_mask=mask,
            ref_logprobs=ref,
            group_stats=stats,
            rollout_weights=rollout_is_weights if folds else None,
            **_support(obj),
        )
    )

    def reduce(per_token: torch.Tensor) -> torch.Tensor:
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
        return agg_loss(per_token, mask, loss_agg_mode, batch_info)

    weights = 1.0 if rollout_is_weights is None or folds else rollout_is_weights
    loss = reduce(terms.tokens.loss * weights)
    if terms.kl_penalty is not None:
        loss = loss + obj.config.kl_penalty.coef * reduce(terms.kl_penalty)
    log_w = torch.where(mask, log_prob.detach() - old_log_prob.to(log_prob.dtype), torch.zeros_like(log_prob))
    return loss, _metrics(terms, log_w, mask)


def _check_no_hidden_kl_loss(obj: objectives.Objective, config: Any) -> None:
    """An objective with its own KL to the reference must not get verl's KL loss on top of it.

    verl computes `ref_log_prob` only with `use_kl_loss=True` (or KL in the reward), and that also
    adds its low_var_kl loss at `kl_loss_coef` (default 0.001): the user asked for tether's KL only.
    """
    coef = config_get(config, "kl_loss_coef")
    if obj.uses_reference() and config_get(config, "use_kl_loss") and coef:
        raise ConfigError(
            f"actor_rollout_ref.actor.kl_loss_coef={coef}: with use_kl_loss=True verl adds its own KL loss to tether "
            f"objective {obj.name!r}, which has its own KL to the reference; set "
            f"actor_rollout_ref.actor.kl_loss_coef=0 "
            "(use_kl_loss=True then only makes verl compute ref_log_prob)"
        )


def _check_aggregation(obj: objectives.Objective, mode: str, batch_info: dict) -> None:
    cfg = obj.config
    if mode not in _agg.AGGREGATIONS:
        raise ConfigError(
            f"actor_rollout_ref.actor.loss_agg_mode={mode!r} has no tether counterpart; use one of "
            f"{', '.join(_agg.AGGREGATIONS.names())} with tether objectives"
        )
    if cfg.aggregation != mode:
        raise ConfigError(
            f"tether objective {obj.name!r} aggregates with {cfg.aggregation!r} but "
            f"actor_rollout_ref.actor.loss_agg_mode is {mode!r} (verl aggregates the policy, entropy and KL terms with "
            f"it); set loss_agg_mode={cfg.aggregation} or the override aggregation={mode}"
        )
    scale = batch_info.get("loss_scale_factor")
    if mode == "seq-mean-token-sum-norm" and cfg.max_len is not None and scale != cfg.max_len:
        raise ConfigError(
            f"tether objective {obj.name!r} has max_len={cfg.max_len} but actor_rollout_ref.actor.loss_scale_factor is "
            f"{scale}; verl's loss_scale_factor is the T_max of seq-mean-token-sum-norm: set it to {cfg.max_len}"
        )


def _metrics(terms: objectives.TokenTerms, log_w: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's three standard keys (its definitions), then the objective's own metrics under actor/tether/."""
    tokens = terms.tokens
    named = {
        # verl: share of tokens a ratio bound clipped, mean of log(pi_old / pi_theta), share dual-clipped.
        "actor/pg_clipfrac": masked_fraction(tokens.clip_low | tokens.clip_high, mask),
        "actor/ppo_kl": masked_mean(-log_w, mask),
        "actor/pg_clipfrac_lower": masked_fraction(tokens.clip_dual, mask),
    }
    named.update({f"actor/tether/{k}": v for k, v in terms.metrics.items()})
    # One host sync for all of them; verl's own losses return floats.
    values = torch.stack([v.detach().reshape(()).to(torch.float64) for v in named.values()]).tolist()
    return dict(zip(named, values))


def _make_loss(loss_mode: str):
    def loss(
        old_log_prob: torch.Tensor,
        log_prob: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Optional[torch.Tensor] = None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        obj = _objective_for(config, loss_mode)
        return policy_loss(
            obj, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )

    loss.__name__ = loss.__qualname__ = loss_mode
    loss.__doc__ = (
        f"verl policy loss {loss_mode!r}: tether {LOSS_MODE_SPECS[loss_mode]!r}, objective "
        f"{LOSS_MODES[loss_mode]!r} (see policy_loss)."
    )
    return loss


# ---------------------------------------------------------------- registration


def register() -> None:
    """Register every tether loss and estimator with verl and install the batch hook (idempotent)."""
    for loss_mode in LOSS_MODES:
        register_loss(loss_mode, _make_loss(loss_mode), owner=__name__)
    for adv_estimator in ESTIMATORS:
        register_estimator(adv_estimator, _make_estimator(adv_estimator), owner=_make_estimator.__module__)
    if os.environ.get(HOOK_ENV, "1") != "0":
        install_batch_hook()
        install_support_hooks(sparse_size)
    guard_trl_probe()  # verl 0.9's actor imports a class trl 1.16 removed (verl_compat.py, item 7)


register()
