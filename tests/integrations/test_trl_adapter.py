"""tether objectives inside TRL's GRPOTrainer (tether.integrations.trl), on CPU with a tiny model.

What these prove:
- end to end: two optimiser steps of TRL's loop with a tether objective change the weights;
- the loss TRL backpropagates is tether's objective on the same tensors, rebuilt here from TRL's
  raw batch independently of the adapter: rewards re-scored from the decoded completions,
  groups checked against the prompts, advantages re-estimated, log-probs recomputed with a plain
  forward pass, and the micro-batch losses of an optimiser step summing to the objective on the
  step's whole mini-batch;
- reference log-probs reach RPG with anchor ref although the caller's beta is 0;
- ETR's micro-batches hold whole prompt groups;
- unknown objectives and unsupported TRL options fail before any model is loaded;
- two processes (`accelerate launch`, gloo on the CPU) train exactly as one on the same global batch:
  loss, updated weights and logged metrics, with group statistics, batch whitening and a reference.
"""

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from tether import objectives  # noqa: E402
from tether.integrations.trl import (  # noqa: E402
    TetherGRPOTrainer,
    group_advantages,
    make_trainer,
    reward_func,
    inactive_trust_region,
    to_dataset,
)
from tether.core.multi_reward import RewardParts, normalize_then_sum  # noqa: E402
from tether.integrations.trl import OLD_SET  # noqa: E402
from tether.model.loading import load_tokenizer  # noqa: E402
from tether.schema import ConfigError  # noqa: E402
from tether.tasks import Example  # noqa: E402

from conftest import slow_after_first, trl_compute_loss  # noqa: E402

PROMPTS = ["1+1=", "2+3=", "7*6=", "9-4=", "8+8=", "5*5="]


def odd_chars(completions, **_):
    """Share of characters with an odd code point: a reward with variance in every group."""
    return [sum(ord(c) % 2 for c in t) / max(len(t), 1) for t in completions]


def _args(tmp_path, **overrides):
    base = dict(
        output_dir=str(tmp_path),
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        max_completion_length=8,
        per_device_train_batch_size=4,
        num_generations=4,
        seed=0,
    )
    return GRPOConfig(**{**base, **overrides})


def _train(tiny_dir, tmp_path, objective, **overrides):
    """Two optimiser steps; returns the trainer, one record per loss evaluation, the initial weights."""
    records = []

    def hook(inputs, batch, out):
        records.append(_record(trainer, inputs, batch, out))

    args = _args(tmp_path, **overrides)
    trainer = make_trainer(
        str(tiny_dir),
        odd_chars,
        Dataset.from_dict({"prompt": PROMPTS}),
        objective=objective,
        args=args,
        on_objective=hook,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert args.beta == 0.0 and trainer.args is not args  # the adapter sets beta on its own copy
    return trainer, records, before


@torch.no_grad()
def _plain_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """log pi(completion token) from a plain forward pass, without TRL's helper."""
    ids = torch.cat([prompt_ids, completion_ids], 1)
    logits = model(input_ids=ids, attention_mask=torch.cat([prompt_mask, completion_mask], 1)).logits
    logits = logits[:, prompt_ids.shape[1] - 1 : -1].float()  # (N, T): position t predicts token t + 1
    return torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)


def _record(trainer, inputs, batch, out):
    tok = trainer.processing_class
    keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
    rec = {k: inputs[k].clone() for k in keys}
    rec.update(
        step=trainer._step,
        loss=out.loss.detach().clone(),
        metrics={k: v.item() for k, v in out.metrics.items()},
        lp=batch.logprobs.detach().clone(),
        lp_plain=_plain_logprobs(trainer.model, *(inputs[k] for k in keys)),
        trl_old=None if inputs.get("old_per_token_logps") is None else inputs["old_per_token_logps"].clone(),
        trl_ref=None if inputs.get("ref_per_token_logps") is None else inputs["ref_per_token_logps"].clone(),
        advantages=inputs["advantages"].clone(),
        rewards=inputs["tether_rewards"].clone(),
        groups=inputs["tether_group_ids"].clone(),
        stats=batch.group_stats,
        loss_norm=batch.loss_norm,
        texts=tok.batch_decode(inputs["completion_ids"], skip_special_tokens=True),
        prompts=[tuple(p[m.bool()].tolist()) for p, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])],
    )
    return rec


def _cat(recs, key):
    return torch.cat([r[key] for r in recs])


def _check_batch_source(recs, obj, group_size):
    """Rewards, groups and advantages of one generation batch, re-derived from TRL's raw rows."""
    texts = [t for r in recs for t in r["texts"]]
    torch.testing.assert_close(_cat(recs, "rewards"), torch.tensor(odd_chars(texts)), rtol=0, atol=1e-6)
    groups, prompts = _cat(recs, "groups"), [p for r in recs for p in r["prompts"]]
    for g in groups.unique().tolist():
        rows = (groups == g).nonzero().flatten().tolist()
        assert len(rows) == group_size and len({prompts[i] for i in rows}) == 1
    expected = obj.advantages(_cat(recs, "rewards"), groups, _cat(recs, "completion_mask").sum(1).float())
    torch.testing.assert_close(_cat(recs, "advantages"), expected, rtol=1e-5, atol=1e-6)
    for r in recs:  # TRL's helper gives the log-prob of each completion token (no off-by-one)
        torch.testing.assert_close(
            r["lp"], torch.where(r["completion_mask"].bool(), r["lp_plain"], r["lp"]), rtol=1e-4, atol=1e-4
        )


def _objective_on(obj, recs, old, ref=None, loss_norm=None):
    """tether's objective on the rows of `recs`, rebuilt from TRL's tensors."""
    batch = objectives.TokenBatch(
        logprobs=_cat(recs, "lp"),
        old_logprobs=old,
        advantages=_cat(recs, "advantages"),
        loss_mask=_cat(recs, "completion_mask").float(),
        ref_logprobs=ref,
        group_ids=_cat(recs, "groups"),
        rewards=_cat(recs, "rewards"),
        loss_norm=loss_norm,
    )
    return obj(batch)


def _changed(trainer, before):
    return [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]


