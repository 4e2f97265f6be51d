"""Public access to divergence measures and trust-region intervals (see `tether.core.divergences`)."""

from .core.divergences import BINARY_MEASURES, MEASURES, interval, lambertw, numeric_interval, value

__all__ = ["BINARY_MEASURES", "MEASURES", "interval", "lambertw", "numeric_interval", "value", "names"]


def names() -> list[str]:
    return MEASURES.names()
