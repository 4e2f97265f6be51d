"""tether's advantage estimators as verl advantage estimators (`tether_<estimator>`, registered by
`tether.integrations.verl`): `fn(token_level_rewards, response_mask, index, config, ...)` -> (advantages, returns),
both (N, T), the outcome reward of each sample grouped by verl's `uid`, and ETR's group statistic nu_g - nu_bar in
`returns`, the one per-sample slot an estimator fills (verl_compat item 4), which tether's loss reads back."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..core import advantages as _adv
from ..core import etr as _etr
from ..schema import ConfigError
from .verl_compat import config_get

ESTIMATORS: dict[str, str] = {"tether_" + name: name for name in _adv.ADVANTAGES.names()}
"""verl adv_estimator -> tether advantage estimator name."""


def _check_no_kl_in_reward(config: Any) -> None:
    """tether's estimators read outcome rewards; verl's KL-in-reward would change them unseen."""
    coef = config_get(config_get(config, "kl_ctrl"), "kl_coef")
    if config_get(config, "use_kl_in_reward") and coef:
        raise ConfigError(
            f"algorithm.kl_ctrl.kl_coef={coef}: with algorithm.use_kl_in_reward=True verl subtracts its KL "
            f"penalty from "
            "the rewards tether's advantage estimators read; set algorithm.kl_ctrl.kl_coef=0 (then it only makes verl "
            "compute ref_log_prob) or algorithm.use_kl_in_reward=False, and put the KL in the objective "
            "(kl_penalty, RPG)"
        )


def group_shift(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """nu_g - nu_bar (N,): ETR's centred reward-variance share of each sample's group, over the
    whole batch (`tether.core.etr.etr_group_stats`, the one home of the formula)."""
    return _etr.etr_group_stats(rewards, group_ids).nu_shift


def _group_ids(index: Any, device: torch.device) -> torch.Tensor:
    labels = np.asarray(list(index), dtype=object)
    _, inverse = np.unique(labels, return_inverse=True)
    return torch.as_tensor(inverse.reshape(-1), device=device)


def _make_estimator(adv_estimator: str):
    name = ESTIMATORS[adv_estimator]

    def estimator(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any = None, config: Any = None, **unused
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns), both (N, T): tether's estimator, and ETR's nu_g - nu_bar in `returns`."""
        if index is None:
            raise ValueError(
                f"{adv_estimator} groups samples by prompt and needs `index` (verl passes non_tensor_batch['uid']); "
                "this batch has no 'uid'"
            )
        _check_no_kl_in_reward(config)
        with torch.no_grad():
            rewards = token_level_rewards.sum(-1)  # (N,) outcome reward
            group_ids = _group_ids(index, rewards.device)
            mask = response_mask.to(rewards.dtype)
            # Response lengths weigh batch-level statistics (reinforce_pp whitens over tokens, as verl does).
            adv = _adv.compute_advantages(name, rewards, group_ids, weights=mask.sum(-1))
            return adv[:, None] * mask, _etr.etr_group_stats(rewards, group_ids).to_tokens(mask)

    estimator.__name__ = estimator.__qualname__ = adv_estimator
    return estimator
