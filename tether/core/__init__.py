"""tether's pure core: the math of every policy objective as functions on tensors.

Imports torch and nothing else (no transformers, no I/O, no logging, no host syncs). The
modules, each opening with its math and its departures from the paper:

- `divergences`: measures D(w) and trust-region intervals (ATR-GRPO's kl3 via Lambert W).
- `surrogates`: PPO/divergence clip (scalar or per-token bounds, dual clip), GSPO, CISPO, REINFORCE.
- `rpg`: Regularized Policy Gradient, both forms, RPG-Style Clip, the clipped differentiable form.
- `kl`: KL-to-reference penalty estimators k1, k2, k3, k3_iw; the squared log-ratio to the sampler (prime-rl's kl_tau).
- `etr`: Elastic Trust Regions (a documented reconstruction).
- `dppo`: DPPO's Binary-TV / Binary-KL (or any ratio measure) trust-region masks with truncated IS.
- `sapo`: SAPO's soft sigmoid gate.
- `gmpo`: GMPO's geometric mean of log-space-clipped token ratios.
- `vespo`: VESPO's gamma weight on the true sequence ratio (rollout-correction weights folded in).
- `dro`: DRO's policy gradient with a quadratic log-ratio penalty (verl's `dro`).
- `covariance`: Clip-Cov and KL-Cov, entropy control on high-covariance tokens.
- `m2po`: M2PO's second-moment mask on the squared token log-ratios (stale data).
- `correction`: rollout correction (TIS, MIS, IcePop, divergence rejection) and DeepSeek-V3.2's off-policy sequence
mask.
- `advantages`: grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_no_baseline, grpo_batch_std, maxrl.
- `multi_reward`: how a weighted reward's parts become one reward: sum, normalize_then_sum (GDPO).
- `aggregation`: the four loss aggregation modes with mini-batch normalisers.
- `masked`: masked reductions and sync-free group statistics.
"""
