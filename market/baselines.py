"""Honest baselines and the comparison a model must win: zero, last return, AR(p), majority class.

Every baseline is fitted on training window ends only and predicts at the validation ends.
:func:`compare` asks for a win that is not noise: the mean per-bar loss difference (baseline minus
model) must exceed ``z`` standard errors, computed over blocks of ``block`` bars (the horizon) so
overlapping k-bar targets do not count as independent.

Every argument is checked at the door: ``order`` and ``block`` ints >= 1, ends integer arrays
with ``order - 1 <= e < n`` (a smaller end would wrap to the last bars and read the future), the
series float ``[n]``. The AR fit skips training rows holding a NaN (a missing bar), so one NaN
never turns every prediction NaN.
"""

from __future__ import annotations

import numpy as np

from ._checks import check_choice, check_float_array, check_index_array, check_int, check_real

KINDS = ("return", "direction")


def ar_design(returns: np.ndarray, ends: np.ndarray, order: int) -> np.ndarray:
    """``[n, order + 1]``: a constant and the returns at e, e-1, .., e-order+1 for each end e."""
    order = check_int("order", order, minimum=1)
    returns = check_float_array("returns", returns, ndim=1)
    ends = _check_ends("ends", ends, order, returns.shape[0])
    lags = returns[np.asarray(ends)[:, None] - np.arange(order)[None, :]]  # [n, order]
    return np.concatenate([np.ones((lags.shape[0], 1)), lags], axis=1)


def fit_ar(returns: np.ndarray, target: np.ndarray, train_ends: np.ndarray, order: int) -> np.ndarray:
    """Least-squares AR(order) coefficients ``[order + 1]`` of ``target[e]`` on past returns."""
    design = ar_design(returns, train_ends, order)  # [n, order + 1]
    target = check_float_array("target", target, ndim=1)[np.asarray(train_ends)]  # [n]
    finite = np.isfinite(design).all(axis=1) & np.isfinite(target)
    if finite.sum() < order + 1:
        raise ValueError(f"train_ends: AR({order}) needs {order + 1} training rows without NaN, "
                         f"got {int(finite.sum())}")
    coef, *_ = np.linalg.lstsq(design[finite], target[finite], rcond=None)
    return coef


def _check_ends(name: str, ends: np.ndarray, order: int, n: int) -> np.ndarray:
    """``ends`` as int64 within ``[order - 1, n - 1]`` (the lags of each end exist and lie in its past)."""
    ends = check_index_array(name, ends)
    if ends.size and (ends.min() < order - 1 or ends.max() >= n):
        raise ValueError(f"{name}: AR({order}) lags need ends in [{order - 1}, {n - 1}], "
                         f"got [{ends.min()}, {ends.max()}]")
    return ends


def baselines(kind: str, *, returns: np.ndarray, trailing: np.ndarray, target: np.ndarray,
              train_ends: np.ndarray, val_ends: np.ndarray, order: int) -> dict[str, np.ndarray]:
    """Baseline predictions at ``val_ends``: for ``"return"`` targets ``zero``, ``last_return`` (the
    trailing k-bar return) and ``ar{order}``; for ``"direction"`` the training ``majority`` class,
    ``last_sign`` and ``ar{order}_sign`` (probabilities 0 or 1). ``returns``, ``trailing``,
    ``target`` float ``[n]``; ends as in the module docstring."""
    kind = check_choice("kind", kind, KINDS)
    returns = check_float_array("returns", returns, ndim=1)
    for name, series in (("trailing", trailing), ("target", target)):
        if check_float_array(name, series, ndim=1).shape != returns.shape:
            raise ValueError(f"{name}: expected shape {returns.shape} like returns, got {np.shape(series)}")
    val_ends = _check_ends("val_ends", val_ends, check_int("order", order, minimum=1), returns.shape[0])
    ar = ar_design(returns, val_ends, order) @ fit_ar(returns, target, train_ends, order)  # [n_val]
    if kind == "return":
        return {"zero": np.zeros(val_ends.shape), "last_return": trailing[val_ends], f"ar{order}": ar}
    majority = float(target[train_ends].mean() >= 0.5)
    return {"majority": np.full(val_ends.shape, majority), "last_sign": (trailing[val_ends] > 0) * 1.0,
            f"ar{order}_sign": (ar > 0.5) * 1.0}


def losses(kind: str, prediction: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Per-bar loss: squared error for returns; 0/1 error for direction (probability > 0.5 is up);
    ``prediction`` and ``target`` float arrays of one shape."""
    kind = check_choice("kind", kind, KINDS)
    prediction, target = np.asarray(prediction), np.asarray(target)
    if prediction.shape != target.shape:
        raise ValueError(f"prediction: expected shape {target.shape} like target, got {prediction.shape}")
    if kind == "return":
        return (prediction - target) ** 2
    return ((prediction > 0.5) != (target > 0.5)) * 1.0


def compare(model_loss: np.ndarray, baseline_loss: np.ndarray, *, block: int, z: float = 2.0) -> dict[str, float]:
    """``{"gain", "z", "beaten"}``: the mean loss the model saves over the baseline, that gain in
    standard errors over non-overlapping blocks of ``block`` bars, and whether it exceeds ``z``.
    Losses: finite float ``[n]`` of one shape; ``block`` an int >= 1; ``z`` a finite number >= 0."""
    block, z = check_int("block", block, minimum=1), check_real("z", z, low=0.0, high=float("inf"), open_high=True)
    model_loss = check_float_array("model_loss", model_loss, ndim=1)
    if check_float_array("baseline_loss", baseline_loss, ndim=1).shape != model_loss.shape:
        raise ValueError(f"baseline_loss: expected shape {model_loss.shape} like model_loss, "
                         f"got {np.shape(baseline_loss)}")
    if not (np.isfinite(model_loss).all() and np.isfinite(baseline_loss).all()):
        raise ValueError("model_loss, baseline_loss: expected finite losses, got a NaN or infinity")
    if model_loss.shape[0] < block:
        raise ValueError(f"model_loss: expected at least block={block} losses, got {model_loss.shape[0]}")
    diff = np.asarray(baseline_loss, np.float64) - np.asarray(model_loss, np.float64)  # [n]
    blocks = diff[:diff.size // block * block].reshape(-1, block).mean(axis=1)  # [n // block]
    error = blocks.std(ddof=1) / np.sqrt(blocks.size) if blocks.size > 1 else np.inf
    score = float(blocks.mean() / error) if error > 0 else 0.0
    return {"gain": float(diff.mean()), "z": score, "beaten": bool(score > z)}
