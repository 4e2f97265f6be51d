"""tether inside verl (CPU, float64): the plugin loads through verl's entry point, verl's registries
hand out tether's losses and estimators, and each gives the loss, gradient and metrics of the
tether code it adapts; tether losses that restate a verl loss agree with verl's own; the hook
carries ref_log_prob and returns through verl's real ppo_loss; the example's Hydra overrides
exist in verl's config schema; and the errors name their fix.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

verl = pytest.importorskip("verl")

from tensordict import TensorDict  # noqa: E402  (verl's dependency)
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

from tether import objectives  # noqa: E402
from tether.core import advantages as A  # noqa: E402
from tether.schema import ConfigError  # noqa: E402

tv = sys.modules.get("tether.integrations.verl")  # loaded by `import verl`, through the entry point
if tv is None:  # the subprocess test below says why; import it so the rest can still run
    import tether.integrations.verl as tv
from tether.integrations import verl_compat  # noqa: E402

D = torch.float64
G = 4  # samples per prompt
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl" / "run_qwen2.5_math_7b_dapo.sh"


def _data(N=12, T=6, seed=0):
    """Random (N, T) tensors with padding (holding garbage that must not matter), 0/1 rewards in
    groups of G: group 0 all correct (zero variance), group 1 mixed, the rest random."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    old = -torch.rand(N, T, generator=g, dtype=D) - 0.1
    lp = old + 0.35 * torch.randn(N, T, generator=g, dtype=D)  # ratios from ~0.5 to ~2: every clip acts
    lp, old = (torch.where(mask, x, torch.full_like(x, 7.0)) for x in (lp, old))
    ref = old - 0.3 * torch.rand(N, T, generator=g, dtype=D)
    groups = torch.arange(N) // G
    rewards = torch.randint(0, 2, (N,), generator=g).to(D)
    rewards[:G] = 1.0
    rewards[G], rewards[G + 1] = 1.0, 0.0
    # verl's outcome reward sits on the last response token.
    token_rewards = torch.zeros(N, T, dtype=D)
    token_rewards[torch.arange(N), lengths - 1] = rewards
    uids = np.array([f"prompt-{int(i)}" for i in groups], dtype=object)
    weights = 0.5 + torch.rand(N, T, generator=g, dtype=D)
    return dict(
        lp=lp,
        old=old,
        ref=ref,
        mask=mask,
        groups=groups,
        rewards=rewards,
        token_rewards=token_rewards,
        uids=uids,
        weights=weights,
    )


def _actor_config(policy_loss=None, **kw):
    """verl's own actor config, as its workers build it."""
    return FSDPActorConfig(
        strategy="fsdp",
        rollout_n=G,
        ppo_micro_batch_size_per_gpu=2,
        **({"policy_loss": policy_loss} if policy_loss is not None else {}),
        **kw,
    )


def _verl_loss(loss_mode, d, config, agg, weights=None, fields=None):
    """(loss, d loss / d lp, metrics) from the function verl's registry returns for `loss_mode`."""
    lp = d["lp"].clone().requires_grad_()
    adv, returns = d["adv_tok"], d["returns"]
    fn = core_algos.get_policy_loss_fn(loss_mode)
    with tv.micro_batch(fields if fields is not None else {"ref_log_prob": d["ref"], "returns": returns}):
        loss, metrics = fn(
            old_log_prob=d["old"],
            log_prob=lp,
            advantages=adv,
            response_mask=d["mask"],
            loss_agg_mode=agg,
            config=config,
            rollout_is_weights=weights,
        )
    loss.backward()
    return loss.detach(), lp.grad, metrics


# ---------------------------------------------------------------- loading and registration


_LOAD_CHECK = (
    "import sys, verl\n"
    "from verl.trainer.ppo import core_algos as ca\n"
    "from verl.workers.utils import losses\n"
    "assert 'tether.integrations.verl' in sys.modules, 'plugin not imported'\n"
    "print(sorted(k for k in ca.POLICY_LOSS_REGISTRY if k.startswith('tether_')))\n"
    "print(sorted(k for k in ca.ADV_ESTIMATOR_REGISTRY if k.startswith('tether_')))\n"
    "print(getattr(losses.ppo_loss, 'tether_hook', False))\n"
)


