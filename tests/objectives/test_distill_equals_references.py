"""On-policy distillation (`objective.distill`) equals the frameworks that ship it, loss and gradient, in float64.

Called (the installed function runs in the test):
- verl 0.9.1's `trainer/distillation/losses.distillation_loss` (the same text as verl-project/verl 1dda039b9c63):
  the k3 estimator backpropagated as a loss (use_policy_gradient=False), the k1 estimator as the advantage of its
  vanilla PPO loss (use_policy_gradient=True), and forward_kl_topk's clamps and aggregation; its FSDP logits
  processor `fsdp/losses.compute_forward_kl_topk` for the top-k KL itself (it computes in float32: rtol 1e-6);
- TRL 1.16's DistillationTrainer `_chunked_divergence_loss` at beta 1 (the full-vocabulary reverse KL: the expected
  gradient of tether's opd, enumerated over the sampled token; float32 there), IW-OPD's `_compute_iw_opd_loss` at
  iw_opd_gamma 0 (the plain sampled-token OPD loss), GKD's `generalized_jsd_loss` at beta 0 (the full-vocabulary
  forward KL: tether's top-k at k = V) and IW-OPD's `generalized_jsd_loss` with top_k and add_tail (tether's top-k
  with `tail`).
Transcribed (the rule written out below, from the repository and commit named):
- Thinking Machines' tinker-cookbook 9dfcc3a2cf44 `distillation/train_on_policy.incorporate_kl_penalty` (the
  advantage -coef (lp_sampler - lp_teacher), `discounted_future_sum_vectorized`) with tinker's importance-sampling
  loss -(pi_theta / pi_sampler) A;
- slime 624b824a898a `backends/megatron_utils/loss.apply_opd_kl_to_advantages` (A - opd_kl_coef (lp - lp_teacher) on
  top of the estimator's advantage), and prime-rl 559b44772e47 `ref_kl_loss_fn`'s advantage ref - lp at the first
  update (tether.core.distill, departure 1: verl and prime-rl read the live policy's log-prob, tether pi_old's);
- verl's top-k forward KL, in float64.
"""

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from tether import objectives
from tether.objectives.distill import distilled

D = torch.float64
N, T, V = 4, 5, 7
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 1, 1, 1]], dtype=torch.bool)
"""Row 1 and 2 end early (padding); row 3's second token is an environment's (multi-turn): mask 0 inside."""


def _logits(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(N, T, V, generator=g, dtype=D)


def _sampled():
    """Student and teacher logits, the sampled tokens, and their log-probs (student's with gradient)."""
    s_logits = _logits(0).requires_grad_()
    t_logits = _logits(1, 1.5)
    tokens = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(2))
    lp = torch.log_softmax(s_logits, -1).gather(-1, tokens[..., None])[..., 0]
    lq = torch.log_softmax(t_logits, -1).gather(-1, tokens[..., None])[..., 0]
    return s_logits, t_logits, tokens, lp, lq


def _batch(lp, old, adv, **kw):
    return objectives.TokenBatch(lp, old, adv, MASK.to(D), **kw)


def _grad(loss, x):
    return torch.autograd.grad(loss, x, retain_graph=True)[0]


# ---------------------------------------------------------------- Thinking Machines (tinker-cookbook), transcribed


def _tinker_advantages(sampled_lp, teacher_lp, mask, coef, gamma, task):
    """incorporate_kl_penalty: per datum, kl_adv = -coef * mask * (sampled - teacher), then (gamma > 0) its
    discounted future sum, sum_k gamma^k x[i + k] by a backward running sum; added to the datum's advantages."""
    out = []
    for i in range(sampled_lp.shape[0]):
        m = mask[i].to(D)
        x = -coef * m * ((sampled_lp[i] - teacher_lp[i]) * m)
        if gamma > 0:
            y, running = torch.empty_like(x), torch.zeros((), dtype=D)
            for t in range(len(x) - 1, -1, -1):
                running = x[t] + gamma * running
                y[t] = running
            x = y
        out.append(task[i] + x)
    return torch.stack(out)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0])
