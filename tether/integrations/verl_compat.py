"""Every place the verl plugin (tether.integrations.verl) touches verl beyond its documented plugin API.

Checked against verl 0.9.1 (the plugin declares verl >= 0.9, < 0.10). A new verl release is a review
of this file: each touchpoint below says what it relies on.

1. Registries: `core_algos.POLICY_LOSS_REGISTRY` / `ADV_ESTIMATOR_REGISTRY` (dicts name -> function),
   read to make registration idempotent, and `register_policy_loss` / `register_adv_est`.
2. `verl.workers.config.PolicyLossConfig`, subclassed so a `tether_*` loss_mode can carry an objective.
3. `ppo_loss(config, model_output, data, dp_group=None)`, wrapped where verl binds it (its definition
   in verl.workers.utils.losses and the two modules that import it by name, `PPO_LOSS_SITES`) so the
   loss can read fields of the micro-batch `data` that verl's policy-loss signature does not pass:
   `ref_log_prob` and `returns`, (N, T) tensors or jagged nested tensors padded with 0.
4. The advantage-estimator contract: `fn(token_level_rewards, response_mask, index, config, ...)`
   returns `(advantages, returns)`, both (N, T), which verl stores as the batch's `advantages` and
   `returns`; `returns` is the only per-sample slot an estimator can fill, so tether's estimators put
   ETR's group statistic there (tether.core.etr.GroupStats.to_tokens) and the loss reads it back.
5. The actor config the loss receives: a Mapping or an object with `global_batch_info` (the global
   normalisers `agg_loss` takes, with `loss_scale_factor`), `policy_loss.{loss_mode, objective,
   overrides}`, `use_kl_loss`, `kl_loss_coef`; the algorithm config's `use_kl_in_reward`, `kl_ctrl.kl_coef`.
6. `core_algos.agg_loss(loss_mat, loss_mask, loss_agg_mode, **global_batch_info)`.
7. `verl.models.transformers.monkey_patch.is_trl_available`, the name `apply_monkey_patch` (run on
   every model verl's FSDP engine builds, the actor's included) checks before it imports trl's
   `AutoModelForCausalLMWithValueHead`. verl 0.9.0 and 0.9.1 import it whenever trl is installed;
   trl 1.16 has no such class, so the import fails and no actor starts. `guard_trl_probe`
   makes that one name answer whether trl has the class; nothing else of verl changes.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Optional

import torch
from verl.trainer.ppo import core_algos
from verl.workers.config import PolicyLossConfig

__all__ = [
    "PolicyLossConfig",
    "agg_loss",
    "batch_field",
    "config_get",
    "guard_trl_probe",
    "install_batch_hook",
    "micro_batch",
    "plain",
    "register_estimator",
    "register_loss",
]

VERIFIED_VERL = "0.9.1"

# ---------------------------------------------------------------- 1. registries


def claim(registry: dict, name: str, fn: Callable, register: Callable, kind: str, owner: str) -> None:
    """Register `fn` under `name` unless module `owner` already did (an earlier import); another's is an error."""
    current = registry.get(name)
    if current is not None:
        if getattr(current, "__module__", None) == owner:
            return  # registered by an earlier import of the plugin
        raise ValueError(f"verl already has a {kind} named {name!r} ({current!r}) that is not tether's")
    register(name)(fn)


def register_loss(name: str, fn: Callable, owner: str) -> None:
    claim(core_algos.POLICY_LOSS_REGISTRY, name, fn, core_algos.register_policy_loss, "policy loss", owner)


def register_estimator(name: str, fn: Callable, owner: str) -> None:
    claim(core_algos.ADV_ESTIMATOR_REGISTRY, name, fn, core_algos.register_adv_est, "advantage estimator", owner)


# ---------------------------------------------------------------- 3. the micro-batch hook

_MICRO_BATCH: ContextVar[Optional[Mapping]] = ContextVar("tether_verl_micro_batch", default=None)


@contextlib.contextmanager
def micro_batch(data: Mapping) -> Iterator[None]:
    """Let tether's losses read `ref_log_prob` and `returns` from `data` (verl's micro-batch
    TensorDict, or a dict of (N, T) tensors) while the block runs."""
    token = _MICRO_BATCH.set(data)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def batch_field(name: str, like: torch.Tensor, required: bool = True) -> Optional[torch.Tensor]:
    """Field `name` of the published micro-batch, padded like verl pads old_log_probs; None if absent.

    A field of the wrong shape is an error when the loss needs it, and skipped when only a metric would use it.
    """
    data = _MICRO_BATCH.get()
    if data is None or name not in data.keys():
        return None
    t = data[name]
    if t.is_nested:
        t = t.to_padded_tensor(0.0)
    if t.shape != like.shape:
        if not required:
            return None
        raise ValueError(f"verl's micro-batch field {name!r} has shape {tuple(t.shape)}, expected {tuple(like.shape)}")
    return t.to(device=like.device, dtype=like.dtype)


