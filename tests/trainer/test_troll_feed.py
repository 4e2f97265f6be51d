"""What tether's trainer feeds TROLL (tether.model.support; docs/algorithms/troll.md, "What the trainer feeds"),
on a float64 tiny causal LM (vocabulary 37), through the fused head and the model's own logits:

1. the old pass keeps pi_old's true top-K per position (the full softmax's topk, ids exact, log-probs to 1e-12),
   as (N, T, K) int32 / float32 / bool, and holds no (N, T, V) tensor for the batch (a recorder of every tensor
   the pass makes; the control, one forward of every row through the model's logits, shows it can see one);
2. the objective's loss and parameter gradient on the trainer's supports equal `tether.core.troll` computed by hand
   from the two models' full logits on the same supports (float64, 1e-10), with padding and an environment token
   in the loss mask, projected and unprojected tokens;
3. on-policy (policy = old, the skipped old pass and a recomputed one alike) the gradient is the plain policy
   gradient -A grad log pi(y) on a support that covers the vocabulary, and the policy gradient of the support's
   renormalised conditional on a sparse one;
4. `tether train` with the troll preset runs 2 steps of the tiny model and logs troll/*; pi_old from the sampler
   is refused with the fix (recompute), by the config and by the step itself.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import metrics_rows, tiny_float64_lm, tiny_run
from tether import objectives
from tether.core import troll as R
from tether.model.causal_lm import LogProbSettings, Tokens, positions
from tether.model.ops import top_logprobs
from tether.objectives import SupportSize
from tether.model.support import old_with_set, on_support

D = torch.float64
V, P, T = 37, 3, 6
TOL = dict(rtol=1e-10, atol=1e-12)


def _tokens(n=4, seed=0) -> Tokens:
    """n rows of [left-padded prompt (P) | completion (T)]: row 1's prompt is 2 tokens, row 2's completion ends after
    3 tokens (padding after), row 0 has an environment token at t = 2 (attended, not trained)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, V, (n, P), generator=g)
    completion = torch.randint(1, V, (n, T), generator=g)
    attention = torch.ones(n, P + T, dtype=torch.long)
    attention[1, 0] = 0
    prompt[1, 0] = 0
    attention[2, P + 3 :] = 0
    completion[2, 3:] = 0
    mask = attention[:, P:].to(D)
    mask[0, 2] = 0.0  # an environment's token
    ids = torch.cat([prompt, completion], 1)
    return Tokens(ids, attention, positions(attention), completion, mask, P)


def _full_logprobs(model, tokens: Tokens, tau: float) -> torch.Tensor:
    """log softmax(logits / tau) at the completion positions (N, T, V), from the model's own forward."""
    logits = model(
        input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, position_ids=tokens.position_ids
    ).logits
    return torch.log_softmax(logits[:, P - 1 : P - 1 + T].double() / tau, -1)


def _models(seed=0, spread=0.3):
    """pi_theta (its head scaled up) and pi_old: pi_old's head moved by `spread` x noise, so that some positions leave the region."""
    new = tiny_float64_lm(seed=seed)
    with torch.no_grad():  # a peaked head: a few tokens hold most of the mass, as in a trained model
        new.get_output_embeddings().weight.mul_(12.0)
    old = copy.deepcopy(new)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        w = old.get_output_embeddings().weight
        w.add_(spread * torch.randn(w.shape, generator=g, dtype=D))
    return new, old


SETTINGS = [
    pytest.param(dict(fused=True, chunk_size=4), id="fused"),
    pytest.param(dict(fused=False), id="logits"),
]


# ---------------------------------------------------------------- 1. the stored set