def test_ratio_clip_loss_is_tethers_objective_on_the_whole_step(tiny_dir, tmp_path):
    # 2 accumulation steps per optimiser step, the generation batch (2 prompts x 4) used twice
    # (num_iterations=2): the second optimiser step is off-policy, so the clip is live.
    trainer, recs, before = _train(tiny_dir, tmp_path, "dapo", gradient_accumulation_steps=2, num_iterations=2)
    obj = trainer.tether_objective
    assert _changed(trainer, before)
    assert [r["step"] for r in recs] == [0, 1, 2, 3]
    _check_batch_source(recs[:2], obj, group_size=4)
    for k, step in enumerate((recs[:2], recs[2:])):
        old = _cat(step, "trl_old")  # TRL computes pi_old here since the batch outlives one optimiser step
        whole = _objective_on(obj, step, old)  # the whole mini-batch at once, its own normaliser
        total = sum(r["loss"] for r in step)
        torch.testing.assert_close(total, whole.loss, rtol=1e-5, atol=1e-7)
        # The logged metrics are the objective's on the whole mini-batch, merged exactly over its
        # micro-batches (loss shares summed, means weighted by their token counts, extremes kept).
        logged = trainer.state.log_history[k]
        assert math.isclose(logged["loss/policy"], total.item(), rel_tol=1e-4, abs_tol=1e-7)
        for name in ("policy/clipfrac_high", "policy/kl_old", "policy/ratio_mean", "policy/ratio_max"):
            assert math.isclose(logged[name], whole.metrics[name].item(), rel_tol=1e-4, abs_tol=1e-6), name
    m = _cat(recs[:2], "completion_mask").bool()
    assert (_cat(recs[:2], "lp") - _cat(recs[:2], "trl_old"))[m].abs().max() < 1e-5  # on-policy at step 1
    assert (_cat(recs[2:], "lp") - _cat(recs[2:], "trl_old"))[m].abs().max() > 1e-3  # off-policy at step 2


def test_rpg_with_reference_anchor_gets_reference_logprobs(tiny_dir, tmp_path):
    # generation batch of 8 = two optimiser steps of 4 (PPO-style mini-batches); beta left at 0.
    spec = {"preset": "rpg_fkl", "anchor": "ref", "beta": 0.05}
    trainer, recs, before = _train(tiny_dir, tmp_path, spec, generation_batch_size=8)
    obj = trainer.tether_objective
    assert trainer.ref_model is not None and trainer.beta == 0.05 and trainer.args.beta == 0.05
    assert _changed(trainer, before)
    _check_batch_source(recs, obj, group_size=4)
    for r in recs:  # each optimiser step is one micro-batch: the objective on it, its own normaliser
        expected = _objective_on(obj, [r], r["trl_old"], ref=r["trl_ref"]).loss
        torch.testing.assert_close(r["loss"], expected, rtol=1e-5, atol=1e-7)
        assert "rpg/kl_anchor" in r["metrics"] and "kl/ref" in r["metrics"]
    m = recs[1]["completion_mask"].bool()
    # The reference is the initial policy, which also sampled the batch; the policy has moved by step 2.
    torch.testing.assert_close(recs[1]["trl_ref"][m], recs[1]["trl_old"][m], rtol=0, atol=1e-5)
    assert (recs[1]["lp"] - recs[1]["trl_old"])[m].abs().max() > 1e-3


def test_etr_micro_batches_get_the_whole_generation_batchs_group_statistics(tiny_dir, tmp_path):
    # 4 prompts x 2 samples per generation batch, shuffled by TRL and split into micro-batches of 2
    # rows, so groups are split: each micro-batch's ETR statistics are still the whole batch's.
    trainer, recs, before = _train(
        tiny_dir,
        tmp_path,
        "etr",
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        num_iterations=2,
    )
    obj = trainer.tether_objective
    assert _changed(trainer, before)
    for step in (recs[:4], recs[4:]):
        _check_batch_source(step, obj, group_size=2)
        stats = obj.group_stats(_cat(step, "rewards"), _cat(step, "groups"))
        norm = obj.normalizer(_cat(step, "completion_mask"))
        start = 0
        for r in step:
            rows = torch.arange(start, start + len(r["groups"]))
            start += len(r["groups"])
            torch.testing.assert_close(r["stats"].nu_shift, stats.nu_shift[rows], rtol=0, atol=1e-7)
            batch = objectives.TokenBatch(
                r["lp"],
                r["trl_old"],
                r["advantages"],
                r["completion_mask"].float(),
                loss_norm=norm,
                group_stats=stats.select(rows),
            )
            torch.testing.assert_close(r["loss"], obj(batch).loss, rtol=1e-5, atol=1e-7)
    assert any(len(set(r["groups"].tolist())) == 2 for r in recs)  # some micro-batch split two groups
    assert any(k.startswith("etr/") for k in trainer.state.log_history[0])


def test_only_trl_compat_touches_trls_private_members():
    # Issue 25, item 6: a new TRL release is a review of trl_compat.py. The adapter overrides no private
    # GRPOTrainer method and reads no private attribute; the hooks class overrides exactly these four.
    import inspect
    import re

    from tether.integrations import trl as adapter
    from tether.integrations import trl_compat
    from trl import GRPOTrainer

    private = {k for k in vars(GRPOTrainer) if k.startswith("_") and not k.startswith("__")}
    assert private & set(vars(trl_compat.GRPOTrainerHooks)) == {
        "_calculate_rewards",
        "_generate_and_score_completions",
        "_prepare_inputs",
        "_compute_loss",
    }
    assert not private & set(vars(TetherGRPOTrainer))
    source = inspect.getsource(adapter)
    assert not re.search(r"self\.(_step|_buffered_inputs|_metrics|_get_per_token_logps_and_entropies)\b", source)


def test_unknown_objective_fails_before_loading_the_model():
    with pytest.raises(ConfigError, match=r"unknown objective or preset 'rpg_fk1'.*'rpg_fkl'.*Valid"):
        TetherGRPOTrainer("no/such-model", odd_chars, GRPOConfig(report_to="none", use_cpu=True), objective="rpg_fk1")


@pytest.mark.parametrize(
    "setting, message",
    [
        ({"top_entropy_quantile": 0.5}, "top_entropy_quantile.*the objective's top_entropy_frac"),
        ({"entropy_coef": 0.01}, "entropy_coef"),
        ({"use_adaptive_entropy": True}, "use_adaptive_entropy.*trainer.entropy_target"),
        ({"sync_ref_model": True}, "sync_ref_model"),
    ],
)
def test_settings_tether_cannot_honour_are_refused(tmp_path, setting, message):
    with pytest.raises(ConfigError, match=message):
        TetherGRPOTrainer("no/such-model", odd_chars, _args(tmp_path, **setting), objective="dapo")