def _publishing(ppo_loss):
    @functools.wraps(ppo_loss)
    def ppo_loss_publishing_micro_batch(config, model_output, data, dp_group=None):
        with micro_batch(data):
            return ppo_loss(config, model_output, data, dp_group)

    ppo_loss_publishing_micro_batch.tether_hook = True
    return ppo_loss_publishing_micro_batch


PPO_LOSS_SITES = ("verl.workers.utils.losses", "verl.trainer.distillation.losses", "verl.workers.engine_workers")
"""Where verl 0.9 binds `ppo_loss`: its definition, and the two modules that import it by name."""


def install_batch_hook() -> list[str]:
    """Wrap verl's `ppo_loss` so that it publishes each micro-batch (idempotent).

    The wrapper changes nothing verl computes. Run at plugin load, before verl's workers bind
    `ppo_loss`; a module that already bound it is patched too. Returns the patched modules.
    """
    importlib.import_module(PPO_LOSS_SITES[0])  # the definition site must exist before it is wrapped

    patched = []
    for site in PPO_LOSS_SITES:
        module = sys.modules.get(site)
        fn = getattr(module, "ppo_loss", None)
        if fn is None:
            continue
        if not getattr(fn, "tether_hook", False):
            setattr(module, "ppo_loss", _publishing(fn))
        patched.append(site)
    return patched


# ---------------------------------------------------------------- 5. and 6. configs and aggregation


def config_get(obj: Any, key: str) -> Any:
    """verl passes an ActorConfig (a Mapping), a DictConfig, or another loss's config: read either way."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def plain(x: Any) -> Any:
    """OmegaConf containers (or any mapping/sequence) -> plain dicts and lists."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return [plain(v) for v in x]
    return x


def global_batch_info(config: Any) -> dict:
    """The global normalisers verl's `agg_loss` takes (loss_scale_factor among them)."""
    return dict(config_get(config, "global_batch_info") or {})


def agg_loss(per_token: torch.Tensor, mask: torch.Tensor, mode: str, batch_info: dict) -> torch.Tensor:
    """verl's aggregation of a (N, T) per-token loss with its global-batch normalisers."""
    return core_algos.agg_loss(loss_mat=per_token, loss_mask=mask, loss_agg_mode=mode, **batch_info)


# ---------------------------------------------------------------- 7. verl's probe for trl's value-head model

TRL_PROBE_SITE = "verl.models.transformers.monkey_patch"
"""The module whose `is_trl_available` gates verl 0.9's import of trl's AutoModelForCausalLMWithValueHead."""
VALUE_HEAD = "AutoModelForCausalLMWithValueHead"


@functools.cache
def trl_has_value_head() -> bool:
    """Whether trl is installed and still has the value-head model (in trl.experimental.ppo or trl),
    where verl 0.9 imports it from; checked on first use, so loading the plugin does not import trl."""
    from verl.utils.import_utils import is_trl_available

    if not is_trl_available():
        return False
    for module in ("trl.experimental.ppo", "trl"):
        try:
            if hasattr(importlib.import_module(module), VALUE_HEAD):
                return True
        except ImportError:
            continue
    return False


def guard_trl_probe() -> bool:
    """Let verl's FSDP engine build a model when trl without the value-head model is installed (idempotent).

    verl 0.9's `apply_monkey_patch` runs `if is_trl_available(): from trl import AutoModelForCausalLMWithValueHead`
    only to patch that class's `state_dict`; with trl 1.16 installed beside verl (tether[dev], or a user's
    environment with both) the import raises and verl's actor cannot start. The guard answers that check with
    `trl_has_value_head()`: True exactly where verl's import succeeds, so verl is unchanged wherever it worked.
    Returns whether the guard is in place.
    """
    module = importlib.import_module(TRL_PROBE_SITE)
    current = getattr(module, "is_trl_available", None)
    if current is None:
        return False
    if not getattr(current, "tether_guard", False):

        def is_trl_available_with_value_head() -> bool:
            return trl_has_value_head()

        is_trl_available_with_value_head.tether_guard = True
        module.is_trl_available = is_trl_available_with_value_head
    return True
