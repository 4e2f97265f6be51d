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
8. TROLL's sparse supports (`install_support_hooks`), for an objective with a sparse support only:
   - the driver's `RayPPOTrainer._compute_old_log_prob(batch)`, which keeps only the log-probs, entropies,
     routed experts and sum_pi_squared of the actor's `compute_log_prob` output: wrapped so that the actor's worker
     is asked for pi_old's sparse set too (the non-tensor key `SIZE_KEY` in the TensorDict it sends), which is
     then added to the returned batch as (N, T, K) fields `SET_FIELDS`, with `SIZE_KEY` in its meta_info (which
     `DataProto.to_tensordict` makes a non-tensor key of the update's TensorDict);
   - the FSDP engine's `FSDPEngineWithLMHead.prepare_model_outputs(output, output_args, micro_batch, ...)`, where
     the logits exist: wrapped so that, when the micro-batch carries `SIZE_KEY`, the model output also holds the
     set (the old pass, without gradient) or pi_theta on the support (the update), in the response layout
     verl's `no_padding_2_padding` gives; read from `output.logits` (bsz, seq, V) and `output_args["temperature"]`
     of the path without remove-padding, fused kernels or sequence parallelism, each refused otherwise;
   - `ppo_loss`'s wrapper (3.) publishes the model output too (`model_output_field`).
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

from ..core.troll import SparseSet
from ..model.head import CompletionHead
from ..model.support import set_of, support_of
from ..objectives import SupportSize

__all__ = [
    "PolicyLossConfig",
    "agg_loss",
    "batch_field",
    "config_get",
    "guard_trl_probe",
    "install_batch_hook",
    "install_support_hooks",
    "model_output_field",
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
_MODEL_OUTPUT: ContextVar[Optional[Mapping]] = ContextVar("tether_verl_model_output", default=None)


@contextlib.contextmanager
def micro_batch(data: Mapping) -> Iterator[None]:
    """Let tether's losses read `ref_log_prob` and `returns` from `data` (verl's micro-batch
    TensorDict, or a dict of (N, T) tensors) while the block runs."""
    token = _MICRO_BATCH.set(data)
    try:
        yield
    finally:
        _MICRO_BATCH.reset(token)


def _padded(data: Any, name: str) -> torch.Tensor:
    """Field `name` of a verl micro-batch as a padded tensor (a jagged nested one padded with 0)."""
    t = data[name]
    return t.to_padded_tensor(0) if t.is_nested else t


def batch_field(name: str, like: torch.Tensor, required: bool = True) -> Optional[torch.Tensor]:
    """Field `name` of the published micro-batch, padded like verl pads old_log_probs; None if absent.

    A field of the wrong shape is an error when the loss needs it, and skipped when only a metric would use it.
    """
    data = _MICRO_BATCH.get()
    if data is None or name not in data.keys():
        return None
    t = _padded(data, name)
    if t.shape != like.shape:
        if not required:
            return None
        raise ValueError(f"verl's micro-batch field {name!r} has shape {tuple(t.shape)}, expected {tuple(like.shape)}")
    return t.to(device=like.device, dtype=like.dtype)


def model_output_field(name: str) -> Any:
    """Entry `name` of the model output `ppo_loss` is computing the loss of (8.), or None."""
    output = _MODEL_OUTPUT.get()
    return None if output is None else output.get(name)


def _publishing(ppo_loss):
    @functools.wraps(ppo_loss)
    def ppo_loss_publishing_micro_batch(config, model_output, data, dp_group=None):
        token = _MODEL_OUTPUT.set(model_output)
        try:
            with micro_batch(data):
                return ppo_loss(config, model_output, data, dp_group)
        finally:
            _MODEL_OUTPUT.reset(token)

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


# ---------------------------------------------------------------- 8. TROLL's sparse supports

SIZE_KEY = "tether_sparse_support"
"""Non-tensor key of a TensorDict (and meta_info key of a DataProto): (top_k, mass) of the sets to compute."""
SET_FIELDS = ("tether_old_set_ids", "tether_old_set_logp", "tether_old_set_keep")
"""pi_old's set, (N, T, K) each, in the batch from the old pass to the update."""
SUPPORT_OUTPUT = "tether_support"
"""The model-output entry of the update's forward: TokenBatch's four support fields (`SupportLogprobs.batch_fields`),
in the response layout."""


def _response_head(output: Any, output_args: dict, micro_batch: Any, loss_mask: torch.Tensor):
    """A `CompletionHead` on the response positions of a micro-batch (bsz, T, V): verl's logits / temperature."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    for key, default in (("use_remove_padding", True), ("use_fused_kernels", False)):
        if tu.get_non_tensor_data(data=micro_batch, key=key, default=default):
            raise ValueError(
                f"tether's sparse supports (troll) under verl read the logits of the path without remove-padding "
                f"or fused kernels; {key} is on: set actor_rollout_ref.model.{key}=False"
            )
    logits = output.logits  # (bsz, seq, V): each sequence's real tokens from column 0 (no remove-padding)
    if type(logits) is not torch.Tensor:  # a DTensor: vocabulary-sharded
        raise ValueError("tether's sparse supports (troll) under verl need unsharded logits (no tensor parallelism)")
    offsets = micro_batch["input_ids"].offsets()
    flat = torch.cat([logits[i, :n] for i, n in enumerate(offsets.diff().tolist())])  # (nnz, V), the logits' dtype
    z = no_padding_2_padding(torch.nested.nested_tensor_from_jagged(flat, offsets=offsets.to(flat.device)), micro_batch)
    tau = output_args["temperature"].to(device=z.device, dtype=torch.float32).clamp(min=1e-8)
    return CompletionHead(loss_mask.bool(), 1.0, None, logits=z.float() / tau[:, None, None])  # (bsz, T, V)


def _supports(output: Any, output_args: dict, micro_batch: Any, size: Any) -> dict:
    """The model-output entries (8.): without gradient and without sets in the batch (the old pass), pi_old's set as
    nested (bsz, T, K) tensors; with gradient (the update), pi_theta on the support, `SUPPORT_OUTPUT`; nothing in a
    forward-only pass that runs once the sets exist (the reference's, after verl merged the old pass's output)."""
    if not torch.is_grad_enabled() and SET_FIELDS[0] in micro_batch.keys():
        return {}  # a forward-only pass after the old one (the reference's): the sets exist, nothing to add
    mask = _padded(micro_batch, "response_mask").bool()
    head = _response_head(output, output_args, micro_batch, mask)
    responses = _padded(micro_batch, "responses").to(mask.device)
    if not torch.is_grad_enabled():
        found = set_of(head, size)
        return {
            k: torch.nested.as_nested_tensor(list(v.unbind()), layout=torch.jagged) for k, v in zip(SET_FIELDS, found)
        }
    old = None
    if SET_FIELDS[0] in micro_batch.keys():
        old = SparseSet(*(_padded(micro_batch, k).to(mask.device) for k in SET_FIELDS))
    old_lp = _padded(micro_batch, "old_log_probs").to(mask.device) if old is not None else None
    _, _, support = support_of(head, responses, size, old, old_lp, with_entropy=False)  # verl has its own
    return {SUPPORT_OUTPUT: support.batch_fields()}  # a dict: verl's detach_tree rebuilds tuples positionally


def _engine_hook(prepare_model_outputs: Callable) -> Callable:
    @functools.wraps(prepare_model_outputs)
    def prepare_model_outputs_with_supports(self, output, output_args, micro_batch, logits_processor_func):
        from verl.utils import tensordict_utils as tu

        out = prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func)
        size = tu.get_non_tensor_data(data=micro_batch, key=SIZE_KEY, default=None)
        if size is not None:
            out.update(_supports(output, output_args, micro_batch, _size(size)))
        return out

    prepare_model_outputs_with_supports.tether_hook = True
    return prepare_model_outputs_with_supports


def _size(size: Any) -> Any:
    return SupportSize(int(size[0]), float(size[1]))


def _old_pass_hook(compute_old_log_prob: Callable, sparse_size: Callable[[Any], Any]) -> Callable:
    @functools.wraps(compute_old_log_prob)
    def compute_old_log_prob_with_sets(self, batch):
        size = sparse_size(self.config.actor_rollout_ref.actor)
        if size is None:
            return compute_old_log_prob(self, batch)
        workers, sent = self.actor_rollout_wg, {}

        class _Asking:  # the actor's workers, asked for pi_old's sets as well
            def __getattr__(self, name):
                return getattr(workers, name)

            def compute_log_prob(self, td):
                from verl.utils import tensordict_utils as tu

                tu.assign_non_tensor(td, **{SIZE_KEY: (size.top_k, size.mass)})
                sent["td"], sent["out"] = td, workers.compute_log_prob(td)
                return sent["out"]

        self.actor_rollout_wg = _Asking()
        try:
            result, mfu = compute_old_log_prob(self, batch)
        finally:
            self.actor_rollout_wg = workers
        from verl.utils import tensordict_utils as tu

        for name, dtype in zip(SET_FIELDS, (torch.int32, torch.float32, torch.bool)):  # 9 K bytes a token
            found = tu.get(sent["out"], name)
            if found is None:
                raise ValueError(
                    f"the actor's old log-prob pass returned no {name}: tether's sparse supports (troll) need verl's "
                    "FSDP engine (actor_rollout_ref.actor.strategy=fsdp or fsdp2) with tether's plugin loaded in "
                    "its workers"
                )
            result.batch[name] = found.to_padded_tensor(0).to(dtype)
        result.meta_info[SIZE_KEY] = (size.top_k, size.mass)
        return result, mfu

    compute_old_log_prob_with_sets.tether_hook = True
    return compute_old_log_prob_with_sets


def install_support_hooks(sparse_size: Callable[[Any], Any]) -> None:
    """Wrap the FSDP engine's `prepare_model_outputs` and the driver's `_compute_old_log_prob` (8.; idempotent).
    `sparse_size(actor_config)` is the (top_k, mass) of the run's objective, or None when it reads no support."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    if not getattr(FSDPEngineWithLMHead.prepare_model_outputs, "tether_hook", False):
        FSDPEngineWithLMHead.prepare_model_outputs = _engine_hook(FSDPEngineWithLMHead.prepare_model_outputs)
    try:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    except ImportError:  # no Ray here: a worker process, or verl without its trainer
        return
    if not getattr(RayPPOTrainer._compute_old_log_prob, "tether_hook", False):
        RayPPOTrainer._compute_old_log_prob = _old_pass_hook(RayPPOTrainer._compute_old_log_prob, sparse_size)