@pytest.mark.parametrize("kw", SETTINGS)
def test_the_old_pass_keeps_the_true_top_k_as_n_t_k(kw):
    model, _ = _models()
    tokens = _tokens()
    settings = LogProbSettings(temperature=0.7, micro_batch_size=2, **kw)
    lp, s = old_with_set(model, tokens, settings, SupportSize(top_k=5, mass=0.9))
    full = _full_logprobs(model, tokens, 0.7)
    values, ids = full.topk(5, -1)
    m = tokens.loss_mask.bool()
    assert s.ids.shape == s.logp.shape == s.keep.shape == (4, T, 5)
    assert (s.ids.dtype, s.logp.dtype, s.keep.dtype) == (torch.int32, D, torch.bool)  # float32 for a float32 model
    assert torch.equal(s.ids[m].long(), ids[m]) and not s.keep[~m].any()
    torch.testing.assert_close(s.logp[m], values[m], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lp, full.gather(-1, tokens.completion_ids[..., None])[..., 0] * m, rtol=1e-12, atol=0)
    # the mass cut: a token is kept while the mass before it is below 0.9 (the first always)
    p = values.exp()
    assert torch.equal(s.keep[m], ((p.cumsum(-1) - p) < 0.9)[m])
    assert s.keep[m].sum(-1).min() >= 1 and (s.keep[m].sum(-1) < 5).any()


@pytest.mark.parametrize("k", [1, 4, 37, 64])
def test_the_tiled_top_k_equals_the_full_softmax_top_k(k):
    # Vocabulary chunks of 8 (5 chunks, the last of 5) and token tiles of 3: the running top-k merges across chunks.
    g = torch.Generator().manual_seed(k)
    hidden, weight = torch.randn(10, 16, generator=g, dtype=D), torch.randn(V, 16, generator=g, dtype=D)
    ids, lp = top_logprobs(hidden, weight, k, temperature=1.3, chunk_size=3, vocab_chunk_size=8)
    values, want = torch.log_softmax(hidden @ weight.t() / 1.3, -1).topk(min(k, V), -1)
    assert ids.shape == (10, min(k, V)) and torch.equal(ids, want)
    torch.testing.assert_close(lp, values, rtol=1e-13, atol=1e-13)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an operation makes."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(x, torch.Tensor):
                self.shapes.append(tuple(x.shape))
        return out


@pytest.mark.parametrize(
    "kw, rows, full_seen",
    [
        (dict(fused=True, chunk_size=4), 8, False),  # tiles of 4 tokens x V
        (dict(fused=False), 2, False),  # one forward's logits: 2 rows x T x V
        (dict(fused=False), 8, True),  # the control: every row in one forward is an (N, T, V) tensor
    ],
)
def test_the_old_pass_holds_no_batch_by_vocabulary_tensor(kw, rows, full_seen):
    model, _ = _models()
    tokens = _tokens(n=8)  # N T = 48 > H = 32, so only logits can reach N T V elements with V last
    settings = LogProbSettings(micro_batch_size=rows, **kw)
    with _Shapes() as rec:
        _, s = old_with_set(model, tokens, settings, SupportSize(top_k=8, mass=1.0 - 1e-5))
    big = [sh for sh in rec.shapes if sh and sh[-1] == V and math.prod(sh) >= 8 * T * V]
    assert bool(big) == full_seen, big
    assert s.ids.shape == (8, T, 8)  # K < V: a set of K >= V would itself be (N, T, V)


# ---------------------------------------------------------------- 2. the objective on the trainer's supports


def _by_hand(new, old, tokens, tau, size, adv, eps, alpha):
    """`core.troll` on the supports built from the two models' full log-probs: pi_old's top_mass set, pi_theta's, the
    sampled token; pi_old's log-probs there from its set (the sampled token's exact); token-mean over the mask.
    Returns (loss, stats, pi_theta's log-probs on the support, its mask)."""
    lpn, lpo = _full_logprobs(new, tokens, tau), _full_logprobs(old, tokens, tau).detach()
    m = tokens.loss_mask.bool()[..., None]
    ids_o, keep_o = R.top_mass(lpo, size.top_k, size.mass)
    ids_n, keep_n = R.top_mass(lpn, size.top_k, size.mass)
    keep_o, keep_n = keep_o & m, keep_n & m
    s = R.union_support(torch.cat([ids_o, ids_n], -1), torch.cat([keep_o, keep_n], -1), tokens.completion_ids, V)
    sampled = lpo.gather(-1, tokens.completion_ids[..., None])[..., 0]
    old_s = R.old_on_support(s, ids_o, lpo.gather(-1, ids_o), keep_o, V, sampled)
    new_s = lpn.gather(-1, s.index)
    out, stats = R.troll(new_s, old_s, s.mask, s.token_index, adv, eps, alpha)
    return (out.loss * m[..., 0]).sum() / m.sum(), stats, new_s, s.mask


