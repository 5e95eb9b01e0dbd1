"""Mixture of experts with top-k routing, computed without data-dependent shapes on every backend.

Parameters (names relative to the block): ``router.weight [E, d]`` (``router.bias [E]``: a
correction added to the scores for the choice only, Nemotron's ``e_score_correction_bias``),
``experts.up.weight [E, 2·f or f, d]``, ``experts.down.weight [E, d, f]`` (float arrays, or
:class:`~portable_ssm.quantized.QuantizedWeight` stacks: int8 with a scale per row of each expert,
or bfloat16; the dense path dequantizes them, the gathered one widens only the experts it takes).

Routing: ``softmax`` (Granite) softmaxes the k chosen logits; ``sigmoid`` (Nemotron, DeepSeek-V3)
chooses by ``sigmoid(logit) + bias`` and weighs by the unbiased sigmoid, optionally renormalised,
times ``scale``. The top k is k rounds of argmax (no sort, no gather of a data-dependent size).
Two ways to apply the experts give one result: every expert on every token, weighted by a dense
``[T, E]`` gate (:func:`moe_dense_ref`, best for long prompts), or each token's k experts'
weights taken by index (:func:`moe`'s gathered path, for decode: it reads k experts, not E).
"""

from __future__ import annotations

from dataclasses import dataclass

from .._array import Array, Namespace, compute_dtype, device
from ..backends import fast_op
from ..mixer import _linear
from ..quantized import QuantizedWeight, dequantize, take_rows
from .mlp import MLPSpec, hidden


@dataclass(frozen=True)
class MoESpec:
    """``experts`` E, ``top_k`` k, the ``router`` kind, ``normalize`` (sigmoid: weights summing to
    one) and ``scale`` (a factor on the routed output), the experts' :class:`MLPSpec`."""

    experts: int
    top_k: int
    router: str  # "softmax" | "sigmoid"
    mlp: MLPSpec
    normalize: bool = False
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.router not in ("softmax", "sigmoid"):
            raise ValueError(f"MoESpec.router: expected 'softmax' or 'sigmoid', got {self.router!r}")
        if not 0 < self.top_k <= self.experts:
            raise ValueError(f"MoESpec.top_k: expected 1 <= top_k <= experts = {self.experts}, got {self.top_k}")


def route(x: Array, p: dict[str, Array], spec: MoESpec, *, xp: Namespace) -> tuple[Array, Array]:
    """``(index [T, k] int64, weight [T, k] compute dtype)`` for tokens ``x [T, d]``."""
    cdtype = compute_dtype(xp, x.dtype)
    logits = xp.astype(_linear(x, p["router.weight"], None, xp=xp), cdtype)  # [T, E]
    scores = logits if spec.router == "softmax" else 1.0 / (1.0 + xp.exp(-logits))
    choice = scores if "router.bias" not in p else scores + xp.astype(p["router.bias"], cdtype)
    experts = xp.arange(spec.experts, dtype=xp.int64, device=device(x))
    low = xp.asarray(-xp.inf, dtype=cdtype, device=device(x))
    picks, values = [], []
    for _ in range(spec.top_k):  # k rounds of argmax: ties go to the lowest index, as torch.topk's do on CPU
        idx = xp.argmax(choice, axis=-1)  # [T]
        onehot = experts[None, :] == idx[:, None]  # [T, E]
        picks.append(idx)
        values.append(xp.sum(xp.where(onehot, scores, xp.zeros_like(scores)), axis=-1))  # [T]
        choice = xp.where(onehot, low, choice)
    index, weight = xp.stack(picks, axis=-1), xp.stack(values, axis=-1)  # [T, k]
    if spec.router == "softmax":
        weight = xp.exp(weight - xp.max(weight, axis=-1, keepdims=True))
        weight = weight / xp.sum(weight, axis=-1, keepdims=True)
    elif spec.normalize:
        weight = weight / (xp.sum(weight, axis=-1, keepdims=True) + 1e-20)
    return index, weight * spec.scale


def _flat(x: Array, *, xp: Namespace) -> Array:
    return xp.reshape(x, (-1, x.shape[-1]))  # [..., d] -> [T, d]