def test_the_reverse_kl_advantage_is_tinker_cookbooks(gamma):
    # tinker's importance_sampling loss per token: -(exp(lp - lp_sampler) A); tether's ppo_clip with a clip too wide
    # to act is -w A too, w = pi_theta / pi_old and pi_old the sampler (trainer.old_logprobs=sampler).
    _, _, _, lp, lq = _sampled()
    sampler = lp.detach() + 0.05 * torch.randn(N, T, generator=torch.Generator().manual_seed(3), dtype=D)
    task = torch.tensor([0.5, -0.5, 1.0, 0.0], dtype=D)
    adv = _tinker_advantages(sampler, lq, MASK, 0.7, gamma, task[:, None].expand(N, T))
    theirs = torch.where(MASK, -torch.exp(lp - sampler) * adv, torch.zeros_like(lp))
    spec = {"name": "ppo_clip", "eps_low": 1e9, "eps_high": 1e9, "aggregation": "token-mean"}
    distill = {"signal": "reverse_kl", "coef": 0.7, "task_coef": 1.0, "discount": gamma}
    terms = objectives.build({**spec, "distill": distill}).terms(_batch(lp, sampler, task, teacher_logprobs=lq))
    ours = torch.where(MASK, terms.tokens.loss, torch.zeros_like(lp))  # the aggregation reads counted tokens only
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grad(ours.sum(), lp), _grad(theirs.sum(), lp), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- slime and prime-rl, transcribed


def test_the_mix_with_the_task_advantage_is_slimes_and_prime_rls_advantage_at_the_first_update():
    # slime: advantages[i] = adv - opd_kl_coef * (student_log_probs[i] - teacher_log_probs[i]), the estimator's
    # advantage (GRPO's, one value per sample broadcast over its tokens) on every response token; student_log_probs
    # are the recomputed old policy's (or the rollout's with --use-rollout-logprobs).
    _, _, _, lp, lq = _sampled()
    old = lp.detach()
    grpo = torch.tensor([0.5, -0.5, 1.0, 0.0], dtype=D)
    slime = [grpo[i] - 0.3 * (old[i] - lq[i]) for i in range(N)]
    cfg = objectives.build({"preset": "dapo", "distill": {"coef": 0.3, "task_coef": 1.0}}).config.distill
    ours = distilled(cfg, _batch(lp, old, grpo, teacher_logprobs=lq), old, {}).advantages
    torch.testing.assert_close(ours[MASK], torch.stack(slime)[MASK], rtol=1e-14, atol=1e-15)
    # prime-rl's ref_kl loss: the per-token policy-gradient signal is (ref - trainer_logprobs).detach(), the live
    # policy's; at the first update of a batch (trainer = old) it is tether's pure-distillation advantage.
    pure = objectives.build("opd").config.distill
    ours = distilled(pure, _batch(lp, old, grpo, teacher_logprobs=lq), old, {}).advantages
    torch.testing.assert_close(ours[MASK], (lq - lp).detach()[MASK], rtol=1e-14, atol=1e-15)


# ---------------------------------------------------------------- TRL, called

trl_iw_opd = pytest.importorskip("trl.experimental.iw_opd.iw_opd_trainer")
trl_gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")


def test_pure_distillation_is_trls_iw_opd_loss_at_gamma_0():
    # IW-OPD's sampled-token loss: A = lp_teacher - lp_rollout (detached), weights 1 + gamma (...) = 1 at gamma 0,
    # loss = sum(-lp A) / counted tokens: REINFORCE, token-mean, on the reverse-KL advantage (the opd preset without
    # its importance weight, which is 1 here: pi_theta = pi_old = the rollout policy).
    s_logits, _, tokens, lp, lq = _sampled()
    stub = SimpleNamespace(
        temperature=1.0,
        iw_opd_gamma=0.0,
        iw_opd_epsilon=1e-8,
        model=SimpleNamespace(training=True),
        _metrics={"train": defaultdict(list)},
    )
    labels = torch.where(MASK, tokens, torch.full_like(tokens, -100))
    rollout = lp.detach()
    theirs = trl_iw_opd.IWOPDTrainer._compute_iw_opd_loss(stub, s_logits, tokens, labels, lq, rollout)
    for spec in ({"name": "reinforce", "distill": {"task_coef": 0.0}}, "opd"):
        ours = objectives.build(spec)(_batch(lp, rollout, torch.ones(N, dtype=D), teacher_logprobs=lq)).loss
        torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-15)
        torch.testing.assert_close(_grad(ours, s_logits), _grad(theirs, s_logits), rtol=1e-12, atol=1e-15)