def _objective_loss(obj, new, tokens, settings, size, old_set, old_lp, adv):
    """The objective on the trainer's micro-batch: `on_support`'s log-probs and supports, as `UpdateBatch.select`
    passes them (pi_old's support log-probs pi_theta's, detached, on-policy)."""
    lp, ent, sup = on_support(new, tokens, settings, size, old_set, old_lp)
    old_support = sup.logprobs.detach() if sup.old_logprobs is None else sup.old_logprobs
    batch = objectives.TokenBatch(
        logprobs=lp,
        old_logprobs=lp.detach() if old_lp is None else old_lp,
        advantages=adv,
        loss_mask=tokens.loss_mask,
        entropy=ent.detach(),
        support_logprobs=sup.logprobs,
        old_support_logprobs=old_support,
        support_mask=sup.mask,
        support_token_index=sup.token_index,
    )
    return obj(batch), sup


def _grads(loss, model):
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        torch.zeros_like(p) if g is None else g
        for p, g in zip(params, torch.autograd.grad(loss, params, allow_unused=True))
    ]


@pytest.mark.parametrize("kw", SETTINGS)
@pytest.mark.parametrize("top_k, delta", [(4, 0.1), (64, 1e-5)])
def test_the_objective_on_the_trainers_supports_equals_core_troll_by_hand(kw, top_k, delta):
    new, old = _models(spread=0.03)  # about half the tokens leave the region of eps = 0.02
    tokens = _tokens()
    settings = LogProbSettings(temperature=0.8, micro_batch_size=2, **kw)
    obj = objectives.build({"preset": "troll", "top_k": top_k, "delta": delta, "eps": 0.02, "alpha": 0.7})
    size = obj.config.sparse_support()
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=D)
    old_lp, old_set = old_with_set(old, tokens, settings, size)
    out, sup = _objective_loss(obj, new, tokens, settings, size, old_set, old_lp, adv)
    want_loss, stats, new_s, s_mask = _by_hand(new, old, tokens, 0.8, size, adv, 0.02, 0.7)
    m = tokens.loss_mask.bool()
    assert torch.equal(sup.mask[m], s_mask[m])  # the same supports, entry by entry
    counted = s_mask & m[..., None]  # the support's padding entries hold some id's log-prob; no loss reads them
    torch.testing.assert_close(sup.logprobs[counted], new_s[counted].detach(), **TOL)
    assert stats.projected[m].any() and (~stats.projected[m]).any()  # both branches
    assert out.loss.item() == pytest.approx(want_loss.item(), rel=1e-10, abs=1e-12)
    for a, b in zip(_grads(out.loss, new), _grads(want_loss, new)):
        torch.testing.assert_close(a, b, **TOL)
    share = stats.projected[m].double().mean().item()
    assert out.metrics["troll/projected_frac"].item() == pytest.approx(share, abs=1e-15)
    a_star = (1 / (1 + stats.eta))[m].mean().item()
    assert out.metrics["troll/a_star_mean"].item() == pytest.approx(a_star, rel=1e-10)


# ---------------------------------------------------------------- 3. on-policy


