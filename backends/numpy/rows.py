"""A market stream's per-bar step: one token for many rows of a batch of states in one call of the
compiled library (``portable_ssm_decode_rows``: ``decode_rows_run`` of ``backends/cpu/decode_model.h``),
one thread, each row's state updated in place.

:func:`.decode.decode_rows_in_place` steps rows one after another, each call reading every weight
(3 to 6 MiB at a market model's shape, more than a core's L2) once per row; this step computes each
product for all rows together, so the weights are read once per bar (per tile of rows): through
the row kernel (``tiled_products``: every output the same float as the batch-1 step's for that row
alone; a market plan's weights, ``decode.plan(..., tiles=True)``, through its tiles, int8 by VNNI
where the CPU has it: each row's output independent of the rows beside it, within float32
rounding of the row kernel's) or, from :data:`GEMM_ROWS` rows on, NumPy's OpenBLAS ``sgemm``
(float32 weights; the same products rounded in another order). The conv windows, the heads'
state updates and the norms are the batch-1 step's, row by row. :class:`RowsStep` checks the model
once (:func:`.decode.plan`) and the states once per :meth:`RowsStep.bind`, and keeps the rows'
state addresses, so a bar costs one check of the input and one library call.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import kernels
from .decode import Plan, _float32
from .threads import blas_sgemm, one_blas_thread

#: Rows from which the float32 products go to OpenBLAS's sgemm instead of the row kernel (measured
#: in benchmarks/market_bench.py: the row kernel re-reads a 64- to 256-row tile's weights from L3 and
#: runs at a fraction of sgemm's rate once the rows fill its registers).
GEMM_ROWS = 16
#: States larger than this (all rows of a call) are streamed past the caches as the step writes them:
#: they are read again only at the next bar, after the rest of the states have passed.
STREAM_BYTES = 16 << 20


class RowsStep:
    """``step(u, rows)``: the model of ``model`` (:func:`.decode.plan`) one token on for the rows
    ``rows`` of the states last :meth:`bind`-ed, in place; see the module docstring. One call at a
    time: a call writes its input's and output's addresses into the object's pointer table.

    Args:
        model: the plan (weights float32, int8 with row scales or bfloat16 bits).
        gemm_rows: rows from which float32 products go to sgemm (0: never; the row kernel's outputs
            equal the batch-1 step's bit for bit); None: :data:`GEMM_ROWS`.
    """

    def __init__(self, model: Plan, *, gemm_rows: int | None = None) -> None:
        gemm_rows = GEMM_ROWS if gemm_rows is None else gemm_rows
        if not isinstance(model, Plan):
            raise TypeError(f"model: expected a decode.Plan, got {type(model).__name__}")
        if isinstance(gemm_rows, bool) or not isinstance(gemm_rows, int) or gemm_rows < 0:
            raise ValueError(f"gemm_rows: expected an int >= 0, got {gemm_rows!r}")
        lib = kernels.library()
        if lib is None:
            raise RuntimeError("RowsStep: NumPy's compiled kernels are off or not built")
        self._call = lib.portable_ssm_decode_rows
        self.model = model
        sgemm = blas_sgemm()
        self._sgemm = None if sgemm is None or gemm_rows == 0 else sgemm[0]
        self._gemm_rows = gemm_rows if self._sgemm is not None else 0
        self._options = np.array([0, self._gemm_rows, 0 if sgemm is None else int(sgemm[1])], dtype=np.int64)
        self._pointers = model.pointers.copy()
        # The fixed arguments' addresses, taken once: each ``.ctypes.data`` costs about a microsecond,
        # a fiftieth of a market model's bar.
        self._fixed = (model.sizes.ctypes.data, self._pointers.ctypes.data, self._options.ctypes.data)
        self._batch = 0
        self._tables: tuple[np.ndarray, np.ndarray] | None = None
        self._every: tuple[int, int] = (0, 0)  # the tables' addresses: every row in order
        self._buffers: dict[int, tuple[np.ndarray, np.ndarray, int, int]] = {}  # k -> inputs, logits, addresses

    def bind(self, conv_states: list[np.ndarray], ssm_states: list[np.ndarray]) -> None:
        """The states the next calls update: per layer ``conv_states[i] [N, conv_dim, d_conv]`` and
        ``ssm_states[i] [N, nheads, headdim, d_state]``, contiguous float32 (ValueError naming the
        first that does not fit); kept by address, so they must stay alive and unmoved while bound."""
        layers = len(self.model.conv_shapes)
        for name, given in (("conv_states", conv_states), ("ssm_states", ssm_states)):
            if not isinstance(given, (list, tuple)) or len(given) != layers:
                raise ValueError(f"RowsStep.bind: {name} must hold one array per layer ({layers}), got "
                                 f"{type(given).__name__} of {len(given) if hasattr(given, '__len__') else '?'}")
        batch = getattr(conv_states[0], "shape", (0,))[0] if layers else 0
        for i in range(layers):
            _float32(conv_states[i], f"conv_states[{i}]", (batch, *self.model.conv_shapes[i][1:]))
            _float32(ssm_states[i], f"ssm_states[{i}]", (batch, *self.model.ssm_shapes[i][1:]))
        tables = []
        for states in (conv_states, ssm_states):
            bases = np.array([a.ctypes.data for a in states], dtype=np.uintp)  # [layers]
            widths = np.array([a[0].nbytes if batch else 0 for a in states], dtype=np.uintp)  # [layers]
            tables.append(bases[None, :] + np.arange(batch, dtype=np.uintp)[:, None] * widths[None, :])  # [N, layers]
        self._tables = (tables[0], tables[1])
        self._every = (tables[0].ctypes.data, tables[1].ctypes.data)
        self._states = (list(conv_states), list(ssm_states))  # kept alive while their addresses are held
        self._batch = batch
        row_bytes = sum(a[0].nbytes for a in (*conv_states, *ssm_states)) if batch else 0
        self._options[0] = int(batch * row_bytes > STREAM_BYTES)

    def inputs(self, k: int) -> np.ndarray:
        """The ``[k, d_model]`` float32 buffer a caller may write the next call's inputs into: a call
        given it reads it where it is known to be (one buffer per ``k`` kept, the last size's)."""
        if k not in self._buffers:
            u, logits = np.zeros((k, self.model.d_model), np.float32), np.zeros((k, self.model.vocab), np.float32)
            self._buffers = {k: (u, logits, u.ctypes.data, logits.ctypes.data)}
        return self._buffers[k][0]

    def __call__(self, u: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Logits ``[k, rows of the head]`` of the inputs ``u [k, d_model]`` (contiguous float32; or
        :meth:`inputs` ``(k)`` written in place) for the bound states' rows ``rows [k]`` (distinct
        int64 in ``[0, N)``; None: every row in order, k = N), those rows' states updated in place."""
        if self._tables is None:
            raise ValueError("RowsStep: no states bound; call bind() first")
        if rows is None:
            k = self._batch
        else:
            ok = isinstance(rows, np.ndarray) and rows.ndim == 1 and rows.dtype == np.int64
            k = rows.shape[0] if ok else -1
        if k < 0 or rows is not None and k and (rows.min() < 0 or rows.max() >= self._batch):
            raise ValueError(f"rows: expected int64 [k] in [0, {self._batch}) or None, got "
                             f"{getattr(rows, 'dtype', type(rows).__name__)} {getattr(rows, 'shape', '')}")
        if k not in self._buffers:
            self.inputs(k)
        given, logits, u_at, logits_at = self._buffers[k]
        if u is not given:
            if not (isinstance(u, np.ndarray) and u.dtype == np.float32 and u.shape == (k, self.model.d_model)
                    and u.flags.c_contiguous):
                _float32(u, "u", (k, self.model.d_model))
            u_at = u.ctypes.data
        if k == 0:
            return logits.copy()
        picked = None if rows is None else (self._tables[0][rows], self._tables[1][rows])  # alive through the call
        conv, ssm = self._every if picked is None else (picked[0].ctypes.data, picked[1].ctypes.data)
        self._pointers[0], self._pointers[4] = u_at, logits_at
        sizes, pointers, options = self._fixed
        self._invoke(self._call, k, (sizes, pointers, conv, ssm, k, self.model.eps, *self.model.dt_limit, options,
                                     self._sgemm))
        return logits.copy()

    def _invoke(self, function: Any, k: int, args: tuple[Any, ...]) -> None:
        """``function(*args)`` of the library for a call of ``k`` rows, OpenBLAS held at one thread where
        they go to its sgemm."""
        if 0 < self._gemm_rows <= k:
            with one_blas_thread():
                function(*args)
        else:
            function(*args)

    def __repr__(self) -> str:
        return f"RowsStep(rows bound={self._batch}, gemm_rows={self._gemm_rows})"


class MarketBar:
    """A market stream's whole bar in one library call (``portable_ssm_market_bar``): each row's
    features from its five fields and carried values, normalised and mapped by the head's input map,
    then :class:`RowsStep`'s step for the rows that had a bar before, and ``logit + head bias``
    (float64; NaN for a row's first bar), as :class:`portable_ssm.market.MarketStream` computes them
    in NumPy (the features in float64 with the C library's ``log`` and ``log1p``, which may differ
    from NumPy's in the last bit; each input then rounded to float32).

    Args:
        step: the model's step (its states bound before each call; :meth:`bind` after each bind).
        mean, std: the normaliser's ``[5]`` (float64); inp_weight ``[d_model, 5]``, inp_bias
            ``[d_model]``, head_bias ``[1]``: the head's float32 maps.
    """

    FIELDS = 5

    def __init__(self, step: RowsStep, mean: np.ndarray, std: np.ndarray, inp_weight: np.ndarray,
                 inp_bias: np.ndarray, head_bias: np.ndarray) -> None:
        if not isinstance(step, RowsStep):
            raise TypeError(f"step: expected a RowsStep, got {type(step).__name__}")
        d, f = step.model.d_model, self.FIELDS
        kept = []
        for name, a, dtype, shape in (("mean", mean, np.float64, (f,)), ("std", std, np.float64, (f,)),
                                      ("inp_weight", inp_weight, np.float32, (d, f)),
                                      ("inp_bias", inp_bias, np.float32, (d,)),
                                      ("head_bias", head_bias, np.float32, (1,))):
            if not (isinstance(a, np.ndarray) and a.dtype == dtype and a.shape == shape):
                raise ValueError(f"MarketBar: {name} must be {np.dtype(dtype).name} {list(shape)}, got "
                                 f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")
            kept.append(np.ascontiguousarray(a.T if name == "inp_weight" else a))  # inp_weight -> [5, d_model]
        self.step = step
        self.head = (mean, std, inp_weight, inp_bias, head_bias)  # as given: MarketBar(other_step, *bar.head)
        self._call = kernels.library().portable_ssm_market_bar
        self._reals = np.array([step.model.eps, *step.model.dt_limit], dtype=np.float64)
        self._kept = kept
        self._table = np.zeros(17, dtype=np.uintp)  # the bar's pointers: see portable_ssm_market_bar
        self._table[3:8] = [a.ctypes.data for a in kept]
        self._table[12:15] = step._fixed  # the step's sizes, pointers and options
        self._table[15:17] = step._sgemm or 0, self._reals.ctypes.data
        self._table_at = self._table.ctypes.data
        self._n = 0
        self._every: tuple[int, int] | None = None  # the step's state tables bound (their addresses)
        self._scratch: tuple[Any, ...] | None = None  # the step's inputs(k) entry whose addresses the table holds
        self._fields: dict[int, tuple[np.ndarray, np.ndarray, int]] = {}  # k -> fields [5, k], out [k], out's address

    def bind(self, carry: np.ndarray, seen: np.ndarray) -> None:
        """The stream's carried values ``carry [2, N]`` (float64: each row's last log close and log1p
        volume) and ``seen [N]`` (bool), updated in place by each call, and the step's bound states
        (N rows); kept by address, so all must stay alive and unmoved while bound."""
        n = self.step._batch
        if not (isinstance(carry, np.ndarray) and carry.dtype == np.float64 and carry.shape == (2, n)
                and carry.flags.c_contiguous):
            raise ValueError(f"MarketBar.bind: carry must be a contiguous float64 [2, {n}], got "
                             f"{getattr(carry, 'dtype', type(carry).__name__)} {getattr(carry, 'shape', '')}")
        if not (isinstance(seen, np.ndarray) and seen.dtype == np.bool_ and seen.shape == (n,)
                and seen.flags.c_contiguous):
            raise ValueError(f"MarketBar.bind: seen must be a contiguous bool [{n}], got "
                             f"{getattr(seen, 'dtype', type(seen).__name__)} {getattr(seen, 'shape', '')}")
        self._bound = (carry, seen)
        self._table[1], self._table[2] = carry.ctypes.data, seen.ctypes.data
        self._table[8], self._table[9] = self._every = self.step._every
        self._n = n

    def fields(self, k: int) -> np.ndarray:
        """The ``[5, k]`` float64 buffer the next call of ``k`` rows reads the bar's fields from (open,
        high, low, close, volume; one buffer per ``k`` kept, the last size's)."""
        if k not in self._fields:
            given, out = np.zeros((self.FIELDS, k)), np.zeros(k)
            self._fields = {k: (given, out, out.ctypes.data)}
            self._table[0] = given.ctypes.data
        return self._fields[k][0]

    def __call__(self, rows: np.ndarray | None, k: int) -> np.ndarray:
        """Predictions ``[k]`` (float64) of the bar in :meth:`fields` ``(k)`` for the rows ``rows [k]``
        (distinct int64 in ``[0, N)``, as the stream checked them; None: every row in order, k = N)."""
        if self._every is not self.step._every or self._n != self.step._batch:
            raise ValueError("MarketBar: the step's states changed since bind(); bind again")
        if k not in self._fields or (rows is None and k != self._n) or (rows is not None and not (
                isinstance(rows, np.ndarray) and rows.dtype == np.int64 and rows.shape == (k,)
                and rows.flags.c_contiguous and (k == 0 or rows.min() >= 0 and rows.max() < self._n))):
            raise ValueError(f"MarketBar: expected fields({k}) filled and {k} int64 rows in [0, {self._n}), got rows "
                             f"{getattr(rows, 'dtype', type(rows).__name__)} {getattr(rows, 'shape', '')}")
        _, out, out_at = self._fields[k]
        scratch = self.step._buffers.get(k)
        if scratch is None or scratch is not self._scratch:  # the step's x and logits buffers for k rows
            self.step.inputs(k)
            self._scratch = scratch = self.step._buffers[k]
            self._table[10], self._table[11] = scratch[2], scratch[3]
        rows_at = None if rows is None else rows.ctypes.data
        self.step._invoke(self._call, k, (self._table_at, rows_at, k, self._n, out_at))
        return out.copy()
