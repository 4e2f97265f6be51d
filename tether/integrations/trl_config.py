"""The GRPOConfig checks of the TRL adapter (tether.integrations.trl, which re-exports them): the settings it cannot
honour, the `beta` that loads TRL's reference exactly when the objective uses one, TRL's and the objective's reward
aggregation agreeing, and the warning when a trust region can never act (the adapter's departures 2, 5 and 6)."""

from __future__ import annotations

from typing import Any, Optional

from ..objectives import Objective


def inactive_trust_region(args: Any, obj: Objective) -> Optional[str]:
    """A warning when the objective's trust region can never act under these settings (departure 6).

    TRL computes old log-probs only when a generation batch outlives one optimiser step, that is
    when `gradient_accumulation_steps` is not a multiple of `steps_per_generation * num_iterations`.
    """
    generate_every = (args.steps_per_generation or args.gradient_accumulation_steps) * args.num_iterations
    if not obj.has_trust_region() or args.gradient_accumulation_steps % generate_every != 0:
        return None
    return (
        f"objective {obj.name!r} clips by the ratio to the sampling policy, but with num_iterations="
        f"{args.num_iterations}, steps_per_generation={args.steps_per_generation} and gradient_accumulation_steps="
        f"{args.gradient_accumulation_steps} every generation batch is used within one optimiser step: the ratio is "
        "1, the clip is inactive and the objective reduces to its unclipped policy gradient. Set num_iterations>=2, "
        "or steps_per_generation to a multiple of gradient_accumulation_steps greater than it "
        "(generation_batch_size = k x the optimiser batch), for an active trust region."
    )


def reference_beta(obj: Objective) -> float:
    """The TRL `beta` that loads the reference exactly when the objective uses it (departure 2)."""
    if not obj.uses_reference():
        return 0.0
    return obj.config.reference_kl_coef() or 1.0


def unsupported_options(args: Any, obj: Objective) -> list[str]:
    """GRPOConfig settings this adapter cannot honour, each with what to do instead."""
    problems = []
    if args.top_entropy_quantile < 1.0:
        problems.append(
            "top_entropy_quantile < 1 (TRL's high-entropy token mask acts inside TRL's loss, which tether replaces); "
            "set 1.0 and the objective's top_entropy_frac (the same selection, within each micro-batch)"
        )
    if args.off_policy_mask_threshold is not None:
        problems.append("off_policy_mask_threshold (TRL's off-policy sequence mask); set None")
    if args.delta is not None:
        problems.append("delta (TRL's two-sided clip); set None and use the objective's dual_clip_c")
    if args.entropy_coef != 0 or args.use_adaptive_entropy:
        problems.append(
            "entropy_coef / use_adaptive_entropy (TRL's entropy bonus and its adaptive control act inside TRL's loss); "
            "set the objective's entropy_coef (adaptive control is tether's own trainer's, trainer.entropy_target)"
        )
    if args.use_vllm and args.vllm_importance_sampling_correction:
        problems.append(
            "vllm_importance_sampling_correction=True (TRL's sampler correction multiplies TRL's per-token loss, "
            "which tether replaces); set it False"
        )
    if obj.uses_teacher():
        problems.append(
            "the objective's distill (GRPOTrainer computes no teacher log-probs); use TRL's DistillationTrainer (or "
            "GKD / IW-OPD), or tether's own trainer with teacher.name_or_path"
        )
    if args.sync_ref_model and not obj.uses_reference():
        problems.append(
            f"sync_ref_model=True, but objective {obj.name!r} uses no reference model; set it False, "
            "or use kl_penalty or an RPG objective with anchor: ref"
        )
    return problems


def reward_aggregation_conflict(args: Any, obj: Objective, advantages: str) -> list[str]:
    """TRL's `multi_objective_aggregation` and the objective's `reward_aggregation` must say the same: with
    advantages="tether" the objective's decides and TRL's would be ignored, with "trl" the other way round."""
    trl_gdpo = args.multi_objective_aggregation == "normalize_then_sum"
    if trl_gdpo == obj.needs_reward_parts():
        return []
    if advantages == "tether":
        return [
            f"multi_objective_aggregation={args.multi_objective_aggregation!r}, but the objective's "
            f"reward_aggregation is {obj.config.reward_aggregation!r}, which decides with advantages='tether'; "
            "set the objective's reward_aggregation (normalize_then_sum for GDPO) and leave TRL's at its default"
        ]
    return [
        f"the objective's reward_aggregation={obj.config.reward_aggregation!r} is not used with "
        f"advantages='trl' (TRL's multi_objective_aggregation={args.multi_objective_aggregation!r} decides); "
        "set them to agree, or use advantages='tether'"
    ]