def _troll_records(tiny_dir, tmp_path, **overrides):
    """TROLL trained in the adapter; at each loss evaluation, beside the adapter's loss and batch: the supports tether's
    trainer computes for the same rows with the same weights (`model.support`, positions 0, 1, ... as TRL's forward
    gets them), and pi_theta's full log-softmax from a plain forward of the model."""
    from tether.model.causal_lm import LogProbSettings, Tokens
    from tether.model.support import old_with_set, on_support

    records = []

    def hook(inputs, batch, out):
        size = trainer.tether_objective.config.sparse_support()
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = inputs["completion_mask"].float()
        tokens = Tokens(
            ids,
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            torch.arange(ids.shape[1]).expand_as(ids),
            inputs["completion_ids"],
            mask,
            inputs["prompt_ids"].shape[1],
        )
        with torch.no_grad():
            _, now_set = old_with_set(trainer.model, tokens, LogProbSettings(), size)
            full = torch.log_softmax(trainer.model(input_ids=ids, attention_mask=tokens.attention_mask).logits, -1)
            full = full[:, tokens.prompt_len - 1 : -1].double()  # (N, T, V): position t predicts token t + 1
        old = inputs.get("tether_old_set_ids")
        old_set = None if old is None else type(now_set)(*(inputs[k] for k in OLD_SET))
        lp, _, support = on_support(
            trainer.model, tokens, LogProbSettings(), size, old_set, inputs.get("old_per_token_logps")
        )
        records.append(
            dict(
                loss=out.loss.detach(),
                batch=batch,
                now_set=now_set,
                old_set=old_set,
                support=support,
                lp=lp.detach(),
                full=full,
                mask=mask.bool(),
                completion_ids=inputs["completion_ids"],
            )
        )

    trainer = make_trainer(
        str(tiny_dir),
        odd_chars,
        Dataset.from_dict({"prompt": PROMPTS}),
        objective={"preset": "troll", "top_k": 8},
        args=_args(tmp_path, **overrides),
        on_objective=hook,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert _changed(trainer, before)
    return trainer, records


@pytest.mark.parametrize("num_iterations", slow_after_first([2, 1]))
def test_troll_runs_in_the_adapter_on_the_supports_tethers_trainer_gives_it(tiny_dir, tmp_path, num_iterations):
    # num_iterations=2: each generation batch serves two optimiser steps, so TRL computes pi_old's log-probs and the
    # adapter adds pi_old's sparse set as columns TRL shuffles and splits with the rows; 1: on-policy, no set.
    trainer, recs = _troll_records(tiny_dir, tmp_path, num_iterations=num_iterations)
    obj = trainer.tether_objective
    assert len(recs) == 2 and all(torch.isfinite(r["loss"]) for r in recs)
    for k, r in enumerate(recs):
        b, sup, m = r["batch"], r["support"], r["mask"]
        # the adapter's loss is tether's objective on the supports tether's trainer computes for these rows
        expected = obj(dataclasses.replace(b, logprobs=r["lp"], **sup.batch_fields())).loss
        torch.testing.assert_close(r["loss"], expected, rtol=1e-6, atol=1e-8)
        # independently of tether's head: pi_theta on the support is the model's own full log-softmax there
        got = b.support_logprobs.detach().double()
        want = r["full"].gather(-1, sup.index)
        torch.testing.assert_close(got[sup.mask & m[..., None]], want[sup.mask & m[..., None]], rtol=0, atol=1e-5)
        sampled = r["full"].gather(-1, r["completion_ids"][..., None])[..., 0]
        torch.testing.assert_close(b.logprobs.detach().double()[m], sampled[m], rtol=0, atol=1e-5)
        if num_iterations == 1:  # on-policy: nothing stored, pi_old on the support is pi_theta's, detached
            assert r["old_set"] is None and torch.equal(b.old_support_logprobs, got.to(b.old_support_logprobs.dtype))
        else:  # the set the columns carry is pi_old's: the weights of the first step, which sampled the batch
            first = recs[0]["now_set"]
            assert r["old_set"] is not None and torch.equal(r["old_set"].ids, first.ids)
            torch.testing.assert_close(r["old_set"].logp, first.logp, rtol=0, atol=1e-6)
    if num_iterations == 2:  # the second step is off-policy: pi_old's support differs from pi_theta's
        b = recs[1]["batch"]
        live = b.support_mask & recs[1]["mask"][..., None]
        assert (b.support_logprobs.detach() - b.old_support_logprobs)[live].abs().max() > 1e-3


def test_troll_refuses_a_batch_with_images(tiny_dir, tmp_path):
    # TROLL's own forward runs the text; a vision-language batch would be scored without its images (departure 12)
    trainer = make_trainer(
        str(tiny_dir), odd_chars, Dataset.from_dict({"prompt": PROMPTS}), objective="troll", args=_args(tmp_path)
    )
    with pytest.raises(ConfigError, match="would leave out the batch's pixel_values"):
        trainer.policy_forward(trainer.model, {"pixel_values": torch.zeros(1, 3)})


def test_troll_with_a_router_loss_is_refused(tiny_dir, tmp_path):
    # a mixture-of-experts router loss comes from TRL's helper, which TROLL's own forward replaces (departure 12)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    model.config.output_router_logits = True  # with a coefficient, what TRL reads to add the router loss
    model.config.router_aux_loss_coef = 0.01
    with pytest.raises(ConfigError, match="computes no router auxiliary loss: set the model's output_router_logits"):
        TetherGRPOTrainer(
            model,
            odd_chars,
            _args(tmp_path),
            objective="troll",
            train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
            processing_class=load_tokenizer(tiny_dir),
        )


@pytest.mark.parametrize(
    "objective", ["opd", {"preset": "dapo", "distill": {"signal": "kl_loss"}}, {"preset": "dapo", "distill": {}}]
)
def test_an_objective_that_distills_is_refused_before_loading_the_model(tmp_path, objective):
    # GRPOTrainer scores no teacher, so the teacher's log-probs the objective reads would never reach the loss: the
    # adapter refuses, naming why and TRL's own distillation trainers
    with pytest.raises(ConfigError, match="distill.*GRPOTrainer computes no teacher log-probs.*DistillationTrainer"):
        TetherGRPOTrainer("no/such-model", odd_chars, _args(tmp_path), objective=objective)


def test_trls_and_the_objectives_reward_aggregation_must_agree(tmp_path):
    gdpo_args = _args(tmp_path, multi_objective_aggregation="normalize_then_sum")
    with pytest.raises(ConfigError, match="multi_objective_aggregation='normalize_then_sum'.*reward_aggregation"):
        TetherGRPOTrainer("no/such-model", odd_chars, gdpo_args, objective="dapo")
    with pytest.raises(ConfigError, match="reward_aggregation='normalize_then_sum' is not used with advantages='trl'"):
        TetherGRPOTrainer("no/such-model", odd_chars, _args(tmp_path), objective="gdpo", advantages="trl")


def digit_share(completions, **_):
    """Share of digit characters: a second reward function, on another scale than odd_chars."""
    return [sum(c.isdigit() for c in t) / max(len(t), 1) for t in completions]


@pytest.mark.parametrize("mode", slow_after_first(["tether", "trl"]))
def test_gdpo_advantages_are_tethers_and_trls_normalize_then_sum(tiny_dir, tmp_path, mode):
    """GDPO in the adapter: with advantages="tether" the gdpo preset's estimator on the two reward functions'
    scores (re-scored here from the decoded completions); with advantages="trl" TRL's own
    `multi_objective_aggregation="normalize_then_sum"`, which is tether's `normalize_then_sum` at TRL's eps 1e-4
    followed by TRL's per-sequence batch step (R - mean_B) / (std_B + 1e-4)."""
    records = []
    weights = [1.0, 0.5]
    args = _args(
        tmp_path,
        gradient_accumulation_steps=2,
        reward_weights=weights,
        multi_objective_aggregation="normalize_then_sum",
    )
    trainer = make_trainer(
        str(tiny_dir),
        [odd_chars, digit_share],
        Dataset.from_dict({"prompt": PROMPTS}),
        objective="gdpo",
        args=args,
        advantages=mode,
        on_objective=lambda i, b, o: records.append(_record(trainer, i, b, o)),
    )
    trainer.train()
    recs = records[:2]  # the first generation batch: 2 prompts x 4, one optimiser step of 2 micro-batches
    texts = [t for r in recs for t in r["texts"]]
    scores = torch.tensor([odd_chars(texts), digit_share(texts)], dtype=torch.float64).T  # (8, 2)
    parts = RewardParts(scores, torch.tensor(weights, dtype=torch.float64))
    groups, got = _cat(recs, "groups"), _cat(recs, "advantages").double()
    if mode == "tether":
        lengths = _cat(recs, "completion_mask").sum(1).double()
        expected = trainer.tether_objective.advantages(scores @ parts.weights, groups, lengths, parts)
    else:
        summed = normalize_then_sum(parts, groups, eps=1e-4)
        expected = (summed - summed.mean()) / (summed.std() + 1e-4)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_grpo_batch_std_is_trls_scale_rewards_batch(tiny_dir, tmp_path):
    """TRL's `scale_rewards="batch"` (advantages="trl") is tether's grpo_batch_std up to the eps: TRL divides by
    std_B + 1e-4, tether by std_B + 1e-6 (tether.core.advantages, grpo_batch_std departure 1)."""
    records = []
    args = _args(tmp_path, gradient_accumulation_steps=2, scale_rewards="batch")
    trainer = make_trainer(
        str(tiny_dir),
        odd_chars,
        Dataset.from_dict({"prompt": PROMPTS}),
        objective={"preset": "dapo", "advantage": "grpo_batch_std"},
        args=args,
        advantages="trl",
        on_objective=lambda i, b, o: records.append(_record(trainer, i, b, o)),
    )
    trainer.train()
    recs = records[:2]  # the first generation batch, 2 prompts x 4
    rewards = torch.tensor(odd_chars([t for r in recs for t in r["texts"]]), dtype=torch.float64)
    groups, got = _cat(recs, "groups"), _cat(recs, "advantages").double()
    std_b = rewards.std()
    expected = trainer.tether_objective.advantages(rewards, groups) * (std_b + 1e-6) / (std_b + 1e-4)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "setting, warns",
    [
        ({}, True),  # TRL's defaults: every generation batch within one optimiser step
        ({"gradient_accumulation_steps": 2}, True),
        ({"num_iterations": 2}, False),
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 4}, False),
    ],
)
def test_an_inactive_trust_region_is_warned_about(tmp_path, setting, warns):
    # Issue 13, item 7: with on-policy updates DAPO's clip reduces to plain policy gradient.
    args = _args(tmp_path, **setting)
    assert (inactive_trust_region(args, objectives.build("dapo")) is not None) == warns
    assert inactive_trust_region(args, objectives.build("reinforce")) is None  # nothing to warn about
    if warns:
        with pytest.warns(UserWarning, match="the clip is inactive.*num_iterations>=2"), pytest.raises(Exception):
            TetherGRPOTrainer("no/such-model", odd_chars, args, objective="dapo")


