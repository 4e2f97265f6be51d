"""tether: reinforcement learning with verifiable rewards for language models.

`tether.objectives` builds any policy objective (GRPO, DAPO, Dr. GRPO, GSPO, CISPO, ATR-GRPO,
RPG, ETR); `tether.divergences.interval` gives divergence trust regions; `tether.core` holds
the pure math.
"""

__version__ = "0.1.0"