@pytest.mark.slow
@pytest.mark.parametrize("route", ["entry point", "VERL_USE_EXTERNAL_MODULES"])
def test_plugin_loads_in_a_fresh_process(route):
    # verl logs a plugin that fails to import at debug level and goes on: check the effects, in a clean interpreter.
    # The older route (verl < 0.9.1) is run with entry-point discovery off, so only it can load the plugin.
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_USE_EXTERNAL_MODULES", "VERL_USE_EXTERNAL_PLUGINS")}
    if route != "entry point":
        env.update(VERL_USE_EXTERNAL_PLUGINS="none", VERL_USE_EXTERNAL_MODULES="tether.integrations.verl")
    out = subprocess.run([sys.executable, "-c", _LOAD_CHECK], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    losses, estimators, hooked = out.stdout.strip().splitlines()[-3:]
    assert eval(losses) == sorted(f"tether_{n}" for n in {*objectives.names(), *objectives.preset_names()})
    assert eval(estimators) == sorted(f"tether_{n}" for n in A.ADVANTAGES.names())
    assert hooked == "True"


_TRAINER_IMPORTS = (
    "import sys, torch, verl\n"
    "import transfer_queue, verl.trainer.main_ppo, verl.trainer.main_ppo_v0\n"
    "from verl.trainer.ppo.v1 import AgentLoopManagerTQ, get_trainer_cls\n"
    "from verl.workers.engine_workers import ActorRolloutRefWorker\n"
    "from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead\n"
    "from verl.models.transformers import monkey_patch\n"
    "from transformers import LlamaConfig, LlamaForCausalLM\n"
    "get_trainer_cls('sync')\n"
    "model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
    "                                     num_attention_heads=2, num_key_value_heads=2))\n"
    "# what verl's FSDP engine runs on every model it builds: it imported trl's value-head class, gone in trl 1.16\n"
    "monkey_patch.apply_monkey_patch(model=model, use_remove_padding=False, ulysses_sp_size=1)\n"
    "import importlib.util\n"
    "print(importlib.util.find_spec('trl') is not None, monkey_patch.is_trl_available())\n"
)


@pytest.mark.slow
def test_verls_trainer_and_actor_modules_import_and_build_a_model_here():
    # Issue 34, item 1: in the environment CI uses (tether[dev]: verl, TransferQueue and trl 1.16 together), in a
    # fresh interpreter, everything main_ppo and its actor workers import, and the model patch the FSDP engine
    # applies to every model it builds (which imported a class trl 1.16 removed).
    out = subprocess.run([sys.executable, "-c", _TRAINER_IMPORTS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    trl_installed, probe = out.stdout.split()[-2:]
    assert trl_installed == "True" and probe == str(verl_compat.trl_has_value_head())


def test_the_trl_probe_guard_answers_whether_trl_has_the_value_head():
    # Fast half of the test above: the plugin replaced verl's check, which with trl 1.16 (no value-head class) is False.
    from verl.models.transformers import monkey_patch

    assert verl_compat.guard_trl_probe() and verl_compat.guard_trl_probe()  # idempotent
    assert monkey_patch.is_trl_available.tether_guard
    import trl

    has = hasattr(trl, verl_compat.VALUE_HEAD)
    assert monkey_patch.is_trl_available() is verl_compat.trl_has_value_head() is has
    assert trl.__version__.startswith("1.16") and not has


def test_the_entry_point_is_declared():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert eps.get("tether") == "tether.integrations.verl"


def test_only_verl_compat_imports_verl():
    # Issue 25, item 6: every touchpoint into verl (registries, ppo_loss, config classes) is in verl_compat.py.
    import inspect
    import re

    source = inspect.getsource(tv)
    assert not re.search(r"^\s*(from|import) verl\b", source, re.M) and "core_algos" not in source
    assert re.search(r"^from verl\.trainer\.ppo import core_algos", inspect.getsource(verl_compat), re.M)


def test_verl_registries_return_tethers_functions():
    assert set(tv.LOSS_MODES.values()) == set(objectives.names())
    for mode in tv.LOSS_MODES:
        assert core_algos.get_policy_loss_fn(mode).__module__ == "tether.integrations.verl"
    for name in A.ADVANTAGES.names():
        assert core_algos.get_adv_estimator_fn(f"tether_{name}").__module__ == "tether.integrations.verl_estimators"
    tv.register()  # a second registration is a no-op, not a duplicate-name error
    with pytest.raises(ValueError, match="not tether's"):
        verl_compat.claim({"tether_rpg": print}, "tether_rpg", print, None, "policy loss", owner=tv.__name__)


# ---------------------------------------------------------------- losses = tether's objectives

# (loss_mode, objective, overrides): every registered loss at least once, plus the paths that
# read the reference (anchor=ref, kl_penalty) and ETR's group statistic.
CASES = [
    ("tether_ppo_clip", "ppo_clip", {}),
    ("tether_ppo_clip", "dapo", {"dual_clip_c": 3.0}),
    ("tether_ppo_clip", "dr_grpo", {}),  # seq-mean-token-sum-norm
    ("tether_ppo_clip", "grpo", {"aggregation": "token-mean"}),  # k3 KL penalty to the reference
    ("tether_ppo_clip", "dapo", {"kl_penalty": {"estimator": "k3_iw", "coef": 0.1}}),
    ("tether_divergence_clip", "atr_grpo", {}),
    ("tether_divergence_clip", "divergence_clip", {"measure": "hellinger", "delta": 0.05, "dual_clip_c": 3.0}),
    ("tether_gspo", "gspo", {}),  # seq-mean-token-mean
    ("tether_cispo", "cispo", {}),
    ("tether_reinforce", "reinforce", {"importance_weight": True}),
    ("tether_rpg", "rpg_urkl", {}),
    ("tether_rpg", "rpg_fkl", {"anchor": "ref", "beta": 0.05}),
    ("tether_rpg", "rpg_urkl_diff", {"anchor": "ref", "beta": 0.05}),
    ("tether_rpg", "rpg_rkl", {"clip": "none", "form": "reinforce", "beta": 0.05}),
    ("tether_etr", "etr", {}),
    ("tether_etr", "etr", {"macro": "off", "dual_clip_c": 3.0}),
    ("tether_etr", "etr", {"alpha": 0.0, "eta": 1.0}),
    ("tether_dppo", "dppo_tv", {}),
    ("tether_dppo", "dppo_kl", {"truncation_c": 1.3, "aggregation": "token-mean"}),
    ("tether_dppo", "dppo", {"measure": "kl3", "delta_low": 0.0231, "delta_high": 0.05}),
    ("tether_sapo", "sapo", {}),
    ("tether_gmpo", "gmpo", {}),
    ("tether_clip_cov", "clip_cov", {"select_frac": 1.0, "cov_lb": 0.02}),  # every candidate chosen: no draw
    ("tether_kl_cov", "kl_cov", {"select_frac": 0.1}),
    ("tether_m2po", "m2po", {"tau": 0.01}),
    ("tether_luspo", "luspo", {"eps_low": 0.2, "eps_high": 0.2}),  # seq-mean-token-sum
    ("tether_vespo", "vespo", {}),
    ("tether_dro", "dro", {"beta": 0.1}),
    ("tether_bapo", "bapo", {}),
    ("tether_gppo", "gppo", {}),
    ("tether_ce_gppo", "ce_gppo", {}),
    ("tether_aspo", "aspo", {}),
    ("tether_pspo", "pspo", {}),
    ("tether_cfpo", "cfpo", {}),
    ("tether_trm", "trm", {"max_delta": 0.5}),  # the test data's ratios are far from 1: keep some sequences
    ("tether_dgpo", "dgpo", {}),
    ("tether_abc_grpo", "abc_grpo", {}),
]


# Objectives whose loss reads more than the sampled tokens' log-probs (TROLL's sparse supports, which only a forward
# of the model gives): tested inside verl's own actor, against tether's trainer (test_verl_actor_runs_tethers_update).
TESTED_IN_VERLS_ACTOR = {"troll"}


def test_the_cases_cover_every_objective():
    assert {tv.LOSS_MODES[c[0]] for c in CASES} == set(objectives.names()) - TESTED_IN_VERLS_ACTOR


def test_an_objective_with_a_sparse_support_says_what_its_loss_needs_when_the_forward_gave_none():
    # TROLL's supports come from the FSDP engine's forward through tether's hooks (verl_compat item 8), after the
    # driver's old pass kept pi_old's sets; a loss called without them names what must run.
    assert tv.sparse_size(_actor_config(tv.TetherPolicyLossConfig(loss_mode="tether_troll"))).top_k == 64
    assert tv.sparse_size(_actor_config(tv.TetherPolicyLossConfig(loss_mode="tether_dapo"))) is None
    pl = tv.TetherPolicyLossConfig(loss_mode="tether_troll", overrides={"top_k": 8})
    d = _data()
    d["adv_tok"], d["returns"] = d["lp"] * 0 + 1.0, d["lp"] * 0
    with pytest.raises(ValueError, match="has none: the actor's old log-prob pass must run"):
        _verl_loss("tether_troll", d, _actor_config(pl), "token-mean")


def _both_sides(loss_mode, objective, overrides, d, batch_info=None, loss_norm=None):
    """verl's registered loss (estimator -> loss, verl's config) and tether's objective on the same tensors."""
    pl = tv.TetherPolicyLossConfig(loss_mode=loss_mode, objective=objective, overrides=overrides)
    obj = tv.objective_from(loss_mode, objective, overrides)
    agg = obj.config.aggregation
    config = _actor_config(pl, loss_agg_mode=agg)
    config.global_batch_info.update(batch_info or {})
    est = core_algos.get_adv_estimator_fn(f"tether_{obj.config.advantage}")
    d["adv_tok"], d["returns"] = est(token_level_rewards=d["token_rewards"], response_mask=d["mask"], index=d["uids"])
    v_loss, v_grad, metrics = _verl_loss(loss_mode, d, config, agg)

    lp = d["lp"].clone().requires_grad_()
    out = obj(
        objectives.TokenBatch(
            logprobs=lp,
            old_logprobs=d["old"],
            advantages=obj.advantages(d["rewards"], d["groups"]),
            loss_mask=d["mask"],
            ref_logprobs=d["ref"],
            group_ids=d["groups"],
            rewards=d["rewards"],
            loss_norm=loss_norm,
        )
    )
    out.loss.backward()
    return (v_loss, v_grad, metrics), (out.loss.detach(), lp.grad, out.metrics), agg


@pytest.mark.parametrize("loss_mode,objective,overrides", CASES, ids=[f"{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_verl_loss_equals_tether_objective(loss_mode, objective, overrides):
    d = _data()
    (v_loss, v_grad, vm), (t_loss, t_grad, tm), agg = _both_sides(loss_mode, objective, overrides, d)
    # verl's seq-mean-token-mean divides each sequence by (its tokens + 1e-8); tether by its tokens.
    tol = dict(rtol=1e-7, atol=1e-9) if agg == "seq-mean-token-mean" else dict(rtol=1e-11, atol=1e-13)
    assert t_loss.abs() > 1e-4 and t_grad.abs().sum() > 1e-3  # a case that tests nothing is a defect
    torch.testing.assert_close(v_loss, t_loss, **tol)
    torch.testing.assert_close(v_grad, t_grad, **tol)
    # Metrics: tether's under actor/tether/, verl's three keys by verl's definitions.
    for key in (
        "policy/clipfrac_low",
        "policy/clipfrac_high",
        "policy/clipfrac_dual",
        "policy/ratio_mean",
        "policy/ratio_max",
        "policy/kl_old",
        "kl/ref",
    ):
        assert vm[f"actor/tether/{key}"] == pytest.approx(float(tm[key]), rel=1e-6, abs=1e-9), key
    clipped = float(tm["policy/clipfrac_low"] + tm["policy/clipfrac_high"])  # disjoint: they need A < 0 and A > 0
    assert vm["actor/pg_clipfrac"] == pytest.approx(clipped, abs=1e-6)
    assert vm["actor/pg_clipfrac_lower"] == pytest.approx(float(tm["policy/clipfrac_dual"]), abs=1e-6)
    if objective.startswith("rpg"):
        assert vm["actor/tether/rpg/kl_anchor"] == pytest.approx(float(tm["rpg/kl_anchor"]), rel=1e-9)
    if loss_mode == "tether_etr":
        assert vm["actor/tether/etr/eps_high_mean"] == pytest.approx(float(tm["etr/eps_high_mean"]), rel=1e-9)
    assert all(isinstance(v, float) for v in vm.values())


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_global_batch_info_normalises_like_tethers_minibatch_normaliser(agg):
    # A micro-batch that is 1/3 of the global batch over dp_size 2: verl divides by the global
    # totals and multiplies by dp_size, i.e. tether's loss_norm = global total / dp_size.
    d = _data(seed=1)
    obj = tv.objective_from("tether_ppo_clip", "dapo", {"aggregation": agg})
    n_tok, n_seq, t_max = int(d["mask"].sum()), int(d["mask"].any(-1).sum()), d["mask"].shape[1]
    info = {"dp_size": 2, "batch_num_tokens": 3 * n_tok, "global_batch_size": 3 * n_seq, "loss_scale_factor": None}
    norm = {"token-mean": 3 * n_tok, "seq-mean-token-sum-norm": 3 * n_seq * t_max}.get(agg, 3 * n_seq) / 2
    (v_loss, v_grad, _), (t_loss, t_grad, _), _ = _both_sides(
        "tether_ppo_clip", "dapo", {"aggregation": agg}, d, info, norm
    )
    assert obj.config.aggregation == agg
    tol = dict(rtol=1e-7, atol=1e-9) if agg == "seq-mean-token-mean" else dict(rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(v_loss, t_loss, **tol)
    torch.testing.assert_close(v_grad, t_grad, **tol)


# ---------------------------------------------------------------- agreement with verl's own losses

# tether losses whose math verl also ships: same loss, gradient and standard metrics, with
# rollout importance weights and global batch info, under every aggregation mode.
SAME_AS_VERL = [
    (
        "vanilla",
        dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0),
        "tether_ppo_clip",
        "ppo_clip",
        {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0},
    ),
    (
        "cispo",
        dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
        "tether_cispo",
        "cispo",
        {"eps_low": 0.2, "eps_high": 0.28},
    ),
    ("gspo", dict(clip_ratio_low=3e-4, clip_ratio_high=4e-4), "tether_gspo", "gspo", {}),
]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize(
    "verl_mode,verl_kw,loss_mode,objective,overrides", SAME_AS_VERL, ids=[c[0] for c in SAME_AS_VERL]
)
def test_matches_verls_own_loss(verl_mode, verl_kw, loss_mode, objective, overrides, agg):
    d = _data(seed=2)
    d["adv_tok"] = torch.randn(d["mask"].shape[0], 1, dtype=D) * d["mask"]
    d["returns"] = d["adv_tok"]
    info = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 20, "loss_scale_factor": 9}
    overrides = {**overrides, "aggregation": agg}
    ours = _actor_config(
        tv.TetherPolicyLossConfig(loss_mode=loss_mode, objective=objective, overrides=overrides), loss_agg_mode=agg
    )
    theirs = _actor_config(loss_agg_mode=agg, **verl_kw)
    for c in (ours, theirs):
        c.global_batch_info.update(info)
    o_loss, o_grad, om = _verl_loss(loss_mode, d, ours, agg, weights=d["weights"])
    v_loss, v_grad, vm = _verl_loss(verl_mode, d, theirs, agg, weights=d["weights"])
    assert v_grad.abs().sum() > 1e-3
    torch.testing.assert_close(o_loss, v_loss, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(o_grad, v_grad, rtol=1e-11, atol=1e-13)
    for key in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert om[key] == pytest.approx(float(vm[key]), rel=1e-6, abs=1e-7), key
    assert vm["actor/pg_clipfrac"] > 0 or verl_mode == "gspo"


# ---------------------------------------------------------------- advantage estimators


def test_estimators_equal_tethers_and_verls():
    d = _data(seed=3)
    r, m, uids = d["token_rewards"], d["mask"], d["uids"]
    verl_twin = {
        "tether_grpo": lambda: core_algos.compute_grpo_outcome_advantage(r, m, uids),
        "tether_dr_grpo": lambda: core_algos.compute_grpo_outcome_advantage(r, m, uids, norm_adv_by_std_in_grpo=False),
        "tether_rloo": lambda: core_algos.compute_rloo_outcome_advantage(r, m, uids),
    }
    for name in sorted(set(A.ADVANTAGES.names()) - A.BATCH_WEIGHTED):  # reinforce_pp: test_reinforce_pp_* below
        adv, returns = core_algos.get_adv_estimator_fn(f"tether_{name}")(
            token_level_rewards=r, response_mask=m, index=uids, config=None
        )
        expected = A.compute_advantages(name, d["rewards"], d["groups"])[:, None] * m
        torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
        if f"tether_{name}" in verl_twin:  # maxrl: verl has none (SkyRL's and prime-rl's: test_maxrl_gdpo.py)
            torch.testing.assert_close(adv, verl_twin[f"tether_{name}"]()[0], rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(returns, tv.group_shift(d["rewards"], d["groups"])[:, None] * m)
        assert adv[:G].abs().max() == 0  # the zero-variance group


def test_group_shift_hand_computed():
    # G = 8 with 0/1 rewards: pass rates 4/8, 1/8, 0/8 -> nu = 4p(1-p) = 1, 0.4375, 0.
    # nu_bar over groups with nu > 0 = (1 + 0.4375) / 2 = 0.71875; shift = nu - nu_bar.
    rewards = torch.tensor([1.0] * 4 + [0.0] * 4 + [1.0] + [0.0] * 7 + [0.0] * 8, dtype=D)
    groups = torch.arange(24) // 8
    shift = tv.group_shift(rewards, groups)
    expected = torch.tensor([0.28125] * 8 + [-0.28125] * 8 + [-0.71875] * 8, dtype=D)
    torch.testing.assert_close(shift, expected, rtol=0, atol=1e-15)


# ---------------------------------------------------------------- through verl's real ppo_loss


def _micro_batch_td(d, P=3):
    """A dense micro-batch as verl's ppo_loss receives it, and the flat log-probs its model returns."""
    N, T = d["mask"].shape
    lengths = d["mask"].sum(-1)
    attn = torch.cat([torch.ones(N, P, dtype=torch.long), d["mask"].long()], dim=1)
    td = TensorDict(
        {
            "prompts": torch.ones(N, P, dtype=torch.long),
            "responses": torch.ones(N, T, dtype=torch.long),
            "attention_mask": attn,
            "response_mask": d["mask"],
            "old_log_probs": d["old"],
            "advantages": d["adv_tok"],
            "returns": d["returns"],
            "ref_log_prob": d["ref"],
        },
        batch_size=[N],
    )
    tu.assign_non_tensor(td, dp_size=1, batch_num_tokens=None, global_batch_size=None)
    # The model's log-prob of response token t sits at flat position (seq start + P - 1 + t).
    starts = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), (P + lengths)[:-1]]), 0)
    flat = torch.zeros(int(attn.sum()), dtype=D)
    for i in range(N):
        flat[starts[i] + P - 1 : starts[i] + P - 1 + lengths[i]] = d["lp"][i, : lengths[i]]
    return td, flat


@pytest.mark.parametrize(
    "loss_mode,objective,overrides",
    [
        ("tether_rpg", "rpg_urkl", {"anchor": "ref", "beta": 0.05}),  # needs ref_log_prob
        ("tether_etr", "etr", {}),  # needs returns
    ],
)
def test_ppo_loss_hook_carries_the_micro_batch(loss_mode, objective, overrides):
    from verl.workers.utils import losses

    assert getattr(losses.ppo_loss, "tether_hook", False)
    d = _data(seed=4)
    obj = tv.objective_from(loss_mode, objective, overrides)
    est = core_algos.get_adv_estimator_fn(f"tether_{obj.config.advantage}")
    d["adv_tok"], d["returns"] = est(token_level_rewards=d["token_rewards"], response_mask=d["mask"], index=d["uids"])
    td, flat = _micro_batch_td(d)
    flat.requires_grad_()
    config = _actor_config(tv.TetherPolicyLossConfig(loss_mode=loss_mode, objective=objective, overrides=overrides))
    loss, metrics = losses.ppo_loss(config, {"log_probs": flat}, td)
    assert float(metrics["actor/pg_loss"].aggregate()) == pytest.approx(float(loss.detach()))

    lp = d["lp"].clone()
    t = obj(
        objectives.TokenBatch(
            logprobs=lp,
            old_logprobs=d["old"],
            advantages=obj.advantages(d["rewards"], d["groups"]),
            loss_mask=d["mask"],
            ref_logprobs=d["ref"],
            group_ids=d["groups"],
            rewards=d["rewards"],
        )
    )
    torch.testing.assert_close(loss.detach(), t.loss, rtol=1e-11, atol=1e-13)
    # Outside ppo_loss nothing is published, so the same loss now fails with a clear message.
    with pytest.raises(ValueError, match="ref_log_prob|returns"):
        _verl_loss(loss_mode, d, config, "token-mean", fields={})


def test_ppo_loss_hook_changes_nothing_for_verls_own_losses():
    from verl.workers.utils import losses

    d = _data(seed=8)
    d["adv_tok"] = torch.randn(d["mask"].shape[0], 1, dtype=D) * d["mask"]
    d["returns"] = d["adv_tok"]
    td, flat = _micro_batch_td(d)
    config = _actor_config(clip_ratio_high=0.28)
    hooked, _ = losses.ppo_loss(config, {"log_probs": flat}, td)
    plain, _ = losses.ppo_loss.__wrapped__(config, {"log_probs": flat}, td)
    assert hooked.item() == plain.item() and hooked.abs() > 1e-4


def test_batch_field_pads_nested_tensors_as_verl_does():
    d = _data(seed=5)
    lengths = d["mask"].sum(-1).tolist()
    nested = torch.nested.nested_tensor([d["ref"][i, :n] for i, n in enumerate(lengths)], layout=torch.jagged)
    with tv.micro_batch({"ref_log_prob": nested}):
        got = verl_compat.batch_field("ref_log_prob", d["lp"])
    torch.testing.assert_close(got, torch.where(d["mask"], d["ref"], torch.zeros_like(d["ref"])))


# ---------------------------------------------------------------- Hydra and the example


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    config_dir = str(Path(verl.__file__).parent / "trainer" / "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


@pytest.mark.filterwarnings("ignore:Disabled critic")  # verl's note that GRPO-style runs need no critic
@pytest.mark.parametrize("objective", ["rpg", "rpg_ref", "atr", "etr"])
def test_example_overrides_fit_verls_schema(objective):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    out = subprocess.run(
        ["bash", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "DRY_RUN": "1", "OBJECTIVE": objective},
    )
    assert out.returncode == 0, out.stderr
    overrides = out.stdout.splitlines()
    cfg = _compose(overrides)  # Hydra rejects a key that verl's schema lacks (without '+')
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)  # as verl's workers build it
    pl = actor.policy_loss
    assert isinstance(pl, tv.TetherPolicyLossConfig)
    obj = tv.objective_from(pl.loss_mode, pl.objective, pl.overrides)
    assert cfg.algorithm.adv_estimator == f"tether_{obj.config.advantage}"
    assert actor.loss_agg_mode == obj.config.aggregation
    # anchor=ref needs ref_log_prob, which verl computes only when a reference policy is in use.
    assert need_reference_policy(cfg) == obj.uses_reference()


def test_hydra_errors_surface_when_verl_builds_the_actor_config():
    from verl.utils.config import omega_conf_to_dataclass

    cfg = _compose(
        [
            "actor_rollout_ref.actor.policy_loss._target_=tether.integrations.verl.TetherPolicyLossConfig",
            "actor_rollout_ref.actor.policy_loss.loss_mode=tether_rpg",
            "+actor_rollout_ref.actor.policy_loss.objective=rpg_urk",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    with pytest.raises(Exception, match="Did you mean 'rpg_urkl'"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


# ---------------------------------------------------------------- errors that name the fix


def test_config_errors():
    with pytest.raises(ConfigError, match="unknown objective or preset 'rpg_ukl'.*Did you mean 'rpg_urkl'"):
        tv.TetherPolicyLossConfig(loss_mode="tether_rpg", objective="rpg_ukl")
    with pytest.raises(ConfigError, match="unknown tether loss mode 'tether_rgp'"):
        tv.TetherPolicyLossConfig(loss_mode="tether_rgp")
    with pytest.raises(ValueError, match="Unsupported loss mode: tether_rgp"):
        core_algos.get_policy_loss_fn("tether_rgp")
    with pytest.raises(ConfigError, match="set loss_mode=tether_atr_grpo"):
        tv.TetherPolicyLossConfig(loss_mode="tether_rpg", objective="atr_grpo")
    with pytest.raises(ConfigError, match="unknown key 'objective.betta'"):
        tv.TetherPolicyLossConfig(loss_mode="tether_rpg", objective="rpg_urkl", overrides={"betta": 1.0})
    with pytest.raises(ConfigError, match="entropy_coeff"):
        tv.TetherPolicyLossConfig(loss_mode="tether_ppo_clip", overrides={"entropy_coef": 0.01})
    # issue 51: the high-entropy token mask reads the per-token entropy, which verl's policy loss never receives
    with pytest.raises(ConfigError, match="top_entropy_frac keeps.*verl passes no policy loss; top_entropy_frac=null"):
        tv.TetherPolicyLossConfig(loss_mode="tether_ppo_clip", overrides={"top_entropy_frac": 0.2})
    with pytest.raises(ConfigError, match="macro=explicit"):
        tv.TetherPolicyLossConfig(loss_mode="tether_etr", overrides={"macro": "implicit"})
    with pytest.raises(ConfigError, match="reward_range=null"):
        tv.TetherPolicyLossConfig(loss_mode="tether_etr", overrides={"reward_range": [0.0, 1.0]})
    # m2po against the sampler reads rollout log-probs that verl's policy loss never receives (issue 30)
    with pytest.raises(ConfigError, match="sampler's log-probs.*algorithm.rollout_correction.*against=old"):
        tv.TetherPolicyLossConfig(loss_mode="tether_m2po", overrides={"against": "sampler"})
    with pytest.raises(ConfigError, match="adv_estimator=gdpo with algorithm.gdpo_reward_keys"):
        tv.TetherPolicyLossConfig(loss_mode="tether_ppo_clip", objective="gdpo")
    # on-policy distillation reads the teacher's log-probs, which verl's policy-loss signature never passes: verl
    # distils by its own teacher workers (distillation.*), named in the refusal
    for distill in ({"task_coef": 0.0}, {"signal": "kl_loss"}, {"signal": "forward_kl_topk"}):
        with pytest.raises(
            ConfigError, match="distill needs the teacher's log-probs.*does not pass.*distillation.enabled"
        ):
            tv.TetherPolicyLossConfig(loss_mode="tether_ppo_clip", overrides={"distill": distill})
    with pytest.raises(ConfigError, match="Drop distill \\(and the opd preset\\)"):
        tv.TetherPolicyLossConfig(loss_mode="tether_reinforce", objective="opd")


def test_runtime_errors_name_the_fix():
    d = _data(seed=6)
    d["adv_tok"] = torch.randn(d["mask"].shape[0], 1, dtype=D) * d["mask"]
    d["returns"] = d["adv_tok"]

    def run(loss_mode, overrides, agg="token-mean", fields=None):
        pl = tv.TetherPolicyLossConfig(loss_mode=loss_mode, overrides=overrides)
        return _verl_loss(loss_mode, d, _actor_config(pl, loss_agg_mode=agg), agg, fields=fields)

    with pytest.raises(ValueError, match="use_kl_loss=True"):  # reference needed, not computed by verl
        run("tether_rpg", {"anchor": "ref"}, fields={"returns": d["returns"]})
    with pytest.raises(ValueError, match="use_kl_loss=True"):
        run("tether_ppo_clip", {"kl_penalty": {"estimator": "k3", "coef": 0.1}}, fields={})
    with pytest.raises(ValueError, match="adv_estimator to one of tether_grpo"):  # verl's estimator: returns == A
        run("tether_etr", {})
    with pytest.raises(ValueError, match="adv_estimator to one of tether_grpo"):  # no returns at all
        run("tether_etr", {}, fields={})
    run("tether_etr", {"macro": "off"}, fields={})  # micro-only ETR needs nothing extra
    with pytest.raises(ConfigError, match="loss_agg_mode=seq-mean-token-mean or the override aggregation=token-mean"):
        run("tether_gspo", {})
    with pytest.raises(ConfigError, match="no tether counterpart"):
        run("tether_ppo_clip", {}, agg="token-sum")
    with pytest.raises(ValueError, match="needs `index`"):
        core_algos.get_adv_estimator_fn("tether_grpo")(token_level_rewards=d["token_rewards"], response_mask=d["mask"])


def test_default_objective_when_verl_passes_another_config():
    # verl's distillation path passes its own loss config: the loss_mode's defaults apply.
    d = _data(seed=7)
    d["adv_tok"] = torch.randn(d["mask"].shape[0], 1, dtype=D) * d["mask"]
    d["returns"] = d["adv_tok"]
    loss, _, _ = _verl_loss("tether_cispo", d, None, "token-mean")
    lp = d["lp"].clone()
    t = objectives.build("cispo")(
        objectives.TokenBatch(logprobs=lp, old_logprobs=d["old"], advantages=d["adv_tok"], loss_mask=d["mask"])
    )
    torch.testing.assert_close(loss, t.loss)


# ---------------------------------------------------------------- verl's own KL terms (issue 13, item 8)


def test_verl_kl_loss_on_top_of_a_tether_kl_is_refused_naming_the_key():
    d = _data(seed=5)
    d["adv_tok"], d["returns"] = d["token_rewards"], d["token_rewards"]
    pl = tv.TetherPolicyLossConfig(loss_mode="tether_rpg", objective="rpg_urkl", overrides={"anchor": "ref"})
    with pytest.raises(
        ConfigError,
        match=r"actor_rollout_ref\.actor\.kl_loss_coef=0\.001.*set actor_rollout_ref\.actor\.kl_loss_coef=0",
    ):
        _verl_loss("tether_rpg", d, _actor_config(pl, use_kl_loss=True), "token-mean")
    _verl_loss("tether_rpg", d, _actor_config(pl, use_kl_loss=True, kl_loss_coef=0.0), "token-mean")  # the fix works
    # An objective without a reference: verl's KL loss is the user's own choice, not hidden.
    plain = tv.TetherPolicyLossConfig(loss_mode="tether_rpg", objective="rpg_urkl")
    _verl_loss("tether_rpg", d, _actor_config(plain, use_kl_loss=True), "token-mean")


def test_verl_kl_in_reward_under_a_tether_estimator_is_refused_naming_the_key():
    from verl.trainer.config import AlgoConfig, KLControlConfig

    d = _data(seed=6)
    est = core_algos.get_adv_estimator_fn("tether_grpo")
    with pytest.raises(ConfigError, match=r"algorithm\.kl_ctrl\.kl_coef=0\.001.*set algorithm\.kl_ctrl\.kl_coef=0"):
        est(
            token_level_rewards=d["token_rewards"],
            response_mask=d["mask"],
            index=d["uids"],
            config=AlgoConfig(use_kl_in_reward=True),
        )
    adv, _ = est(
        token_level_rewards=d["token_rewards"],
        response_mask=d["mask"],
        index=d["uids"],
        config=AlgoConfig(use_kl_in_reward=True, kl_ctrl=KLControlConfig(kl_coef=0.0)),
    )
    assert torch.isfinite(adv).all()


# ---------------------------------------------------------------- issue 18: DPPO, SAPO, GMPO, Clip-Cov, KL-Cov, REINFORCE++

from verl.workers.config import PolicyLossConfig  # noqa: E402

from tether.core.masked import group_summary  # noqa: E402

# (verl loss_mode, verl actor keys, verl policy_loss keys, tether objective spec, aggregation modes verl honours).
# Settings are chosen so that every mechanism acts on _data's ratios (~0.5 to ~2): masks, TIS truncation, clips,
# the covariance selection; verl's `sapo` and `geo_mean` aggregate their own way whatever loss_agg_mode says.
ALL_AGG = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
VERL_OWN = [
    (
        "dppo_tv",
        dict(clip_ratio=0.15, clip_ratio_low=0.1, clip_ratio_high=0.15, clip_ratio_c=1.5),
        {},
        {"name": "dppo", "measure": "binary_tv", "delta_low": 0.1, "delta_high": 0.15, "truncation_c": 1.5},
        ALL_AGG,
    ),
    (
        "dppo_kl",
        dict(clip_ratio=0.05, clip_ratio_low=0.05, clip_ratio_high=0.03, clip_ratio_c=1.5),
        {},
        {"name": "dppo", "measure": "binary_kl", "delta_low": 0.05, "delta_high": 0.03, "truncation_c": 1.5},
        ALL_AGG,
    ),
    (
        "sapo",
        dict(tau_pos=1.0, tau_neg=1.05),
        {},
        {"name": "sapo", "tau_pos": 1.0, "tau_neg": 1.05},
        ("seq-mean-token-mean",),
    ),
    (
        "sapo",
        dict(tau_pos=2.0, tau_neg=3.0),
        {},
        {"name": "sapo", "tau_pos": 2.0, "tau_neg": 3.0},
        ("seq-mean-token-mean",),
    ),
    (
        "geo_mean",
        dict(clip_ratio=0.4, clip_ratio_low=0.4, clip_ratio_high=0.3),
        {},
        {"name": "gmpo", "eps_low": 0.4, "eps_high": 0.3},
        ("seq-mean-token-mean",),
    ),
    (
        "clip_cov",
        dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28),
        dict(clip_cov_ratio=1.0, clip_cov_lb=0.05, clip_cov_ub=5.0),  # k >= candidates: verl's draw is forced
        {"name": "clip_cov", "eps_low": 0.2, "eps_high": 0.28, "select_frac": 1.0, "cov_lb": 0.05, "cov_ub": 5.0},
        ALL_AGG,
    ),
    (
        "kl_cov",
        {},
        dict(kl_cov_ratio=0.1, ppo_kl_coef=1.0),
        {"name": "kl_cov", "select_frac": 0.1, "kl_coef": 1.0},
        ALL_AGG,
    ),
    (
        "kl_cov",
        {},
        dict(kl_cov_ratio=2e-3, ppo_kl_coef=0.1),
        {"name": "kl_cov", "select_frac": 2e-3, "kl_coef": 0.1},
        ("token-mean",),
    ),
    ("dro", {}, dict(dro_beta=0.1), {"name": "dro", "beta": 0.1}, ALL_AGG),
]
VERL_OWN_IDS = [f"{c[0]}-{i}" for i, c in enumerate(VERL_OWN)]


def _own_data(seed=2):
    d = _data(seed=seed)
    adv = torch.randn(d["mask"].shape[0], 1, dtype=D) * d["mask"]  # (N, T), sequence-level values, 0 on padding
    d["adv_tok"], d["returns"] = adv, adv
    return d


def _verl_own(mode, d, agg, actor_kw, pl_kw, weights=None, info=None):
    config = _actor_config(PolicyLossConfig(loss_mode=mode, **pl_kw), loss_agg_mode=agg, **actor_kw)
    config.global_batch_info.update(info or {})
    return _verl_loss(mode, d, config, agg, weights=weights)


def _tether_own(spec, d, agg):
    obj = objectives.build({**spec, "aggregation": agg})
    lp = d["lp"].clone().requires_grad_()
    out = obj(objectives.TokenBatch(logprobs=lp, old_logprobs=d["old"], advantages=d["adv_tok"], loss_mask=d["mask"]))
    out.loss.backward()
    return out.loss.detach(), lp.grad, out.metrics


@pytest.mark.parametrize("mode,actor_kw,pl_kw,spec,aggs", VERL_OWN, ids=VERL_OWN_IDS)
def test_tether_objectives_equal_verls_own_losses(mode, actor_kw, pl_kw, spec, aggs):
    # tether's own objective (tether's aggregation) against verl 0.9.1's loss function, float64.
    d = _own_data()
    for agg in aggs:
        v_loss, v_grad, vm = _verl_own(mode, d, agg, actor_kw, pl_kw)
        t_loss, t_grad, tm = _tether_own(spec, d, agg)
        assert v_loss.abs() > 1e-3 and v_grad.abs().sum() > 1e-2  # a case that tests nothing is a defect
        torch.testing.assert_close(t_loss, v_loss, rtol=0, atol=1e-12)
        torch.testing.assert_close(t_grad, v_grad, rtol=0, atol=1e-12)
        if mode.startswith("dppo"):  # verl's clipfrac is tether's masked share on both sides
            masked = float(tm["policy/clipfrac_low"] + tm["policy/clipfrac_high"])
            zero_adv = float((d["mask"] & (d["adv_tok"] == 0)).sum() / d["mask"].sum())  # A = 0: masked or not
            assert abs(vm["actor/pg_clipfrac"] - masked) <= zero_adv + 1e-6
            assert vm["actor/pg_clipfrac_lower"] == pytest.approx(float(tm["dppo/truncfrac"]), abs=1e-6)
        if mode == "clip_cov":
            assert vm["actor/pg_clipfrac"] == pytest.approx(float(tm["cov/selected_frac"]), abs=1e-6)
            assert 0 < tm["cov/selected_frac"] < 1
        if mode == "kl_cov":
            assert vm["actor/ppo_kl"] == pytest.approx(float(tm["cov/kl_abs_mean"]), rel=1e-9)
    if mode.startswith("dppo"):
        assert tm["dppo/truncfrac"] > 0 and tm["policy/clipfrac_high"] > 0 and tm["policy/clipfrac_low"] > 0


@pytest.mark.parametrize("mode,measure", [("dppo_tv", "binary_tv"), ("dppo_kl", "binary_kl")])
def test_dppo_equals_verls_dppo_at_verls_default_config(mode, measure):
    # Issue 22, item 5: verl's actor config left at its defaults: clip_ratio (low and high) 0.2, clip_ratio_c 3.0
    # (not 20: that is only verl's fallback for a config without the key), loss_agg_mode token-mean.
    config = _actor_config(PolicyLossConfig(loss_mode=mode))
    assert (config.clip_ratio_low, config.clip_ratio_high, config.clip_ratio_c, config.loss_agg_mode) == (
        0.2,
        0.2,
        3.0,
        "token-mean",
    )
    spec = {
        "name": "dppo",
        "measure": measure,
        "delta_low": 0.2,
        "delta_high": 0.2,
        "truncation_c": 3.0,
        "aggregation": "token-mean",
    }
    # Rare tokens (p_old ~ 0.02-0.05) with log-ratios scaled by 3: w up to ~5.5, so the cap at 3 acts.
    d = _own_data(seed=3)
    d["lp"], d["old"] = d["old"] - 3.0 + 3.0 * (d["lp"] - d["old"]), d["old"] - 3.0
    v_loss, v_grad, vm = _verl_loss(mode, d, config, "token-mean")
    t_loss, t_grad, tm = _tether_own(spec, d, "token-mean")
    torch.testing.assert_close(t_loss, v_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(t_grad, v_grad, rtol=0, atol=1e-12)
    assert tm["dppo/truncfrac"] > 0 and vm["actor/pg_clipfrac_lower"] == pytest.approx(float(tm["dppo/truncfrac"]))
    # The audit's token: p_old = e^-5, w = e^2, A = 1, one of 2 counted tokens. verl: -min(e^2, 3) / 2 = -1.5;
    # tether's default (no cap, the authors'): -e^2 / 2 = -3.695.
    one = {
        "old": torch.tensor([[-5.0, -1.0]], dtype=D),
        "lp": torch.tensor([[-3.0, -1.1]], dtype=D),
        "mask": torch.ones(1, 2, dtype=torch.bool),
        "ref": torch.zeros(1, 2, dtype=D),
    }
    one["adv_tok"] = one["returns"] = torch.ones(1, 2, dtype=D)
    _, v_grad, _ = _verl_loss(mode, one, config, "token-mean")
    _, t_grad, _ = _tether_own(spec, one, "token-mean")
    assert v_grad[0, 0].item() == pytest.approx(-1.5, rel=1e-15)
    torch.testing.assert_close(t_grad, v_grad, rtol=0, atol=1e-15)
    _, t_default, _ = _tether_own(
        {"name": "dppo", "measure": measure, "delta_low": 0.2, "delta_high": 0.2}, one, "token-mean"
    )
    assert t_default[0, 0].item() == pytest.approx(-math.exp(2.0) / 2, rel=1e-15)


@pytest.mark.parametrize("mode,actor_kw,pl_kw,spec,aggs", VERL_OWN, ids=VERL_OWN_IDS)
def test_tether_losses_through_the_plugin_equal_verls_own(mode, actor_kw, pl_kw, spec, aggs):
    # The plugin's tether_<name> against verl's own, both through verl's agg_loss, with rollout IS weights and
    # global batch info, except for geo_mean: verl reduces it by a plain mean over rows (no global batch info)
    # and takes the geometric mean of the IS weights per sequence, where the plugin weighs each token.
    d = _own_data(seed=4)
    gmpo = mode == "geo_mean"
    weights = None if gmpo else d["weights"]
    info = None if gmpo else {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 20, "loss_scale_factor": 9}
    loss_mode = f"tether_{spec['name']}"
    for agg in aggs:
        overrides = {k: v for k, v in spec.items() if k != "name"} | {"aggregation": agg}
        ours = _actor_config(tv.TetherPolicyLossConfig(loss_mode=loss_mode, overrides=overrides), loss_agg_mode=agg)
        ours.global_batch_info.update(info or {})
        o_loss, o_grad, _ = _verl_loss(loss_mode, d, ours, agg, weights=weights)
        v_loss, v_grad, _ = _verl_own(mode, d, agg, actor_kw, pl_kw, weights=weights, info=info)
        assert v_grad.abs().sum() > 1e-2
        torch.testing.assert_close(o_loss, v_loss, rtol=0, atol=1e-12)
        torch.testing.assert_close(o_grad, v_grad, rtol=0, atol=1e-12)


def test_clip_cov_random_choice_equals_verls_given_the_same_draw(monkeypatch):
    # When k < the number of candidates both draw a uniformly random k-subset, from different random numbers
    # (tether.core.covariance, departure 1). Hand verl tether's draw through its randperm: then loss and
    # gradient agree exactly, so the random choice is the only difference.
    from tether.core import covariance as C

    d = _own_data(seed=5)
    spec = {"name": "clip_cov", "eps_low": 0.2, "eps_high": 0.28, "select_frac": 0.1, "cov_lb": 0.02, "cov_ub": 5.0}
    lp, m = d["lp"], d["mask"]
    torch.manual_seed(11)
    chosen = C.clip_cov(
        torch.where(m, lp, 0 * lp), torch.where(m, d["old"], 0 * lp), d["adv_tok"], m, 0.2, 0.28, 0.1, 0.02, 5.0
    )
    n_cand, n_sel = int(chosen.candidates.sum()), int(chosen.selected.sum())
    assert n_sel == max(int(0.1 * int(m.sum())), 1) and n_cand > n_sel  # a real choice
    torch.manual_seed(11)
    t_loss, t_grad, _ = _tether_own(spec, d, "token-mean")

    cand_idx = torch.nonzero(chosen.candidates)  # verl's order: row-major over the candidates
    first = [i for i in range(n_cand) if chosen.selected[tuple(cand_idx[i])]]
    perm = torch.tensor(first + [i for i in range(n_cand) if i not in first])
    monkeypatch.setattr(torch, "randperm", lambda n, *a, **k: perm if n == n_cand else torch.arange(n))
    v_loss, v_grad, _ = _verl_own(
        "clip_cov",
        d,
        "token-mean",
        dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
        dict(clip_cov_ratio=0.1, clip_cov_lb=0.02, clip_cov_ub=5.0),
    )
    torch.testing.assert_close(t_loss, v_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(t_grad, v_grad, rtol=0, atol=1e-12)


def test_reinforce_pp_equals_verls_reinforce_plus_plus_baseline():
    d = _data(seed=3)
    r, m, uids = d["token_rewards"], d["mask"], d["uids"]
    ours, returns = core_algos.get_adv_estimator_fn("tether_reinforce_pp")(
        token_level_rewards=r, response_mask=m, index=uids, config=None
    )
    theirs, _ = core_algos.get_adv_estimator_fn("reinforce_plus_plus_baseline")(
        token_level_rewards=r.clone(), response_mask=m, index=uids
    )
    lengths = m.sum(-1).to(D)
    expected = A.compute_advantages("reinforce_pp", d["rewards"], d["groups"], weights=lengths)
    torch.testing.assert_close(ours, expected[:, None] * m, rtol=0, atol=1e-15)
    torch.testing.assert_close(returns, tv.group_shift(d["rewards"], d["groups"])[:, None] * m)
    # verl computes the Bessel factor n / (n - 1) of its token-level variance in float32 (an int64 tensor
    # division), a relative error up to ~3e-8 in the variance; tether's is float64. With verl's factor the two
    # agree to rounding on every group with reward variance.
    s = group_summary(d["rewards"], d["groups"])
    flat = (s["min"] == s["max"])[:, None] & m
    live = m & ~flat
    n = int(lengths.sum())
    bessel32 = float(torch.tensor(n) / torch.tensor(n - 1))  # how verl's masked_var computes it
    a = (d["rewards"] - s["mean"])[:, None].expand_as(m)
    mean = (a[m]).sum() / n
    var_pop = ((a[m] - mean) ** 2).sum() / n
    assert live.sum() > 0 and flat[0].any() and bessel32 != n / (n - 1)
    torch.testing.assert_close(
        theirs[live], (a[live] - mean) * torch.rsqrt(var_pop * bessel32 + 1e-8), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        ours[live], (a[live] - mean) * torch.rsqrt(var_pop * n / (n - 1) + 1e-8), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(ours[live], theirs[live], rtol=3e-8, atol=0)
    # Zero-variance groups (group 0, all correct, and here group 2): tether 0 (SPEC 4); verl (0 - mean_B) / std_B,
    # with token-weighted batch statistics (advantages.py, departure 1).
    assert ours[flat].abs().max() == 0
    torch.testing.assert_close(
        theirs[flat], (-mean * torch.rsqrt(var_pop * bessel32 + 1e-8)).expand(int(flat.sum())), rtol=0, atol=1e-12
    )


# ---------------------------------------------------------------- issue 22: rollout correction as verl defines it


@pytest.mark.parametrize("seed", [0, 1])
def test_rollout_correction_equals_verls_rollout_corr_helper(seed):
    # tether's rollout_correction against verl 0.9.1's own functions (float64): IS weights (TIS: one threshold;
    # IcePop: "low_high") at token and sequence level, where verl's sequence ratio is the product of the token
    # ratios; and the rejection mask (rollout_rs token_k3 / seq_mean_k3), a 0/1 mask on the token's k3 or the
    # sequence's mean k3. Log-ratios of up to +-1.2 per token: products far outside every band occur.
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights, compute_rollout_rejection_mask

    from tether.core.correction import rollout_correction

    d = _data(seed=seed)
    g = torch.Generator().manual_seed(seed)
    mask = d["mask"]
    sampler = torch.where(mask, d["old"] - 0.4 * torch.randn(d["old"].shape, generator=g, dtype=D), d["old"])
    log_ratio = torch.where(mask, d["old"] - sampler, torch.zeros_like(sampler))
    m = mask.to(D)
    for level in ("token", "sequence"):
        for low, high, threshold in ((0.0, 2.0, 2.0), (0.0, 1.2, 1.2), (0.5, 2.0, "0.5_2.0"), (0.8, 1.25, "0.8_1.25")):
            mode = "truncate" if isinstance(threshold, float) else "mask"
            verl_w, _ = compute_rollout_correction_weights(log_ratio, m, level, threshold)
            c = rollout_correction(d["old"], sampler, mask, level, mode, low, high)
            torch.testing.assert_close(c.weights, verl_w, rtol=1e-15, atol=0)
        assert (c.weights == 0).any() and (c.weights > 0).any()  # the narrow IcePop band both keeps and drops
    for level, option in (("token", "token_k3"), ("sequence", "seq_mean_k3")):
        for delta in (0.01, 0.05):
            verl_mask, _ = compute_rollout_rejection_mask(log_ratio, m, option, delta)
            c = rollout_correction(d["old"], sampler, mask, level, "mask", measure="kl3", delta=delta)
            torch.testing.assert_close(c.weights, verl_mask, rtol=0, atol=0)
            assert (c.masked == (mask & (verl_mask == 0))).all()
        assert c.masked.any() and (c.weights == 1).any()


def test_vespo_folds_verls_rollout_is_weights_into_its_sequence_ratio():
    # Issue 30: the plugin hands rollout_is_weights to VESPO, which folds them into w = prod_t r_t rho_t (the authors'
    # verl recipe, tests/objectives/test_vespo_luspo_dro.py), instead of multiplying them into the loss as for every other loss.
    d = _own_data(seed=5)
    config = _actor_config(tv.TetherPolicyLossConfig(loss_mode="tether_vespo"), loss_agg_mode="token-mean")
    o_loss, o_grad, _ = _verl_loss("tether_vespo", d, config, "token-mean", weights=d["weights"])
    _, t_grad, _ = _tether_own({"name": "vespo"}, {**d}, "token-mean")  # without the weights: must differ
    lp = d["lp"].clone().requires_grad_()
    out = objectives.build("vespo")(
        objectives.TokenBatch(
            logprobs=lp,
            old_logprobs=d["old"],
            advantages=d["adv_tok"],
            loss_mask=d["mask"],
            rollout_weights=d["weights"],
        )
    )
    out.loss.backward()
    torch.testing.assert_close(o_loss, out.loss.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(o_grad, lp.grad, rtol=0, atol=1e-12)
    assert (o_grad - t_grad).abs().max() > 1e-3


def test_sampler_kl_is_refused_under_verl():
    with pytest.raises(ConfigError, match="sampler_kl_coef.*set sampler_kl_coef=0"):
        tv.objective_from("tether_ppo_clip", "dapo", {"sampler_kl_coef": 1e-3})


# ---------------------------------------------------------------- issue 34: every preset is a loss_mode by its own name

DOCS = Path(__file__).resolve().parents[2] / "docs" / "verl.md"


# Presets that verl runs by its own means, so that their loss mode is refused with the verl setting to use.
REFUSED_UNDER_VERL = {
    "gdpo": "adv_estimator=gdpo",
    "opd": "distillation.enabled with distillation.teacher_models",
}
PRESETS_UNDER_VERL = [p for p in objectives.preset_names() if p not in REFUSED_UNDER_VERL]


def test_every_preset_is_a_verl_loss_mode_by_its_own_name():
    # tether_<name> runs what `objective: <name>` runs in tether's own config: every preset's values, its label.
    for preset, fix in REFUSED_UNDER_VERL.items():
        assert core_algos.get_policy_loss_fn(f"tether_{preset}").__module__ == "tether.integrations.verl"
        with pytest.raises(ConfigError, match=fix):
            tv.objective_from(f"tether_{preset}")
    for preset in PRESETS_UNDER_VERL:
        mode = f"tether_{preset}"
        assert core_algos.get_policy_loss_fn(mode).__module__ == "tether.integrations.verl", mode
        assert objectives.describe(tv.objective_from(mode)) == objectives.describe(objectives.build(preset)), mode
        assert tv.LOSS_MODES[mode] == objectives.build(preset).name
        if preset in objectives.names():  # one loss mode for both: the preset selects that same objective
            assert objectives.load_preset(preset)["name"] == preset


@pytest.mark.parametrize("preset", [p for p in PRESETS_UNDER_VERL if p not in TESTED_IN_VERLS_ACTOR])
def test_a_preset_loss_mode_equals_its_objective_mode_told_the_preset(preset):
    # verl's own PolicyLossConfig (no _target_) with loss_mode=tether_<preset> gives the loss, gradient and metrics
    # of loss_mode=tether_<objective> with TetherPolicyLossConfig's objective=<preset>.
    d = _data(seed=5)
    obj = objectives.build(preset)
    est = core_algos.get_adv_estimator_fn(f"tether_{obj.config.advantage}")
    d["adv_tok"], d["returns"] = est(token_level_rewards=d["token_rewards"], response_mask=d["mask"], index=d["uids"])
    agg = obj.config.aggregation
    by_name = _actor_config(PolicyLossConfig(loss_mode=f"tether_{preset}"), loss_agg_mode=agg)
    by_key = _actor_config(
        tv.TetherPolicyLossConfig(loss_mode=f"tether_{obj.name}", objective=preset), loss_agg_mode=agg
    )
    torch.manual_seed(0)  # clip_cov's random choice draws the same on both sides
    n_loss, n_grad, n_metrics = _verl_loss(f"tether_{preset}", d, by_name, agg)
    torch.manual_seed(0)
    k_loss, k_grad, k_metrics = _verl_loss(f"tether_{obj.name}", d, by_key, agg)
    assert n_grad.abs().sum() > 1e-3
    torch.testing.assert_close(n_loss, k_loss, rtol=0, atol=0)
    torch.testing.assert_close(n_grad, k_grad, rtol=0, atol=0)
    assert n_metrics == k_metrics


@pytest.mark.filterwarnings("ignore:Disabled critic")  # verl's note that GRPO-style runs need no critic
def test_preset_loss_modes_through_verls_hydra_config():
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    base = [
        "algorithm.adv_estimator=tether_grpo",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    ]
    loss = "actor_rollout_ref.actor.policy_loss"
    # The name alone, verl's own policy-loss config: validated and built as verl's driver and workers do.
    cfg = _compose([*base, f"{loss}.loss_mode=tether_atr_grpo"])
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert type(actor.policy_loss) is PolicyLossConfig
    assert tv._objective_for(actor, "tether_atr_grpo").label == "atr_grpo"
    # With overrides, through TetherPolicyLossConfig.
    cfg = _compose(
        [
            *base,
            f"{loss}._target_=tether.integrations.verl.TetherPolicyLossConfig",
            f"{loss}.loss_mode=tether_atr_grpo",
            f"+{loss}.overrides={{delta:0.0331}}",
        ]
    )
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    obj = tv._objective_for(actor, "tether_atr_grpo")
    assert (obj.label, obj.config.delta, obj.config.measure) == ("atr_grpo", 0.0331, "kl3")
    # An objective key that names another objective: the error names the loss mode to set.
    cfg = _compose(
        [
            *base,
            f"{loss}._target_=tether.integrations.verl.TetherPolicyLossConfig",
            f"{loss}.loss_mode=tether_atr_grpo",
            f"+{loss}.objective=rpg_urkl",
        ]
    )
    with pytest.raises(Exception, match="set loss_mode=tether_rpg_urkl"):
        omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)


def _docs_preset_rows() -> list[list[str]]:
    """The rows of docs/verl.md's preset table: loss_mode, preset, objective, adv_estimator, loss_agg_mode."""
    text = DOCS.read_text()
    table = text[text.index("| verl `policy_loss.loss_mode` | tether preset |") :].split("\n\n")[0]
    return [[c.strip().strip("`") for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_docs_preset_table_is_what_the_plugin_registers():
    rows = _docs_preset_rows()
    assert {r[1] for r in rows} >= {"atr_grpo", "rpg_urkl", "etr", "dapo", "grpo", "dr_grpo"}
    for mode, preset, objective, estimator, agg in rows:
        obj = objectives.build(preset)
        assert (mode, objective) == (f"tether_{preset}", tv.LOSS_MODES[mode]), mode
        assert (estimator, agg) == (f"tether_{obj.config.advantage}", obj.config.aggregation), mode


# ---------------------------------------------------------------- issue 34: the one-GPU example (a GPU run is not made here)

from conftest import slow_after_first  # noqa: E402

ONE_GPU = EXAMPLE.with_name("one_gpu.sh")


@pytest.mark.filterwarnings("ignore:Disabled critic")  # verl's note that GRPO-style runs need no critic
@pytest.mark.parametrize("preset", slow_after_first(["atr_grpo", "rpg_urkl", "etr", "dr_grpo"]))  # ~5 s each
def test_one_gpu_example_overrides_fit_verls_schema(preset, tmp_path):
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    env = {
        **os.environ,
        "DRY_RUN": "1",
        "OBJECTIVE": preset,
        "PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(EXAMPLE.parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        ["bash", str(ONE_GPU), str(tmp_path / "model"), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    cfg = _compose(out.stdout.splitlines())  # Hydra rejects a key that verl's schema lacks (without '+')
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    obj = tv._objective_for(actor, actor.policy_loss.loss_mode)
    assert (actor.policy_loss.loss_mode, obj.label) == (f"tether_{preset}", preset)
    assert cfg.algorithm.adv_estimator == f"tether_{obj.config.advantage}"
    assert actor.loss_agg_mode == obj.config.aggregation
    assert not need_reference_policy(cfg)
    assert Path(cfg.reward.custom_reward_function.path).is_file()
    assert cfg.trainer.n_gpus_per_node == 1 and cfg.trainer.total_training_steps == 5


def test_one_gpu_example_refuses_a_missing_model_and_downloads_nothing(tmp_path):
    out = subprocess.run(
        ["bash", str(ONE_GPU), "Qwen/Qwen2.5-0.5B-Instruct", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "not a local model directory" in out.stderr
    assert not list(tmp_path.iterdir())


def test_one_gpu_example_data_and_reward(tmp_path):
    import importlib.util

    import pandas as pd

    def load(name):
        spec = importlib.util.spec_from_file_location(name, EXAMPLE.with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    load("make_data").main([str(tmp_path), "--train", "8", "--val", "4"])
    train, val = pd.read_parquet(tmp_path / "train.parquet"), pd.read_parquet(tmp_path / "val.parquet")
    assert (len(train), len(val)) == (8, 4)
    row = train.iloc[0]
    assert row["data_source"] == "tether_arithmetic" and row["prompt"][0]["role"] == "user"
    assert "\\boxed{}" in row["prompt"][0]["content"]
    gold = row["reward_model"]["ground_truth"]
    assert not set(train["extra_info"].map(lambda e: e["id"])) & set(val["extra_info"].map(lambda e: e["id"]))
    reward = load("reward")
    assert reward.compute_score("tether_arithmetic", f"So the answer is \\boxed{{{gold}}}.", gold) == 1.0
    assert reward.compute_score("tether_arithmetic", f"\\boxed{{{int(gold) + 1}}}", gold) == 0.0


# ---------------------------------------------------------------- multi-turn batches: verl's response_mask


def _multi_turn(d):
    """`d` as verl's agent loop hands a multi-turn batch over: `response_mask` 0 at the tools' and the
    environment's tokens between the model's turns (attention still reads them), their log-probs garbage."""
    mask = d["mask"].clone()
    mask[0, 1:3] = False  # a tool response inside the first row
    mask[5, 0] = False  # an observation at a row's start
    mask[7, 2:4] = False
    env = d["mask"] & ~mask
    lp = torch.where(env, torch.full_like(d["lp"], -3.0), d["lp"])
    return {**d, "mask": mask, "lp": lp, "env": env}


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_response_mask_holes_are_honoured_like_verls_own_loss(agg):
    """verl's agent loop marks only the model's tokens in `response_mask`: tether's loss through verl's
    registry equals verl's vanilla loss on the same mask, and an environment token gets no gradient."""
    d = _multi_turn(_data(seed=3))
    assert d["env"].any()
    d["adv_tok"] = torch.randn(d["mask"].shape[0], 1, dtype=D) * d["mask"]
    d["returns"] = d["adv_tok"]
    kw = dict(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)
    overrides = {"eps_low": 0.2, "eps_high": 0.28, "dual_clip_c": 3.0, "aggregation": agg}
    ours = _actor_config(
        tv.TetherPolicyLossConfig(loss_mode="tether_ppo_clip", objective="ppo_clip", overrides=overrides),
        loss_agg_mode=agg,
    )
    theirs = _actor_config(loss_agg_mode=agg, **kw)
    o_loss, o_grad, _ = _verl_loss("tether_ppo_clip", d, ours, agg)
    v_loss, v_grad, _ = _verl_loss("vanilla", d, theirs, agg)
    torch.testing.assert_close(o_loss, v_loss, rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(o_grad, v_grad, rtol=1e-11, atol=1e-13)
    assert torch.all(o_grad[d["env"]] == 0) and o_grad[d["mask"]].abs().sum() > 0


@pytest.mark.parametrize(
    "loss_mode, objective",
    [
        ("tether_divergence_clip", "atr_grpo"),
        ("tether_gspo", "gspo"),
        ("tether_rpg", "rpg_urkl"),
        ("tether_etr", "etr"),
    ],
)
def test_environment_tokens_change_no_loss_of_a_tether_objective_under_verl(loss_mode, objective):
    """Sequence-level ratios (GSPO) and group statistics (ETR) included: the log-probs at the environment's
    tokens change neither the loss nor the gradient at the model's tokens."""
    d = _multi_turn(_data(seed=4))
    obj = tv.objective_from(loss_mode, objective, {})
    est = core_algos.get_adv_estimator_fn(f"tether_{obj.config.advantage}")
    d["adv_tok"], d["returns"] = est(token_level_rewards=d["token_rewards"], response_mask=d["mask"], index=d["uids"])
    agg = obj.config.aggregation
    cfg = _actor_config(tv.TetherPolicyLossConfig(loss_mode=loss_mode, objective=objective), loss_agg_mode=agg)
    a_loss, a_grad, _ = _verl_loss(loss_mode, d, cfg, agg)
    moved = {
        **d,
        "lp": torch.where(d["env"], d["lp"] + 1.7, d["lp"]),
        "old": torch.where(d["env"], d["old"] - 0.9, d["old"]),
        "ref": torch.where(d["env"], d["ref"] + 0.4, d["ref"]),
    }
    b_loss, b_grad, _ = _verl_loss(loss_mode, moved, cfg, agg)
    assert a_loss.abs() > 1e-4
    torch.testing.assert_close(a_loss, b_loss, rtol=0, atol=0)
    assert torch.equal(a_grad, b_grad) and torch.all(a_grad[d["env"]] == 0)


def test_the_engine_adds_troll_supports_only_where_they_are_needed_and_on_the_dense_logits_path():
    # verl_compat item 8: a forward-only pass once the batch holds pi_old's sets (the reference's, which verl runs
    # after merging the old pass's output) adds nothing; the remove-padding and fused-kernel paths, whose logits are
    # packed or never formed, are refused with the setting to change.
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from tether.integrations.verl_compat import SET_FIELDS, _supports

    size = objectives.SupportSize(8, 1.0)
    with_sets = TensorDict({SET_FIELDS[0]: torch.zeros(2, 3, 8, dtype=torch.long)}, batch_size=[2])
    with torch.no_grad():
        assert _supports(None, {}, with_sets, size) == {}
    for key, value in (("use_remove_padding", True), ("use_fused_kernels", True)):
        data = TensorDict({"response_mask": torch.ones(2, 3)}, batch_size=[2])
        tu.assign_non_tensor(data, **{"use_remove_padding": False, key: value})
        with pytest.raises(ValueError, match=rf"{key} is on: set actor_rollout_ref.model.{key}=False"):
            _supports(None, {}, data, size)
