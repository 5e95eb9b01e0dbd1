"""Hand-written CPU kernels for the torch backend: batch-1 decode's one-row matrix products,
every decode step's state update, the conv and SiLU, the gated RMSNorm, and the chunked scan and
its backward.

A decode step of one row reads every weight once, so its time is the memory bandwidth's. torch's
own GEMV (MKL on some CPUs takes a generic path) and inductor's generated one (one accumulator
and a horizontal sum per weight row) read float32 weights at about 75% of a streaming read,
inductor's widening int8 loads are scalar, and fbgemm's int8 kernel also rounds the row to 8
bits. ``backends/cpu/torch_ops.cpp`` (:data:`SOURCE_FILE`) holds small C++ kernels instead:

* ``row_gemv``: ``row [1, in] @ weight.T -> [1, out]`` in float32 for a float32, int8 (times a
  float32 scale per output row: weight-only, the row stays float32) or bfloat16 weight, four FMA
  accumulators per weight row; a float32 weight eight rows at a time instead, one accumulator
  each, every load of the row feeding all eight; the rows split over torch's intra-op threads, each
  thread prefetching the weights ahead of its loads (4 KiB; 1 KiB on each of the eight float32
  rows: the hardware prefetchers stop at every 4 KiB page);
* ``decode_step``: one layer's step after in_proj (:func:`portable_ssm.mixer.decode_step_ref`:
  conv, SiLU, Δ, state update, ``H @ C``, D skip and gate) for float32 tensors of any batch, the
  heads split over the threads, each new state row multiplied by C as it is written and streamed
  to memory past the caches (eager torch otherwise makes about twenty passes over the state and its
  temporaries; inductor's fused loops in a compiled step come close to the kernel);
* ``decode_model``: the whole batch-1 step of a language model with the pieces of the two above
  and of the norm kernel below, in one call and one parallel region: the threads meet at three
  barriers a layer, with no ATen op, dispatch or allocation between the layers' kernels, where a
  call of each kernel forked and joined the threads four times a layer (with float32 weights
  eight rows at a time, a 130m LM's step 1.09x faster for float32 weights, 1.14x for int8, 1.12x
  for bfloat16 on a 2-core VM, ``decode_model_ab.py --against 0e92e50``);
* ``conv_silu`` and ``conv_silu_backward``: a forward's causal depthwise conv and SiLU for
  float32 tensors in one pass, x read in place from in_proj's output, and its gradients in one
  more (the pre-activations recomputed), the steps (forward) or channels (backward) split over
  the threads (autograd of the array-API conv makes about fifteen passes over ``[b, l, conv_dim]``
  tensors, zero-filled and concatenated ones among them; torch's depthwise conv1d needs the
  channels-first copy of x with its history in front);
* ``gated_rms_norm`` and ``gated_rms_norm_backward``: ``weight ⊙ rmsnorm(y ⊙ silu(z))`` per group
  (the layer's norm without the gate too) for float32 tensors in one pass over each row, z read
  in place from in_proj's output, and its gradients in one more (the gate and the scales
  recomputed), the rows split over the threads (``F.silu``, ``F.rms_norm`` and their autograd make
  about a dozen passes over ``[b, l, d_inner]`` tensors: a 130m layer's training step at l=2048 took
  1.08x as long with them, ``benchmarks/train_kernels_ab.py --only-norm``);
* ``scan_forward``: the chunked scan of float32 tensors (inference, prompts and the training scan
  op's forward): NumPy's native chunk loop in one C++ pass per block of heads of a group, the
  blocks split over the threads, each chunk's products one matrix product each for the block
  (NumPy's loop makes about twenty passes over each chunk's ``[heads, Q, Q]`` decays and its
  temporaries: 26 against 11 ms for a 130m layer's scan at l=2048 on 2 threads);
* ``scan_backward``: the training scan op's backward for float32 tensors
  (:func:`portable_ssm.backends.torch_scan.ssd_chunked_grad`'s steps) in one C++ pass per block of
  heads, as the forward's: the entering states recomputed, then the chunks from last to first, each
  chunk's products one matrix product each for the block, each head's ``[q, q]`` decays of the
  diagonal block exponentiated once with every product and sum over them in the same pass (the
  torch ops take about fifty ops per chunk, each a pass over a ``[heads, q, p]``, ``[heads, q, n]``
  or smaller temporary: a 130m layer's training step at l=2048 took 1.14x as long with them,
  ``benchmarks/train_kernels_ab.py --only-scan-backward``).

``python benchmarks/decode_model_ab.py --against REV`` times the whole-model step against the
kernels of an earlier revision, alternating in one process. On a 2-core AVX-512 VM, the prefetches
and the streamed state took a 130m LM's step from 30.5 to 26.0 ms for float32 weights, 15.0 to 11.0
for int8 and 23.3 to 16.5 for bfloat16 (``--against 74cc866``, the kernels without them).

They are compiled from that file (and the ``shared.h`` it includes) on first use with
``torch.utils.cpp_extension.load`` (the C++ compiler ``torch.compile`` needs on CPU anyway, and
ninja; about a minute, once: the build is cached in torch's extensions folder under a name that
:func:`.cpu_source.source_key` derives from every source file and the flags) and registered as ops
of the ``portable_ssm_cpu`` namespace (``portable_ssm_cpu::row_gemv`` etc.), which compiled graphs
call as they call any torch op. They are used only where they can be: an x86-64 CPU with AVX2 and
FMA (as torch reports its CPU capability) and ``PORTABLE_SSM_CPU_KERNELS`` not ``0``. Where the
build fails, one warning says why and torch's kernels, the array-API step and the backward's torch
ops stay; nothing else changes."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import sys
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import torch

from portable_ssm import ssd

from .cpu_source import ENV, head_block, simd_flags, source_key, source_path
from .kernel_cache import damage, record

#: The ops' C++ source under :data:`.cpu_source.SOURCE_DIR` (it includes ``shared.h``).
SOURCE_FILE = "torch_ops.cpp"

#: The compiler's flags: AVX2 and FMA code (the avx512 build where ``PORTABLE_SSM_CPU_ISA`` asks for
#: it at import, :func:`.cpu_source.isa`); OpenMP, so ``at::parallel_for`` splits the rows over
#: torch's threads (the symbols resolve to the OpenMP runtime torch has loaded; none is linked).
CFLAGS = (*simd_flags(), "-fopenmp")
#: Weight dtypes the kernel reads.
WEIGHT_DTYPES = (torch.float32, torch.int8, torch.bfloat16)


@lru_cache(maxsize=1)
def _cpu_has_avx2() -> bool:
    """Whether this is an x86-64 CPU on which torch runs AVX2 (or AVX512) code (fixed per process)."""
    machine = platform.machine().lower()
    return machine in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def enabled() -> bool:
    """Whether the kernels may be used here: not turned off by :data:`ENV`, an x86-64 CPU with AVX2."""
    return os.environ.get(ENV, "").strip() != "0" and _cpu_has_avx2()


_BUILT: list[bool] = []  # empty until the first build attempt, then whether it loaded
_ACTIVE = [False]  # whether the kernel is loaded and enabled, as ensure() last found


def build_folder(name: str) -> Path | None:
    """The folder torch's ``cpp_extension`` builds extension ``name`` in (None where this torch's
    private helper for it is gone)."""
    from torch.utils import cpp_extension

    try:
        return Path(cpp_extension._get_build_directory(name, verbose=False))
    except (AttributeError, TypeError, OSError):
        return None


def _drop_if_damaged(library: Path) -> None:
    """Removes torch's build of the ops where it is not whole (:func:`.kernel_cache.damage`, against the
    record written after it was built), with one warning naming it, so ninja links it again: torch
    rebuilds by timestamps only and would ``dlopen`` a truncated file (SIGBUS at the first call)."""
    if not os.path.lexists(library):
        return
    reason = damage(library)
    if reason is not None:
        library.unlink()  # a folder here: OSError, the build's one warning
        warnings.warn(f"portable_ssm: torch's cached CPU kernel library {library} was damaged ({reason}); it is "
                      "built again", RuntimeWarning, stacklevel=5)


def _build() -> bool:
    """Compile and load :data:`SOURCE_FILE` (True), or warn why it could not be (False)."""
    from torch.utils import cpp_extension

    try:
        name = "portable_ssm_cpu_" + source_key(*CFLAGS)
        folder = build_folder(name)
        library = None if folder is None else folder / f"{name}.so"
        if library is not None:
            _drop_if_damaged(library)
        if library is None or not library.is_file():
            print(f"portable_ssm: building torch's CPU kernels (once, about a minute) into {folder or name}",
                  file=sys.stderr, flush=True)
        cpp_extension.load(name, sources=[str(source_path(SOURCE_FILE))], extra_cflags=list(CFLAGS),
                           is_python_module=False, verbose=False)
        if library is not None and damage(library) is not None:  # just built: record it as it is
            with contextlib.suppress(OSError):  # not recorded: the next process builds it again
                library.chmod(library.stat().st_mode & 0o755)  # the linker's umask may leave it group-writable
                record(library)
    except Exception as error:  # no compiler or ninja, or a failed build: torch's kernels stay
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warnings.warn(f"portable_ssm: the CPU decode kernels could not be built ({first_line}); decode uses "
                      f"torch's own kernels (set {ENV}=0 to skip the attempt)", RuntimeWarning, stacklevel=4)
        return False
    torch.library.register_fake("portable_ssm_cpu::row_gemv")(_row_gemv_shape)
    torch.library.register_fake("portable_ssm_cpu::decode_step")(_decode_step_shapes)
    torch.library.register_fake("portable_ssm_cpu::decode_model")(_decode_model_shapes)
    torch.library.register_fake("portable_ssm_cpu::scan_forward")(_scan_forward_shapes)
    torch.library.register_fake("portable_ssm_cpu::scan_backward")(_scan_backward_shapes)
    torch.library.register_fake("portable_ssm_cpu::conv_silu")(lambda x, *rest: x.new_empty(x.shape))
    torch.library.register_fake("portable_ssm_cpu::conv_silu_backward")(_conv_silu_backward_shapes)
    torch.library.register_fake("portable_ssm_cpu::gated_rms_norm")(lambda y, *rest: y.new_empty(y.shape))
    torch.library.register_fake("portable_ssm_cpu::gated_rms_norm_backward")(gated_rms_norm_backward_shapes)
    return True


def _row_gemv_shape(row: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return row.new_empty((1, weight.shape[0]))


def _decode_step_shapes(xBC: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return z.new_empty(z.shape), conv_state.new_empty(conv_state.shape), ssm_state.new_empty(ssm_state.shape)


def _decode_model_shapes(x: torch.Tensor, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor],
                         *rest: Any) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    head = rest[ModelWeights._fields.index("head")]  # rest: the weights' fields, then the scalars
    return (x.new_empty((1, head.shape[0])), [c.new_empty(c.shape) for c in conv_states],
            [h.new_empty(h.shape) for h in ssm_states])


def _scan_forward_shapes(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                         *rest: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    b, _, h, p = x.shape
    return (x.new_empty(x.shape), x.new_empty((b, h, p, B.shape[-1])), x.new_empty((), dtype=torch.float64))


def _scan_backward_shapes(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                          D: torch.Tensor | None, initial_states: torch.Tensor | None, dy: torch.Tensor,
                          dfinal: torch.Tensor, chunk: int, floor: float, block: int) -> tuple[torch.Tensor, ...]:
    return (x.new_empty(x.shape), dt.new_empty(dt.shape), A.new_empty(A.shape), B.new_empty(B.shape),
            C.new_empty(C.shape), x.new_empty((0,)) if D is None else D.new_empty(D.shape),
            x.new_empty((0,)) if initial_states is None else initial_states.new_empty(initial_states.shape))


def _conv_silu_backward_shapes(dy: torch.Tensor, x: torch.Tensor, taps: torch.Tensor, bias: torch.Tensor | None,
                               history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (x.new_empty(x.shape), taps.new_empty(taps.shape), x.new_empty((x.shape[-1],)),
            history.new_empty(history.shape))


def gated_rms_norm_backward_shapes(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None,
                                   weight: torch.Tensor, groups: int,
                                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The shapes :func:`gated_rms_norm_backward` returns (its op's and ``portable_ssm::gated_rms_norm_backward``'s
    fake): ``(dy, dz, d weight)``, dz empty without z."""
    return y.new_empty(y.shape), y.new_empty(y.shape if z is not None else (0,)), weight.new_empty(weight.shape)


