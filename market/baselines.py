"""Honest baselines and the comparison a model must win: zero, last return, AR(p), majority class.

Every baseline is fitted on training window ends only and predicts at the validation ends.
:func:`compare` asks for a win that is not noise: the mean per-bar loss difference (baseline minus
model) must exceed ``z`` standard errors, computed over blocks of ``block`` bars (the horizon) so
overlapping k-bar targets do not count as independent.
"""

from __future__ import annotations

import numpy as np


def ar_design(returns: np.ndarray, ends: np.ndarray, order: int) -> np.ndarray:
    """``[n, order + 1]``: a constant and the returns at e, e-1, .., e-order+1 for each end e."""
    lags = returns[np.asarray(ends)[:, None] - np.arange(order)[None, :]]  # [n, order]
    return np.concatenate([np.ones((lags.shape[0], 1)), lags], axis=1)


def fit_ar(returns: np.ndarray, target: np.ndarray, train_ends: np.ndarray, order: int) -> np.ndarray:
    """Least-squares AR(order) coefficients ``[order + 1]`` of ``target[e]`` on past returns."""
    design = ar_design(returns, train_ends, order)
    coef, *_ = np.linalg.lstsq(design, target[train_ends], rcond=None)
    return coef


def baselines(kind: str, *, returns: np.ndarray, trailing: np.ndarray, target: np.ndarray,
              train_ends: np.ndarray, val_ends: np.ndarray, order: int) -> dict[str, np.ndarray]:
    """Baseline predictions at ``val_ends``: for ``"return"`` targets ``zero``, ``last_return`` (the
    trailing k-bar return) and ``ar{order}``; for ``"direction"`` the training ``majority`` class,
    ``last_sign`` and ``ar{order}_sign`` (probabilities 0 or 1)."""
    ar = ar_design(returns, val_ends, order) @ fit_ar(returns, target, train_ends, order)  # [n_val]
    if kind == "return":
        return {"zero": np.zeros(val_ends.shape), "last_return": trailing[val_ends], f"ar{order}": ar}
    majority = float(target[train_ends].mean() >= 0.5)
    return {"majority": np.full(val_ends.shape, majority), "last_sign": (trailing[val_ends] > 0) * 1.0,
            f"ar{order}_sign": (ar > 0.5) * 1.0}


def losses(kind: str, prediction: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per-bar loss: squared error for returns; 0/1 error for direction (probability > 0.5 is up)."""
    if kind == "return":
        return (prediction - target) ** 2
    return ((prediction > 0.5) != (target > 0.5)) * 1.0


def compare(model_loss: np.ndarray, baseline_loss: np.ndarray, *, block: int, z: float = 2.0) -> dict[str, float]:
    """``{"gain", "z", "beaten"}``: the mean loss the model saves over the baseline, that gain in
    standard errors over non-overlapping blocks of ``block`` bars, and whether it exceeds ``z``."""
    diff = np.asarray(baseline_loss, np.float64) - np.asarray(model_loss, np.float64)  # [n]
    blocks = diff[:diff.size // block * block].reshape(-1, block).mean(axis=1)  # [n // block]
    error = blocks.std(ddof=1) / np.sqrt(blocks.size) if blocks.size > 1 else np.inf
    score = float(blocks.mean() / error) if error > 0 else 0.0
    return {"gain": float(diff.mean()), "z": score, "beaten": bool(score > z)}
