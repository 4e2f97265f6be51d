"""tether's presets equal TRL 1.16's own GRPO losses (float64), by calling `GRPOTrainer._compute_loss` itself.

`conftest.trl_compute_loss` builds the trainer without a model and gives it only the attributes `_compute_loss`
reads; its log-prob forward returns the test's tensors, so what is compared is TRL's loss code as installed:

| TRL `loss_type` and settings | tether |
|---|---|
| `grpo`, beta 0.04, `use_bias_correction_kl=False` | preset `grpo` (k3, coef 0.04, `seq-mean-token-mean`) |
| `grpo`, beta 0.04, `use_bias_correction_kl=True` (TRL 1.16's default) | `grpo` with `kl_penalty.estimator: k3_iw` |
| `bnpo` | `ppo_clip`, `token-mean` |
| `dr_grpo` | preset `dr_grpo` with `max_len` = `max_completion_length` |
| `dapo` (one process, no accumulation) | preset `dapo` |
| `cispo`, `epsilon_high` = 1 + 0.28 (TRL's bound is on the ratio itself) | preset `cispo` |
| `sapo`, temperatures 1.0 / 1.05 | preset `sapo` |
| `grpo`, `importance_sampling_level="sequence"` | preset `gspo`'s sequence ratio (with GSPO's eps) |

Every row has at least one token on each side of each clip bound (checked), both advantage signs and a
zero-advantage row; the batch has no empty row (tether's and TRL's normalisers part on rows with no counted
token: docs/trl.md).
"""

import pytest
import torch

pytest.importorskip("trl")

from tether import objectives  # noqa: E402

from conftest import trl_compute_loss  # noqa: E402

D = torch.float64
T_MAX = 8  # TRL's max_completion_length (dr_grpo's normaliser)


def _batch():
    g = torch.Generator().manual_seed(0)
    n, t = 6, T_MAX
    old = -torch.rand(n, t, generator=g, dtype=D) * 3 - 0.05
    lp = (old + (torch.rand(n, t, generator=g, dtype=D) * 1.0 - 0.5)).requires_grad_()  # w in [0.61, 1.65]
    ref = old - 0.4 * torch.rand(n, t, generator=g, dtype=D)
    adv = torch.tensor([1.2, -0.7, 0.4, -1.5, 0.0, 0.9], dtype=D)
    mask = torch.ones(n, t, dtype=D)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    w = torch.exp(lp - old).detach()[mask.bool()]
    assert (w < 0.8).any() and (w > 1.28).any() and ((w > 0.8) & (w < 1.28)).any()
    return lp, old, ref, adv, mask


def _tether_loss(spec, lp, old, ref, adv, mask):
    batch = objectives.TokenBatch(logprobs=lp, old_logprobs=old, advantages=adv, loss_mask=mask, ref_logprobs=ref)
    return objectives.build(spec, max_len=T_MAX)(batch).loss


CASES = [  # (id, TRL loss_type and settings, tether spec)
    ("grpo-k3", dict(loss_type="grpo", beta=0.04), "grpo"),
    (
        "grpo-bias-corrected-kl",
        dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=True),
        {"preset": "grpo", "kl_penalty": {"estimator": "k3_iw"}},
    ),
    (
        "bnpo",
        dict(loss_type="bnpo", eps=(0.2, 0.28)),
        {"name": "ppo_clip", "eps_high": 0.28, "aggregation": "token-mean"},
    ),
    ("dr_grpo", dict(loss_type="dr_grpo"), "dr_grpo"),
    ("dapo", dict(loss_type="dapo", eps=(0.2, 0.28)), "dapo"),
    ("cispo", dict(loss_type="cispo", eps=(0.2, 1.28)), "cispo"),
    ("sapo", dict(loss_type="sapo"), "sapo"),
    ("gspo", dict(loss_type="grpo", eps=(3e-4, 4e-4), level="sequence"), "gspo"),
]


@pytest.mark.parametrize("trl_settings,spec", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_preset_equals_trls_loss(trl_settings, spec):
    lp, old, ref, adv, mask = _batch()
    settings = dict(trl_settings)
    theirs, g_theirs, _ = trl_compute_loss(
        settings.pop("loss_type"), lp, old, adv, mask, ref=ref, max_len=T_MAX, **settings
    )
    ours = _tether_loss(spec, lp, old, ref, adv, mask)
    # TRL's sapo builds its temperatures with torch.where on Python floats, a float32 tensor: 1.05 is then
    # 1.0499999523, a relative 5e-8 off, which moves the loss by ~2e-7 relative.
    tol = dict(rtol=1e-6, atol=1e-9) if trl_settings["loss_type"] == "sapo" else dict(rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours.detach(), theirs, **tol)
    g_ours = torch.autograd.grad(ours, lp)[0]
    torch.testing.assert_close(g_ours, g_theirs, **tol)
    assert g_ours.abs().sum() > 0


def test_the_grpo_presets_kl_is_not_trls_default_kl():
    # TRL 1.16 multiplies k3 by the ratio by default (use_bias_correction_kl=True); the grpo preset is GRPO's plain
    # k3, so at the same batch they differ once the ratio is not 1 (docs/trl.md, docs/algorithms/README.md).
    lp, old, ref, adv, mask = _batch()
    trl_default, _, _ = trl_compute_loss(
        "grpo", lp, old, adv, mask, ref=ref, beta=0.04, max_len=T_MAX, use_bias_correction_kl=True
    )
    assert abs(_tether_loss("grpo", lp, old, ref, adv, mask).item() - trl_default.item()) > 1e-4
