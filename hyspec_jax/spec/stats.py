"""Round statistics of the speculative engine that need only numpy (the engine's `SpecStats` / `SpecResult`,
`hyspec generate --stats`, `hyspec bench e2e`)."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def prefix_survival(accepted: list[list[int]], depth: int) -> list[float]:
    """ReaDy's censored prefix survival from per-request lists of accepted drafts per round: entry j−1 is
    the fraction of request-rounds that accepted ≥ j drafts, where the last round of each request is
    censored — it counts when it reached j, but not as a failure below j (a request that stops or runs out
    of max_tokens cuts its last round short). NaN where no round counts."""
    hits, seen = np.zeros(depth), np.zeros(depth)
    for rounds in accepted:
        for r, a in enumerate(rounds):
            last = r == len(rounds) - 1
            for j in range(1, depth + 1):
                if a >= j:
                    hits[j - 1] += 1
                    seen[j - 1] += 1
                elif not last:
                    seen[j - 1] += 1
    return [float(h / s) if s else float("nan") for h, s in zip(hits, seen)]


def rounded(xs: Sequence[float], digits: int = 4) -> list[float | None]:
    """For JSON: rounded, NaN as None."""
    return [None if x != x else round(float(x), digits) for x in xs]


__all__ = ["prefix_survival", "rounded"]
