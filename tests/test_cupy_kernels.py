"""The CuPy kernels (``portable_ssm.backends.cupy``) against their array-API twins.

Every kernel test runs on two runtimes: ``cupy``, the real kernels through ``cupy.RawModule`` on a GPU
(skipped without cupy or a GPU), and ``host``, the same ``.cu`` sources compiled for the CPU and run
on NumPy arrays by ``test_cuda_sources.HostEmulator`` (skipped without a C++20 host compiler). The
host runs prove the kernels' index math, masks, conversions and launch sizes; only the GPU runs prove
NVRTC, warp behaviour and cuBLAS, and none has run yet (no GPU was available).

The scan kernels also pass test_hostile_numerics' checks through ``ps.ssd_scan`` (its helpers, its
thresholds): extreme Δ within 10x the float32 recurrence's error and 1e-10 in float64, and non-finite
input never reaching an earlier output.

Outputs and scratch are allocated filled with NaN, so an element a kernel forgets to write fails;
each case draws fresh random data; sizes are odd (l not a multiple of the chunk, p and n not
multiples of a warp, h spread over groups). Tolerances (max error / max |expected|): float64 1e-10,
float32 1e-5, float16 and bfloat16 1e-2.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from conftest import Backend, rel_err
from hypothesis import given
from test_cuda_sources import host_emulator, host_toolchain_problem, import_without_cupy
from test_hostile_numerics import (
    Scan,
    causality_cases,
    check_float32_extreme,
    check_float64_extreme,
    check_one_huge_step,
    check_scan_causality,
    float32_extremes,
    float64_extremes,
    poisoned,
    quiet,
)
from test_hostile_packed import SETTINGS as PACKED_SETTINGS
from test_hostile_packed import check_packed_scan, packed_poisonings

import portable_ssm as ps
from portable_ssm import ssd as core_ssd
from portable_ssm.config import Mamba2Config
from portable_ssm.params import init_params
from portable_ssm.recurrence import selective_scan

ops = import_without_cupy("ops")
reference = import_without_cupy("reference")

TOL = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
STORAGE = ("float32", "float64", "float16", "bfloat16")


def _poisoned_empty(cp: Any) -> Any:
    """``empty(shape, dtype)`` filled with NaN (bfloat16 NaN bits for 16-bit integers, -1 for ids)."""
    def empty(shape: tuple[int, ...], dtype: Any) -> Any:
        dtype = np.dtype(dtype)
        fill = np.nan if dtype.kind == "f" else 0x7FC0 if dtype.itemsize == 2 else -1
        return cp.full(shape, fill, dtype=dtype)

    return empty


@dataclass
class Runtime:
    """Where the kernels run: ``cp`` (numpy or cupy) holds the arrays, ``xp`` is the namespace the
    references run in, ``kernels`` the KernelSet with poisoned allocations."""

    name: str
    cp: Any
    xp: Any
    kernels: Any

    def put(self, host: np.ndarray) -> Any:
        return self.cp.asarray(host)

    def get(self, a: Any) -> np.ndarray:
        return np.asarray(a) if self.cp is np else self.cp.asnumpy(a)


#: Plain host arrays, for building inputs that tests then move to torch.
HOST = Runtime("numpy", np, None, None)


def _cupy_runtime() -> Runtime:
    cupy = pytest.importorskip("cupy", reason="cupy: not installed (needs an NVIDIA GPU)")
    if not cupy.cuda.is_available():
        pytest.skip("cupy: cupy.cuda.is_available() is False (no GPU)")
    import array_api_compat.cupy as xp
    from portable_ssm.backends import cupy as backend

    return Runtime("cupy", cupy, xp, ops.KernelSet(cupy, backend.LAUNCH, empty=_poisoned_empty(cupy)))


@pytest.fixture(params=["host", "cupy"], scope="module")
def rt(request: pytest.FixtureRequest) -> Runtime:
    if request.param == "cupy":
        return _cupy_runtime()
    problem = host_toolchain_problem()
    if problem:
        pytest.skip(f"host emulation: {problem}")
    import array_api_compat.numpy as xp

    return Runtime("host", np, xp, ops.KernelSet(np, host_emulator(), empty=_poisoned_empty(np)))


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Fresh random data for every test case."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def _bf16_bits(values: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bits (uint16), rounded by torch: an oracle independent of the kernels."""
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16).view(torch.int16) \
        .numpy().view(np.uint16)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _store(rt: Runtime, values: np.ndarray, dtype: str) -> tuple[Any, Any]:
    """``(kernel input, reference input)``: both hold the same numbers; for bfloat16 the kernel gets
    the bits and the reference float32 (cupy and numpy have no bfloat16)."""
    if dtype == "bfloat16":
        bits = _bf16_bits(values)
        return rt.put(bits), rt.put(_bf16_values(bits))
    stored = rt.put(values.astype(dtype))
    return stored, stored