@pytest.mark.parametrize("kw", SETTINGS)
@pytest.mark.parametrize("recomputed", [False, True], ids=["skipped", "recomputed"])
def test_on_policy_the_gradient_is_the_policy_gradient(kw, recomputed):
    # pi_theta = pi_old: nothing is projected, the regression term is 0, and the loss's gradient is
    # token-mean(-A grad log pi(y | S)), pi(y | S) = pi(y) / pi(S) the support's conditional; on a support that
    # covers the vocabulary (K >= V, delta 0) that is the plain policy gradient token-mean(-A grad log pi(y)).
    model, _ = _models()
    tokens = _tokens()
    settings = LogProbSettings(temperature=0.9, micro_batch_size=2, **kw)
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2], dtype=D)
    m = tokens.loss_mask.bool()
    for top_k, delta in ((64, 0.0), (3, 0.05)):
        obj = objectives.build({"preset": "troll", "top_k": top_k, "delta": delta})
        size = obj.config.sparse_support()
        old_lp, old_set = old_with_set(model, tokens, settings, size) if recomputed else (None, None)
        out, sup = _objective_loss(obj, model, tokens, settings, size, old_set, old_lp, adv)
        assert out.metrics["troll/projected_frac"].item() == 0.0
        lp_full = _full_logprobs(model, tokens, 0.9)
        lp_y = lp_full.gather(-1, tokens.completion_ids[..., None])[..., 0]
        if top_k >= V:
            assert (sup.mask.sum(-1)[m] == V).all()
            pg = lp_y
        else:  # log pi(y) - log pi(S), from the full log-probs at the support's ids
            assert (sup.mask.sum(-1)[m] < V).all()
            on_s = torch.where(sup.mask, lp_full.gather(-1, sup.index), torch.full_like(sup.logprobs, -math.inf))
            pg = lp_y - torch.logsumexp(on_s, -1)
        want = (-adv[:, None] * pg * m).sum() / m.sum()
        for a, b in zip(_grads(out.loss, model), _grads(want, model)):
            torch.testing.assert_close(a, b, **TOL)


# ---------------------------------------------------------------- 4. a run, and the refusal


def test_tether_train_runs_the_troll_preset(tiny_dir, tmp_path):
    # 2 mini-batches: the second update is off-policy, so pi_old's set is kept and some tokens may be projected.
    from tether.cli import main

    out = tmp_path / "run"
    code = main(
        [
            "train",
            *tiny_run(
                tiny_dir,
                "objective=troll",
                "trainer.total_steps=2",
                "trainer.progress=false",
                "trainer.plots=false",
                out=out,
            ),
        ]
    )
    assert code == 0
    rows = [r for r in metrics_rows(out) if r["step"] >= 1]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        keys = ("troll/projected_frac", "troll/a_star_mean", "troll/kl_before", "troll/kl_after", "troll/support_size")
        assert all(math.isfinite(r[k]) for k in keys), r
        assert 0 <= r["troll/projected_frac"] <= 1 and 0 < r["troll/a_star_mean"] <= 1
        assert r["troll/kl_before"] > 0  # the second mini-batch moved pi_theta from pi_old
        assert math.isfinite(r["loss/total"]) and r["optim/skipped_updates"] == 0


def test_pi_old_from_the_sampler_is_refused_with_the_fix(tiny_dir, tmp_path, capsys):
    from tether.cli import main
    from tether.config.loading import load_config
    from tether.schema import ConfigError
    from tether.trainer.step import old_logprobs_and_set

    with pytest.raises(
        ConfigError,
        match="objective 'troll' with trainer.old_logprobs=sampler.*top 64 tokens.*set trainer.old_logprobs=recompute",
    ):
        load_config(None, ["objective=troll", "trainer.old_logprobs=sampler"])
    out = tmp_path / "run"
    code = main(["train", *tiny_run(tiny_dir, "objective=troll", "trainer.old_logprobs=sampler", out=out)])
    assert code == 2 and "set trainer.old_logprobs=recompute" in capsys.readouterr().err and not out.exists()
    # the step refuses it too, for a caller that skips the config's checks (a benchmark, a test)
    cfg = load_config(None, ["objective=dapo", "trainer.old_logprobs=sampler"])
    with pytest.raises(ValueError, match="sampled token's log-prob.*set trainer.old_logprobs=recompute"):
        old_logprobs_and_set(None, None, None, cfg.trainer, SupportSize(64, 1.0))
