"""Many instruments streamed through one market model: a batch row per instrument, each its own state.

:class:`MarketStream` holds, per instrument, the Mamba-2 state and the last bar's log close and
log1p volume; each :meth:`~MarketStream.update` takes one new bar for any subset of the
instruments and returns their predictions in one batched step, the features computed from the
carried values (no window is recomputed, :func:`~portable_ssm.market.features.feature_rows` as the
batch path uses). An instrument's first bar has no features: it returns NaN and leaves the state
alone, as :meth:`MarketModel.predict` returns NaN for row 0. Instruments join (:meth:`add`) and
leave (:meth:`remove`) between updates; the others' states are untouched.

The step (``fast=True``, the default) takes the fastest exact path each backend has:

- NumPy, and PyTorch's float32 CPU tensors (through zero-copy NumPy views of them, as the torch
  backend's own native paths read its tensors; projections may be int8 or bfloat16
  :class:`~portable_ssm.QuantizedWeight`, viewed as int8 and as bfloat16 bits), with a float32
  head: the whole bar, after the checks, in one call of the compiled library for every updating
  row together (:class:`portable_ssm.backends.numpy.rows.MarketBar`: the features from the carried
  values, the normaliser and the input map, then :class:`~portable_ssm.backends.numpy.rows.RowsStep`,
  the whole-model decode of ``backends/cpu/decode_model.h`` with each weight read once per bar for
  all rows, each row's state updated in place; the model planned and checked once at
  construction, the states once per join or leave);
- NumPy where the compiled library is off or not built:
  :class:`~portable_ssm.market.numpy_step.NumpyStep` (weights prepared once, the state updated in
  place);
- PyTorch where that step cannot read the tensors (bfloat16, a GPU, no compiled library): each row
  through the backend's compiled whole-model decode (``decode_model`` of
  ``portable_ssm.backends.torch``, batch 1), its state row written back in place.

Otherwise it is :func:`portable_ssm.step` between the input and output maps, ``jax.jit``-compiled on
JAX (once per count of updating rows), and with ``fast=False`` that step op by op, the reference;
tests hold every path to the batch forward within float32 rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import numpy as np
from portable_ssm.backends import compiled

from portable_ssm import Mamba2Config, Mamba2State, empty_state, step, to_backend
from portable_ssm._array import array_backend, device, namespace

from ._checks import check_float_array, check_int
from .features import Normaliser, feature_rows, model_inputs
from .numpy_step import NumpyStep

HEAD_NAMES = ("inp.weight", "inp.bias", "head.weight", "head.bias")
_FIELDS = ("open", "high", "low", "close", "volume")  # update()'s bar fields
_INT64, _FLOAT64 = np.dtype(np.int64), np.dtype(np.float64)


def _linear(x: Any, weight: Any, bias: Any) -> Any:
    return x @ weight.T + bias  # [..., in] -> [..., out]


@lru_cache(maxsize=8)
def _step_bar(config: Mamba2Config, xp: Any, fast: bool) -> Callable[..., tuple[Any, Mamba2State]]:
    """``(x [k, F], state, params, head) -> (outputs [k, 1], state)``: the input map,
    :func:`portable_ssm.step` and the output map; with ``fast`` compiled where the backend compiles
    by default (JAX: ``jax.jit`` once per row count, traced as "market bar")."""

    def run(x: Any, state: Mamba2State, params: dict[str, Any], head: dict[str, Any]) -> tuple[Any, Mamba2State]:
        u = _linear(x, head["inp.weight"], head["inp.bias"])  # [k, d_model]
        y, new = step(u, state, params, config=config)
        return _linear(y, head["head.weight"], head["head.bias"]), new  # [k, 1]

    return compiled(run, xp, "market bar") if fast else run


def check_head(head: Any, config: Mamba2Config, features: int) -> None:
    """ValueError unless ``head`` holds the four maps with shapes ``inp.weight [d_model, F]``,
    ``inp.bias [d_model]``, ``head.weight [1, d_model]``, ``head.bias [1]``."""
    if not isinstance(head, dict):
        raise TypeError(f"head: expected a dict of {HEAD_NAMES}, got {type(head).__name__}")
    d = config.d_model
    shapes = {"inp.weight": (d, features), "inp.bias": (d,), "head.weight": (1, d), "head.bias": (1,)}
    for name, shape in shapes.items():
        if name not in head:
            raise ValueError(f"head: missing {name!r}; expected {list(HEAD_NAMES)}")
        if tuple(head[name].shape) != shape:
            raise ValueError(f"head[{name!r}]: expected shape {list(shape)}, got {tuple(head[name].shape)}")


class MarketStream:
    """One prediction per instrument per bar, for any number of instruments updated together.

    Args:
        head: the two linear maps (:func:`check_head`), on the backbone's backend and dtype.
        params, config: the Mamba-2 backbone.
        normaliser: the training span's frozen feature statistics.
        instruments: the instrument ids streaming from the start (more join with :meth:`add`).
        fast: take each backend's fast path (module docstring); False: :func:`portable_ssm.step` only.
    """

    def __init__(self, head: dict[str, Any], params: dict[str, Any], *, config: Mamba2Config,
                 normaliser: Normaliser, instruments: tuple[int, ...] | list[int] = (), fast: bool = True) -> None:
        if not isinstance(fast, bool):
            raise TypeError(f"fast: expected a bool, got {type(fast).__name__}")
        if not isinstance(normaliser, Normaliser):
            raise TypeError(f"normaliser: expected a Normaliser, got {type(normaliser).__name__}")
        check_head(head, config, normaliser.mean.shape[0])
        self.head, self.params, self.config, self.normaliser = head, params, config, normaliser
        like = head["inp.weight"]
        self._xp, self._backend, self._device, self._dtype = (namespace(like=like), array_backend(like),
                                                              device(like), like.dtype)
        self._ids: list[int] = []
        self._row: dict[int, int] = {}
        self._all_rows = np.zeros(0, np.int64)  # [N]: every row in order
        # (ids as int64 bytes, their rows): every instrument in row order, and the last update's ids
        self._known: tuple[tuple[bytes, np.ndarray], ...] = ((b"", self._all_rows), (b"", self._all_rows))
        self._previous = np.zeros((2, 0))  # [2, N]: each row's last log close and log1p volume
        self._seen = np.zeros(0, bool)  # [N]: whether the row has had a bar
        self.state: Mamba2State | None = None  # batch N, rows in the order of ``instruments``
        # The fast paths of the module docstring, each built only where the one before it is not.
        self._bar = self._prepared_bar() if fast else None  # the whole bar in one library call
        fallback = fast and self._bar is None
        use_numpy = fallback and self._backend == "numpy" and NumpyStep.supports({**params, **head}, config)
        self._numpy = NumpyStep(params, config) if use_numpy else None
        self._native = self._native_decode() if fallback else None
        self._step_bar = _step_bar(config, self._xp, fast)  # what runs where none of those does
        self._bound: Mamba2State | None = None  # the state self._bar's step holds the addresses of
        if len(instruments):
            self._join(list(instruments))

    @property
    def instruments(self) -> tuple[int, ...]:
        """The instrument ids streaming, in row order."""
        return tuple(self._ids)

    def _native_decode(self) -> Any:
        """``(x [1, d_model], state) -> (outputs [1, 1] before head.bias, state)`` through the torch
        backend's whole-model decode, or None where that backend has none."""
        if self._backend != "torch":
            return None
        from portable_ssm.backends import torch as torch_backend

        params, config = self._head_as_vocabulary()

        def decode(x: Any, state: Mamba2State) -> Any:
            return torch_backend.decode_model(x, state, params, config)

        return decode

    def _head_as_vocabulary(self) -> tuple[dict[str, Any], Mamba2Config]:
        """The backbone's params and config with the head as a one-row vocabulary (the LM decode's)."""
        params = {**self.params, "lm_head.weight": self.head["head.weight"]}
        return params, dataclasses.replace(self.config, tie_embeddings=False)

    def _host(self, tensors: list[Any]) -> list[Any] | None:
        """The arrays as NumPy sees their memory: themselves on NumPy, zero-copy views of plain float32
        CPU torch tensors (a :class:`QuantizedWeight` as one over views of its int8 data and scales
        or of its bfloat16 data's bits, uint16); None where there are none (another backend, device
        or dtype)."""
        if self._backend == "numpy":
            return list(tensors)
        if self._backend != "torch":
            return None
        from portable_ssm.backends.torch_views import numpy_views

        return numpy_views(list(tensors))

    def _prepared_bar(self) -> Any:
        """:class:`~portable_ssm.backends.numpy.rows.MarketBar` of the model and head (NumPy arrays, or
        views of float32 CPU torch tensors; planned by :func:`~portable_ssm.backends.numpy.decode.plan`
        once, here); None where the kernels are off or not built, the head is not float32 or the model
        is a variant that step does not compute."""
        from portable_ssm.backends.numpy import decode, kernels, rows

        if kernels.library() is None:
            return None
        params, config = self._head_as_vocabulary()
        names = list(params)
        host = self._host([params[k] for k in names] + [self.head[k] for k in HEAD_NAMES])
        if host is None or any(getattr(a, "dtype", None) != np.float32 for a in host[len(names):]):
            return None  # another head dtype: the reference judges it, as the batch forward does
        try:
            plan = decode.plan(dict(zip(names, host)), config, tiles=True)
        except ValueError:
            return None
        inp_w, inp_b, _, head_b = host[len(names):]
        return rows.MarketBar(rows.RowsStep(plan), self.normaliser.mean, self.normaliser.std, inp_w, inp_b, head_b)

    def add(self, instrument_id: int) -> None:
        """A new instrument joins with a fresh state (its first bar gives no prediction)."""
        self._join([instrument_id])

    def _join(self, instrument_ids: Any) -> None:
        """Instruments join together: one copy of the state for all of them (joining one at a time
        would copy the growing state once per instrument)."""
        ids = [check_int("instrument_id", i, minimum=0) for i in instrument_ids]
        for i in ids:
            if i in self._row or ids.count(i) > 1:
                raise ValueError(f"instrument_id: {i} is already streaming")
        fresh = empty_state(self.config, len(ids), self.head["inp.weight"])
        fresh = Mamba2State(conv=tuple(a * 1 for a in fresh.conv), ssm=tuple(a * 1 for a in fresh.ssm))  # per layer
        self.state = fresh if self.state is None else Mamba2State(
            conv=tuple(self._xp.concat([a, b], axis=0) for a, b in zip(self.state.conv, fresh.conv)),
            ssm=tuple(self._xp.concat([a, b], axis=0) for a, b in zip(self.state.ssm, fresh.ssm)))
        for i in ids:
            self._row[i] = len(self._ids)
            self._ids.append(i)
        self._previous = np.concatenate([self._previous, np.full((2, len(ids)), np.nan)], axis=1)
        self._seen = np.concatenate([self._seen, np.zeros(len(ids), bool)])
        self._rows_changed()

    def _rows_changed(self) -> None:
        """After a join or leave: the id-to-row answers kept by :meth:`_rows` are stale."""
        self._all_rows = np.arange(len(self._ids))
        self._known = ((np.array(self._ids, dtype=np.int64).tobytes(), self._all_rows), (b"", self._all_rows))

    def remove(self, instrument_id: int) -> None:
        """The instrument leaves: its row and state are dropped; the others keep theirs."""
        instrument_id = check_int("instrument_id", instrument_id, minimum=0)
        if instrument_id not in self._row:
            raise ValueError(f"instrument_id: {instrument_id} is not streaming (streaming: {self._ids[:20]})")
        gone = self._row.pop(instrument_id)
        self._ids.pop(gone)
        self._row = {i: r for r, i in enumerate(self._ids)}
        keep = np.delete(np.arange(len(self._ids) + 1), gone)
        self._previous, self._seen = np.ascontiguousarray(self._previous[:, keep]), self._seen[keep]  # [2, N - 1]
        self._rows_changed()
        if not self._ids:
            self.state = None
            return
        rows = to_backend(keep.astype(np.int64), self._backend, device=self._device)
        self.state = Mamba2State(conv=tuple(self._xp.take(a, rows, axis=0) for a in self.state.conv),
                                 ssm=tuple(self._xp.take(a, rows, axis=0) for a in self.state.ssm))

    def _rows(self, instrument_ids: Any) -> np.ndarray:
        """The state rows of ``instrument_ids`` (checked); the last answer again, without a look-up
        per id, for the same ids as the last update or every instrument in row order."""
        ids = instrument_ids if type(instrument_ids) is np.ndarray else np.asarray(instrument_ids)
        if ids.dtype.kind not in "iu" or ids.ndim != 1:
            raise TypeError(f"instrument_ids: expected a 1-D integer array, got {ids.dtype} {ids.shape}")
        key = (ids if ids.dtype is _INT64 else ids.astype(np.int64)).tobytes()  # no id is negative: none wraps to one
        for known, rows in self._known:
            if key == known:
                return rows
        unknown = [int(i) for i in ids if int(i) not in self._row]
        if unknown:
            raise ValueError(f"instrument_ids: {unknown[:10]} are not streaming; add() them first")
        rows = np.array([self._row[int(i)] for i in ids], dtype=np.int64)
        if np.unique(rows).size != rows.size:
            raise ValueError("instrument_ids: an instrument appears twice in one update")
        self._known = (self._known[0], (key, rows))
        return rows

    def update(self, instrument_ids: Any, open: Any, high: Any, low: Any, close: Any, volume: Any) -> np.ndarray:
        """One closed bar for each of ``instrument_ids [k]`` (distinct, streaming), the bar's fields
        float ``[k]`` each (NaN or a non-positive price: a missing bar); returns the predictions
        ``[k]`` float64 made at the bars' close (NaN for an instrument's first bar)."""
        rows = self._rows(instrument_ids)
        fields = self._fields(rows, (open, high, low, close, volume))
        if self._bar is not None:
            return self._whole_bar(rows, fields)
        features, log_close, log_volume = feature_rows(self._previous[0, rows], self._previous[1, rows], *fields)
        stepping = self._seen[rows]  # [k]: rows with a bar before (their features exist)
        self._previous[:, rows] = log_close, log_volume
        self._seen[rows] = True
        if stepping.all():  # every row has had a bar (the usual bar): no selection
            return self._step(rows, model_inputs(features, self.normaliser))
        out = np.full(rows.size, np.nan)
        if stepping.any():
            out[stepping] = self._step(rows[stepping], model_inputs(features[stepping], self.normaliser))
        return out

    @staticmethod
    def _fields(rows: np.ndarray, fields: Sequence[Any]) -> Sequence[np.ndarray]:
        """:meth:`update`'s five fields as float64 arrays shaped like ``rows``: as given where they are
        (the usual bar: no conversion calls), else converted; TypeError or ValueError naming the
        first that cannot be."""
        for value in fields:
            if type(value) is not np.ndarray or value.dtype is not _FLOAT64 or value.shape != rows.shape:
                break
        else:
            return fields
        fields = [check_float_array(n, v, ndim=1) for n, v in zip(_FIELDS, fields)]
        for name, value in zip(_FIELDS, fields):
            if value.shape != rows.shape:
                raise ValueError(f"{name}: expected shape [{rows.size}] like instrument_ids, got {value.shape}")
        return fields

    def _step(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray:
        """Model outputs ``[k]`` of inputs ``x [k, F]`` (float32) for state rows ``rows [k]``."""
        xp = self._xp
        everyone = rows is self._all_rows or rows.size == len(self._ids) and (rows == np.arange(rows.size)).all()
        if self._numpy is not None:
            return self._numpy_step(rows, x, everyone)
        if self._native is not None:
            out = self._native_rows(rows, x)
            if out is not None:
                return out
        index = None if everyone else to_backend(rows, self._backend, device=self._device)
        state = self.state if everyone else Mamba2State(conv=tuple(xp.take(a, index, axis=0) for a in self.state.conv),
                                                         ssm=tuple(xp.take(a, index, axis=0) for a in self.state.ssm))
        x_b = xp.astype(to_backend(x, self._backend, device=self._device), self._dtype)  # [k, F]
        out, state = self._step_bar(x_b, state, self.params, self.head)  # [k, 1]
        self.state = state if everyone else self._scatter(index, state)
        return np.asarray(to_backend(out, "numpy"), dtype=np.float64)[:, 0]

    def _bind_bar(self) -> None:
        """The states' arrays, and the carried values and seen flags, bound to the bar's step where they
        are not (joined, left or replaced since the last bar: a join or leave replaces all three)."""
        if self._bound is not self.state:
            parts = [self._host(list(part)) for part in (self.state.conv, self.state.ssm)]
            if any(p is None or not all(a.flags.c_contiguous for a in p) for p in parts):
                raise ValueError("MarketStream.state: expected contiguous float32 arrays on the model's backend")
            self._bar.step.bind(*parts)
            self._bar.bind(self._previous, self._seen)
            self._bound = self.state

    def _whole_bar(self, rows: np.ndarray, fields: Sequence[np.ndarray]) -> np.ndarray:
        """:meth:`update` after its checks as one call of
        :class:`~portable_ssm.backends.numpy.rows.MarketBar`: features, inputs and the step together."""
        if self.state is None:  # no instrument streaming: nothing to step
            return np.zeros(0)
        self._bind_bar()
        given = self._bar.fields(rows.size)  # [5, k]
        for i, value in enumerate(fields):
            given[i] = value
        return self._bar(None if rows is self._all_rows else rows, rows.size)

    def _native_rows(self, rows: np.ndarray, x: np.ndarray) -> np.ndarray | None:
        """:meth:`_step` as one whole-model native decode per row (batch 1 each), each row's state
        written back in place; None (nothing changed) where the backend declines the first row."""
        u = _linear(self._xp.astype(to_backend(x, self._backend, device=self._device), self._dtype),
                    self.head["inp.weight"], self.head["inp.bias"])  # [k, d_model]
        out = np.empty(rows.size)
        for j, r in enumerate(rows.tolist()):
            row = Mamba2State(conv=tuple(a[r:r + 1] for a in self.state.conv),
                              ssm=tuple(a[r:r + 1] for a in self.state.ssm))
            fused = self._native(u[j:j + 1], row)
            if fused is None:
                if j == 0:
                    return None
                raise RuntimeError("the native decode declined a row after taking the first")
            logits, new = fused  # [1, 1]: norm_f and head.weight applied
            for whole, part in zip((*self.state.conv, *self.state.ssm), (*new.conv, *new.ssm)):
                whole[r:r + 1] = part
            out[j] = float(logits[0, 0] + self.head["head.bias"][0])
        return out

    def _numpy_step(self, rows: np.ndarray, x: np.ndarray, everyone: bool) -> np.ndarray:
        """:meth:`_step` through :class:`NumpyStep`, the state updated in place (its rows copied out
        and back when only some instruments update)."""
        conv, ssm = list(self.state.conv), list(self.state.ssm)
        if not everyone:
            conv, ssm = [a[rows] for a in conv], [a[rows] for a in ssm]
        u = _linear(x, self.head["inp.weight"], self.head["inp.bias"])  # [k, d_model]
        y = self._numpy(u, conv, ssm)  # [k, d_model]
        if not everyone:
            for whole, part in zip((*self.state.conv, *self.state.ssm), (*conv, *ssm)):
                whole[rows] = part
        return _linear(y, self.head["head.weight"], self.head["head.bias"])[:, 0].astype(np.float64)

    def _scatter(self, index: Any, rows: Mamba2State) -> Mamba2State:
        from portable_ssm.state_pool import scatter_state

        return scatter_state(self.state, index, rows, xp=self._xp)
