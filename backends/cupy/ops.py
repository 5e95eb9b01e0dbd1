"""The Python side of the CuPy kernels: validation at the door, dtypes, launch sizes and the matmuls.

:class:`KernelSet` works on any array module with NumPy's API for ``empty``, ``astype``,
``ascontiguousarray`` and ``matmul`` (CuPy on a GPU, NumPy under the tests' host emulation of the
kernels) and launches kernels through a ``launch`` callable, so nothing here imports cupy.

Storage dtypes: float16, float32 and float64, and bfloat16 as raw bits in a uint16 or int16 array
(CuPy has no bfloat16 dtype; torch bfloat16 tensors arrive that way through DLPack, see
``torch_ops``). All math runs in float32 (float64 for float64 storage). Every method is pure: it
returns new arrays and never writes to its arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from portable_ssm import ssd as core_ssd
from portable_ssm._array import Array, dtype_name, namespace
from portable_ssm._checks import Shapes, check_dt_limit, check_positive_int, check_same_device
from portable_ssm.ssm_inputs import skip_and_gate

#: ``launch(source, kernel, grid, block, args, shared_mem)``: runs one kernel of a ``.cu`` family.
Launch = Callable[[str, str, tuple[int, int, int], tuple[int, int, int], tuple[Any, ...], int], None]

#: Threads per block of the 1-D grid-stride kernels, and the most blocks one launch asks for.
BLOCK = 256
MAX_BLOCKS = 1 << 20
#: Threads per block of the decode kernel: 4 warps (any multiple of 32 is correct).
DECODE_BLOCK = 128
#: The shared memory a block may use without opting in (48 KiB on every CUDA GPU).
SHARED_LIMIT = 48 * 1024

_SUFFIX = {"float32": "f32", "float64": "f64", "float16": "f16", "uint16": "bf16", "int16": "bf16"}


def _storage(name: str, x: Array) -> str:
    """The kernel suffix for ``x``'s storage dtype; TypeError naming ``name`` for any other."""
    suffix = _SUFFIX.get(dtype_name(x.dtype))
    if suffix is None:
        raise TypeError(f"{name}: expected float16, float32, float64 or bfloat16 bits (uint16/int16) "
                        f"storage, got {dtype_name(x.dtype)}")
    return suffix


def _compute(suffix: str) -> Any:
    """The math dtype for a storage suffix: float64 stays, everything else is float32."""
    return np.float64 if suffix == "f64" else np.float32


def _same_dtype(name: str, x: Array, ref_name: str, ref: Array) -> None:
    if x.dtype != ref.dtype:
        raise TypeError(f"{name} is {dtype_name(x.dtype)} but {ref_name} is {dtype_name(ref.dtype)}; "
                        f"the kernel reads both as {ref_name}'s storage dtype")


def _kind(name: str, x: Array, kinds: str, what: str) -> None:
    if x.dtype.kind not in kinds:
        raise TypeError(f"{name}: expected {what}, got {dtype_name(x.dtype)}")


def _check_args(shapes: Shapes, ref_name: str, ref: Array,
                args: tuple[tuple[str, Array | None, tuple[str, ...], str | None], ...]) -> None:
    """Checks each ``(name, value, spec, rule)`` (None values skipped): the shape against ``spec``
    (binding its letters in ``shapes``), ``ref``'s device, and the dtype by ``rule``: ``"same"`` as
    ``ref``, ``"float"`` any floating dtype, ``"ids"`` an integer dtype, None unchecked."""
    for name, value, spec, rule in args:
        if value is None:
            continue
        shapes.check(name, value, spec)
        check_same_device(name, value, ref_name, ref)
        if rule == "same":
            _same_dtype(name, value, ref_name, ref)
        elif rule == "float":
            _kind(name, value, "f", "a floating dtype")
        elif rule == "ids":
            _kind(name, value, "iu", "an integer dtype (sequence ids per step)")