def _values(rt: Runtime, a: Any, dtype: str) -> np.ndarray:
    """The values of a kernel output as float64 on the host (NaNs stay NaN)."""
    host = rt.get(a)
    with np.errstate(invalid="ignore"):
        return (_bf16_values(host) if dtype == "bfloat16" else host).astype(np.float64)


def _assert_close(rt: Runtime, actual: Any, expected: Any, dtype: str, *, like: Any) -> None:
    """``actual`` has ``like``'s array type, dtype and ``expected``'s shape, and is within TOL[dtype]."""
    assert type(actual) is type(like), f"result is a {type(actual).__name__}"
    assert actual.dtype == like.dtype, f"dtype {actual.dtype} != {like.dtype}"
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    err = rel_err(_values(rt, actual, dtype), rt.get(expected))
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]:.3g}"


def _packed_ids(rng: np.random.Generator, b: int, l: int) -> np.ndarray:
    """Non-decreasing ids per row with a few boundaries (length-1 sequences possible), int32."""
    starts = rng.random((b, l)) < 0.15
    starts[:, 0] = False
    return (np.cumsum(starts, axis=1) + rng.integers(0, 3, (b, 1))).astype(np.int32)


# --- causal conv1d ------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["plain", "state+bias", "packed"])
@pytest.mark.parametrize("dtype", STORAGE)
def test_causal_conv1d_kernel_equals_the_reference(rt: Runtime, dtype: str, variant: str,
                                                   rng: np.random.Generator) -> None:
    b, l, d, k = 2, 13, 37, 4
    x, x_ref = _store(rt, rng.standard_normal((b, l, d)), dtype)
    state, state_ref = (None, None) if variant == "plain" else _store(rt, rng.standard_normal((b, d, k)),
                                                                      dtype)
    weight = rt.put(rng.standard_normal((d, k)).astype(np.float32))
    bias = rt.put(rng.standard_normal(d).astype(np.float32)) if variant != "plain" else None
    seq = rt.put(_packed_ids(rng, b, l)) if variant == "packed" else None
    y, new_state = rt.kernels.causal_conv1d(x, weight, bias, state, seq)
    y_ref, state_ref = reference.causal_conv1d_ref(x_ref, weight, bias, state_ref, xp=rt.xp, seq_idx=seq)
    _assert_close(rt, y, y_ref, dtype, like=x)
    _assert_close(rt, new_state, state_ref, dtype, like=x)