def ensure() -> bool:
    """Whether the kernels may be used now, building them first (once per process) if that was not
    tried yet; call it outside ``torch.compile`` tracing (generation's compiler does, before tracing)."""
    usable = enabled()
    if usable and not _BUILT:
        _BUILT.append(_build())
    _ACTIVE[0] = usable and _BUILT[0]
    return _ACTIVE[0]


def ready() -> bool:
    """Whether the kernel was found usable by the last :func:`ensure` (never builds; a graph being
    traced reads this flag)."""
    return _ACTIVE[0]


def row_product(row: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``row [1, in] @ weight.T -> [1, out]`` in float32 (each output times ``scale [out]`` when given)."""
    return torch.ops.portable_ssm_cpu.row_gemv(row, weight, scale)


#: The dtype every tensor of the fused decode step must have.
DECODE_DTYPE = torch.float32


def decode_step(xBC: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, dt_limit: tuple[float, float],
                ngroups: int, headdim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`portable_ssm.mixer.decode_step_ref` (which documents the arguments) in one pass over
    the state for float32 CPU tensors: the state is read once and written once, each new row
    multiplied by C as it is written (the array-API step reads it a second time for C). Returns
    ``(y [b, h·p], new_conv_state, new_ssm_state)``; the inputs are left untouched."""
    low, high = dt_limit
    return torch.ops.portable_ssm_cpu.decode_step(
        xBC.contiguous(), dt.contiguous(), z.contiguous(), conv_state.contiguous(), ssm_state.contiguous(),
        conv_weight.contiguous(), None if conv_bias is None else conv_bias.contiguous(), dt_bias.contiguous(),
        A.contiguous(), D.contiguous(), float(low), float(high), ngroups, headdim)


#: Heads of one group a work item of :func:`scan_forward` takes at most: its state ``[n, block·p]``
#: and its diagonal blocks stay in L2 (as NumPy's ``SCAN_HEAD_BLOCK``).
SCAN_HEAD_BLOCK = 12


def _packed_rows(t: torch.Tensor) -> torch.Tensor:
    """``t [b, l, m, k]`` as :func:`scan_forward` reads it: itself where each step's ``[m, k]`` is
    contiguous (a slice of the conv's output, read in place), else a contiguous copy."""
    packed = t.numel() == 0 or (t.stride(-1) == 1 and (t.shape[-2] == 1 or t.stride(-2) == t.shape[-1]))
    return t if packed else t.contiguous()


def _head_block(b: int, g: int, h: int) -> int:
    """Heads per work item of the scan kernels (at most SCAN_HEAD_BLOCK of one group): as many
    items per group as give every thread one."""
    return head_block(b, g, h, torch.get_num_threads(), SCAN_HEAD_BLOCK)


def scan_forward(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                 D: torch.Tensor | None, initial_states: torch.Tensor | None,
                 chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked scan ``(y [b, l, h, p], final state [b, h, p, n])`` of float32 CPU tensors shaped
    as ``portable_ssm.ssd.ssd_chunked_ref``'s (Δ already discretized, no ``seq_idx``; D ``[h]``,
    ``[h, p]`` or None), in chunks of ``chunk_size``: NumPy's native loop
    (``portable_ssm.backends.numpy.ops.ssd_chunked``) in one C++ pass per block of at most
    SCAN_HEAD_BLOCK heads, the blocks split over torch's threads, each chunk's products one matrix
    product each for the block. A non-finite output (a non-finite input) runs the kernel again with
    masked products, which keep it from the outputs before its step (as NumPy's loop and the
    reference do): those equal a clean input's bit for bit."""
    args = (_packed_rows(x), dt.contiguous(), A.contiguous(), _packed_rows(B), _packed_rows(C),
            None if D is None else D.contiguous(), None if initial_states is None else initial_states.contiguous(),
            chunk_size, ssd.decay_floor(torch.float32, xp=torch), _head_block(x.shape[0], B.shape[2], x.shape[2]))
    y, final, check = torch.ops.portable_ssm_cpu.scan_forward(*args, False)
    if not math.isfinite(float(check)):  # a non-finite input: again, keeping it from the steps before it
        y, final, _ = torch.ops.portable_ssm_cpu.scan_forward(*args, True)
    return y, final


def scan_backward(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  D: torch.Tensor | None, initial_states: torch.Tensor | None, dy: torch.Tensor, dfinal: torch.Tensor,
                  chunk_size: int) -> tuple[torch.Tensor | None, ...]:
    """The gradients ``(dx, dΔ, dA, dB, dC, dD, d initial_states)`` (None for an absent D or
    initial state) of ``sum(dy·y) + sum(dfinal·final)`` for :func:`scan_forward`'s scan of float32
    CPU tensors, in chunks of ``chunk_size`` (:func:`portable_ssm.backends.torch_scan.ssd_chunked_grad`
    computes the same in torch ops and documents it): one C++ pass per block of heads, as the
    forward's, the entering states recomputed first. A non-finite input or incoming gradient gives
    non-finite gradients (the caller tells by their sums)."""
    args = (_packed_rows(x), dt.contiguous(), A.contiguous(), _packed_rows(B), _packed_rows(C),
            None if D is None else D.contiguous(), None if initial_states is None else initial_states.contiguous(),
            dy.contiguous(), dfinal.contiguous(), chunk_size, ssd.decay_floor(torch.float32, xp=torch),
            _head_block(x.shape[0], B.shape[2], x.shape[2]))
    dx, ddt, dA, dB, dC, dD, d_initial = torch.ops.portable_ssm_cpu.scan_backward(*args)
    return dx, ddt, dA, dB, dC, None if D is None else dD, None if initial_states is None else d_initial


def _steps_apart(x: torch.Tensor) -> torch.Tensor:
    """``x [b, l, d]`` as the conv kernels read it: itself where its channels are contiguous and its
    steps and rows do not overlap (a slice of in_proj's output, read in place), else a copy."""
    b, l, d = x.shape
    if x.stride(2) == 1 and x.stride(1) >= d and x.stride(0) >= l * x.stride(1):
        return x
    return x.contiguous()


def conv_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              history: torch.Tensor) -> torch.Tensor:
    """``silu(causal depthwise conv)`` of ``x [b, l, d]`` with ``weight [d, k]``, ``bias [d]`` or
    None, and the ``k-1`` inputs before it, ``history [b, k-1, d]``, all float32: ``y [b, l, d]``
    (``portable_ssm.conv.causal_conv1d_silu``'s output), eight channels per vector; x is read in
    place where its channels are contiguous (:func:`_steps_apart`)."""
    return torch.ops.portable_ssm_cpu.conv_silu(_steps_apart(x), weight.t().contiguous(),
                                                None if bias is None else bias.contiguous(), history.contiguous())


