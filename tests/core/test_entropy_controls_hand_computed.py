"""tether.core.entropy by hand: the high-entropy token mask ("Beyond the 80/20 Rule", arXiv 2506.01939), the
entropy estimated from sampled tokens, and Skywork-OR1's adaptive entropy coefficient (arXiv 2505.22312)."""

import math

import pytest
import torch

from tether.core.entropy import adaptive_entropy_coef, sampled_entropy, top_entropy_mask

D = torch.float64
# Two rows, five counted tokens; the padding (row 1, last) has the highest entropy of all and must never be kept.
H = torch.tensor([[0.1, 0.5, 0.3], [0.9, 0.2, 7.0]], dtype=D)
M = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=D)


@pytest.mark.parametrize(
    "frac, expected",
    [
        (0.4, [[0, 1, 0], [1, 0, 0]]),  # k = ceil(0.4 x 5) = 2: the entropies 0.9 and 0.5
        (0.5, [[0, 1, 1], [1, 0, 0]]),  # k = ceil(2.5) = 3: 0.9, 0.5, 0.3
        (0.01, [[0, 0, 0], [1, 0, 0]]),  # k = ceil(0.05) = 1: at least one token, 0.9
        (1.0, [[1, 1, 1], [1, 1, 0]]),  # k = 5: every counted token, never the padding
    ],
)
def test_the_mask_keeps_the_ceil_rho_n_highest_entropy_counted_tokens(frac, expected):
    assert top_entropy_mask(H, M, frac).tolist() == torch.tensor(expected, dtype=torch.bool).tolist()


def test_trls_own_example_keeps_the_same_tokens():
    # TRL's test_compute_entropy_mask_0 (top_entropy_quantile 0.8 there, rho = 0.2 here): 10 counted tokens, the top
    # 20% are the 2 with entropies 0.9 and 1.0; 1.1 and 1.2 are padding. k = ceil(0.2 x 10) = 2.
    h = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0.7, 0.8, 0.9, 1.0, 1.1, 1.2]], dtype=D)
    m = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=D)
    assert top_entropy_mask(h, m, 0.2).tolist() == [[False] * 6, [False, False, True, True, False, False]]


def test_ties_at_the_threshold_are_all_kept_and_the_count_is_not_rounded_up_by_float_error():
    # k = ceil(0.25 x 4) = 1, the threshold 0.5, which two tokens have: both kept (a share of 2/4).
    h = torch.tensor([[0.5, 0.5, 0.1, 0.2]], dtype=D)
    assert top_entropy_mask(h, torch.ones_like(h), 0.25).tolist() == [[True, True, False, False]]
    # 0.7 x 10 is 7.000000000000001 in floating point; ceil of it would keep 8 tokens, the rule keeps 7 (0.3 ... 0.9).
    h = torch.arange(10, dtype=D)[None] / 10
    assert top_entropy_mask(h, torch.ones_like(h), 0.7).sum().item() == 7
    assert top_entropy_mask(h, torch.ones_like(h), 0.7)[0, 3:].all()


def test_no_counted_token_keeps_nothing():
    assert not top_entropy_mask(H, torch.zeros_like(M), 0.5).any()


def test_the_entropy_estimated_from_sampled_tokens():
    # -mean_m(lp) = -(-1.0 - 2.0 - 0.5) / 3 = 3.5 / 3; the padding's 9.9 does not count.
    lp = torch.tensor([[-1.0, -2.0], [-0.5, 9.9]], dtype=torch.float32)
    m = torch.tensor([[1, 1], [1, 0]])
    e = sampled_entropy(lp, m)
    assert e.dtype == D and e.item() == pytest.approx(3.5 / 3, abs=1e-7)
    assert math.isnan(sampled_entropy(lp, torch.zeros_like(m)).item())
    # Its expectation is the entropy: tokens drawn from p = (1/2, 1/4, 1/4), whose entropy is
    # 1/2 ln 2 + 2 x 1/4 ln 4 = 1.5 ln 2 = 1.03972; 200k draws put the estimate within 0.005 of it (sd 0.0008).
    p = torch.tensor([0.5, 0.25, 0.25], dtype=D)
    y = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    est = sampled_entropy(p.log()[y][None], torch.ones(1, y.numel())).item()
    assert est == pytest.approx(1.5 * math.log(2), abs=0.005)


def test_the_adaptive_coefficient_step_by_step():
    # target 0.2, Delta 0.005, bounds [0, 0.012], c_0 = 0 (the paper's): (e_k, alpha_k, c_{k+1}) per step.
    steps = [
        (0.25, 0.0, 0.0),  # above the target: no bonus; c - 0.005 clipped at the lower bound 0
        (0.15, 0.0, 0.005),  # below: the bonus is c_k = 0; c + 0.005
        (0.10, 0.005, 0.010),  # below: alpha = c_k = 0.005; c + 0.005
        (0.10, 0.010, 0.012),  # below: alpha = 0.010; 0.015 clipped at the upper bound 0.012
        (0.20, 0.012, 0.012),  # at the target: the bonus acts (e <= target), c stays
        (0.30, 0.0, 0.007),  # above: no bonus, 0.012 - 0.005
        (float("nan"), 0.0, 0.007),  # no counted token: no bonus, c stays
    ]
    c = 0.0
    for e, alpha, c_next in steps:
        got_alpha, c = adaptive_entropy_coef(c, e, 0.2, 0.005, 0.0, 0.012)
        assert got_alpha == pytest.approx(alpha, abs=1e-15) and c == pytest.approx(c_next, abs=1e-15), (e, got_alpha, c)