def test_unscorable_completions_get_zero_advantage_and_no_part_in_the_baseline():
    obj = objectives.build("rpg_fkl")  # dr_grpo: A = R - group mean
    rewards = torch.tensor([1.0, float("nan"), 0.0, 1.0, 0.5, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    # group 0 keeps one scored sample: no baseline, A = 0; group 1: mean 0.5; group 2: mean 0.25
    expected = torch.tensor([0.0, 0.0, -0.5, 0.5, 0.25, -0.25])
    torch.testing.assert_close(group_advantages(obj, rewards, groups), expected, rtol=0, atol=1e-7)


def test_reinforce_pp_advantages_are_the_trainers_whitened_over_tokens():
    """Issue 22, item 4: the adapter passed no lengths, so reinforce_pp whitened per sequence while
    tether's trainer and verl whiten over tokens. The audit's case, float64."""
    obj = objectives.build("reinforce_pp")
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1], dtype=torch.float64)
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    lengths = torch.tensor([10.0, 200, 30, 50, 5, 120, 60, 15], dtype=torch.float64)
    # a = R - group mean = [.5, -.5, -.5, .5 | .25, .25, -.75, .25]; weights L, sum W = 490.
    # sum L a = 5 - 100 - 15 + 25 + 1.25 + 30 - 45 + 3.75 = -95, so the mean m = -95/490;
    # sum L a^2 = 290 * .25 + 140 * .0625 + 60 * .5625 = 115, var = (115 - 490 m^2) / (490 - 1) (Bessel);
    # A = (a - m) / sqrt(var + 1e-8) = [1.561, -0.689, -0.689, 1.561, 0.999, 0.999, -1.251, 0.999].
    a = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, -0.75, 0.25], dtype=torch.float64)
    m = -95 / 490
    expected = (a - m) / math.sqrt((115 - 490 * m**2) / 489 + 1e-8)
    trainer = obj.advantages(rewards, groups, lengths)  # what tether's trainer computes (train.py)
    torch.testing.assert_close(trainer, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(group_advantages(obj, rewards, groups, lengths), expected, rtol=1e-12, atol=0)
    assert torch.allclose(
        expected,
        torch.tensor([1.561, -0.689, -0.689, 1.561, 0.999, 0.999, -1.251, 0.999], dtype=torch.float64),
        atol=5e-4,
    )
    # Per sequence (all weights 1; the adapter before): mean 0, var = 1.75 / 7 = .25, A = 2a.
    torch.testing.assert_close(group_advantages(obj, rewards, groups), 2 * a, rtol=1e-6, atol=0)
    # An unscorable row leaves the baseline and the batch statistics, its length with it.
    rewards[1] = float("nan")
    ok = torch.arange(8) != 1
    got = group_advantages(obj, rewards, groups, lengths)
    assert got[1] == 0
    torch.testing.assert_close(got[ok], obj.advantages(rewards[ok], groups[ok], lengths[ok]), rtol=0, atol=0)


def test_reward_func_scores_tether_examples_with_a_tether_verifier():
    data = to_dataset([Example("a", "1+1=", "2"), Example("b", "2+3=", "5")])
    score = reward_func("exact_match")
    rows = data[:]
    assert score(
        prompts=rows["prompt"],
        completions=["2", "6"],
        answer=rows["answer"],
        id=rows["id"],
        meta=rows["meta"],
        trainer_state=None,
    ) == [1.0, 0.0]
    assert score.__name__ == "exact_match"


@pytest.mark.gpu
def test_the_adapter_trains_on_cuda_in_bf16(tiny_dir, tmp_path):
    trainer, recs, before = _train(tiny_dir, tmp_path, "dapo", use_cpu=False, bf16=True, num_iterations=2)
    assert next(trainer.model.parameters()).device.type == "cuda"
    assert _changed(trainer, before)
    assert all(torch.isfinite(r["loss"]) for r in recs)


@pytest.mark.slow  # a training that starts its own vLLM engine in a fresh interpreter: about 45 s on 2 cores
@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine: TRL's own weight sync serves vLLM's CUDA build")
@pytest.mark.parametrize("onednn", ["native", "AVX2"])
def test_colocated_vllm_on_a_cpu_samples_from_the_current_weights(tmp_path, monkeypatch, onednn):
    """TRL's own colocated sync stops where vLLM packs its linear layers (tests/rollout/test_vllm_engine.py); the
    adapter pushes through vLLM's reload instead (departure 11). Both kinds of CPU on one machine: oneDNN as the
    CPU has it, and capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`: no bfloat16 matmul, so vLLM falls back to torch's
    linear and keeps its weights, as on an AVX2-only CPU; AMX CPUs pack through sgl-kernel regardless).
    A tied model (as SmolLM2 and Qwen2.5-0.5B are), lr 1e-2, two generation batches of two optimiser steps: at
    every loss evaluation vLLM's sampler log-probs are the policy's at sampling time up to TRL's bfloat16 engine
    (measured 3-4e-3). The control: after training, the engine as the last batch left it (two steps behind)
    reads about 1, and 6e-3 after one more sync."""
    pytest.importorskip("vllm")
    from tether.model.loading import init_model
    from trl_vllm_colocate import run

    if onednn != "native":
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn)
    model_dir = init_model(tmp_path / "m", hidden_size=128, num_layers=1, num_heads=4, seed=0, tied=True)
    result = run(model_dir, "tether", tmp_path / "out")
    assert "error" not in result and result["steps"] == 4, result
    if onednn == "AVX2" and not torch.cpu._is_amx_tile_supported():
        assert result["packed"] == [], result  # the emulation reached vLLM's fallback
    assert len(result["sampler_gap"]) == 4 and max(result["sampler_gap"]) < 0.02, result
    assert result["after"]["stale"] > 0.2 and result["after"]["synced"] < 0.02, result


