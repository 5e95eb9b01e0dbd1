"""Synthetic bars for tests and ``--quick`` runs: a pure random walk, or one with a planted component.

``planted``: a persistent two-state regime (flips with probability 0.02 a bar) sets both the volume
level (high or low, overlapping lognormals) and the sign of the return autocorrelation (+0.5 in the
high-volume regime, -0.5 in the low one). Averaged over regimes the autocorrelation is about zero,
so a linear AR on returns cannot use it; a model reading volume and returns together can.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_choice, check_int, check_real
from .bars import Bars

KINDS = ("planted", "random-walk")
_BAR_NS = 60_000_000_000  # one-minute bars
_START_NS = 1_700_000_000_000_000_000


def synthetic_bars(kind: str, n: int, *, seed: int, vol: float = 1e-3) -> Bars:
    """``n`` one-minute bars around price 100 (prices on the 1e-9 grid, integer volumes); ``n`` an
    int >= 1, ``seed`` an int >= 0, ``vol`` in (0, 1]."""
    kind = check_choice("kind", kind, KINDS)
    n, seed = check_int("n", n, minimum=1), check_int("seed", seed, minimum=0)
    vol = check_real("vol", vol, low=0.0, high=1.0, open_low=True)
    rng = np.random.default_rng([seed, 7])
    flips = rng.random(n) < 0.02
    regime = (np.cumsum(flips) + rng.integers(0, 2)) % 2  # [n] 1 = high volume, momentum
    shocks = vol * rng.standard_normal(n)
    if kind == "random-walk":
        returns = shocks
    else:
        phi = np.where(regime == 1, 0.5, -0.5)
        returns = np.empty(n)
        returns[0] = shocks[0]
        for t in range(1, n):
            returns[t] = phi[t] * returns[t - 1] + shocks[t]
    close = np.round(100.0 * np.exp(np.cumsum(returns)), 9)
    open_ = np.concatenate([[100.0], close[:-1]])
    wick = vol * np.abs(rng.standard_normal((2, n)))
    high = np.round(np.maximum(open_, close) * np.exp(wick[0]), 9)
    low = np.round(np.minimum(open_, close) * np.exp(-wick[1]), 9)
    level = np.where(regime == 1, 8.0, 6.5) if kind == "planted" else 7.0
    volume = np.rint(np.exp(level + 0.5 * rng.standard_normal(n)))
    ts = _START_NS + _BAR_NS * np.arange(n, dtype=np.int64)
    return Bars(ts_event=ts, open=open_, high=high, low=low, close=close, volume=volume)
