"""Packing is exact: padding-free forwards (trainer.packing) and token-budget micro-batches (trainer.micro_batch_tokens)
give the padded computation's log-probs, and the update's gradient, to float64 rounding, for every objective.

The batch is built to catch a packing that leaks across sequences or misplaces a token: prompts of different
lengths (left padding), completions of different lengths (right padding), an environment's tokens inside two
completions (read by the model, outside the loss mask), groups of three samples (group statistics), and two
mini-batches so that the second is off-policy and every trust region acts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tether import objectives
from tether.config.sections import TrainerConfig
from tether.core import aggregation as G
from tether.model import packing
from tether.model.causal_lm import LogProbSettings, Precision, Tokens, batched_logprobs, head_pass, left_pad, positions
from tether.model.loading import load_model
from tether.objectives.runtime import RewardParts
from tether.model.support import old_with_set
from tether.trainer.update import Policy, TeacherScores, UpdateBatch, update

PROMPTS = [[5, 9, 3], [7, 2], [4, 4, 8, 6, 1], [9]]  # four groups of three samples
COMPLETION_LENGTHS = [6, 2, 4, 1, 5, 3, 6, 6, 2, 3, 1, 4]
ENV_TOKENS = {1: [], 4: [1, 2], 7: [3]}  # row -> completion columns an environment wrote
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model(tiny_dir):
    m, _ = load_model(str(tiny_dir), device="cpu")
    return m.double()


def _tokens() -> Tokens:
    g = torch.Generator().manual_seed(0)
    prompts, prompt_mask, _ = left_pad([p for p in PROMPTS for _ in range(3)], 0)
    T = max(COMPLETION_LENGTHS)
    completion = torch.randint(3, 40, (len(COMPLETION_LENGTHS), T), generator=g)
    attention = torch.zeros(len(COMPLETION_LENGTHS), T, dtype=torch.long)
    for i, n in enumerate(COMPLETION_LENGTHS):
        attention[i, :n] = 1
    completion = completion * attention
    trained = attention.clone().double()
    for i, cols in ENV_TOKENS.items():
        trained[i, cols] = 0.0
    mask = torch.cat([prompt_mask, attention], 1)
    return Tokens(torch.cat([prompts, completion], 1), mask, positions(mask), completion, trained, prompts.shape[1])


def test_a_packed_forward_gives_the_padded_log_probs_and_entropies(model):
    tokens = _tokens()
    padded = head_pass(model, tokens, LogProbSettings(share_prompts=False))
    packed = head_pass(model, tokens, LogProbSettings(pack=True, share_prompts=False))
    assert packing.packing_reason(model) == ""
    shared = head_pass(model, tokens, LogProbSettings(pack=True))  # each group's prompt once (SHARED_ROUNDING)
    torch.testing.assert_close(shared.logprobs, padded.logprobs, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(shared.entropy, padded.entropy, rtol=1e-9, atol=1e-9)
    plan = packing.plan(tokens.input_ids, tokens.attention_mask, tokens.prompt_len)
    assert plan.bins < tokens.input_ids.shape[0]  # it did pack rows together
    torch.testing.assert_close(packed.logprobs, padded.logprobs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(packed.entropy, padded.entropy, rtol=1e-12, atol=1e-12)
    # and a sequence's log-probs do not depend on what it is packed with: change another row's tokens
    other = dataclasses.replace(tokens, input_ids=tokens.input_ids.clone())
    other.input_ids[0, -3:] = 11
    again = head_pass(model, other, LogProbSettings(pack=True, share_prompts=False))
    torch.testing.assert_close(again.logprobs[1:], packed.logprobs[1:], rtol=1e-12, atol=1e-12)


def test_the_plan_places_every_real_token_once_first_fit_decreasing():
    ids = torch.tensor([[0, 5, 6, 7], [1, 2, 3, 4], [0, 0, 8, 9], [0, 0, 0, 9]])
    mask = (ids != 0).long()
    p = packing.plan(ids, mask, 2)  # rows as wide as the longest, 4
    assert (p.bins, p.width) == (3, 4)  # [4], [3 | 1], [2]
    assert sorted(set(p.dst.tolist())) == sorted(p.dst.tolist()) and len(p.dst) == int(mask.sum())
    packed = torch.zeros(p.bins * p.width, dtype=torch.long)
    packed[p.dst] = ids.flatten()[p.src]
    assert packed.view(p.bins, p.width).tolist() == [[1, 2, 3, 4], [5, 6, 7, 9], [8, 9, 0, 0]]
    # three rows sharing a prompt, in rows of 6, longest first: the completion of 3 tokens with the prompt, the one of
    # 2 in a second row with a copy of it, the one of 1 beside either; balanced, rows of 5 take them as well: the
    # prompt's copy is read by two completions that attend to it and not to each other
    ids = torch.tensor([[0, 5, 6, 7, 0, 0], [0, 5, 6, 8, 9, 0], [0, 5, 6, 1, 2, 3]])
    p = packing.plan(ids, (ids != 0).long(), 3, share=True, width=6)
    packed = torch.zeros(p.bins * p.width, dtype=torch.long)
    packed[p.dst] = ids.flatten()[p.src]
    assert packed.view(p.bins, p.width).tolist() == [[5, 6, 1, 2, 3], [5, 6, 8, 9, 7]]
    allowed = packing.attention_mask_4d(p, torch.bool)[1, 0].long().tolist()
    assert allowed[3:] == [[1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
    assert p.read[0, 1:].tolist() == [5, 6, 9, -1, -1] and p.read[1, 1:].tolist() == [5, 6, 7, 8, -1]
    assert p.read[2, 1:].tolist() == [0, 1, 2, 3, 4]


def test_token_budgets_are_balanced_and_respected():
    lengths = [30, 5, 9, 3, 12, 7, 2, 18]
    parts = packing.token_batches(lengths, 30)
    assert sorted(i for part in parts for i in part) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in part) for part in parts]
    assert all(load <= 30 for load in loads) and len(parts) == 3  # 86 tokens: 3 micro-batches of 30 at most
    assert max(loads) - min(loads) <= 2  # LPT: 30, 28, 28
    assert packing.token_batches([50, 1], 10) == [[0], [1]]  # a row over the budget goes alone


def _batch(model, obj, tokens: Tokens, settings: LogProbSettings) -> UpdateBatch:
    """The inputs the step gives `update`, with pi_old, the reference, the sampler and the teacher each a
    perturbation of the model's own log-probs (so every ratio, penalty and correction acts)."""
    g = torch.Generator().manual_seed(1)
    lp = batched_logprobs(model, tokens, settings)
    noisy = [(lp + s * torch.randn(lp.shape, generator=g, dtype=lp.dtype)) * tokens.loss_mask for s in (0.05, 0.1, 0.1)]
    old, ref, sampler = noisy
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.float64)
    groups = torch.arange(4).repeat_interleave(3)
    parts = RewardParts(torch.stack([rewards, 1 - rewards], 1), torch.tensor([0.7, 0.3], dtype=torch.float64))
    adv = obj.advantages(rewards, groups, tokens.loss_mask.sum(1), parts if obj.needs_reward_parts() else None)
    size, old_set, teacher = obj.config.sparse_support(), None, None
    if size is not None:
        old, old_set = old_with_set(model, tokens, settings, size)
    if obj.uses_teacher():
        teacher = TeacherScores(ref)
    return UpdateBatch(tokens, adv, rewards, groups, old, ref, sampler, old_set=old_set, teacher=teacher)


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params):
        super().__init__(params, lr=0.05)
        self.grads = []

    def step(self, closure=None):
        self.grads.append([p.grad.detach().clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


def _update(tiny_dir, preset, **trainer) -> list[list[torch.Tensor]]:
    """The gradient of each optimiser step of one rollout batch's update (two mini-batches). Prompts are not shared:
    the shared-prompt forward is exact only to about 1e-8 in float64, and the padded one is the reference here."""
    torch.manual_seed(0)
    model, _ = load_model(str(tiny_dir), device="cpu")
    model = model.double()
    t = TrainerConfig(
        **{"mini_batches": 2, "micro_batch_size": 3, "max_grad_norm": 0, "share_prompts": False, **trainer}
    )
    settings = LogProbSettings(
        3, share_prompts=t.share_prompts, pack=t.packing, micro_batch_tokens=t.micro_batch_tokens
    )
    obj = objectives.build(preset, max_len=8)
    batch = _batch(model, obj, _tokens(), LogProbSettings(share_prompts=False))
    opt = _RecordingSGD(model.parameters())
    policy = Policy(model, None, opt, _NoSchedule(), CPU, Precision.of("off", CPU), settings)
    update(policy, obj, batch, t, torch.Generator().manual_seed(7))
    return opt.grads


class _NoSchedule:
    def step(self):
        pass


# These select among a micro-batch's tokens (Clip-Cov and KL-Cov their tokens, M2PO its masked set, BAPO its clip
# bounds; tests/objectives/test_objective_api_and_invariants.py's BATCH_SELECTING), so their gradient depends on how
# a mini-batch is cut into micro-batches, though not on packing, which keeps the rows: token budgets skip them.
PER_MICRO_BATCH = {"clip_cov", "kl_cov", "m2po", "bapo"}


def _assert_equal(grads, reference, rounding: float = 0.0):
    """Equal gradients to float64 rounding (`rounding` 0) or, where the sums are reordered, to a relative error of
    `rounding` in each parameter's gradient norm."""
    assert len(grads) == len(reference) == 2
    for step_a, step_b in zip(grads, reference, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            if rounding:
                assert (a - b).norm() <= rounding * b.norm() + 1e-15
            else:
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


# A packed row that shares a prompt sums its samples' gradients into the prompt's states once, where the padded rows
# each carry their own copy: the same sum in another order. Llama's RMSNorm computes in float32 even in a float64
# model (transformers casts to float32 and back), so a reordered sum agrees to float32 rounding, amplified by the
# backward: the shared forms (this packing and the KV-cache sharing of trainer.share_prompts) are compared at 1e-6
# of each gradient's norm, the unshared packing at float64 rounding.
SHARED_ROUNDING = 1e-6


@pytest.mark.parametrize("preset", objectives.preset_names())
def test_the_update_gradient_does_not_depend_on_packing_or_token_budgets(tiny_dir, preset):
    padded = _update(tiny_dir, preset)
    assert any(bool(g.ne(0).any()) for step in padded for g in step)  # a gradient to compare
    _assert_equal(_update(tiny_dir, preset, packing=True), padded)
    _assert_equal(_update(tiny_dir, preset, packing=True, share_prompts=True), padded, SHARED_ROUNDING)
    if preset not in PER_MICRO_BATCH:
        _assert_equal(_update(tiny_dir, preset, packing=True, micro_batch_tokens=20), padded)
        _assert_equal(_update(tiny_dir, preset, micro_batch_tokens=20), padded)


@pytest.mark.parametrize("aggregation", G.AGGREGATIONS.names())
def test_every_aggregation_gives_the_padded_gradient_packed_and_in_token_budgets(tiny_dir, aggregation):
    spec = {"preset": "dapo", "aggregation": aggregation}
    padded = _update(tiny_dir, spec)
    _assert_equal(_update(tiny_dir, spec, packing=True), padded)
    _assert_equal(_update(tiny_dir, spec, packing=True, micro_batch_tokens=20), padded)


# ---------------------------------------------------------------- in a run


def _run_metrics(tiny_dir, out, *extra):
    from conftest import metrics_rows, train_config

    from tether.trainer.loop import train

    lora = ["model.lora={r: 4, alpha: 8}", "objective={preset: rpg_urkl, anchor: ref, beta: 0.05}"]
    quiet = ["trainer.total_steps=2", "trainer.plots=false", "trainer.tensorboard=false"]
    train(train_config(tiny_dir, out, *lora, *quiet, *extra), log=lambda *_: None)
    return [row for row in metrics_rows(out) if row["step"] > 0]


def test_a_lora_run_packed_in_token_budgets_trains_as_the_padded_one(tiny_dir, tmp_path):
    padded = _run_metrics(tiny_dir, tmp_path / "padded")
    packed = _run_metrics(tiny_dir, tmp_path / "packed", "trainer.packing=true", "trainer.micro_batch_tokens=40")
    assert sum(r["tokens/pad_frac"] for r in packed) < sum(r["tokens/pad_frac"] for r in padded)  # the point of it
    for a, b in zip(padded, packed, strict=True):
        assert b["tokens/pad_frac"] <= a["tokens/pad_frac"]
        for key in ("loss/total", "kl/ref", "reward/mean", "policy/ratio_max"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key  # float32: the same to rounding


def test_a_packed_run_under_bf16_autocast_runs(tiny_dir, tmp_path):
    rows = _run_metrics(tiny_dir, tmp_path / "bf16", "trainer.packing=true", "trainer.autocast=bf16")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss/total"])) for r in rows)