@pytest.mark.parametrize(
    "objective",
    slow_after_first(
        ["dppo_tv", "sapo", "gmpo", "clip_cov", "kl_cov", "reinforce_pp", "vespo", "luspo", "dro"]
        + ["bapo", "gppo", "ce_gppo", "aspo", "pspo", "cfpo", "trm", "dgpo", "abc_grpo"]  # issue 51
    ),
)
def test_every_objective_trains_off_policy_in_the_adapter(tiny_dir, tmp_path, objective):
    # Issue 18: every objective is usable in the TRL adapter (here off-policy: num_iterations=2). ASPO's preset carries
    # the paper's KL penalty, which needs TRL's reference model (beta > 0); here without it.
    spec = {"preset": "aspo", "kl_penalty": None} if objective == "aspo" else objective
    trainer, recs, before = _train(tiny_dir, tmp_path, spec, num_iterations=2)
    assert _changed(trainer, before)
    assert all(torch.isfinite(r["loss"]) for r in recs)
    obj = trainer.tether_objective
    _check_batch_source(recs[:1], obj, group_size=4)  # one generation batch, used by both steps
    for r in recs:  # each optimiser step is one micro-batch here: the objective on its rows
        expected = _objective_on(obj, [r], r["trl_old"]).loss
        if objective not in ("clip_cov", "bapo"):  # clip_cov's random choice; bapo's bounds from the whole batch
            torch.testing.assert_close(r["loss"], expected, rtol=1e-5, atol=1e-7)


