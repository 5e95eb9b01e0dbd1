"""What the scans share: the shape legend, validation at the door, the D skip and the z gate.

Shape legend (MAMBA2_SPEC.md):
    b batch, l sequence length, h heads, p headdim, g groups (head i reads group i // (h/g)),
    n state size, Q chunk size, c number of chunks.

Dtype rule: ``x`` and ``z`` share one floating dtype (the storage dtype; mixing float32 and
float64 there is a TypeError). ``B`` and ``C`` have x's dtype or, as mamba_ssm's kernels allow,
the compute dtype (float32 B, C beside bfloat16/float16 x, so they need not be rounded to half).
The SSM parameters ``dt``, ``A``, ``D`` and ``dt_bias`` may be any floating dtype, as mamba_ssm
keeps them in float32 for bf16 models. All the math runs
in the compute dtype: float64 for float64 inputs, float32 otherwise (bf16/fp16 too). States
(``initial_states`` and the returned ones) are in the compute dtype; ``y`` comes back in x's dtype.

Packed sequences (``seq_idx [b, l]``, mamba_ssm's argument): integer ids, 0 first and non-decreasing
along l (checked at the door); a new sequence starts wherever the id changes, so only neighbours are
compared and gaps between ids do not matter. Entry points turn them into run ids once (:func:`sequence_runs`);
the inner functions only ask that equal ids mean one contiguous sequence. Incoming states belong
to each row's first sequence, returned states to its last one. ``cu_seqlens`` packs a batch-1 row
with one incoming and one returned state per sequence instead (:mod:`portable_ssm.varlen`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._array import Array, Namespace, compute_dtype, constant, dtype_name, is_traced, namespace, silu
from ._checks import (
    Shapes,
    check_bool,
    check_dt_limit,
    check_floating,
    check_given,
    check_positive_int,
    check_same_device,
    check_same_dtype,
)
from .discretize import delta, validate_dt
from .varlen import Varlen, check_cu_seqlens


@dataclass(frozen=True)
class ScanInputs:
    """Validated scan arguments, cast to the compute dtype; ``dt`` already holds Δ."""

    xp: Namespace
    x: Array  # [b, l, h, p] (or [b, h, p] for a step)
    dt: Array  # Δ [b, l, h]
    A: Array  # [h]
    B: Array  # [b, l, g, n]
    C: Array  # [b, l, g, n]
    D: Array | None  # [h] or [h, p]
    z: Array | None  # like x
    states: Array | None  # [b, h, p, n]
    out_dtype: Any
    seq_idx: Array | None = None  # run ids [b, l] (sequence_runs), None for one sequence per row
    varlen: Varlen | None = None  # a packed row by cu_seqlens (states [n_seq, h, p, n]), or None


def check_scan_inputs(x: Array, dt: Array, A: Array, B: Array, C: Array, *, D: Array | None,
                      z: Array | None, dt_bias: Array | None, dt_softplus: bool, dt_limit: Any,
                      states: Array | None, states_name: str, step: bool,
                      seq_idx: Array | None = None, cu_seqlens: Array | None = None) -> ScanInputs:
    """Validates the arguments of ``ssd_scan``/``selective_scan`` (or ``ssd_step`` when ``step``).

    Raises ValueError for shapes (naming the argument, the legend's letters and both sizes),
    TypeError for non-floating or mixed storage dtypes, a non-integer ``seq_idx`` and arrays
    from two backends. ``seq_idx`` comes back as run ids (:func:`sequence_runs`), ``cu_seqlens``
    as a :class:`~portable_ssm.varlen.Varlen` (``states`` then ``[n_seq, h, p, n]``).
    """
    check_given(x=x, dt=dt, A=A, B=B, C=C)
    xp = namespace(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, **{states_name: states},
                   seq_idx=seq_idx, cu_seqlens=cu_seqlens)
    dt_limit = check_dt_limit(dt_limit)
    check_bool("dt_softplus", dt_softplus)
    seq = () if step else ("l",)
    shapes = Shapes()
    check_floating("x", x, xp=xp)
    shapes.check("x", x, ("b", *seq, "h", "p"))
    validate_dt(shapes, dt, A, dt_bias, ("b", *seq, "h"), xp=xp)
    cdtype = compute_dtype(xp, x.dtype)
    for name, value in (("B", B), ("C", C)):
        check_floating(name, value, xp=xp)
        _check_projection_dtype(name, value, x, cdtype)
        shapes.check(name, value, ("b", *seq, "g", "n"))
    if shapes["g"] == 0:
        raise ValueError(f"B: expected at least one group (shape {tuple(B.shape)} has g=0)")
    if shapes["h"] % shapes["g"] != 0:
        raise ValueError(f"B: the number of heads h={shapes['h']} (from x) must be a multiple of the "
                         f"number of groups g={shapes['g']} (from B)")
    if D is not None:
        check_floating("D", D, xp=xp)
        shapes.check("D", D, ("h",) if D.ndim == 1 else ("h", "p"))
    if z is not None:
        check_floating("z", z, xp=xp)
        check_same_dtype("z", z, "x", x)
        shapes.check("z", z, ("b", *seq, "h", "p"))
    varlen = None
    if cu_seqlens is not None:
        varlen = check_cu_seqlens(cu_seqlens, seq_idx, shapes, "x", x, xp=xp)
    if states is not None:
        check_floating(states_name, states, xp=xp)
        shapes.check(states_name, states, ("b" if varlen is None else "s", "h", "p", "n"))
        if states.dtype != cdtype:
            raise TypeError(f"{states_name}: expected the compute dtype {dtype_name(cdtype)} for "
                            f"x of dtype {dtype_name(x.dtype)}, got {dtype_name(states.dtype)}")
    if seq_idx is not None:
        check_seq_idx(seq_idx, shapes, "x", x, xp=xp)
    for name, value in (("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
                        ("dt_bias", dt_bias), (states_name, states)):
        if value is not None:
            check_same_device(name, value, "x", x)

    def cast(value: Array | None) -> Array | None:
        return None if value is None else xp.astype(value, cdtype, copy=False)

    return ScanInputs(xp=xp, x=cast(x), dt=cast(delta(dt, dt_bias, dt_softplus, dt_limit, xp=xp)),
                      A=cast(A), B=cast(B), C=cast(C), D=cast(D), z=cast(z), states=states,
                      out_dtype=x.dtype, seq_idx=None if seq_idx is None else sequence_runs(seq_idx, xp=xp),
                      varlen=varlen)


def _check_projection_dtype(name: str, value: Array, x: Array, cdtype: Any) -> None:
    """TypeError unless B or C has x's dtype or the compute dtype (float32 beside half x)."""
    if value.dtype not in (x.dtype, cdtype):
        allowed = dtype_name(x.dtype) if cdtype == x.dtype else f"{dtype_name(x.dtype)} or {dtype_name(cdtype)}"
        raise TypeError(f"{name} is {dtype_name(value.dtype)} but x is {dtype_name(x.dtype)}; expected {allowed} "
                        f"(cast explicitly with xp.astype: mixed float dtypes are not promoted silently)")


def check_seq_idx(seq_idx: Array, shapes: Shapes, ref_name: str, ref: Array, *, xp: Namespace) -> None:
    """Checks ``seq_idx`` against ``ref`` (x or input_ids): one backend, an integer dtype (bool is
    not one), shape ``[b, l]`` with the sizes ``shapes`` already bound, ``ref``'s device and (when
    the values are concrete, not traced) 0 at each row's first step and non-decreasing ids along l,
    mamba_ssm's layout: a decreasing id would restart a sequence that already ended."""
    namespace(**{ref_name: ref}, seq_idx=seq_idx)
    if not xp.isdtype(seq_idx.dtype, "integral"):
        raise TypeError(f"seq_idx: expected an integer dtype (sequence ids per step), "
                        f"got {dtype_name(seq_idx.dtype)}")
    shapes.check("seq_idx", seq_idx, ("b", "l"))
    check_same_device("seq_idx", seq_idx, ref_name, ref)
    b, l = seq_idx.shape
    if is_traced(seq_idx) or b == 0 or l == 0:
        return
    first = xp.astype(seq_idx[:, 0] != 0, xp.int8)  # [b]
    if bool(xp.any(first == 1)):
        row = int(xp.argmax(first))
        raise ValueError(f"seq_idx: expected 0 at each row's first step, got {int(seq_idx[row, 0])} in row {row}")
    down = xp.astype(seq_idx[:, 1:] < seq_idx[:, :-1], xp.int8)  # 1 where an id decreases, [b, l-1]
    if bool(xp.any(down == 1)):
        at = int(xp.argmax(xp.reshape(down, (-1,))))
        row, t = divmod(at, l - 1)
        raise ValueError(f"seq_idx: expected non-decreasing ids along l, got {int(seq_idx[row, t])} then "
                         f"{int(seq_idx[row, t + 1])} at row {row}, steps {t} and {t + 1}")


def sequence_runs(seq_idx: Array, *, xp: Namespace) -> Array:
    """Run ids ``[b, l]`` int32: 0 for each row's first sequence, one more wherever the id changes.

    ``[[7, 7, 9, 9, 9, 4]] -> [[0, 0, 1, 1, 1, 2]]``: equal run ids always mean one contiguous
    sequence, which is all the masks in the scans and the conv rely on."""
    previous = xp.concat([seq_idx[:, :1], seq_idx[:, :-1]], axis=1)  # id one step earlier, [b, l]
    starts = xp.astype(seq_idx != previous, xp.int32)  # 1 where a new sequence begins, [b, l]
    return xp.cumulative_sum(starts, axis=1, dtype=xp.int32)  # [b, l]


def within(v: Array, keep: Array | None, *, xp: Namespace) -> Array:
    """``v`` where ``keep``, else 0 (terms that would cross a sequence boundary); ``v`` itself when
    ``keep`` is None, so one sequence per row computes exactly what it did without ``seq_idx``."""
    return v if keep is None else xp.where(keep, v, constant(0.0, v, xp=xp))


def check_chunk_size(chunk_size: Any, return_final_states: Any = False) -> None:
    """ValueError unless ``chunk_size`` is None or a positive int; TypeError unless
    ``return_final_states`` is a bool."""
    check_positive_int("chunk_size", chunk_size, allow_none=True)
    check_bool("return_final_states", return_final_states)


def skip_and_gate(y: Array, x: Array, D: Array | None, z: Array | None, *, xp: Namespace) -> Array:
    """``(y + D*x) * silu(z)`` over ``[..., h, p]``; D is ``[h]`` or ``[h, p]``."""
    if D is not None:
        y = y + x * (D[:, None] if D.ndim == 1 else D)  # [..., h, p]
    if z is not None:
        y = y * silu(z, xp=xp)
    return y


def heads_from_groups(v: Array, heads: int, *, xp: Namespace) -> Array:
    """``[..., g, n] -> [..., h, n]``: head i reads group i // (h/g)."""
    *lead, g, n = v.shape
    v = xp.broadcast_to(v[..., None, :], (*lead, g, heads // g, n))  # [..., g, h/g, n]
    return xp.reshape(v, (*lead, heads, n))  # [..., h, n]

