"""A market stream's per-bar step: one token for many rows of a batch of states in one call of the
compiled library (``portable_ssm_decode_rows``: ``decode_rows_run`` of ``backends/cpu/decode_model.h``),
one thread, each row's state updated in place.

:func:`.decode.decode_rows_in_place` steps rows one after another, each call reading every weight
(3 to 6 MiB at a market model's shape, more than a core's L2) once per row; this step computes each
product for all rows together, so the weights are read once per bar (per tile of rows): through
the row kernel (``tiled_products``: every output the same float as the batch-1 step's for that row
alone) or, from :data:`GEMM_ROWS` rows on, NumPy's OpenBLAS ``sgemm`` (float32 weights; the same
products rounded in another order). The conv windows, the heads' state updates and the norms are
the batch-1 step's, row by row. :class:`RowsStep` checks the model once (:func:`.decode.plan`) and
the states once per :meth:`RowsStep.bind`, and keeps the rows' state addresses, so a bar costs
one check of the input and one library call.
"""

from __future__ import annotations

import contextlib

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
        self._batch = 0
        self._tables: tuple[np.ndarray, np.ndarray] | None = None

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
        self._states = (list(conv_states), list(ssm_states))  # kept alive while their addresses are held
        self._batch = batch
        row_bytes = sum(a[0].nbytes for a in (*conv_states, *ssm_states)) if batch else 0
        self._options[0] = int(batch * row_bytes > STREAM_BYTES)

    def __call__(self, u: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
        """Logits ``[k, rows of the head]`` of the inputs ``u [k, d_model]`` (contiguous float32) for
        the bound states' rows ``rows [k]`` (distinct int64 in ``[0, N)``; None: every row in order,
        k = N), those rows' states updated in place."""
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
        if not (isinstance(u, np.ndarray) and u.dtype == np.float32 and u.shape == (k, self.model.d_model)
                and u.flags.c_contiguous):
            _float32(u, "u", (k, self.model.d_model))
        conv, ssm = self._tables if rows is None else (self._tables[0][rows], self._tables[1][rows])
        logits = np.empty((k, self.model.vocab), dtype=np.float32)
        if k == 0:
            return logits
        pointers = self._pointers
        pointers[0], pointers[4] = u.ctypes.data, logits.ctypes.data
        low, high = self.model.dt_limit
        gemm = 0 < self._gemm_rows <= k
        with one_blas_thread() if gemm else contextlib.nullcontext():
            self._call(self.model.sizes.ctypes.data, pointers.ctypes.data, conv.ctypes.data, ssm.ctypes.data, k,
                       self.model.eps, low, high, self._options.ctypes.data, self._sgemm)
        return logits

    def __repr__(self) -> str:
        return f"RowsStep(rows bound={self._batch}, gemm_rows={self._gemm_rows})"