def test_the_objectives_top_entropy_frac_selects_from_trls_entropies(tiny_dir, tmp_path):
    # Issue 51: TRL's top_entropy_quantile is refused (it masks TRL's own loss); the objective's top_entropy_frac
    # takes its place, selecting within each micro-batch from the entropies TRL computes, passed detached.
    from tether.core.entropy import top_entropy_mask

    records = []
    trainer = make_trainer(
        str(tiny_dir),
        odd_chars,
        Dataset.from_dict({"prompt": PROMPTS}),
        objective={"preset": "dapo", "top_entropy_frac": 0.2},
        args=_args(tmp_path),
        on_objective=lambda inputs, batch, out: records.append((batch, out)),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert records and _changed(trainer, before)
    for batch, out in records:
        assert batch.entropy is not None and not batch.entropy.requires_grad
        kept = top_entropy_mask(batch.entropy, batch.loss_mask, 0.2)
        share = (kept.sum() / batch.loss_mask.sum()).item()
        assert out.metrics["policy/top_entropy_kept_frac"].item() == pytest.approx(share, abs=1e-12) and share < 1
        again = trainer.tether_objective(dataclasses.replace(batch, logprobs=batch.logprobs.detach()))
        torch.testing.assert_close(out.loss.detach(), again.loss, rtol=1e-6, atol=1e-8)


def _train_on_injected_sampler_logprobs(tiny_dir, tmp_path, spec, seed):
    """Two optimiser steps of `spec` whose sampler log-probs are injected (pi_old plus noise) as TRL hands vLLM's
    over (`sampling_per_token_logps`); the trainer and each loss evaluation's (inputs, batch, out)."""

    class Injected(TetherGRPOTrainer):
        def on_generation_batch(self, out):
            out = super().on_generation_batch(out)
            old = out["old_per_token_logps"]
            g = torch.Generator().manual_seed(seed)
            out["sampling_per_token_logps"] = old + 0.2 * torch.randn(old.shape, generator=g).to(old.device)
            return out

    records = []
    trainer = Injected(
        str(tiny_dir),
        odd_chars,
        _args(tmp_path, num_iterations=2),
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        objective=spec,
        on_objective=lambda inputs, batch, out: records.append((inputs, batch, out)),
    )
    trainer.train()
    return trainer, records


def test_rollout_correction_reads_injected_sampler_logprobs(tiny_dir, tmp_path):
    # Issue 18, item 2: the objective's correction weighs each token by the injected sampler log-probs.
    spec = {"preset": "dapo", "rollout_correction": {"mode": "truncate", "high": 1.5}}
    _, records = _train_on_injected_sampler_logprobs(tiny_dir, tmp_path, spec, seed=0)
    for inputs, batch, out in records:
        assert torch.equal(batch.sampler_logprobs, inputs["sampling_per_token_logps"])
        assert out.metrics["rollout_correction/mismatch_k3"] > 0
        assert 0 < out.metrics["rollout_correction/truncated_frac"] < 1
        plain = objectives.build("dapo")(
            objectives.TokenBatch(batch.logprobs.detach(), batch.old_logprobs, batch.advantages, batch.loss_mask)
        )
        assert not torch.isclose(out.loss.detach(), plain.loss)  # the correction changed the loss


def test_vespo_and_the_sampler_kl_read_injected_sampler_logprobs(tiny_dir, tmp_path):
    # Issue 30: VESPO folds the rollout-correction weights into its sequence ratio and sampler_kl_coef adds
    # tau (log pi_theta - log pi_sampler)^2; both read TRL's sampling_per_token_logps.
    spec = {"preset": "vespo", "rollout_correction": {"mode": "truncate", "high": 1.5}, "sampler_kl_coef": 0.01}
    trainer, records = _train_on_injected_sampler_logprobs(tiny_dir, tmp_path, spec, seed=1)
    for _, batch, out in records:
        again = trainer.tether_objective(dataclasses.replace(batch, logprobs=batch.logprobs.detach()))
        torch.testing.assert_close(out.loss.detach(), again.loss, rtol=1e-6, atol=1e-8)
        assert out.metrics["loss/sampler_kl"] > 0 and 0 < out.metrics["rollout_correction/truncated_frac"] < 1
        assert "vespo/phi_mean" in out.metrics


# ---------------------------------------------------------------- many processes

TWO_PROCESS_SCRIPT = Path(__file__).resolve().parents[1].joinpath("trl_two_processes.py")
TWO_PROCESS_OBJECTIVES = ["ppo_clip", "etr", "reinforce_pp", "rpg_ref"]  # the script's OBJECTIVES


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def one_and_two_processes(tiny_dir, tmp_path_factory):
    """The script's runs in one process and in two (`accelerate launch`), side by side; their output dirs."""
    one, two = tmp_path_factory.mktemp("one_process"), tmp_path_factory.mktemp("two_processes")
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1"}
    single = subprocess.Popen(
        [sys.executable, str(TWO_PROCESS_SCRIPT), str(tiny_dir), str(one)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(_free_port()),
        str(TWO_PROCESS_SCRIPT),
        str(tiny_dir),
        str(two),
    ]
    try:
        double = subprocess.run(launch, env=env, capture_output=True, text=True, timeout=900)
        single_log = single.communicate(timeout=900)[0]
    finally:
        if single.poll() is None:
            single.kill()
            single.wait()
    assert single.returncode == 0, single_log[-4000:]
    assert double.returncode == 0, (double.stdout + double.stderr)[-4000:]
    return one, two


def _run(out_dir: Path, name: str, ranks: int) -> list[dict]:
    return [json.loads((out_dir / f"{name}.rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.slow
@pytest.mark.parametrize("name", TWO_PROCESS_OBJECTIVES)
def test_two_processes_train_exactly_as_one(one_and_two_processes, tiny_dir, name):
    """Issue 22: the adapter gathers rewards (advantages, ETR's group statistics, reinforce_pp's token
    counts), reduces normalisers and merges metrics across processes. Two processes of 6 rows each (one
    accumulation step) against one process of 12 rows (two accumulation steps), on the same global batch
    (tests/trl_two_processes.py), two SGD steps, the second off-policy: the same loss, the same weights
    (SGD: weights move by lr x the gradient, so equal weights are equal gradients), the same logged metrics."""
    one_dir, two_dir = one_and_two_processes
    (one,), two = _run(one_dir, name, 1), _run(two_dir, name, 2)
    assert one["processes"] == 1
    assert [r["processes"] for r in two] == [2, 2] and two[0]["backend"] == "gloo"
    assert two[0]["distributed"].endswith("MULTI_CPU")
    # The same global batch: (group, reward, counted tokens, advantage) of every row of the first step.
    rows_one = sorted(row for r in one["records"] if r["step"] == 0 for row in r["rows"])
    rows_two = sorted(row for rank in two for r in rank["records"] if r["step"] == 0 for row in r["rows"])
    assert len(rows_one) == len(rows_two) == 12
    torch.testing.assert_close(
        torch.tensor(rows_two, dtype=torch.float64), torch.tensor(rows_one, dtype=torch.float64), rtol=0, atol=1e-6
    )
    # Group 1 is split between the processes (rows 4-5 on rank 0, 6-7 on rank 1).
    assert all(1 in {row[0] for r in rank["records"] for row in r["rows"]} for rank in two)
    for step in (0, 1):
        # One process: the sum of its micro-batch losses; two: DDP averages the processes' gradients.
        loss_one = sum(r["loss"] for r in one["records"] if r["step"] == step)
        loss_two = sum(r["loss"] for rank in two for r in rank["records"] if r["step"] == step) / 2
        assert math.isclose(loss_two, loss_one, rel_tol=1e-5, abs_tol=1e-6), (step, loss_one, loss_two)
        logged_one, logged_two = one["history"][step], two[0]["history"][step]
        assert math.isclose(logged_one["loss/total"], loss_one, rel_tol=1e-5, abs_tol=1e-6)
        names = sorted(one["records"][0]["metrics"])
        assert set(names) <= set(logged_two)
        for k in names:
            assert math.isclose(logged_two[k], logged_one[k], rel_tol=1e-5, abs_tol=1e-6), (step, k)
    w_one, w_two = torch.load(one_dir / f"{name}.rank0.pt"), torch.load(two_dir / f"{name}.rank0.pt")
    from transformers import AutoModelForCausalLM

    w_init = AutoModelForCausalLM.from_pretrained(str(tiny_dir)).state_dict()
    assert max((w_one[k] - w_init[k]).abs().max().item() for k in w_init) > 1e-2  # the steps moved the weights
    for k in w_one:
        torch.testing.assert_close(w_two[k], w_one[k], rtol=0, atol=1e-6)
    if name == "reinforce_pp":
        # Whitened over tokens (item 4): sum_i L_i A_i = 0, so at ratio 1 (step 0) the token-mean loss
        # -sum_i L_i A_i / sum_i L_i is 0; per-sequence whitening would make sum_i A_i = 0 instead.
        lengths, adv = torch.tensor([row[2] for row in rows_two]), torch.tensor([row[3] for row in rows_two])
        assert abs((lengths * adv).sum().item()) < 1e-4 and abs(adv.sum().item()) > 0.1
        assert abs(two[0]["history"][0]["loss/policy"]) < 1e-6
    if name == "etr":
        assert any(k.startswith("etr/") for k in names)
    if name == "rpg_ref":
        assert two[0]["history"][1]["kl/ref"] > 0


@pytest.fixture(scope="module")
def two_machines(tiny_dir, tmp_path_factory):
    """The script's ETR run as two "machines" on loopback: two `accelerate launch --num_machines 2` commands,
    machine ranks 0 and 1, one process each, meeting at 127.0.0.1 (issue 34, item 4); their output dir."""
    out = tmp_path_factory.mktemp("two_machines")
    # gloo connects the ranks over the loopback interface only.
    env = {**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    port = str(_free_port())

    def machine(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "accelerate.commands.launch",
                "--multi_gpu",
                "--num_machines",
                "2",
                "--num_processes",
                "2",
                "--machine_rank",
                str(rank),
                "--main_process_ip",
                "127.0.0.1",
                "--main_process_port",
                port,
                "--mixed_precision",
                "no",
                "--dynamo_backend",
                "no",
                str(TWO_PROCESS_SCRIPT),
                str(tiny_dir),
                str(out),
                "etr",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    machines = [machine(0), machine(1)]
    logs = []
    try:
        logs = [m.communicate(timeout=900)[0] for m in machines]
    finally:
        for m in machines:
            if m.poll() is None:
                m.kill()
                m.wait()
    for rank, (m, log) in enumerate(zip(machines, logs)):
        assert m.returncode == 0, f"machine {rank}: {log[-4000:]}"
    return out


@pytest.mark.slow
def test_two_machines_on_loopback_train_as_one_process(one_and_two_processes, two_machines):
    """Issue 34, item 4: `--multi_gpu --num_machines 2` on two launchers (loopback, gloo, CPU) forms one group
    of world size 2, whose ranks end with identical weights, equal to one process's on the same global batch,
    with the same loss at each step. (`--cpu --num_machines 2` would run two unrelated one-process jobs.)"""
    one_dir, _ = one_and_two_processes
    (one,), two = _run(one_dir, "etr", 1), _run(two_machines, "etr", 2)
    assert [(r["processes"], r["backend"]) for r in two] == [(2, "gloo"), (2, "gloo")]
    assert all(r["distributed"].endswith("MULTI_CPU") for r in two)
    for step in (0, 1):
        loss_one = sum(r["loss"] for r in one["records"] if r["step"] == step)
        loss_two = sum(r["loss"] for rank in two for r in rank["records"] if r["step"] == step) / 2
        assert math.isclose(loss_two, loss_one, rel_tol=1e-5, abs_tol=1e-6), (step, loss_one, loss_two)
        assert math.isclose(two[0]["history"][step]["loss/total"], loss_one, rel_tol=1e-5, abs_tol=1e-6)
    w0, w1 = (torch.load(two_machines / f"etr.rank{r}.pt") for r in (0, 1))
    w_one = torch.load(one_dir / "etr.rank0.pt")
    for k in w0:
        torch.testing.assert_close(w1[k], w0[k], rtol=0, atol=0)  # DDP: both ranks took the same step
        torch.testing.assert_close(w0[k], w_one[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_the_example_defaults_make_the_trust_region_act(tmp_path):
    """examples/trl/train_grpo.py with its defaults (--num-iterations 2) on a tiny model: the second
    pass over each generation batch is off-policy, so the ratio moves and the clip acts (issue 24, 19)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "trl" / "train_grpo.py"
    spec = importlib.util.spec_from_file_location("train_grpo", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    trainer = example.main(
        [
            "--tiny",
            "--max-steps",
            "2",
            "--per-device-batch",
            "8",
            "--num-generations",
            "4",
            "--output-dir",
            str(tmp_path),
        ]
    )
    logs = [h for h in trainer.state.log_history if "policy/ratio_max" in h]
    assert len(logs) == 2
    # optimiser step 1: first pass, on-policy (ratio exactly 1, nothing clipped); step 2: second pass
    assert logs[0]["policy/ratio_max"] == 1.0 and logs[0]["policy/clipfrac_high"] == 0.0
    assert logs[1]["policy/ratio_max"] > 1.0
    assert logs[1]["policy/clipfrac_high"] + logs[1]["policy/clipfrac_low"] > 0


# ---------------------------------------------------------------- rows with no counted token (issue 30, item 3)


def _adapters_loss(objective, lp, old, adv, mask, max_len, train=True, tool_mask=None, ref=None, beta=0.0):
    """The adapter's loss path (`TetherGRPOTrainer.on_new_buffer`, `_step_normalizer`, `_token_batch`,
    `objective_loss`) on a stand-in trainer: one process, one accumulation step, the batch its own buffer."""
    from types import MethodType, SimpleNamespace

    leaf = lp.clone().requires_grad_()
    stub = SimpleNamespace(
        tether_objective=objectives.build(objective, max_len=max_len),
        beta=beta,
        on_objective=None,
        model=SimpleNamespace(training=train),
        current_gradient_accumulation_steps=1,
        num_iterations=1,
        micro_step=0,
        args=SimpleNamespace(steps_per_generation=1, gradient_accumulation_steps=1),
        accelerator=SimpleNamespace(reduce=lambda x, **_: x, num_processes=1),
        _log_objective=lambda *a: None,
    )
    for name in ("on_new_buffer", "_step_normalizer", "_token_batch"):
        setattr(stub, name, MethodType(getattr(TetherGRPOTrainer, name), stub))
    inputs = {"completion_mask": mask, "advantages": adv, "old_per_token_logps": old}
    if tool_mask is not None:
        inputs["tool_mask"] = tool_mask
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    stub.on_new_buffer([inputs])
    loss = TetherGRPOTrainer.objective_loss(stub, inputs, leaf, torch.zeros_like(leaf))
    loss.backward()
    return loss.detach(), leaf.grad


GRPO_SAME_AS_TRL = {"name": "ppo_clip", "aggregation": "seq-mean-token-mean", "advantage": "grpo"}  # beta 0
DR_GRPO = "dr_grpo"


def test_an_empty_row_counts_in_the_normaliser_as_in_trl_hand_computed():
    # 4 rows, the last with no counted token (mask_truncated_completions on a truncated completion); on-policy,
    # so every kept token's loss is -A. Rows 0-2: A = .3, -.6, .9 over 2, 3, 1 tokens.
    #   TRL grpo: mean over the 4 rows of the row's token mean = -(.3 - .6 + .9 + 0) / 4 = -0.15
    #   (before: over the 3 rows with tokens, -0.2, the 4/3)
    #   TRL dr_grpo: sum over tokens / (4 rows x max_completion_length 3) = -(.6 - 1.8 + .9) / 12 = 0.025
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]])
    lp = torch.full((4, 3), -1.0)
    adv = torch.tensor([0.3, -0.6, 0.9, 0.0])
    for spec, expected in ((GRPO_SAME_AS_TRL, -0.15), (DR_GRPO, 0.025)):
        for train in (True, False):
            loss, _ = _adapters_loss(spec, lp, lp, adv, mask, 3, train)
            assert loss.item() == pytest.approx(expected, rel=1e-6), (spec, train)
    # tether's own trainer keeps verl's convention: the empty row does not count
    assert objectives.build(GRPO_SAME_AS_TRL)(
        objectives.TokenBatch(lp, lp, adv, mask.float())
    ).loss.item() == pytest.approx(-0.2, rel=1e-6)


@pytest.mark.parametrize(
    "loss_type, spec",
    [("grpo", GRPO_SAME_AS_TRL), ("dr_grpo", DR_GRPO), ("bnpo", {"name": "ppo_clip", "aggregation": "token-mean"})],
)
@pytest.mark.parametrize("seed", range(3))
def test_the_adapters_loss_and_gradient_are_trls_own_with_empty_rows(loss_type, spec, seed):
    g = torch.Generator().manual_seed(seed)
    n, t = 4, 6
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2 - 0.1
    lp = old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)  # off-policy: the clip acts
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.arange(t)[None, :] < torch.tensor([6, 0, 3, 5])[:, None]).long()  # row 1 empty
    mask[3, 1] = 0  # a tool-output token inside a row
    trl_loss, trl_grad, _ = trl_compute_loss(loss_type, lp, old, adv, mask, max_len=t + 2)
    loss, grad = _adapters_loss(spec, lp, old, adv, mask, t + 2)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- multi-turn batches: TRL's tool_mask


@pytest.mark.parametrize("loss_type, spec", [("grpo", "grpo"), ("dr_grpo", DR_GRPO), ("dapo", "dapo")])
@pytest.mark.parametrize("seed", range(2))
def test_tool_outputs_are_masked_out_of_the_loss_and_the_kl_as_trl_masks_them(loss_type, spec, seed):
    """A TRL batch of tool-calling completions carries `tool_mask` (0 at the tools' output): the adapter's loss
    and gradient are TRL's own `_compute_loss` on the same inputs, the KL penalty included (grpo: beta 0.04),
    and a tool-output token gets no gradient."""
    g = torch.Generator().manual_seed(seed)
    n, t = 4, 8
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 2 - 0.1
    lp = old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = old + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    mask = (torch.arange(t)[None, :] < torch.tensor([8, 6, 7, 5])[:, None]).long()
    tool = torch.ones(n, t, dtype=torch.long)
    tool[0, 2:5] = 0  # a tool's result inside a completion, the model's tokens after it
    tool[2, 1:3] = 0
    tool[3, :5] = 0  # a row that is all tool output
    objective = objectives.build(spec).config
    beta = objective.kl_penalty.coef if getattr(objective, "kl_penalty", None) else 0.0
    eps = (objective.eps_low, objective.eps_high)
    trl_loss, trl_grad, _ = trl_compute_loss(
        loss_type, lp, old, adv, mask, ref=ref if beta else None, beta=beta, eps=eps, max_len=t, tool_mask=tool
    )
    loss, grad = _adapters_loss(spec, lp, old, adv, mask, t, tool_mask=tool, ref=ref if beta else None, beta=beta)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-12, atol=1e-15)
    assert torch.all(grad[tool == 0] == 0) and grad[(tool * mask) == 1].abs().sum() > 0