def conv_silu_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       history: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``(dx, d weight [d, k], d bias [d], d history)`` of ``sum(dy · conv_silu(x,
    weight, bias, history))``, the pre-activations recomputed; the channels split over the threads."""
    dx, dtaps, dbias, dhistory = torch.ops.portable_ssm_cpu.conv_silu_backward(
        dy.contiguous(), _steps_apart(x), weight.t().contiguous(), None if bias is None else bias.contiguous(),
        history.contiguous())
    return dx, dtaps.t().contiguous(), dbias, dhistory


def _rows_apart(t: torch.Tensor) -> torch.Tensor:
    """``t [..., d]`` as the norm kernels read it, ``[rows, d]``: a view where its leading axes merge
    and its channels are contiguous with the rows apart (a slice of in_proj's output, read in
    place), else a contiguous copy."""
    rows = t.reshape(-1, t.shape[-1])  # [..., d] -> [rows, d]
    if rows.stride(-1) == 1 and (rows.shape[0] <= 1 or rows.stride(0) >= rows.shape[1]):
        return rows
    return rows.contiguous()


def gated_rms_norm(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, groups: int,
                   eps: float) -> torch.Tensor:
    """``weight ⊙ rmsnorm(y ⊙ silu(z))`` over each of ``groups`` equal slices of the last axis
    (``portable_ssm.norm.gated_rms_norm_ref``; ``z=None``: no gate) for float32 ``y, z [..., d]`` and
    ``weight [d]``, one pass over each row; ``[..., d]`` float32. y and z are read in place where
    their rows merge into evenly spaced ones (:func:`_rows_apart`)."""
    out = torch.ops.portable_ssm_cpu.gated_rms_norm(_rows_apart(y), None if z is None else _rows_apart(z),
                                                    weight.contiguous(), groups, float(eps))
    return out.view(y.shape)


def gated_rms_norm_backward(dout: torch.Tensor, y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor,
                            groups: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients ``(dy, dz, d weight)`` of ``sum(dout · gated_rms_norm(y, z, weight, groups,
    eps))`` (dz empty without z), the gate and the scales recomputed; the rows split over the threads."""
    dy, dz, dweight = torch.ops.portable_ssm_cpu.gated_rms_norm_backward(
        _rows_apart(dout), _rows_apart(y), None if z is None else _rows_apart(z), weight.contiguous(), groups,
        float(eps))
    return dy.view(y.shape), dz if z is None else dz.view(z.shape), dweight


