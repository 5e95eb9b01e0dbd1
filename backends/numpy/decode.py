"""NumPy's whole-model batch-1 decode step: one token through every layer of a language model in
one call of the compiled library (``portable_ssm_decode_model``: ``decode_model_run`` of
``backends/cpu/decode_model.h``, the C++ torch's ``decode_model`` op runs), one OpenMP parallel
region of :func:`.threads.workers` threads, where the per-layer step makes a dozen NumPy and
ctypes calls a layer.

- :func:`plan`: a model's arrays checked and gathered into the library's size and pointer tables,
  ValueError naming the first array that does not fit;
- :func:`decode_model`: one step on a plan, ``(logits [1, rows], new conv states, new ssm states)``;
- :func:`decode_rows_in_place`: that step for rows of a batch of states one after another, each
  updated in place (the row-by-row twin :class:`.rows.RowsStep` is tested against);
- :func:`decode_model_hook`: the backend's ``decode_model`` fast op (``portable_ssm.lm.decode``):
  the step for the variant the kernel computes, None for any other (the core's array-API step
  runs, the reference it is tested against) or where the kernels are off.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import numpy as np

from portable_ssm import lm
from portable_ssm.config import Mamba2Config
from portable_ssm.model import Mamba2State
from portable_ssm.quantized import QuantizedWeight

from . import kernels
from .threads import workers

#: The weight storage the library reads, by its kind number (``WeightKind`` of decode_model.h).
WEIGHT_KINDS = {np.dtype(np.float32): 0, np.dtype(np.int8): 1, np.dtype(np.uint16): 2}
#: The kinds of a market stream's plan (:func:`plan` with ``tiles=True``): the rows, then the same
#: weights in tile order (:func:`with_tiles`), which its step's products read. INT8_SYMMETRIC: int8
#: holding no -128 (every int8 weight :func:`portable_ssm.quantize` makes) where the library's int8
#: products go through AVX-512 VNNI (``digit_products`` of shared.h, :func:`.kernels.vnni_products`);
#: FLOAT32_TILES, BFLOAT16_TILES and INT8_TILES: float32, bfloat16 bits and any other int8, widened
#: from their tiles (``widened_tile_products``; on a CPU without VNNI an int8 bar's products used
#: to take the row kernel, one row at a time: ``benchmarks/MARKET.md``, 2026-12-07 16:40 UTC).
INT8_SYMMETRIC, FLOAT32_TILES, BFLOAT16_TILES, INT8_TILES = 3, 4, 5, 6
#: A market plan's kind of each storage but int8 (:func:`_tiled_kind`).
_TILED_KINDS = {np.dtype(np.float32): FLOAT32_TILES, np.dtype(np.uint16): BFLOAT16_TILES}
#: Entries of the tables before the layers' and per layer.
_HEAD_SIZES, _LAYER_SIZES, _HEAD_POINTERS, _LAYER_POINTERS = 6, 8, 5, 15
#: The least weight bytes a thread of the step reads: about 0.1 ms at a core's streaming rate.
BYTES_PER_THREAD = 1 << 20
#: Per-call pointers in a layer's entries: conv_state, ssm_state, new_conv, new_ssm.
_STATE_SLOTS = (1, 8, 9, 10)


@dataclass(frozen=True)
class Plan:
    """A model's arrays as the library reads them: ``sizes`` and ``pointers`` (the per-call slots 0),
    the states' shapes per layer, the logits' width and the arrays themselves (kept alive)."""

    sizes: np.ndarray
    pointers: np.ndarray
    conv_shapes: tuple[tuple[int, ...], ...]
    ssm_shapes: tuple[tuple[int, ...], ...]
    d_model: int
    vocab: int
    eps: float
    dt_limit: tuple[float, float]
    arrays: tuple[Any, ...]
    weight_bytes: int = 0


def _fits(a: Any) -> bool:
    return (isinstance(a, np.ndarray) and a.dtype.isnative and a.flags.c_contiguous and a.flags.aligned)


def _float32(a: Any, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """``a`` where it is a contiguous float32 ``shape``; ValueError naming it otherwise."""
    if not (_fits(a) and a.dtype == np.float32 and a.shape == shape):
        got = f"{getattr(a, 'shape', None)} {getattr(a, 'dtype', type(a).__name__)}"
        raise ValueError(f"decode_model: {name} must be a contiguous float32 {list(shape)}, got {got}")
    return a


def _weight(w: Any, name: str, shape: tuple[int, ...], tiles: bool = False) -> tuple[
        np.ndarray, int, np.ndarray | None]:
    """``(data, kind, scale or None)`` of a float32, int8 or bfloat16-bits weight ``shape`` (``[out,
    in]``, or a stack ``[E, out, in]`` of experts' with a scale per row of each: ``[E, out]``);
    ``tiles``: a weight ``[out, in]`` gets its tiled kind (:func:`_tiled_kind`, :func:`with_tiles`)."""
    data, scale = (w.data, w.scale) if isinstance(w, QuantizedWeight) else (w, None)
    kind = WEIGHT_KINDS.get(getattr(data, "dtype", None))
    if kind is None or not _fits(data) or data.shape != shape:
        got = f"{getattr(data, 'shape', None)} {getattr(data, 'dtype', type(data).__name__)}"
        raise ValueError(f"decode_model: {name} must be a contiguous float32, int8 or bfloat16-bits (uint16) "
                         f"{list(shape)}, got {got}")
    if scale is not None:
        _float32(scale, f"{name}'s scale", shape[:-1])
    if tiles and len(shape) == 2 and data.size:
        tiled = _tiled_kind(data)
        return with_tiles(data, 4 if tiled == INT8_SYMMETRIC else 1), tiled, scale
    return data, kind, scale


def _tiled_kind(data: np.ndarray) -> int:
    """A market plan's kind of a weight's data: int8 through VNNI where the library has it and the
    weight holds no -128 (VNNI negates weight bytes), every other int8 widened from its tiles."""
    if data.dtype != np.int8:
        return _TILED_KINDS[data.dtype]
    return INT8_SYMMETRIC if kernels.vnni_products() and data.min() > -128 else INT8_TILES


def row_tiles(w: np.ndarray, g: int) -> np.ndarray:
    """``w [out, n]`` (int8, float32 or bfloat16 bits) in the order a market step's products read it
    (shared.h): for each 64 rows, a tile of ``B`` blocks of 16 rows as ``[groups][B][16][g]``, a
    group being ``g`` columns (4 int8 ones for :data:`INT8_SYMMETRIC`: one VNNI lane's bytes; else
    1); zero past ``n`` and ``out``."""
    out, n = w.shape
    blocks, groups = -(-out // 16), -(-n // g)
    padded = np.zeros((blocks * 16, groups * g), w.dtype)
    padded[:out, :n] = w
    rows = padded.reshape(blocks, 16, groups, g)  # [block, row, group, column]
    whole = blocks // 4 * 4
    full = rows[:whole].reshape(whole // 4, 4, 16, groups, g).transpose(0, 3, 1, 2, 4)  # [tile, group, block, row, g]
    last = rows[whole:].transpose(2, 0, 1, 3)  # [group, block, row, g]: the last tile, of fewer blocks
    return np.concatenate([full.reshape(-1), last.reshape(-1)])


def with_tiles(w: np.ndarray, g: int) -> np.ndarray:
    """A market plan's weight data from ``w [out, n]`` (int8, float32 or bfloat16 bits): its rows,
    zeros to a multiple of 64 bytes (``tiles_at`` of shared.h), then :func:`row_tiles` of groups of
    ``g`` columns."""
    rows = w.reshape(-1)
    return np.concatenate([rows, np.zeros(-rows.nbytes % 64 // w.itemsize, w.dtype), row_tiles(w, g)])


def _address(a: np.ndarray | None) -> int:
    return 0 if a is None else a.ctypes.data


def mamba_row(params: dict[str, Any], prefix: str, norm: np.ndarray, d: int, g: int, p: int, gate_norm: bool = True,
              norm_before_gate: bool = False, tiles: bool = False) -> tuple[
                  list[np.ndarray | None], list[int], tuple[int, ...], tuple[int, ...]]:
    """The Mamba-2 mixer under ``prefix`` (``layers.{i}.mixer.``) as the library reads a layer: its
    15 table entries (None: a null pointer; ``norm`` the block's RMSNorm weight first), its 8 sizes,
    and its conv and SSM states' shapes at batch 1. ``gate_norm``: the gated RMSNorm's weight is read
    (mamba_ssm's rmsnorm), else none is (y·silu(z) straight into out_proj); ``norm_before_gate``:
    rmsnorm(y)·silu(z) instead of rmsnorm(y·silu(z)); ``tiles``: as :func:`plan`'s. ValueError
    naming the first array that does not fit (in_proj's output ``[z, xBC, dt]``, no projection biases)."""
    def get(leaf: str) -> Any:
        return params.get(prefix + leaf)

    for leaf in ("in_proj.bias", "out_proj.bias"):
        if get(leaf) is not None:
            raise ValueError(f"decode_model: {prefix}{leaf} must be absent (the kernel adds no projection biases)")
    dt_bias = get("dt_bias")
    h = getattr(dt_bias, "shape", (0,))[0] if getattr(dt_bias, "ndim", 0) == 1 else 0
    if h <= 0 or h % g:
        raise ValueError(f"decode_model: {prefix}dt_bias must be [nheads] with nheads a positive multiple of "
                         f"ngroups={g}, got {getattr(dt_bias, 'shape', None)}")
    taps = get("conv1d.weight")
    conv_dim = getattr(taps, "shape", (0,))[0]
    n2 = conv_dim - h * p
    if taps is None or taps.ndim != 3 or n2 <= 0 or n2 % (2 * g):
        raise ValueError(f"decode_model: {prefix}conv1d.weight must be [d_inner + 2·ngroups·d_state, 1, d_conv] "
                         f"for d_inner={h * p}, got {getattr(taps, 'shape', None)}")
    n, k = n2 // (2 * g), taps.shape[2]
    bias, D = get("conv1d.bias"), get("D")
    row = [norm, None, _float32(taps, prefix + "conv1d.weight", (conv_dim, 1, k)),
           None if bias is None else _float32(bias, prefix + "conv1d.bias", (conv_dim,)),
           _float32(dt_bias, prefix + "dt_bias", (h,)), _float32(get("A_log"), prefix + "A_log", (h,)),
           _float32(D, prefix + "D", (h, p) if getattr(D, "ndim", 1) == 2 else (h,)),
           _float32(get("norm.weight"), prefix + "norm.weight", (h * p,)) if gate_norm else None, None, None, None]
    w_in, in_kind, in_scale = _weight(get("in_proj.weight"), prefix + "in_proj.weight", (2 * h * p + 2 * g * n + h, d),
                                      tiles)
    w_out, out_kind, out_scale = _weight(get("out_proj.weight"), prefix + "out_proj.weight", (d, h * p), tiles)
    sizes = [h, conv_dim, k, n, in_kind, out_kind, D.ndim == 2, norm_before_gate]
    return (row + [w_in, in_scale, w_out, out_scale], sizes,
            (1, conv_dim, k), (1, h, p, n))


def head_row(params: dict[str, Any], weight: Any, d: int, tiles: bool = False) -> tuple[
        np.ndarray, np.ndarray, int, np.ndarray | None]:
    """``(norm_f, head data, head kind, head scale or None)`` as the library reads them."""
    norm_f = _float32(params.get("norm_f.weight"), "norm_f.weight", (d,))
    rows = getattr(weight, "shape", (0,))[0]
    head, kind, scale = _weight(weight, "the head's weight", (rows, d), tiles)
    return norm_f, head, kind, scale


def plan(params: dict[str, Any], config: Mamba2Config, *, tiles: bool = False) -> Plan:
    """``params`` of ``config``'s language model checked and gathered for :func:`decode_model`: the
    variant the kernel computes (in_proj's output ``[z, xBC, dt]``, no projection biases, float32
    arrays; weights float32, int8 with row scales or bfloat16 bits). ``tiles``: the weights are kept a
    second time in tile order (:func:`with_tiles`, of their kind :func:`_tiled_kind`): a market
    stream's plan, whose weights stay in the caches between bars and whose step's products read
    the tiles. ValueError naming the first array or setting that does not fit."""
    c = config
    if c.d_mlp or not c.rmsnorm or c.norm_before_gate:
        raise ValueError("decode_model: config must have no gated MLP (d_mlp=0), rmsnorm=True and "
                         f"norm_before_gate=False, got d_mlp={c.d_mlp}, rmsnorm={c.rmsnorm}, "
                         f"norm_before_gate={c.norm_before_gate}")
    d, g, p = c.d_model, c.ngroups, c.headdim
    sizes, pointers, arrays, convs, ssms = [], [], [], [], []
    for i in range(c.n_layer):
        norm = _float32(params.get(f"layers.{i}.norm.weight"), f"layers.{i}.norm.weight", (d,))
        row, layer_sizes, conv, ssm = mamba_row(params, f"layers.{i}.mixer.", norm, d, g, p, tiles=tiles)
        pointers += [_address(a) for a in row]
        arrays += [a for a in row if a is not None]
        sizes += layer_sizes
        convs.append(conv)
        ssms.append(ssm)
    head_weight = lm.head_weight(params, c)
    norm_f, head, head_kind, head_scale = head_row(params, head_weight, d, tiles)
    arrays += [a for a in (norm_f, head, head_scale) if a is not None]
    vocab = head_weight.shape[0]
    return Plan(np.array([c.n_layer, d, g, p, vocab, head_kind, *sizes], dtype=np.int64),
                np.array([0, norm_f.ctypes.data, head.ctypes.data, _address(head_scale), 0, *pointers],
                         dtype=np.uintp),
                tuple(convs), tuple(ssms), d, vocab, float(c.norm_eps), tuple(map(float, c.dt_limit)),
                tuple(arrays), sum(a.nbytes for a in arrays))


@lru_cache(maxsize=8)
def _state_layout(conv_shapes: tuple[tuple[int, ...], ...], ssm_shapes: tuple[tuple[int, ...], ...]) -> tuple[
        tuple[tuple[int, ...], ...], tuple[int, ...], tuple[int, ...], int, np.ndarray]:
    """One float32 buffer holding a conv and an ssm state of these shapes per layer, in that order:
    the shapes in order, where each starts (a multiple of 16 floats: 64 bytes), its element count,
    the buffer's floats, and the starts as ``uintp`` ``[2·layers]``."""
    shapes = tuple(s for pair in zip(conv_shapes, ssm_shapes) for s in pair)
    counts = tuple(math.prod(s) for s in shapes)
    padded = [-(-n // 16) * 16 for n in counts]
    starts = tuple(sum(padded[:i]) for i in range(len(shapes)))
    return shapes, starts, counts, sum(padded), np.array(starts, dtype=np.uintp)


def fresh_states(conv_shapes: tuple[tuple[int, ...], ...],
                 ssm_shapes: tuple[tuple[int, ...], ...]) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Uninitialized float32 new states, one conv and one ssm state of these shapes per layer, each
    starting on a 64-byte boundary (the kernel streams new states past the caches into them), as
    views of one buffer: one allocation a step, where one per array took about 5 µs each, a
    sixtieth of an int8 step's time; and their addresses ``[layers, 2]`` (conv, ssm)."""
    shapes, starts, counts, total, offsets = _state_layout(conv_shapes, ssm_shapes)
    buffer = np.empty(total + 16, dtype=np.float32)
    first = (-buffer.ctypes.data % 64) // 4
    views = [buffer[first + o:first + o + n].reshape(s) for o, n, s in zip(starts, counts, shapes)]
    addresses = buffer.ctypes.data + 4 * (first + offsets)  # [2·layers]
    convs, ssms, addresses = views[0::2], views[1::2], addresses.reshape(-1, 2)  # [2·layers] -> [layers, 2]
    global _LAST_MADE
    _LAST_MADE = (conv_shapes, ssm_shapes, tuple(map(weakref.ref, convs)), tuple(map(weakref.ref, ssms)), addresses)
    return convs, ssms, addresses


#: The states :func:`fresh_states` made last: their shapes, weak references to them and their
#: addresses (one tuple, replaced whole, so a reader never mixes two steps' entries).
_LAST_MADE: tuple[Any, ...] = ((), (), (), (), np.empty((0, 2), dtype=np.uintp))


def referenced(refs: tuple[weakref.ref, ...], objects: Any) -> bool:
    """Whether ``objects`` are, in order, the very objects the weak references ``refs`` hold."""
    return len(refs) == len(objects) and all(r() is o for r, o in zip(refs, objects))


def made_addresses(conv_states: Any, ssm_states: Any, conv_shapes: tuple[tuple[int, ...], ...],
                   ssm_shapes: tuple[tuple[int, ...], ...]) -> np.ndarray | None:
    """The addresses ``[layers, 2]`` of ``conv_states`` and ``ssm_states`` where they are the very
    arrays :func:`fresh_states` made last for these shapes (a decode loop's state, handed back):
    contiguous float32 of these shapes at known addresses, so they need neither a check nor a
    ctypes address each (about a microsecond apiece, four dozen a step, several times that with
    the caches cold after a step); None otherwise."""
    convs, ssms, conv_refs, ssm_refs, addresses = _LAST_MADE
    same = (convs == conv_shapes and ssms == ssm_shapes and referenced(conv_refs, conv_states)
            and referenced(ssm_refs, ssm_states))
    return addresses if same else None


def addresses_of(arrays: list[np.ndarray]) -> np.ndarray:
    """The data addresses of ``arrays`` as a ``uintp`` array."""
    return np.array([a.ctypes.data for a in arrays], dtype=np.uintp)


def decode_model(x: np.ndarray, conv_states: list[np.ndarray], ssm_states: list[np.ndarray], model: Plan,
                 threads: int | None = None) -> tuple[np.ndarray, list[np.ndarray], list[np.ndarray]] | None:
    """One token through the whole model of ``model`` (:func:`plan`) from the embedded ``x [1,
    d_model]`` float32 and each layer's ``conv_states[i] [1, conv_dim, d_conv]`` and ``ssm_states[i]
    [1, nheads, headdim, d_state]`` (contiguous float32, left untouched) on ``threads`` threads
    (default :func:`.threads.workers`): ``(logits [1, rows], new conv states, new ssm states)``;
    None where the kernels are off or not built. ValueError naming the array that does not fit."""
    lib = kernels.library()
    if lib is None:
        return None
    _float32(x, "x", (1, model.d_model))
    olds = made_addresses(conv_states, ssm_states, model.conv_shapes, model.ssm_shapes)
    if olds is None:
        layers = len(model.conv_shapes)
        for name, given in (("conv_states", conv_states), ("ssm_states", ssm_states)):
            if len(given) != layers:
                raise ValueError(f"decode_model: {name} must hold one array per layer ({layers}), got {len(given)}")
        for i in range(layers):
            _float32(conv_states[i], f"conv_states[{i}]", model.conv_shapes[i])
            _float32(ssm_states[i], f"ssm_states[{i}]", model.ssm_shapes[i])
        olds = np.stack([addresses_of(conv_states), addresses_of(ssm_states)], axis=1)  # [layers, 2]
    _check_threads(threads)
    new_convs, new_ssms, fresh = fresh_states(model.conv_shapes, model.ssm_shapes)
    logits = np.empty((1, model.vocab), dtype=np.float32)
    _call(lib, model, x.ctypes.data, logits.ctypes.data, np.concatenate([olds, fresh], axis=1), threads)
    return logits, new_convs, new_ssms


def _call(lib: Any, model: Plan, x: int, logits: int, states: np.ndarray, threads: int | None) -> None:
    """The library's step on ``model`` for the row at address ``x`` into ``logits``, ``states [layers,
    4]`` the addresses of each layer's conv state, ssm state, new conv state and new ssm state."""
    pointers = model.pointers.copy()
    pointers[0], pointers[4] = x, logits
    pointers[_slots(len(model.conv_shapes))] = states
    low, high = model.dt_limit
    lib.portable_ssm_decode_model(model.sizes.ctypes.data, pointers.ctypes.data, model.eps, low, high,
                                  default_threads(model) if threads is None else threads)


def default_threads(model: Plan) -> int:
    """:func:`.threads.workers`, but no more threads than the weights give each at least
    :data:`BYTES_PER_THREAD` to read: the step meets at three barriers a layer, and a small model's
    step split over threads waits at them longer than it reads (on a busy machine a thread
    preempted at a barrier stalls the others for a scheduler slice)."""
    return max(1, min(workers(), model.weight_bytes // BYTES_PER_THREAD))


def _slots(layers: int) -> np.ndarray:
    """The per-call pointers' places in the table: ``[layers, 4]``."""
    return np.add.outer(_HEAD_POINTERS + _LAYER_POINTERS * np.arange(layers), _STATE_SLOTS)


def _check_threads(threads: int | None) -> None:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"decode_model: threads must be a positive int or None, got {threads!r}")


def decode_rows_in_place(x: np.ndarray, conv_states: list[np.ndarray], ssm_states: list[np.ndarray],
                         rows: np.ndarray, model: Plan, threads: int | None = None) -> np.ndarray | None:
    """:func:`decode_model` for ``k`` rows one after another, each with its own state updated in
    place: ``x [k, d_model]`` and row ``rows[j]`` of every layer's ``conv_states[i] [N, conv_dim,
    d_conv]`` and ``ssm_states[i] [N, nheads, headdim, d_state]`` (contiguous float32; ``rows``
    integers in ``[0, N)``) -> ``logits [k, rows of the head]``, no state copied. None where the
    kernels are off or not built. ValueError naming what does not fit."""
    lib = kernels.library()
    if lib is None:
        return None
    k = x.shape[0] if isinstance(x, np.ndarray) and x.ndim == 2 else -1
    _float32(x, "x", (max(k, 0), model.d_model))
    layers = len(model.conv_shapes)
    for name, given in (("conv_states", conv_states), ("ssm_states", ssm_states)):
        if len(given) != layers:
            raise ValueError(f"decode_model: {name} must hold one array per layer ({layers}), got {len(given)}")
    batch = getattr(conv_states[0], "shape", (0,))[0] if layers else 0
    for i in range(layers):
        _float32(conv_states[i], f"conv_states[{i}]", (batch, *model.conv_shapes[i][1:]))
        _float32(ssm_states[i], f"ssm_states[{i}]", (batch, *model.ssm_shapes[i][1:]))
    rows = np.asarray(rows)
    if (rows.dtype == np.bool_ or not np.issubdtype(rows.dtype, np.integer) or rows.shape != (k,)
            or (k and (rows.min() < 0 or rows.max() >= batch))):
        raise ValueError(f"decode_model: rows must be {k} integers in [0, {batch}), got {rows.dtype} {rows.shape}")
    _check_threads(threads)
    logits = np.empty((k, model.vocab), dtype=np.float32)
    bases = np.array([[a.ctypes.data, b.ctypes.data] for a, b in zip(conv_states, ssm_states)], dtype=np.uintp)
    widths = np.array([[a[0].nbytes if batch else 0, b[0].nbytes if batch else 0]
                       for a, b in zip(conv_states, ssm_states)], dtype=np.uintp)
    for j, r in enumerate(rows.tolist()):
        here = bases + widths * np.uintp(r)  # [layers, 2]: the row's states, read and written in place
        _call(lib, model, x[j].ctypes.data, logits[j].ctypes.data, np.concatenate([here, here], axis=1), threads)
    return logits


class LastPlan:
    """``make(params, config)`` (a plan builder that raises ValueError for what it refuses),
    remembered for the params last asked about: ``{(config, names, ids of the values): (weak
    references to the values, the plan without its arrays, or None where refused)}`` (weak, so a
    model the caller drops is freed; a plan is used only while every value it was made from is
    alive: the first of them freed drops the entry). A refusal is remembered too: a model the step
    does not compute is not checked again per token."""

    def __init__(self, make: Any) -> None:
        self.make, self.known = make, {}

    def __call__(self, params: dict[str, Any], config: Any) -> Any:
        """The plan of ``params``, remembered (the same names and the same live objects); None where
        ``make`` refuses them."""
        key = (config, tuple(params), tuple(map(id, params.values())))
        known = self.known.get(key)
        if known is not None:  # every value it was made from alive: a freed one drops the entry
            return known[1]
        self.known.clear()
        try:
            made = self.make(params, config)
        except ValueError:
            made = None

        def forget(_: weakref.ref, known: dict[Any, Any] = self.known) -> None:
            known.pop(key, None)

        try:  # remembered without its arrays: the model's own references keep them alive while it is
            self.known[key] = ([weakref.ref(v, forget) for v in params.values()],
                               None if made is None else replace(made, arrays=()))
        except TypeError:  # a value without weak references: planned again next call
            pass
        return made


#: :func:`plan`, remembered for the params :func:`decode_model_hook` last stepped.
known_plan = LastPlan(plan)


def decode_model_hook(x: Any, state: Mamba2State, params: dict[str, Any],
                      config: Mamba2Config) -> tuple[np.ndarray, Mamba2State] | None:
    """The ``decode_model`` fast op: :func:`decode_model` for a float32 ``x [1, d_model]`` and the
    variant :func:`plan` takes, with the states made contiguous; None otherwise (the core's step
    runs) or where the kernels are off. Returns ``(logits [1, rows], new state)``."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.shape[0] != 1 or kernels.library() is None:
        return None
    model = known_plan(params, config)
    if model is None:
        return None
    contiguous = ((state.conv, state.ssm) if made_addresses(state.conv, state.ssm, model.conv_shapes, model.ssm_shapes)
                  is not None else [[np.ascontiguousarray(s) for s in states] for states in (state.conv, state.ssm)])
    try:
        out = decode_model(np.ascontiguousarray(x), *contiguous, model)
    except ValueError:
        return None
    if out is None:
        return None
    logits, convs, ssms = out
    return logits, Mamba2State(conv=tuple(convs), ssm=tuple(ssms))