def _all_patterns(rt: Runtime, dtype: str) -> tuple[Any, np.ndarray]:
    """Every 16-bit pattern as a float16 (or bfloat16 bits) array ``[1, 256, 256]``, and its values."""
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(1, 256, 256)
    if dtype == "float16":
        return rt.put(bits.view(np.float16)), bits.view(np.float16).astype(np.float32)
    return rt.put(bits), _bf16_values(bits)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_loads_are_exact_for_every_pattern(rt: Runtime, dtype: str) -> None:
    """A k=1 conv with weight 1 returns every finite 16-bit value unchanged, NaN as NaN."""
    x, values = _all_patterns(rt, dtype)
    y, _ = rt.kernels.causal_conv1d(x, rt.put(np.ones((256, 1), np.float32)), None, None)
    with np.errstate(invalid="ignore"):  # signalling NaN patterns
        np.testing.assert_array_equal(_values(rt, y, dtype), values.astype(np.float64))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_stores_round_to_nearest_even_like_numpy_and_torch(rt: Runtime, dtype: str,
                                                                         rng: np.random.Generator) -> None:
    """A k=1 conv of ones with float32 weights stores each weight rounded once: checked on every
    midpoint between neighbouring 16-bit values (the ties), on random float32 bit patterns (inf and NaN
    included) and on values around the subnormal and overflow thresholds."""
    _, values = _all_patterns(rt, dtype)
    grid = np.sort(values[np.isfinite(values)].ravel())
    midpoints = (grid[:-1] + (grid[1:] - grid[:-1]) / 2).astype(np.float32)  # exact in float32
    random_bits = rng.integers(0, 1 << 32, 1 << 15, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.float32([65504, 65519.99, 65520, 65536, 6.1e-5, 6.0e-8, 2.98e-8, 2.9e-8, 3.39e38, 3.4e38, 0.0])
    nans = np.uint32([0x7F800001, 0x7F800100, 0x7FC00000, 0x7FFFFFFF]).view(np.float32)  # low payloads too
    w = np.concatenate([midpoints, -midpoints, random_bits, edges, -edges, nans, -nans])
    x = _store(rt, np.ones((1, 1, w.size)), dtype)[0]
    y, _ = rt.kernels.causal_conv1d(x, rt.put(w[:, None]), None, None)
    with np.errstate(over="ignore", invalid="ignore"):
        want = w.astype(np.float16).astype(np.float32) if dtype == "float16" else _bf16_values(_bf16_bits(w))
        np.testing.assert_array_equal(_values(rt, y, dtype)[0, 0], want.astype(np.float64))


# --- decode step --------------------------------------------------------------------------------

def _decode_args(rt: Runtime, rng: np.random.Generator, dtype: str, *, per_channel_D: bool,
                 limited: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Random decode arguments for the kernel and the reference: b=3, h=6 over g=2 groups, p=5 and
    n=37 (neither a multiple of the 4 warps / 32 lanes), k=4."""
    b, h, g, p, n, k = 3, 6, 2, 5, 37, 4
    conv_dim = h * p + 2 * g * n
    cdtype = np.float64 if dtype == "float64" else np.float32
    kernel, ref = {}, {}
    for name, shape in (("xBC", (b, conv_dim)), ("dt", (b, h)), ("z", (b, h * p)),
                        ("conv_state", (b, conv_dim, k))):
        kernel[name], ref[name] = _store(rt, rng.standard_normal(shape), dtype)
    shared = {
        "ssm_state": rng.standard_normal((b, h, p, n)).astype(cdtype),
        "conv_weight": rng.standard_normal((conv_dim, k)).astype(np.float32),
        "conv_bias": None if limited else rng.standard_normal(conv_dim).astype(np.float32),
        "dt_bias": rng.standard_normal(h).astype(np.float32),
        "A": -np.exp(rng.standard_normal(h)).astype(cdtype),
        "D": rng.standard_normal((h, p) if per_channel_D else (h,)).astype(np.float32),
    }
    for name, value in shared.items():
        kernel[name] = ref[name] = None if value is None else rt.put(value)
    for args in (kernel, ref):
        args.update(dt_limit=(0.05, 1.5) if limited else (0.0, math.inf), ngroups=g, headdim=p)
    return kernel, ref


@pytest.mark.parametrize(("per_channel_D", "limited"), [(False, False), (True, True)])
@pytest.mark.parametrize("dtype", STORAGE)
def test_decode_step_kernel_equals_the_reference(rt: Runtime, dtype: str, per_channel_D: bool, limited: bool,
                                                 rng: np.random.Generator) -> None:
    kernel_args, ref_args = _decode_args(rt, rng, dtype, per_channel_D=per_channel_D, limited=limited)
    y, conv_state, ssm_state = rt.kernels.decode_step(**kernel_args)
    y_ref, conv_ref, ssm_ref = reference.decode_step_ref(**ref_args)
    _assert_close(rt, y, y_ref, dtype, like=kernel_args["xBC"])
    _assert_close(rt, conv_state, conv_ref, dtype, like=kernel_args["conv_state"])
    _assert_close(rt, ssm_state, ssm_ref, "float64" if dtype == "float64" else "float32",
                  like=kernel_args["ssm_state"])


def test_decode_reference_is_the_ssm_part_of_mixer_step(rng: np.random.Generator) -> None:
    """decode_step_ref, then the grouped RMSNorm (gate already applied) and out_proj, is mixer_step."""
    import array_api_compat.numpy as xp

    from portable_ssm.mixer import mixer_step

    c = Mamba2Config(d_model=12, d_state=5, headdim=4, ngroups=2, D_has_hdim=True, dt_limit=(0.01, 3.0))
    params = init_params(c, seed=int(rng.integers(1000)), dtype="float64")
    p = {name.removeprefix("layers.0.mixer."): v for name, v in params.items() if ".mixer." in name}
    b = 3
    u = rng.standard_normal((b, c.d_model))
    conv_state = rng.standard_normal((b, c.conv_dim, c.d_conv))
    ssm_state = rng.standard_normal((b, c.nheads, c.headdim, c.d_state))
    out, conv_want, ssm_want = mixer_step(u, p, c, conv_state, ssm_state, xp=xp)

    zxbcdt = (p["in_proj.weight"] @ u.T).T  # [b, d_in_proj] = [z, xBC, dt], as mixer_step's decode matmul
    z, xBC, dt = np.split(zxbcdt, [c.d_inner, c.d_inner + c.conv_dim], axis=-1)
    y, conv_state, ssm_state = reference.decode_step_ref(
        xBC, dt, z, conv_state, ssm_state, p["conv1d.weight"].reshape(c.conv_dim, c.d_conv), p["conv1d.bias"],
        p["dt_bias"], -np.exp(p["A_log"]), p["D"], c.dt_limit, c.ngroups, c.headdim)
    v = y.reshape(b, c.ngroups, -1)  # [b, d_inner] -> [b, g, d_inner/g]
    v = (v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + c.norm_eps)).reshape(b, c.d_inner)
    assert rel_err(v * p["norm.weight"] @ p["out_proj.weight"].T, out) <= 1e-12
    assert rel_err(conv_state, conv_want) == 0.0
    assert rel_err(ssm_state, ssm_want) <= 1e-12


# --- chunked scan -------------------------------------------------------------------------------

def _scan_args(rt: Runtime, rng: np.random.Generator, dtype: str, *, l: int = 45, initial: bool,
               packed: bool) -> dict[str, Any]:
    """Random scan inputs (Δ > 0, A < 0): b=2, h=6 over g=3 groups, p=5, n=7."""
    b, h, g, p, n = 2, 6, 3, 5, 7
    put = {name: rng.standard_normal(shape) for name, shape in
           (("x", (b, l, h, p)), ("B", (b, l, g, n)), ("C", (b, l, g, n)))}
    put["dt"] = np.exp(rng.standard_normal((b, l, h)) - 1.0)
    put["A"] = -np.exp(rng.standard_normal(h))
    put["initial_states"] = rng.standard_normal((b, h, p, n)) if initial else None
    args = {name: None if v is None else rt.put(v.astype(dtype)) for name, v in put.items()}
    args["seq_idx"] = rt.put(_packed_ids(rng, b, l)) if packed else None
    return args


@pytest.mark.parametrize(("chunk_size", "initial", "packed"),
                         [(None, False, False), (7, True, False), (16, True, True), (1, False, True),
                          (45, True, True)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_ssd_kernels_equal_the_chunked_reference(rt: Runtime, dtype: str, chunk_size: int | None,
                                                 initial: bool, packed: bool,
                                                 rng: np.random.Generator) -> None:
    args = _scan_args(rt, rng, dtype, initial=initial, packed=packed)
    y, final = rt.kernels.ssd_chunked(args["x"], args["dt"], args["A"], args["B"], args["C"], chunk_size,
                                      args["initial_states"], seq_idx=args["seq_idx"])
    y_ref, final_ref = reference.ssd_chunked_ref(**args, chunk_size=chunk_size, xp=rt.xp)
    _assert_close(rt, y, y_ref, dtype, like=args["x"])
    _assert_close(rt, final, final_ref, dtype, like=args["x"])


@pytest.mark.parametrize("D_shape", [(6,), (6, 5)])
def test_ssd_kernels_add_the_D_skip(rt: Runtime, rng: np.random.Generator, D_shape: tuple[int, ...]) -> None:
    args = _scan_args(rt, rng, "float64", initial=True, packed=True)
    D = rt.put(rng.standard_normal(D_shape))
    y, final = rt.kernels.ssd_chunked(args["x"], args["dt"], args["A"], args["B"], args["C"], 7,
                                      args["initial_states"], seq_idx=args["seq_idx"], D=D)
    y_ref, final_ref = reference.ssd_chunked_ref(**args, chunk_size=7, D=D, xp=rt.xp)
    _assert_close(rt, y, y_ref, "float64", like=args["x"])
    _assert_close(rt, final, final_ref, "float64", like=args["x"])


def test_ssd_kernels_carry_the_state_across_segments(rt: Runtime, rng: np.random.Generator,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """With 14-step segments (two chunks of 7) a 45-step packed scan runs in four segments and
    still equals the reference in one segment."""
    args = _scan_args(rt, rng, "float64", initial=True, packed=True)
    y_ref, final_ref = reference.ssd_chunked_ref(**args, chunk_size=7, xp=rt.xp)
    monkeypatch.setattr(core_ssd, "SEGMENT_TOKENS", 14)
    y, final = rt.kernels.ssd_chunked(args["x"], args["dt"], args["A"], args["B"], args["C"], 7,
                                      args["initial_states"], seq_idx=args["seq_idx"])
    _assert_close(rt, y, y_ref, "float64", like=args["x"])
    _assert_close(rt, final, final_ref, "float64", like=args["x"])


def test_ssd_kernels_equal_the_sequential_recurrence(rt: Runtime, rng: np.random.Generator) -> None:
    args = _scan_args(rt, rng, "float64", l=30, initial=True, packed=True)
    y, final = rt.kernels.ssd_chunked(args["x"], args["dt"], args["A"], args["B"], args["C"], 8,
                                      args["initial_states"], seq_idx=args["seq_idx"])
    ids = args["seq_idx"] - args["seq_idx"][:, :1]  # the kernels take any ids; the public scan 0 first
    y_seq, final_seq = selective_scan(args["x"], args["dt"], args["A"], args["B"], args["C"],
                                      initial_states=args["initial_states"], seq_idx=ids,
                                      return_final_states=True)
    _assert_close(rt, y, y_seq, "float64", like=args["x"])
    _assert_close(rt, final, final_seq, "float64", like=args["x"])


# --- the scan kernels under hostile numbers: test_hostile_numerics' checks, on the kernels ----------

@pytest.fixture
def kernel_scan(rt: Runtime, monkeypatch: pytest.MonkeyPatch) -> Scan:
    """``ps.ssd_scan`` with the scan kernels as its native ``ssd_chunked`` (as PORTABLE_SSM_CUPY_KERNELS=1
    registers them on a GPU), inputs moved to the runtime, y brought back to the host."""
    native = core_ssd.fast_op
    monkeypatch.setattr(core_ssd, "fast_op",
                        lambda xp, op: rt.kernels.ssd_chunked if op == "ssd_chunked" else native(xp, op))

    def scan(inputs: dict[str, np.ndarray], **kw: Any) -> np.ndarray:
        return rt.get(ps.ssd_scan(**{k: rt.put(v) for k, v in inputs.items()}, **kw))

    return scan


@causality_cases
def test_ssd_kernels_never_let_a_non_finite_input_at_t_change_an_output_before_t(kernel_scan: Scan,
                                                                                  case: dict) -> None:
    check_scan_causality(kernel_scan, case)


@float32_extremes
def test_ssd_kernels_in_float32_with_extreme_delta_stay_within_10x_the_recurrence(kernel_scan: Scan, seed: int,
                                                                                  l: int, big: float, A_min: float,
                                                                                  Q: int | None) -> None:
    check_float32_extreme(kernel_scan, seed, l, big, A_min, Q)


def test_ssd_kernels_keep_float32_accuracy_after_one_huge_step_in_a_chunk(kernel_scan: Scan) -> None:
    check_one_huge_step(kernel_scan)


@float64_extremes
def test_ssd_kernels_in_float64_with_delta_from_1e_6_to_1e4_stay_within_1e_10(kernel_scan: Scan, seed: int, l: int,
                                                                              A_min: float, Q: int | None) -> None:
    check_float64_extreme(kernel_scan, seed, l, A_min, Q)


@pytest.mark.parametrize("value", [math.nan, math.inf])
@pytest.mark.parametrize("name", ["x", "dt", "B", "C"])
def test_ssd_kernels_keep_non_finite_input_causal_in_packed_rows_as_the_reference(
        rt: Runtime, name: str, value: float, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """With seq_idx and an initial state, over four segments of 14 steps: a non-finite entry at step t
    leaves the outputs before t and the other row bit-equal to the clean run, and the kernels' outputs
    are non-finite exactly where the reference's are, equal to it elsewhere."""
    monkeypatch.setattr(core_ssd, "SEGMENT_TOKENS", 14)
    args = _scan_args(rt, rng, "float64", initial=True, packed=True)
    t = int(rng.integers(0, args["x"].shape[1]))
    bad = {k: None if v is None else rt.put(v) for k, v in
           poisoned({k: None if v is None else rt.get(v) for k, v in args.items()}, name, 1, t, value, rng).items()}

    def run(a: dict[str, Any]) -> np.ndarray:
        return rt.get(rt.kernels.ssd_chunked(a["x"], a["dt"], a["A"], a["B"], a["C"], 7, a["initial_states"],
                                             seq_idx=a["seq_idx"])[0])

    clean, y = run(args), quiet(run, bad)
    y_ref = rt.get(quiet(reference.ssd_chunked_ref, **bad, chunk_size=7, xp=rt.xp)[0])
    np.testing.assert_array_equal(y[:, :t], clean[:, :t])
    np.testing.assert_array_equal(y[0], clean[0])
    np.testing.assert_array_equal(np.isfinite(y), np.isfinite(y_ref))
    assert not np.isfinite(y[1, t]).all()
    finite = np.isfinite(y_ref)
    assert rel_err(y[finite], y_ref[finite]) <= TOL["float64"]


@PACKED_SETTINGS
@given(case=packed_poisonings())
def test_ssd_kernels_keep_a_non_finite_value_inside_its_packed_sequence(rt: Runtime, kernel_scan: Scan,
                                                                       case: dict) -> None:
    """test_hostile_packed's check on the kernels (seq_idx rows: cu_seqlens rows take the core's
    varlen scan): the other sequences and the poisoned one's earlier steps bit-equal to the clean run."""
    check_packed_scan(Backend(rt.name, "cupy" if rt.name == "cupy" else "numpy", None), dict(case, layout="seq_idx"))


# --- purity and validation ----------------------------------------------------------------------

def test_kernels_leave_their_inputs_untouched(rt: Runtime, rng: np.random.Generator) -> None:
    scan = _scan_args(rt, rng, "float32", l=20, initial=True, packed=True)
    decode, _ = _decode_args(rt, rng, "float32", per_channel_D=False, limited=False)
    conv = {"x": scan["x"][:, :, 0, :], "weight": rt.put(rng.standard_normal((5, 4)).astype(np.float32)),
            "bias": None, "state": rt.put(rng.standard_normal((2, 5, 4)).astype(np.float32)),
            "seq_idx": scan["seq_idx"]}
    arrays = [v for group in (scan, decode, conv) for v in group.values() if hasattr(v, "shape")]
    before = [rt.get(v).copy() for v in arrays]
    rt.kernels.ssd_chunked(scan["x"], scan["dt"], scan["A"], scan["B"], scan["C"], 8, scan["initial_states"],
                           seq_idx=scan["seq_idx"])
    rt.kernels.decode_step(**decode)
    rt.kernels.causal_conv1d(**conv)
    for v, old in zip(arrays, before):
        np.testing.assert_array_equal(rt.get(v), old)


def test_kernel_wrappers_reject_bad_arguments_naming_them(rt: Runtime, rng: np.random.Generator) -> None:
    scan = _scan_args(rt, rng, "float32", l=10, initial=False, packed=False)
    x, dt, A, B, C = (scan[k] for k in ("x", "dt", "A", "B", "C"))
    with pytest.raises(ValueError, match=r"B: expected shape \[b, l, g, n\] = \[2, 10, \?, \?\], "
                                         r"got \(2, 9, 3, 7\)"):
        rt.kernels.ssd_chunked(x, dt, A, B[:, :9, ...], C, None, None)
    with pytest.raises(TypeError, match="C is float64 but x is float32"):
        rt.kernels.ssd_chunked(x, dt, A, B, C.astype(np.float64), None, None)
    with pytest.raises(TypeError, match="x: the scan kernels take the compute dtype"):
        rt.kernels.ssd_chunked(*(v.astype(np.float16) for v in (x, dt, A, B, C)), None, None)
    with pytest.raises(ValueError, match="h=6 .* multiple of the number of groups g=4"):
        rt.kernels.ssd_chunked(x, dt, A, rt.cp.zeros((2, 10, 4, 7), np.float32),
                               rt.cp.zeros((2, 10, 4, 7), np.float32), None, None)
    with pytest.raises(ValueError, match="chunk_size: expected a positive int, got 0"):
        rt.kernels.ssd_chunked(x, dt, A, B, C, 0, None)

    conv_x = x[:, :, 0, :]
    with pytest.raises(TypeError, match="seq_idx: expected an integer dtype"):
        rt.kernels.causal_conv1d(conv_x, rt.cp.ones((5, 4), np.float32), None, None, dt[:, :, 0])
    with pytest.raises(TypeError, match="state is float64 but x is float32"):
        rt.kernels.causal_conv1d(conv_x, rt.cp.ones((5, 4), np.float32), None, rt.cp.zeros((2, 5, 4)))
    with pytest.raises(ValueError, match=r"weight: expected shape \[d, k\] = \[5, \?\], got \(6, 4\)"):
        rt.kernels.causal_conv1d(conv_x, rt.cp.ones((6, 4), np.float32), None, None)
    with pytest.raises(TypeError, match="x: expected float16, float32, float64 or bfloat16 bits"):
        rt.kernels.causal_conv1d(conv_x.astype(np.int32), rt.cp.ones((5, 4), np.float32), None, None)

    decode, _ = _decode_args(rt, rng, "float32", per_channel_D=False, limited=False)
    with pytest.raises(TypeError, match="ssm_state: expected the compute dtype float32 for xBC of dtype"):
        rt.kernels.decode_step(**{**decode, "ssm_state": decode["ssm_state"].astype(np.float64)})
    with pytest.raises(ValueError, match="xBC: expected conv_dim = d_inner \\+ 2·g·n channels"):
        rt.kernels.decode_step(**{**decode, "xBC": decode["xBC"][:, :-1]})
    with pytest.raises(ValueError, match="dt_limit: expected 0 <= low < high"):
        rt.kernels.decode_step(**{**decode, "dt_limit": (1.0, 0.5)})


def test_kernel_wrappers_reject_arrays_of_another_library_naming_both(rt: Runtime) -> None:
    torch = pytest.importorskip("torch")
    x = rt.put(np.zeros((1, 3, 2), np.float32))
    with pytest.raises(TypeError, match=r"weight is a torch array but x is a (numpy|cupy) array"):
        rt.kernels.causal_conv1d(x, torch.zeros(2, 4), None, None)


# --- GPU only: registration, the core on the kernels, torch interop --------------------------------

@pytest.fixture(scope="module")
def gpu_backend() -> Any:
    """The real ``portable_ssm.backends.cupy`` (skips without cupy and a GPU)."""
    _cupy_runtime()
    from portable_ssm.backends import cupy as backend

    return backend


def test_fast_ops_hold_the_kernels_only_with_the_switch(gpu_backend: Any) -> None:
    from portable_ssm.backends.cupy import sources

    want = {"causal_conv1d", "ssd_chunked", "decode_step"} if sources.kernels_enabled() else set()
    assert set(gpu_backend.FAST_OPS) == want


def test_forward_and_step_on_cupy_agree_with_and_without_the_kernels(gpu_backend: Any,
                                                                    rng: np.random.Generator,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import portable_ssm

    c = Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=2)
    params = init_params(c, seed=1, backend="cupy")
    x = gpu_backend.asarray(rng.standard_normal((2, 37, c.d_model)), "float32", None)
    x_t = gpu_backend.asarray(rng.standard_normal((2, c.d_model)), "float32", None)
    monkeypatch.setattr(gpu_backend, "FAST_OPS", {})
    y_ref, state_ref = portable_ssm.forward(x, params, config=c, return_state=True)
    out_ref, _ = portable_ssm.step(x_t, state_ref, params, config=c)
    kernels = gpu_backend.KERNELS
    monkeypatch.setattr(gpu_backend, "FAST_OPS", {"causal_conv1d": kernels.causal_conv1d,
                                                  "ssd_chunked": kernels.ssd_chunked,
                                                  "decode_step": kernels.decode_step})
    y, state = portable_ssm.forward(x, params, config=c, return_state=True)
    out, _ = portable_ssm.step(x_t, state, params, config=c)
    assert rel_err(gpu_backend.to_numpy(y), gpu_backend.to_numpy(y_ref)) <= 1e-5
    assert rel_err(gpu_backend.to_numpy(out), gpu_backend.to_numpy(out_ref)) <= 1e-5


@pytest.fixture(scope="module")
def torch_ops(gpu_backend: Any) -> Any:
    """``portable_ssm.backends.cupy.torch_ops`` (skips without torch on CUDA)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch-cuda: torch.cuda.is_available() is False")
    from portable_ssm.backends.cupy import torch_ops

    return torch_ops


def _cuda(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    return {k: torch.tensor(v, device="cuda") if isinstance(v, np.ndarray) else v for k, v in args.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_hooks_on_cuda_tensors_equal_the_reference(torch_ops: Any, dtype: str,
                                                         rng: np.random.Generator) -> None:
    import array_api_compat.torch as txp
    import torch

    storage = getattr(torch, dtype)
    x = torch.tensor(rng.standard_normal((2, 13, 37)), device="cuda", dtype=storage)
    w = torch.tensor(rng.standard_normal((37, 4)), device="cuda", dtype=torch.float32)
    state = torch.tensor(rng.standard_normal((2, 37, 4)), device="cuda", dtype=storage)
    y, new_state = torch_ops.causal_conv1d(x, w, None, state)
    y_ref, state_ref = reference.causal_conv1d_ref(x.float(), w, None, state.float(), xp=txp)
    assert y.dtype == storage and new_state.dtype == storage
    assert rel_err(y.float().cpu().numpy(), y_ref.cpu().numpy()) <= TOL[dtype]
    assert rel_err(new_state.float().cpu().numpy(), state_ref.cpu().numpy()) <= TOL[dtype]

    args = _cuda(_decode_args(HOST, rng, "float32", per_channel_D=True, limited=False)[0])
    stored = {k: args[k].to(storage) for k in ("xBC", "dt", "z", "conv_state")}
    got = torch_ops.decode_step(**{**args, **stored})
    want = reference.decode_step_ref(**{**args, **{k: v.float() for k, v in stored.items()}})
    assert got[0].dtype == storage and got[1].dtype == storage and got[2].dtype == torch.float32
    for a, e in zip(got, want):
        assert rel_err(a.float().cpu().numpy(), e.float().cpu().numpy()) <= TOL[dtype]


def test_torch_hooks_backward_equals_autograd_of_the_reference(torch_ops: Any,
                                                               rng: np.random.Generator) -> None:
    import array_api_compat.torch as txp

    scan = {k: v.requires_grad_() for k, v in _cuda(_scan_args(HOST, rng, "float32", initial=True,
                                                                packed=False)).items() if v is not None}
    conv_host = {"x": (2, 13, 5), "weight": (5, 4), "bias": (5,), "state": (2, 5, 4)}
    conv = {k: v.requires_grad_() for k, v in _cuda({k: rng.standard_normal(shape).astype(np.float32)
                                                     for k, shape in conv_host.items()}).items()}

    def loss(ssd: Any, causal_conv1d: Any) -> Any:
        y, final = ssd(scan["x"], scan["dt"], scan["A"], scan["B"], scan["C"], 16, scan["initial_states"])
        yc, state = causal_conv1d(conv["x"], conv["weight"], conv["bias"], conv["state"])
        return y.square().sum() + final.sum() + (yc * yc.detach()).sum() + state.square().sum()

    leaves = {**{f"scan.{k}": v for k, v in scan.items()}, **{f"conv.{k}": v for k, v in conv.items()}}
    loss(torch_ops.ssd_chunked, torch_ops.causal_conv1d).backward()
    grads = {k: v.grad.clone() for k, v in leaves.items()}
    for v in leaves.values():
        v.grad = None
    loss(lambda *a: reference.ssd_chunked_ref(*a[:5], chunk_size=a[5], initial_states=a[6], xp=txp),
         lambda *a: reference.causal_conv1d_ref(*a, xp=txp)).backward()
    for k, v in leaves.items():
        assert rel_err(grads[k].cpu().numpy(), v.grad.cpu().numpy()) <= 1e-5, k


def test_use_kernels_needs_the_switch_and_restores_the_torch_fast_ops(torch_ops: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from portable_ssm.backends import torch as torch_backend

    before = dict(torch_backend.FAST_OPS)
    monkeypatch.delenv("PORTABLE_SSM_CUPY_KERNELS", raising=False)
    with pytest.raises(RuntimeError, match="PORTABLE_SSM_CUPY_KERNELS=1"):
        with torch_ops.use_kernels():
            pass
    monkeypatch.setenv("PORTABLE_SSM_CUPY_KERNELS", "1")
    with torch_ops.use_kernels():
        assert torch_backend.FAST_OPS["ssd_chunked"] is torch_ops.ssd_chunked
    assert torch_backend.FAST_OPS == before
