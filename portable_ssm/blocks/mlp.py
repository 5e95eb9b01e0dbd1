"""Feed-forward blocks: gated (SwiGLU / GeGLU) and plain (relu², GELU) MLPs.

Parameters (names relative to the block): ``up.weight`` — ``[2·f, d]`` packed ``[gate; up]`` when
gated, ``[f, d]`` plain — and ``down.weight [d, f]``. Activations run in float32 at least.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .._array import Array, Namespace, compute_dtype, silu
from ..backends import fast_op
from ..mixer import _linear

#: The activations an MLP may use, by transformers' ``hidden_act`` / ``mlp_hidden_act`` names.
ACTIVATIONS = ("silu", "relu2", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True)
class MLPSpec:
    """``act``: one of :data:`ACTIVATIONS`; ``gated``: ``down(act(gate)·up)`` instead of ``down(act(up))``."""

    act: str
    gated: bool

    def __post_init__(self) -> None:
        if self.act not in ACTIVATIONS:
            raise ValueError(f"MLPSpec.act: expected one of {', '.join(ACTIVATIONS)}, got {self.act!r}")


def _erf(x: Array, *, xp: Namespace) -> Array:
    """erf to 1.5e-7 (Abramowitz & Stegun 7.1.26): the standard has no erf."""
    a = xp.abs(x)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return xp.sign(x) * (1.0 - poly * xp.exp(-a * a))


def activation(v: Array, act: str, *, xp: Namespace) -> Array:
    """``act(v)`` in v's dtype (v already in the compute dtype)."""
    if act == "silu":
        return silu(v, xp=xp)
    if act == "relu2":
        r = xp.maximum(v, xp.zeros_like(v))
        return r * r
    if act == "gelu":
        return 0.5 * v * (1.0 + _erf(v / math.sqrt(2.0), xp=xp))
    return 0.5 * v * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v * v * v)))  # gelu_pytorch_tanh


def hidden(u: Array, spec: MLPSpec, *, xp: Namespace) -> Array:
    """The activated hidden units of the up projection's output ``u [..., 2f or f]`` -> ``[..., f]``
    in the compute dtype (shared with the MoE experts)."""
    u = xp.astype(u, compute_dtype(xp, u.dtype), copy=False)
    if not spec.gated:
        return activation(u, spec.act, xp=xp)
    native = fast_op(xp, "gated_activation")
    return gated_activation_ref(u, spec.act, xp=xp) if native is None else native(u, spec.act)


def gated_activation_ref(u: Array, act: str, *, xp: Namespace) -> Array:
    """``act(gate) · up`` of ``u [..., 2f]`` packed ``[gate; up]`` -> ``[..., f]``: the reference of
    a backend's ``fast_op(xp, "gated_activation")`` (NumPy's one-pass SiLU kernel)."""
    f = u.shape[-1] // 2
    return activation(u[..., :f], act, xp=xp) * u[..., f:]


def mlp(x: Array, p: dict[str, Array], spec: MLPSpec, *, xp: Namespace) -> Array:
    """``x [..., d] -> [..., d]``: ``down(act(gate)·up)`` (gated) or ``down(act(up))``."""
    u = _linear(x, p["up.weight"], None, xp=xp)  # [..., 2f or f]
    return _linear(xp.astype(hidden(u, spec, xp=xp), x.dtype, copy=False), p["down.weight"], None, xp=xp)