class KernelSet:
    """The three kernel families behind the CuPy fast paths, on array module ``cp``.

    Args:
        cp: the array module (``cupy``; ``numpy`` under host emulation).
        launch: runs a kernel (see :data:`Launch`).
        empty: allocates outputs and scratch, ``empty(shape, dtype)`` (default ``cp.empty``; tests
            pass one that fills with NaN so an unwritten output cannot pass).
    """

    def __init__(self, cp: Any, launch: Launch, *, empty: Callable[..., Array] | None = None) -> None:
        self.cp = cp
        self._launch = launch
        self._empty = cp.empty if empty is None else empty

    def _grid_stride(self, source: str, kernel: str, total: int, args: tuple[Any, ...]) -> None:
        blocks = min(-(-total // BLOCK), MAX_BLOCKS)
        if blocks > 0:
            self._launch(source, kernel, (blocks, 1, 1), (BLOCK, 1, 1), args, 0)

    def _contiguous(self, x: Array | None, dtype: Any = None) -> Array | None:
        if x is None:
            return None
        return self.cp.ascontiguousarray(x if dtype is None else x.astype(dtype, copy=False))

    def _ids(self, seq_idx: Array | None) -> tuple[Array, np.int32]:
        """``(int64 ids, has_seq)``; a one-element placeholder when there are none."""
        if seq_idx is None:
            return self._empty((1,), np.int64), np.int32(0)
        return self._contiguous(seq_idx, np.int64), np.int32(1)

    def causal_conv1d(self, x: Array, weight: Array, bias: Array | None, state: Array | None,
                      seq_idx: Array | None = None) -> tuple[Array, Array]:
        """The conv of ``portable_ssm.conv.causal_conv1d_ref`` in two launches (conv1d.cu).

        ``x [b, l, d]``, weight ``[d, k]``, bias ``[d]`` or None, state ``[b, d, k]`` (x's dtype) or
        None (zeros), ``seq_idx [b, l]`` integer ids or None. Returns ``(y [b, l, d], new_state
        [b, d, k])`` in x's dtype.
        """
        namespace(x=x, weight=weight, bias=bias, state=state, seq_idx=seq_idx)
        suffix = _storage("x", x)
        shapes = Shapes()
        _check_args(shapes, "x", x, (
            ("x", x, ("b", "l", "d"), None), ("weight", weight, ("d", "k"), "float"),
            ("bias", bias, ("d",), "float"), ("state", state, ("b", "d", "k"), "same"),
            ("seq_idx", seq_idx, ("b", "l"), "ids")))
        b, l, d = x.shape
        k = shapes["k"]
        if l == 0:
            raise ValueError("x: expected at least one time step, got l=0")
        F = _compute(suffix)
        x, state = self._contiguous(x), self._contiguous(state)
        w, bias = self._contiguous(weight, F), self._contiguous(bias, F)
        ids, has_seq = self._ids(seq_idx)
        y = self._empty((b, l, d), x.dtype)
        new_state = self._empty((b, d, k), x.dtype)
        sizes = (np.int64(b), np.int64(l), np.int64(d), np.int32(k))
        has_state = np.int32(state is not None)
        state = x if state is None else state  # placeholders are never read
        self._grid_stride("conv1d", f"conv1d_forward_{suffix}", b * l * d,
                          (x, w, w if bias is None else bias, state, ids, y, *sizes,
                           np.int32(bias is not None), has_state, has_seq))
        self._grid_stride("conv1d", f"conv1d_final_state_{suffix}", b * d * k,
                          (x, state, ids, new_state, *sizes, has_state, has_seq))
        return y, new_state

    def ssd_chunked(self, x: Array, dt: Array, A: Array, B: Array, C: Array, chunk_size: int | None,
                    initial_states: Array | None, seq_idx: Array | None = None,
                    D: Array | None = None) -> tuple[Array, Array]:
        """``portable_ssm.ssd.ssd_chunked`` (D skip, no gate) with six kernels (seven in packed rows)
        and four cuBLAS matmuls per segment (ssd.cu), with the reference's numerics: in-chunk decays
        from step-by-step sums, the decay floor, and non-finite input reaching no earlier output nor
        another sequence. Inputs in the compute dtype
        (all float32 or all float64): ``x [b, l, h, p]``, ``dt`` = Δ ``[b, l, h]``, ``A [h]``,
        ``B, C [b, l, g, n]``, ``initial_states [b, h, p, n]`` or None, ``seq_idx [b, l]`` or None,
        ``D [h]`` or ``[h, p]`` or None; chunk_size None picks ``choose_chunk_size(l)``.
        Returns ``(y [b, l, h, p], final_states [b, h, p, n])``.
        """
        xp = namespace(x=x, dt=dt, A=A, B=B, C=C, initial_states=initial_states, seq_idx=seq_idx, D=D)
        check_positive_int("chunk_size", chunk_size, allow_none=True)
        suffix = _storage("x", x)
        if suffix not in ("f32", "f64"):
            raise TypeError(f"x: the scan kernels take the compute dtype (float32 or float64), got "
                            f"{dtype_name(x.dtype)}")
        shapes = Shapes()
        _check_args(shapes, "x", x, (
            ("x", x, ("b", "l", "h", "p"), None), ("dt", dt, ("b", "l", "h"), "same"),
            ("A", A, ("h",), "same"), ("B", B, ("b", "l", "g", "n"), "same"),
            ("C", C, ("b", "l", "g", "n"), "same"), ("seq_idx", seq_idx, ("b", "l"), "ids"),
            ("initial_states", initial_states, ("b", "h", "p", "n"), "same"),
            ("D", D, ("h", "p") if D is not None and D.ndim == 2 else ("h",), "same")))
        b, l, h, p = x.shape
        g = shapes["g"]
        if h % g:
            raise ValueError(f"B: the number of heads h={h} (from x) must be a multiple of the number of "
                             f"groups g={g} (from B)")
        if l == 0:
            raise ValueError("x: expected at least one time step, got l=0")
        Q = core_ssd.chunk_length(l, chunk_size)
        step = max(Q, (core_ssd.SEGMENT_TOKENS // Q) * Q)
        x, dt, A, B, C = (self._contiguous(v) for v in (x, dt, A, B, C))
        ids, has_seq = self._ids(seq_idx)
        y = self._empty((b, l, h, p), x.dtype)
        state = self._contiguous(initial_states)
        floor = _compute(suffix)(core_ssd.decay_floor(x.dtype, xp=xp))  # decay factors below exp(floor) are 0
        for t0 in range(0, l, step):
            length = min(step, l - t0)
            state = self._ssd_segment(x, dt, A, B, C, ids, has_seq, t0, length, Q, state, y, suffix, floor)
        return skip_and_gate(y, x, D, None, xp=xp), state

    def _ssd_segment(self, x: Array, dt: Array, A: Array, B: Array, C: Array, ids: Array, has_seq: np.int32,
                     t0: int, length: int, Q: int, state: Array | None, y: Array, suffix: str,
                     floor: np.floating) -> Array:
        """Steps ``t0 .. t0+length`` of the scan into ``y`` (a fresh output of ``ssd_chunked``), from
        ``state`` (None: zeros); returns the state after the segment. ``floor`` is
        ``portable_ssm.ssd.decay_floor`` in the compute dtype."""
        cp, empty = self.cp, self._empty
        b, L, h, p = x.shape
        g, n = B.shape[2:]
        r = h // g
        c = -(-length // Q)
        dtype = x.dtype
        seg = (np.int64(b), np.int64(L), np.int64(t0), np.int64(length), np.int64(c), np.int64(Q))

        a, acs, to_end = (empty((b, c, h, Q), dtype) for _ in range(3))  # A·Δ, its running and suffix sums
        self._grid_stride("ssd", f"ssd_chunk_exponents_{suffix}", b * c * h,
                          (dt, A, a, acs, to_end, *seg, np.int64(h)))
        Bg, Cg = empty((b, c, g, Q, n), dtype), empty((b, c, g, Q, n), dtype)
        self._grid_stride("ssd", f"ssd_pad_bc_{suffix}", b * c * g * Q * n,
                          (B, C, Bg, Cg, *seg, np.int64(g), np.int64(n)))
        Xh, Xd = empty((b, c, h, Q, p), dtype), empty((b, c, g, Q, r * p), dtype)
        self._grid_stride("ssd", f"ssd_scale_x_{suffix}", b * c * Q * h * p,
                          (x, dt, to_end, ids, Xh, Xd, *seg, np.int64(h), np.int64(p), np.int64(g), floor,
                           has_seq))

        # 1. diagonal blocks: M = (C Bᵀ) ⊙ exp(segsum), then M X
        CB = cp.ascontiguousarray(cp.matmul(Cg, Bg.swapaxes(-1, -2)))  # [b, c, g, Q, Q]
        M = empty((b, c, h, Q, Q), dtype)
        self._grid_stride("ssd", f"ssd_diag_mask_{suffix}", b * c * h * Q * Q,
                          (CB, a, ids, M, *seg, np.int64(h), np.int64(g), floor, has_seq))
        Y_diag = cp.ascontiguousarray(cp.matmul(M, Xh))  # [b, c, h, Q, p]

        # 2. chunk states: S = Xdᵀ B per group (packed rows: B of the chunk's last sequence only)
        if has_seq:
            self._grid_stride("ssd", f"ssd_mask_b_{suffix}", b * c * g * Q * n,
                              (Bg, ids, *seg, np.int64(g), np.int64(n)))
        S = cp.ascontiguousarray(cp.matmul(Xd.swapaxes(-1, -2), Bg))  # [b, c, g, r·p, n] = [b, c, h, p, n]

        # 3. state passing
        S_in, final = empty((b, c, h, p, n), dtype), empty((b, h, p, n), dtype)
        init = x if state is None else state  # a placeholder is never read
        self._grid_stride("ssd", f"ssd_state_passing_{suffix}", b * h * p * n,
                          (S, acs, init, ids, S_in, final, *seg, np.int64(h), np.int64(p * n), floor,
                           np.int32(state is not None), has_seq))

        # 4. state -> output: C read against the entering state, decayed, plus the diagonal part
        S_in = S_in.reshape(b, c, g, r * p, n)  # [b, c, h, p, n] -> [b, c, g, r·p, n]
        Y_off = cp.ascontiguousarray(cp.matmul(Cg, S_in.swapaxes(-1, -2)))  # [b, c, g, Q, r·p]
        self._grid_stride("ssd", f"ssd_combine_{suffix}", b * length * h * p,
                          (Y_diag, Y_off, acs, x, dt, ids, y, *seg, np.int64(h), np.int64(p), np.int64(g), floor,
                           has_seq))
        return final

    def decode_step(self, xBC: Array, dt: Array, z: Array, conv_state: Array, ssm_state: Array,
                    conv_weight: Array, conv_bias: Array | None, dt_bias: Array, A: Array, D: Array,
                    dt_limit: tuple[float, float], ngroups: int, headdim: int) -> tuple[Array, Array, Array]:
        """One token of one layer after in_proj in one launch (decode.cu); equals
        :func:`portable_ssm.backends.cupy.reference.decode_step_ref`, which documents the arguments.

        Storage dtype T for ``xBC``, ``dt``, ``z`` and ``conv_state``; ``ssm_state`` in the compute
        dtype; the parameters in any floating dtype (float32 ones are used without a copy).
        Returns ``(y [b, d_inner] in T, new_conv_state [b, conv_dim, k], new_ssm_state [b, h, p, n])``.
        """
        namespace(xBC=xBC, dt=dt, z=z, conv_state=conv_state, ssm_state=ssm_state, conv_weight=conv_weight,
                  conv_bias=conv_bias, dt_bias=dt_bias, A=A, D=D)
        check_positive_int("ngroups", ngroups)
        check_positive_int("headdim", headdim)
        low, high = check_dt_limit(dt_limit)
        suffix = _storage("xBC", xBC)
        F = _compute(suffix)
        if dtype_name(ssm_state.dtype) != np.dtype(F).name:
            raise TypeError(f"ssm_state: expected the compute dtype {np.dtype(F).name} for xBC of dtype "
                            f"{dtype_name(xBC.dtype)}, got {dtype_name(ssm_state.dtype)}")
        shapes = self._decode_shapes(xBC, dt, z, conv_state, ssm_state, conv_weight, conv_bias, dt_bias, A, D,
                                     ngroups, headdim)
        b, h, p, n, k = (shapes[s] for s in ("b", "h", "p", "n", "k"))
        shared = (p + 2 * n) * np.dtype(F).itemsize
        if shared > SHARED_LIMIT:
            raise ValueError(f"ssm_state: headdim + 2·d_state = {p + 2 * n} values need {shared} bytes of "
                             f"shared memory per block, more than {SHARED_LIMIT}")
        if b > 65535:
            raise ValueError(f"xBC: the decode kernel launches one grid row per batch entry, at most 65535, "
                             f"got b={b}")
        xBC, dt, z, conv_state, ssm_state = (self._contiguous(v)
                                             for v in (xBC, dt, z, conv_state, ssm_state))
        conv_w, conv_b, dt_bias, A, D = (self._contiguous(v, F)
                                         for v in (conv_weight, conv_bias, dt_bias, A, D))
        y = self._empty((b, h * p), xBC.dtype)
        new_conv_state = self._empty(conv_state.shape, conv_state.dtype)
        new_ssm_state = self._empty(ssm_state.shape, ssm_state.dtype)
        args = (xBC, dt, z, conv_state, ssm_state, conv_w, conv_w if conv_b is None else conv_b, dt_bias,
                A, D, y, new_conv_state, new_ssm_state, np.int32(h), np.int32(p), np.int32(n),
                np.int32(ngroups), np.int32(k), np.int32(conv_b is not None), np.int32(D.ndim == 2),
                F(low), F(high))
        self._launch("decode", f"decode_step_{suffix}", (h, b, 1), (DECODE_BLOCK, 1, 1), args, shared)
        return y, new_conv_state, new_ssm_state

    @staticmethod
    def _decode_shapes(xBC: Array, dt: Array, z: Array, conv_state: Array, ssm_state: Array,
                       conv_weight: Array, conv_bias: Array | None, dt_bias: Array, A: Array, D: Array,
                       ngroups: int, headdim: int) -> Shapes:
        """Checks the decode arguments' shapes, devices and dtypes (storage ones as xBC's); binds b, h,
        p, n, k, conv_dim, d_inner."""
        shapes = Shapes(g=ngroups, p=headdim)
        _check_args(shapes, "xBC", xBC, (("dt", dt, ("b", "h"), "same"),))
        h = shapes["h"]
        if h % ngroups:
            raise ValueError(f"ngroups: the number of heads h={h} (from dt) must be a multiple of "
                             f"ngroups={ngroups}")
        shapes.bind("d_inner", h * headdim, "dt and headdim")
        _check_args(shapes, "xBC", xBC, (("z", z, ("b", "d_inner"), "same"),
                                         ("xBC", xBC, ("b", "conv_dim"), None)))
        bc = shapes["conv_dim"] - h * headdim
        if bc <= 0 or bc % (2 * ngroups):
            raise ValueError(f"xBC: expected conv_dim = d_inner + 2·g·n channels with "
                             f"d_inner = {h * headdim} and g = {ngroups}, got {shapes['conv_dim']}")
        shapes.bind("n", bc // (2 * ngroups), "xBC")
        _check_args(shapes, "xBC", xBC, (
            ("conv_state", conv_state, ("b", "conv_dim", "k"), "same"),
            ("ssm_state", ssm_state, ("b", "h", "p", "n"), None),
            ("conv_weight", conv_weight, ("conv_dim", "k"), "float"),
            ("conv_bias", conv_bias, ("conv_dim",), "float"), ("dt_bias", dt_bias, ("h",), "float"),
            ("A", A, ("h",), "float"), ("D", D, ("h",) if D.ndim == 1 else ("h", "p"), "float")))
        return shapes
