"""A NumPy batch step of the Mamba-2 backbone for streaming, in place on its own float32 state.

:func:`portable_ssm.step` is the reference (it validates, dispatches and returns a new state each
call: about a millisecond of Python at the seed shape); :class:`NumpyStep` computes the same
step with the weights prepared once (transposed, A = -exp(A_log)) and the state updated in place,
in about thirty NumPy calls per layer. It takes the variant market models use: float32, no gated
MLP (``d_ssm`` None), the RMS norm after the gate, no projection biases; :meth:`NumpyStep.supports`
says whether a model is one. ``MarketStream`` uses it on NumPy where the compiled library (its
``MarketBar``) is off or not built, and its test holds it to the reference within float32 rounding.
Shapes: k rows, d = d_model, h heads of p channels, g groups of n state entries, K conv taps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_ssm import Mamba2Config


def _rms(v: np.ndarray, weight: np.ndarray, eps: float, groups: int = 1) -> np.ndarray:
    """``v [k, c]`` over ``groups`` equal slices, divided by its RMS, times ``weight [c]``."""
    k, c = v.shape
    grouped = v.reshape(k, groups, c // groups)  # [k, g, c/g]
    scale = 1.0 / np.sqrt(np.mean(grouped * grouped, axis=-1, keepdims=True) + np.float32(eps))  # [k, g, 1]
    return (grouped * scale).reshape(k, c) * weight  # [k, c]


def _silu(v: np.ndarray) -> np.ndarray:
    half = np.float32(0.5) * v
    return half + half * np.tanh(half)


def _softplus(v: np.ndarray) -> np.ndarray:
    magnitude = np.abs(v)
    return np.float32(0.5) * (v + magnitude) + np.log1p(np.exp(-magnitude))


class NumpyStep:
    """One token through every layer and norm_f for ``k`` rows; the state is ``(conv [k, conv_dim,
    K], ssm [k, h, p, n])`` per layer, float32 NumPy arrays this object updates in place."""

    def __init__(self, params: dict[str, Any], config: Mamba2Config) -> None:
        c = self.config = config
        self.layers = []
        for i in range(c.n_layer):
            p = f"layers.{i}."
            bias = params.get(p + "mixer.conv1d.bias")
            self.layers.append({
                "norm": params[p + "norm.weight"], "in_t": np.ascontiguousarray(params[p + "mixer.in_proj.weight"].T),
                "conv": params[p + "mixer.conv1d.weight"].reshape(c.conv_dim, c.d_conv),
                "conv_bias": np.zeros(c.conv_dim, np.float32) if bias is None else bias,
                "dt_bias": params[p + "mixer.dt_bias"], "A": -np.exp(params[p + "mixer.A_log"]),
                "D": params[p + "mixer.D"], "gate_norm": params[p + "mixer.norm.weight"],
                "out_t": np.ascontiguousarray(params[p + "mixer.out_proj.weight"].T)})
        self.norm_f = params["norm_f.weight"]
        self._scratch: dict[int, np.ndarray] = {}  # k -> [k, h, p, n]: the Δ·outer(x, B) term, reused

    def _outer(self, k: int) -> np.ndarray:
        c = self.config
        if k not in self._scratch:
            self._scratch = {k: np.empty((k, c.nheads, c.headdim, c.d_state), np.float32)}  # one size kept
        return self._scratch[k]

    @staticmethod
    def supports(params: dict[str, Any], config: Mamba2Config) -> bool:
        """Whether ``params`` are float32 NumPy arrays of the variant this step computes."""
        c = config
        if c.d_mlp or not c.rmsnorm or c.norm_before_gate or c.bias:
            return False
        return all(isinstance(v, np.ndarray) and v.dtype == np.float32 for v in params.values())

    def __call__(self, u: np.ndarray, conv: list[np.ndarray], ssm: list[np.ndarray]) -> np.ndarray:
        """``u [k, d]`` float32 -> ``y [k, d]`` (after norm_f); ``conv``, ``ssm`` updated in place."""
        c = self.config
        k, h, p, g, n = u.shape[0], c.nheads, c.headdim, c.ngroups, c.d_state
        d_inner = h * p
        residual, hidden = None, u
        for layer, conv_state, ssm_state in zip(self.layers, conv, ssm):
            residual = hidden if residual is None else residual + hidden
            zxbcdt = _rms(residual, layer["norm"], c.norm_eps) @ layer["in_t"]  # [k, 2·h·p + 2·g·n + h]
            z, xBC, dt = zxbcdt[:, :d_inner], zxbcdt[:, d_inner:d_inner + c.conv_dim], zxbcdt[:, -h:]
            conv_state[:, :, :-1] = conv_state[:, :, 1:]  # shift the window left by one tap (in place)
            conv_state[:, :, -1] = xBC
            xBC = _silu(np.sum(conv_state * layer["conv"], axis=-1) + layer["conv_bias"])  # [k, conv_dim]
            x = xBC[:, :d_inner].reshape(k, h, p)  # [k, h, p]
            B = xBC[:, d_inner:d_inner + g * n].reshape(k, g, 1, n)  # [k, g, 1, n]: head i reads group i // (h/g)
            C = xBC[:, d_inner + g * n:].reshape(k, g, 1, n)  # [k, g, 1, n]
            delta = np.maximum(_softplus(dt + layer["dt_bias"]), np.float32(c.dt_limit[0]))  # Δ [k, h]
            if np.isfinite(c.dt_limit[1]):
                delta = np.minimum(delta, np.float32(c.dt_limit[1]))
            state = ssm_state.reshape(k, g, h // g * p, n)  # [k, g, h/g·p, n] (a view)
            state *= np.exp(delta * layer["A"]).repeat(p, axis=1).reshape(k, g, h // g * p, 1)
            outer = self._outer(k).reshape(k, g, h // g * p, n)
            np.multiply((delta[:, :, None] * x).reshape(k, g, h // g * p, 1), B, out=outer)  # Δ·outer(x, B)
            state += outer
            y = np.matmul(state.reshape(k * g, h // g * p, n), C.reshape(k * g, n, 1)).reshape(k, h, p)  # H @ C
            y = y + layer["D"].reshape(h, -1) * x  # D [h] or [h, p]
            gated = _rms(y.reshape(k, d_inner) * _silu(z), layer["gate_norm"], c.norm_eps, g)  # [k, h·p]
            hidden = gated @ layer["out_t"]  # [k, d]
        return _rms(residual + hidden, self.norm_f, c.norm_eps)