def test_the_expected_opd_gradient_is_trls_distillation_trainers_reverse_kl():
    # TRL 1.16's DistillationTrainer (beta 1, its default) backpropagates the full-vocabulary reverse KL
    # sum_v p_S(v) (log p_S(v) - log p_T(v)) at each completion position, over the counted positions, from hidden
    # states and heads in chunks (`_chunked_divergence_loss`, float32). tether's opd samples one token y per position
    # and backpropagates -A log p_S(y), A = -(log p_S - log p_T)(y): with the context fixed, its expectation over
    # y ~ p_S has that gradient (E[(s - q)(y) grad log p_S(y)] = grad KL(p_S || p_T), as E[grad log p_S] = 0), and the
    # expected k1, E[s - q], is the KL itself. Enumerated: row v * B + b holds token v at every position of row b.
    trl_distill = pytest.importorskip("trl.trainer.distillation_trainer")
    g = torch.Generator().manual_seed(7)
    B, K, tau = 2, 3, 0.7
    h_s = torch.randn(B, K, 4, generator=g, dtype=D).requires_grad_()
    h_t = torch.randn(B, K, 5, generator=g, dtype=D)  # a teacher of another width: only the vocabulary is shared
    w_s, w_t = torch.randn(V, 4, generator=g, dtype=D), torch.randn(V, 5, generator=g, dtype=D)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]], dtype=D)
    theirs, _, _ = trl_distill._chunked_divergence_loss(h_s, h_t, w_s, w_t, mask, beta=1.0, temperature=tau)
    ls, lt = torch.log_softmax(h_s @ w_s.T / tau, -1), torch.log_softmax(h_t @ w_t.T / tau, -1)  # (B, K, V)
    lp, lq = ls.permute(2, 0, 1).reshape(V * B, K), lt.permute(2, 0, 1).reshape(V * B, K)  # (V B, K)
    prob, m = lp.detach().exp(), mask.repeat(V, 1)
    batch = objectives.TokenBatch(lp, lp.detach(), torch.zeros(V * B, dtype=D), m, teacher_logprobs=lq)
    terms = objectives.build("opd").terms(batch)
    ours = (prob * terms.tokens.loss * m).sum() / mask.sum()
    expected_k1 = (prob * (lp - lq) * m).sum() / mask.sum()
    torch.testing.assert_close(expected_k1.detach(), theirs.detach().to(D), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(_grad(ours, h_s), _grad(theirs, h_s), rtol=1e-5, atol=1e-7)


def _topk_batch(s_logits, t_logits, k):
    """tether's forward_kl_topk inputs: the teacher's top-k log-probs and ids (full softmax), and the student's
    log-probs of those ids (with gradient), the sampled tokens' log-probs beside them."""
    full_t = torch.log_softmax(t_logits, -1)
    top = full_t.topk(k, -1)
    student = torch.log_softmax(s_logits, -1).gather(-1, top.indices)
    lp = torch.log_softmax(s_logits, -1)[..., 0]
    return dict(teacher_logprobs=full_t[..., 0], teacher_topk_logprobs=top.values, student_topk_logprobs=student), lp


def _topk_loss(s_logits, t_logits, k, **distill):
    spec = {"name": "reinforce", "distill": {"signal": "forward_kl_topk", "topk": k, "task_coef": 0.0, **distill}}
    fields, lp = _topk_batch(s_logits, t_logits, k)
    out = objectives.build(spec)(_batch(lp, lp.detach(), torch.zeros(N, dtype=D), **fields))
    return out.metrics["loss/distill"], out.loss


def test_topk_at_the_whole_vocabulary_is_trls_gkd_forward_kl():
    # GKD's generalized JSD at beta 0 is KL(teacher || student) over the vocabulary, summed and divided by the
    # counted tokens ("batchmean" with labels): forward_kl_topk with k = V (the clamp at 0 never acts on a true KL).
    s_logits, t_logits, tokens, _, _ = _sampled()
    labels = torch.where(MASK, tokens, torch.full_like(tokens, -100))
    theirs = trl_gkd.GKDTrainer.generalized_jsd_loss(s_logits, t_logits, labels, beta=0.0)
    value, ours = _topk_loss(s_logits, t_logits, V)
    torch.testing.assert_close(value, theirs.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_grad(ours, s_logits), _grad(theirs, s_logits), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("k", [1, 3])
def test_topk_with_the_tail_is_trls_iw_opd_topk_divergence(k):
    # IW-OPD's generalized_jsd_loss at beta 0 with top_k and add_tail: the teacher's top-k support, both log-probs
    # from the full softmax, one tail bucket log(1 - sum) each (its log-sum capped at -1e-7), KL over k + 1.
    s_logits, t_logits, tokens, _, _ = _sampled()
    labels = torch.where(MASK, tokens, torch.full_like(tokens, -100))
    theirs = trl_iw_opd.IWOPDTrainer.generalized_jsd_loss(s_logits, t_logits, labels, beta=0.0, top_k=k, add_tail=True)
    value, ours = _topk_loss(s_logits, t_logits, k, tail=True)
    torch.testing.assert_close(value, theirs.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_grad(ours, s_logits), _grad(theirs, s_logits), rtol=1e-12, atol=1e-15)


# ---------------------------------------------------------------- verl, called and transcribed

verl = pytest.importorskip("verl")
from tensordict import TensorDict  # noqa: E402
from verl.trainer.distillation import losses as verl_losses  # noqa: E402
from verl.trainer.distillation.fsdp import losses as verl_fsdp  # noqa: E402
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig  # noqa: E402


def _flat(x):
    """A padded (N, T, ...) tensor in verl's no-padding layout: per row a 1-token prompt, the row's response values
    (its first `len` columns), one unused position (verl shifts the model's outputs left by one)."""
    lengths = [int(MASK[i, : int(MASK[i].nonzero().max()) + 1].numel()) for i in range(N)]
    return torch.cat([torch.cat([x[i, : lengths[i]], x.new_zeros(1, *x.shape[2:])]) for i in range(N)]), lengths


def _verl_data(old, extra):
    lengths = _flat(old)[1]
    attention = torch.zeros(N, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        attention[i, :n] = 1
    return TensorDict(
        {
            "prompts": torch.ones(N, 1, dtype=torch.long),
            "responses": torch.ones(N, T, dtype=torch.long),
            "attention_mask": torch.cat([torch.ones(N, 1, dtype=torch.long), attention], 1),
            "response_mask": MASK,
            "old_log_probs": old,
            "dp_size": 1,
            "batch_num_tokens": int(MASK.sum()),
            "global_batch_size": N,
            **extra,
        },
        batch_size=[],
    )


def _verl_distillation_loss(model_output, data, **loss_config):
    actor = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode="token-mean")
    config = DistillationConfig(enabled=False, distillation_loss=DistillationLossConfig(**loss_config))
    return verl_losses.distillation_loss(actor, config, model_output, data)[0]


def test_the_k3_loss_is_verls_estimator_loss_without_a_policy_gradient():
    # verl: kl_penalty(student, teacher, "k3") (its k3 is tether's k3_clamped), clamped to +-loss_max_clamp (10),
    # token-mean; tether: kl_loss with k3_clamped and clamp 10. The spread puts some tokens past verl's clamp.
    _, _, _, lp, lq = _sampled()
    lq = lq - 3 * torch.rand(N, T, generator=torch.Generator().manual_seed(4), dtype=D)
    data = _verl_data(lp.detach(), {"teacher_logprobs": _flat(lq[..., None])[0]})
    theirs = _verl_distillation_loss({"log_probs": _flat(lp)[0]}, data, loss_mode="k3", use_policy_gradient=False)
    distill = {"signal": "kl_loss", "estimator": "k3_clamped", "clamp": 10.0, "task_coef": 0.0}
    out = objectives.build({"name": "reinforce", "distill": distill})(
        _batch(lp, lp.detach(), torch.zeros(N, dtype=D), teacher_logprobs=lq)
    )
    torch.testing.assert_close(out.loss, theirs, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(_grad(out.loss, lp), _grad(theirs, lp), rtol=1e-13, atol=1e-15)


def test_the_reverse_kl_advantage_is_verls_policy_gradient_form_at_the_first_update():
    # verl: advantages = -clamp(k1(student, teacher), +-10).detach() into its vanilla PPO loss (clip 0.2), with the
    # live policy's log-probs; at the first update (lp = old) tether's reverse_kl with clamp 10 on ppo_clip is it.
    _, _, _, lp, lq = _sampled()
    old = lp.detach()
    data = _verl_data(old, {"teacher_logprobs": _flat(lq[..., None])[0]})
    theirs = _verl_distillation_loss({"log_probs": _flat(lp)[0]}, data, loss_mode="k1", use_policy_gradient=True)
    distill = {"signal": "reverse_kl", "clamp": 10.0, "task_coef": 0.0}
    ours = objectives.build({"name": "ppo_clip", "distill": distill})(
        _batch(lp, old, torch.zeros(N, dtype=D), teacher_logprobs=lq)
    ).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(_grad(ours, lp), _grad(theirs, lp), rtol=1e-13, atol=1e-15)


def test_the_task_mix_is_verls_use_task_rewards():
    # verl's distillation_ppo_loss with use_task_rewards: policy_loss(task advantages) + coef * distillation_loss.
    _, _, _, lp, lq = _sampled()
    old = lp.detach() + 0.1 * torch.randn(N, T, generator=torch.Generator().manual_seed(5), dtype=D)
    adv = torch.tensor([0.5, -0.5, 1.0, 0.0], dtype=D)
    data = _verl_data(old, {"teacher_logprobs": _flat(lq[..., None])[0]})
    distill = _verl_distillation_loss({"log_probs": _flat(lp)[0]}, data, loss_mode="k3", use_policy_gradient=False)
    config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode="token-mean")
    vanilla = verl_losses.get_policy_loss_fn("vanilla")
    policy, _ = vanilla(old, lp, adv[:, None].expand(N, T), MASK, "token-mean", config)
    theirs = policy + 0.25 * distill
    spec = {
        "name": "ppo_clip",
        "distill": {"signal": "kl_loss", "estimator": "k3_clamped", "clamp": 10.0, "coef": 0.25},
    }
    ours = objectives.build(spec)(_batch(lp, old, adv, teacher_logprobs=lq)).loss
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(_grad(ours, lp), _grad(theirs, lp), rtol=1e-13, atol=1e-15)


def _verl_topk_kl(s_logits, t_logits, k, log_prob_min):
    """verl's forward_kl_topk per token, transcribed in float64: the student's log_softmax gathered at the teacher's
    top-k ids, both clamped below at log_prob_min, sum_k exp(t) (t - s)."""
    t = torch.log_softmax(t_logits, -1).topk(k, -1)
    s = torch.log_softmax(s_logits, -1).gather(-1, t.indices)
    tv, sv = t.values.clamp_min(log_prob_min), s.clamp_min(log_prob_min)
    return (tv.exp() * (tv - sv)).sum(-1)


@pytest.mark.parametrize("k", [2, 5])
def test_topk_is_verls_forward_kl_topk(k):
    # The per-token KL (transcribed) through verl's own clamp_min(0), clamp at +-10 and aggregation (called); a
    # student sharper than the teacher (rows 0, 1) puts more mass on the teacher's top k (a negative truncated sum),
    # a flatter one (rows 2, 3) less; log_prob_min -2 clamps the tail of both.
    _, t_logits, _, _, _ = _sampled()
    noise = torch.randn(N, T, V, generator=torch.Generator().manual_seed(6), dtype=D)
    sharpness = torch.tensor([2.0, 2.0, 0.5, 0.5], dtype=D)[:, None, None]
    s_logits = (sharpness * t_logits + 0.3 * noise).requires_grad_()
    per_token = _verl_topk_kl(s_logits, t_logits, k, -2.0)
    assert (per_token < 0).any() and (per_token > 0).any()  # a truncated sum can be negative: both clamp it at 0
    masses = torch.ones(N, T, dtype=D)
    output = {
        "distillation_losses": _flat(per_token)[0],
        "student_mass": _flat(masses)[0],
        "teacher_mass": _flat(masses)[0],
        "log_probs": _flat(torch.zeros(N, T, dtype=D))[0],
    }
    data = _verl_data(torch.zeros(N, T, dtype=D), {})
    theirs = _verl_distillation_loss(output, data, loss_mode="forward_kl_topk", topk=k, use_policy_gradient=False)
    value, ours = _topk_loss(s_logits, t_logits, k, log_prob_min=-2.0, clamp=10.0)
    torch.testing.assert_close(value, theirs.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(_grad(ours, s_logits), _grad(theirs, s_logits), rtol=1e-12, atol=1e-15)


def test_topk_is_verls_fsdp_logits_processor_in_float32():
    # verl's logits processor computes the top-k KL from the student's logits in float32 (nested teacher tensors).
    s_logits, t_logits, _, _, _ = _sampled()
    k = 3
    top = torch.log_softmax(t_logits, -1).topk(k, -1)
    nested = lambda x: torch.nested.nested_tensor([x[i] for i in range(N)], layout=torch.jagged)  # noqa: E731
    config = DistillationConfig(
        enabled=False,
        distillation_loss=DistillationLossConfig(loss_mode="forward_kl_topk", topk=k, log_prob_min_clamp=-10.0),
    )
    out = verl_fsdp.compute_forward_kl_topk(
        s_logits.reshape(1, N * T, V), nested(top.values), nested(top.indices), config, "thd"
    )
    ours = _verl_topk_kl(s_logits, t_logits, k, -10.0).clamp_min(0)
    torch.testing.assert_close(out["distillation_losses"].reshape(N, T).double(), ours, rtol=1e-6, atol=1e-7)
    assert math.isclose(out["teacher_mass"].sum().item(), top.values.exp().sum().item(), rel_tol=1e-6)