def _all_experts(w: Array | QuantizedWeight, *, xp: Namespace) -> Array:
    """Every expert's weight ``[E, out, in]`` as an array (a quantized stack dequantized)."""
    return dequantize(w, xp=xp) if isinstance(w, QuantizedWeight) else w


def chosen_experts(w: Array | QuantizedWeight, ids: Array, *, xp: Namespace) -> Array:
    """The experts ``ids [n]`` of ``w [E, out, in]``: ``[n, out, in]`` (of a quantized stack, the
    chosen experts' storage and scales taken, then only those widened)."""
    return take_rows(w, ids, xp=xp) if isinstance(w, QuantizedWeight) else xp.take(w, ids, axis=0)


def moe_dense_ref(x: Array, p: dict[str, Array], spec: MoESpec, *, xp: Namespace) -> Array:
    """Every expert on every token, summed with the routing weights as a dense ``[T, E]`` gate:
    ``x [..., d] -> [..., d]``."""
    flat = _flat(x, xp=xp)
    index, weight = route(flat, p, spec, xp=xp)
    experts = xp.arange(spec.experts, dtype=xp.int64, device=device(x))
    onehot = xp.astype(index[:, :, None] == experts[None, None, :], weight.dtype)  # [T, k, E]
    gate = xp.sum(onehot * weight[:, :, None], axis=1)  # [T, E]
    up_w, down_w = _all_experts(p["experts.up.weight"], xp=xp), _all_experts(p["experts.down.weight"], xp=xp)
    up = xp.matmul(flat[None, :, :], xp.matrix_transpose(up_w))  # [E, T, 2f or f]
    h = xp.astype(hidden(up, spec.mlp, xp=xp), x.dtype)  # [E, T, f]
    out = xp.astype(xp.matmul(h, xp.matrix_transpose(down_w)), gate.dtype)  # [E, T, d]
    y = xp.sum(out * xp.permute_dims(gate, (1, 0))[:, :, None], axis=0)  # [T, d]
    return xp.reshape(xp.astype(y, x.dtype), x.shape)  # [T, d] -> [..., d]


def moe_gathered(x: Array, p: dict[str, Array], spec: MoESpec, *, xp: Namespace) -> Array:
    """Each token's k experts' weights taken by index (``[T·k, f', d]``): ``x [..., d] -> [..., d]``."""
    flat = _flat(x, xp=xp)
    t, d = flat.shape
    index, weight = route(flat, p, spec, xp=xp)
    ids = xp.reshape(index, (-1,))  # [T·k]
    up_w = chosen_experts(p["experts.up.weight"], ids, xp=xp)  # [T·k, 2f or f, d]
    down_w = chosen_experts(p["experts.down.weight"], ids, xp=xp)  # [T·k, d, f]
    rows = xp.reshape(xp.broadcast_to(flat[:, None, :], (t, spec.top_k, d)), (t * spec.top_k, 1, d))  # [T·k, 1, d]
    up = xp.matmul(rows, xp.matrix_transpose(up_w))  # [T·k, 1, 2f or f]
    h = xp.astype(hidden(up, spec.mlp, xp=xp), x.dtype)
    out = xp.reshape(xp.matmul(h, xp.matrix_transpose(down_w)), (t, spec.top_k, d))  # [T·k, 1, d] -> [T, k, d]
    y = xp.sum(xp.astype(out, weight.dtype) * weight[:, :, None], axis=1)  # [T, d]
    return xp.reshape(xp.astype(y, x.dtype), x.shape)


def moe(x: Array, p: dict[str, Array], spec: MoESpec, *, xp: Namespace) -> Array:
    """The routed experts over ``x [..., d]``: gathered when tokens·k < E (decode), else the
    backend's ``fast_op(xp, "moe")`` (NumPy's: each expert on the tokens that chose it) or dense;
    all give :func:`moe_dense_ref`'s result (tests hold them together)."""
    tokens = 1
    for s in x.shape[:-1]:
        tokens *= s
    if tokens * spec.top_k < spec.experts:
        return moe_gathered(x, p, spec, xp=xp)
    native = fast_op(xp, "moe")
    grouped = None if native is None else native(x, p, spec)
    return moe_dense_ref(x, p, spec, xp=xp) if grouped is None else grouped