class ModelWeights(NamedTuple):
    """A language model's tensors as :func:`decode_model` reads them, one entry per layer in each
    list (``in_scales`` / ``out_scales``: int8 row scales or None; ``conv_biases``: None without)."""

    norms: list[torch.Tensor]
    in_weights: list[torch.Tensor]
    in_scales: list[torch.Tensor | None]
    conv_weights: list[torch.Tensor]
    conv_biases: list[torch.Tensor | None]
    dt_biases: list[torch.Tensor]
    A_logs: list[torch.Tensor]
    Ds: list[torch.Tensor]
    gate_norms: list[torch.Tensor]
    out_weights: list[torch.Tensor]
    out_scales: list[torch.Tensor | None]
    norm_f: torch.Tensor
    head: torch.Tensor
    head_scale: torch.Tensor | None


def decode_model(x: torch.Tensor, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor],
                 weights: ModelWeights, eps: float, dt_limit: tuple[float, float], ngroups: int,
                 headdim: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One decode step of a whole language model at batch 1 in one call: :func:`portable_ssm.lm.decode`
    after the embedding (each layer's norm, in_proj, :func:`decode_step`, gated norm, out_proj and
    residual, then norm_f and the head, the products ``row_gemv``'s), for ``x [1, d_model]``
    float32 and contiguous float32 tensors (the weights also int8 with row scales or bfloat16). The
    variant it computes: in_proj's output ``[z, xBC, dt]`` (no gated MLP), no projection biases, the
    gated norm after the gate. Returns ``(logits [1, rows], new conv states, new ssm states)``; the
    inputs are left untouched."""
    low, high = dt_limit
    return torch.ops.portable_ssm_cpu.decode_model(x, conv_states, ssm_states, *weights, float(eps), float(low),
                                                   float(high), ngroups, headdim)
