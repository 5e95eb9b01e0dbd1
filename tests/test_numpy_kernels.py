"""NumPy's compiled kernels (portable_ssm.backends.numpy.kernels): the conv with SiLU, the gated
RMSNorm, a gated MLP's SiLU and the mixer's SiLU gate agree with the array-API references where they
read their inputs in place from wider rows, over channel counts that are not a multiple of the
vector width and rows split over the pool; the native paths take them only in float32 and while they
are on; a failed build warns once and leaves NumPy's ufunc paths; the built library is cached and
reused. The row product of a decode step with int8 and bfloat16 weights agrees with float64 and
NumPy's tiles, and a step's row takes it."""

from __future__ import annotations

import warnings

import array_api_compat.numpy as nxp
import numpy as np
import pytest
from portable_ssm.backends.cpu_source import ENV
from portable_ssm.backends.numpy import kernels, ops

from portable_ssm import ssd
from portable_ssm._array import silu
from portable_ssm.blocks.mlp import MLPSpec, gated_activation_ref, hidden
from portable_ssm.conv import causal_conv1d_ref
from portable_ssm.norm import gated_rms_norm_ref


def conv_inputs(b: int, l: int, d: int, k: int, seed: int):
    """x as the mixer has it, a slice of wider rows (in_proj's output), taps, bias and a state."""
    rng = np.random.default_rng(seed)
    wide = rng.standard_normal((b, l, d + 11)).astype(np.float32)
    return (wide[:, :, 5:5 + d], rng.standard_normal((d, k)).astype(np.float32),
            rng.standard_normal(d).astype(np.float32), rng.standard_normal((b, d, k)).astype(np.float32))


@pytest.mark.parametrize(("b", "l", "d", "k"), [(1, 1, 8, 4), (3, 40, 13, 4), (2, 70, 24, 4), (2, 9, 7, 9)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_conv_silu_kernel_reads_wider_rows_in_place_and_agrees_with_the_reference(library, monkeypatch, b, l, d, k,
                                                                                   with_bias):
    x, w, bias, state = conv_inputs(b, l, d, k, seed=l + d)
    bias = bias if with_bias else None
    results: list[np.ndarray | None] = []
    conv = kernels.conv_silu
    monkeypatch.setattr(kernels, "conv_silu", lambda *a: results.append(conv(*a)) or results[-1])
    y, new_state = ops.causal_conv1d_silu(x, w, bias, state)
    assert len(results) == 1 and results[0] is not None  # the kernel ran, the state's history a strided view
    y_ref, state_ref = causal_conv1d_ref(x.astype(np.float64), w.astype(np.float64),
                                         None if bias is None else bias.astype(np.float64),
                                         state.astype(np.float64), xp=nxp)
    assert y.dtype == np.float32 and y.shape == (b, l, d)
    np.testing.assert_allclose(y, silu(y_ref, xp=nxp), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(new_state, state_ref.astype(np.float32))


def test_conv_silu_kernel_is_causal_bit_for_bit(library):
    """A nan at step s reaches the outputs of steps s to s+k-1 only; every other output is unchanged
    to the bit."""
    x, w, bias, _ = conv_inputs(2, 50, 19, 4, seed=3)
    clean = kernels.conv_silu(x, np.ascontiguousarray(w.T), bias, np.zeros((2, 3, 19), np.float32))
    poisoned = x.copy()
    poisoned[1, 20, 6] = np.nan
    y = kernels.conv_silu(poisoned, np.ascontiguousarray(w.T), bias, np.zeros((2, 3, 19), np.float32))
    changed = ~(y == clean)
    assert np.isnan(y[1, 20:24, 6]).all()
    assert changed.sum() == 4


@pytest.mark.parametrize(("rows", "d", "groups"), [(1, 8, 1), (37, 20, 2), (64, 24, 3), (5, 7, 1)])
@pytest.mark.parametrize("gated", [True, False])
def test_norm_kernel_reads_wider_rows_in_place_and_agrees_with_the_reference(library, rows, d, groups, gated):
    rng = np.random.default_rng(rows + d)
    y = rng.standard_normal((rows, d)).astype(np.float32)
    z = rng.standard_normal((rows, 3 * d)).astype(np.float32)[:, d:2 * d] if gated else None  # rows 3d apart
    w = rng.standard_normal(d).astype(np.float32)
    out = ops.gated_rms_norm(y, z, w, groups, 1e-5)
    ref = gated_rms_norm_ref(y.astype(np.float64), None if z is None else z.astype(np.float64),
                             w.astype(np.float64), groups, 1e-5, xp=nxp)
    assert out.dtype == np.float32 and out.shape == (rows, d)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(("rows", "f"), [(1, 8), (37, 13), (70, 24), (5, 2048)])
def test_gated_silu_kernel_reads_wider_rows_in_place_and_agrees_with_the_reference(library, monkeypatch, rows, f):
    rng = np.random.default_rng(rows + f)
    wide = (4 * rng.standard_normal((rows, 2 * f + 9))).astype(np.float32)
    u = wide[:, 3:3 + 2 * f]  # [rows, 2f] = [gate; up], rows 2f + 9 floats apart
    u[0, :3] = (-100.0, 100.0, 0.0)  # gates where silu is about -0, the gate itself, and 0
    results: list[np.ndarray | None] = []
    fused = kernels.gated_silu
    monkeypatch.setattr(kernels, "gated_silu", lambda *a: results.append(fused(*a)) or results[-1])
    out = hidden(u, MLPSpec("silu", True), xp=nxp)
    assert len(results) == 1 and results[0] is not None  # the kernel ran on the strided rows
    assert out.dtype == np.float32 and out.shape == (rows, f)
    np.testing.assert_allclose(out, gated_activation_ref(u.astype(np.float64), "silu", xp=nxp), rtol=2e-6, atol=2e-6)


def test_gated_silu_kernel_keeps_a_nan_in_its_own_unit_bit_for_bit(library):
    """A nan in a gate or an up unit reaches that unit's output only; every other output is unchanged
    to the bit."""
    u = np.random.default_rng(7).standard_normal((40, 2 * 19)).astype(np.float32)
    clean = kernels.gated_silu(u)
    poisoned = u.copy()
    poisoned[3, 5] = np.nan  # a gate
    poisoned[30, 19 + 11] = np.nan  # an up unit
    out = kernels.gated_silu(poisoned)
    assert np.isnan(out[3, 5]) and np.isnan(out[30, 11])
    assert (~(out == clean)).sum() == 2


@pytest.mark.parametrize(("lead", "f"), [((1, 1), 8), ((2, 37), 13), ((3, 70), 24)])
def test_silu_gate_kernel_reads_a_slice_of_wider_rows_and_agrees_with_the_reference(library, monkeypatch, lead, f):
    """The mixer's ``y · silu(z)`` without a norm (Falcon-H1's): z a slice of in_proj's wider rows."""
    from portable_ssm.mixer import _gate

    rng = np.random.default_rng(f)
    y = (4 * rng.standard_normal((*lead, f))).astype(np.float32)
    z = (4 * rng.standard_normal((*lead, 2 * f + 9))).astype(np.float32)[..., 3:3 + f]  # rows 2f + 9 floats apart
    z[0, 0, :3] = (-100.0, 100.0, 0.0)
    results: list[np.ndarray | None] = []
    fused = kernels.silu_gate
    monkeypatch.setattr(kernels, "silu_gate", lambda *a: results.append(fused(*a)) or results[-1])
    out = _gate(y, z, np.float32, xp=nxp)
    assert len(results) == 1 and results[0] is not None and not np.shares_memory(results[0], z)
    assert out.dtype == np.float32 and out.shape == y.shape
    want = y.astype(np.float64) * silu(z.astype(np.float64), xp=nxp)
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    with monkeypatch.context() as off:
        off.setattr(kernels, "silu_gate", lambda *a: None)
        np.testing.assert_array_equal(_gate(y, z, np.float32, xp=nxp), y * silu(z, xp=nxp))  # declined: the reference
    poisoned = y.copy()
    poisoned[-1, -1, 2] = np.nan
    again = _gate(poisoned, z, np.float32, xp=nxp)
    assert np.isnan(again[-1, -1, 2]) and np.isnan(again).sum() == 1


def test_native_paths_take_the_kernels_only_in_float32_and_while_they_are_on(library, monkeypatch):
    calls: list[str] = []
    for name in ("conv_silu", "gated_rms_norm", "gated_silu", "silu_gate"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, _f=real: calls.append(_n) or _f(*a))
    x, w, bias, state = conv_inputs(1, 20, 8, 4, seed=0)
    rows = x[0]
    ops.causal_conv1d_silu(x, w, bias, state)
    ops.gated_rms_norm(rows, rows, w[:, 0], 1, 1e-5)
    ops.gated_activation(rows, "silu")
    ops.gated_activation(rows, "relu2")  # the reference's
    assert ops.silu_gate(rows.astype(np.float64), rows.astype(np.float64)) is None  # no call: the reference's
    assert calls == ["conv_silu", "gated_rms_norm", "gated_silu", "silu_gate"]
    assert kernels.conv_silu(x.astype(np.float64), np.ascontiguousarray(w.T).astype(np.float64), None,
                             np.zeros((1, 3, 8))) is None
    assert kernels.gated_rms_norm(rows.astype(np.float64), None, w[:, 0].astype(np.float64), 1, 1e-5) is None
    assert kernels.gated_rms_norm(rows[:, ::2], None, w[::2, 0], 1, 1e-5) is None  # channels not contiguous
    assert kernels.gated_silu(rows.astype(np.float64)) is None
    np.testing.assert_array_equal(ops.gated_activation(rows.astype(np.float64), "silu"),
                                  gated_activation_ref(rows.astype(np.float64), "silu", xp=nxp))
    monkeypatch.setenv(ENV, "0")
    assert kernels.library() is None
    assert kernels.conv_silu(x, np.ascontiguousarray(w.T), bias, np.zeros((1, 3, 8), np.float32)) is None


def test_the_library_is_built_once_into_the_cache_and_reused(library, tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    assert kernels.library() is not None
    built = list(tmp_path.glob("numpy_kernels_*.so"))
    assert len(built) == 1 and not list(tmp_path.glob("*.partial"))
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_build", lambda *a: pytest.fail("built again"))
    assert kernels.library() is not None
    assert built[0].stat().st_mtime_ns == stamp


def test_build_kernels_builds_the_library_ahead_and_says_where(library, tmp_path, monkeypatch, capsys):
    import io

    from portable_ssm.backends import kernel_build

    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    out = io.StringIO()
    assert kernel_build._numpy(out)
    (built,) = tmp_path.glob("numpy_kernels_*.so")
    assert out.getvalue() == f"numpy: ready: {built}\n"
    assert capsys.readouterr().err == f"portable_ssm: building NumPy's CPU kernels (once, a few seconds) into {built}\n"


def test_the_cli_builds_the_kernels_ahead_with_build_kernels(library, tmp_path, monkeypatch, capsys):
    from portable_ssm.backends import kernel_build

    from portable_ssm.cli import main

    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernel_build, "_torch", lambda out: print("torch: left out here", file=out) or True)
    assert main(["build-kernels"]) == 0
    (built,) = tmp_path.glob("numpy_kernels_*.so")
    assert capsys.readouterr().out == f"numpy: ready: {built}\ntorch: left out here\n"


def test_a_failed_build_warns_and_leaves_the_ufunc_paths(tmp_path, monkeypatch):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_cpu_has_avx2", lambda: True)
    x, w, bias, state = conv_inputs(2, 30, 8, 4, seed=1)
    with pytest.warns(RuntimeWarning, match="NumPy's CPU kernels could not be built .*no C\\+\\+ compiler"):
        y, _ = ops.causal_conv1d_silu(x, w, bias, state)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once: the failure is remembered
        assert kernels.library() is None
    y_ref, _ = causal_conv1d_ref(x, w, bias, state, xp=nxp)
    np.testing.assert_allclose(y, silu(y_ref, xp=nxp), rtol=1e-6, atol=1e-6)
    assert not list(tmp_path.iterdir())


def test_a_compiler_error_names_the_compiler_and_leaves_no_partial_file(tmp_path, monkeypatch):
    script = tmp_path / "bin" / "broken-c++"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho 'error: broken on purpose' >&2\nexit 3\n")
    script.chmod(0o755)
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(script))
    monkeypatch.setattr(kernels, "_LOADED", {})
    monkeypatch.setattr(kernels, "_cpu_has_avx2", lambda: True)
    with pytest.warns(RuntimeWarning, match="broken-c\\+\\+ exited with 3: error: broken on purpose"):
        assert kernels.library() is None
    assert not list((tmp_path / "cache").glob("*"))


@pytest.fixture
def compiled_scan(library):
    if kernels.blas_sgemm() is None:
        pytest.skip("NumPy's compiled scan: no OpenBLAS sgemm found in the process")


def scan_inputs(b: int, l: int, h: int, p: int, g: int, n: int, seed: int):
    """x, B and C as the mixer has them, slices of one conv output row [b, l, h·p + 2·g·n + 3] (read
    in place), Δ > 0, A < 0, D [h] and initial states."""
    rng = np.random.default_rng(seed)
    conv = rng.standard_normal((b, l, h * p + 2 * g * n + 3)).astype(np.float32)
    x = conv[..., :h * p].reshape(b, l, h, p)  # [b, l, h·p] -> [b, l, h, p], a view
    B = conv[..., h * p:h * p + g * n].reshape(b, l, g, n)  # a view
    C = conv[..., h * p + g * n:h * p + 2 * g * n].reshape(b, l, g, n)  # a view
    dt = rng.uniform(0.01, 0.3, (b, l, h)).astype(np.float32)
    A = -rng.uniform(0.5, 4.0, h).astype(np.float32)
    D = rng.standard_normal(h).astype(np.float32)
    initial = rng.standard_normal((b, h, p, n)).astype(np.float32)
    return x, dt, A, B, C, D, initial


@pytest.mark.parametrize(("b", "l", "h", "p", "g", "n", "chunk"),
                         [(2, 150, 8, 16, 2, 32, 64), (1, 1, 4, 8, 1, 16, 64), (3, 77, 6, 5, 3, 7, 16),
                          (1, 200, 24, 8, 1, 16, 64)])
def test_compiled_scan_reads_the_conv_output_in_place_and_agrees_with_the_reference(compiled_scan, monkeypatch, b, l,
                                                                                      h, p, g, n, chunk):
    x, dt, A, B, C, D, initial = scan_inputs(b, l, h, p, g, n, seed=l + h)
    copied: list[np.ndarray] = []
    packed = kernels._packed_rows

    def spy(a: np.ndarray) -> np.ndarray:
        out = packed(a)
        if out is not a:
            copied.append(a)
        return out

    monkeypatch.setattr(kernels, "_packed_rows", spy)
    y, final = kernels.ssd_chunked(x, dt, A, B, C, chunk, initial, D)
    assert not copied
    f64 = {k: v.astype(np.float64) for k, v in dict(x=x, dt=dt, A=A, B=B, C=C, D=D, initial_states=initial).items()}
    y_ref, final_ref = ssd.ssd_chunked_ref(**f64, chunk_size=chunk, xp=nxp)
    assert y.dtype == final.dtype == np.float32 and y.shape == (b, l, h, p) and final.shape == (b, h, p, n)
    assert np.abs(y - y_ref).max() <= 1e-5 * np.abs(y_ref).max()
    assert np.abs(final - final_ref).max() <= 1e-5 * np.abs(final_ref).max()


def test_compiled_scan_keeps_a_non_finite_input_from_earlier_steps_bit_for_bit(compiled_scan):
    """A nan in x at step s: every output before s equals the clean input's to the bit, and the
    nan's column is nan from s on (the second, masked call)."""
    x, dt, A, B, C, D, initial = scan_inputs(1, 130, 4, 8, 1, 16, seed=5)
    clean, _ = kernels.ssd_chunked(x, dt, A, B, C, 64, initial, D)
    x = x.copy()
    x[0, 70, 2, 3] = np.nan
    y, _ = kernels.ssd_chunked(x, dt, A, B, C, 64, initial, D)
    np.testing.assert_array_equal(y[:, :70], clean[:, :70])
    assert np.isnan(y[0, 70:, 2, 3]).all()


def test_numpy_scan_takes_the_compiled_scan_only_in_float32_with_the_blas_sgemm(compiled_scan, monkeypatch):
    x, dt, A, B, C, D, initial = scan_inputs(1, 40, 4, 8, 1, 16, seed=2)
    assert kernels.ssd_chunked(x.astype(np.float64), dt, A, B, C, 16, None, None) is None
    monkeypatch.setattr(kernels, "blas_sgemm", lambda: None)
    assert kernels.ssd_chunked(x, dt, A, B, C, 16, None, None) is None
    y, _ = ops.ssd_chunked(x, dt, A, B, C, 16, None, D=D)  # NumPy's loop
    y_ref, _ = ssd.ssd_chunked_ref(x, dt, A, B, C, chunk_size=16, initial_states=None, xp=nxp, D=D)
    assert np.abs(y - y_ref).max() <= 1e-5 * np.abs(y_ref).max()


def test_compiled_scan_calls_a_blas_with_32_bit_integers_alike(compiled_scan, monkeypatch):
    """The scan's products through a CBLAS sgemm that takes 32-bit integers (a BLAS built LP64, as
    SciPy's wheels ship one), not NumPy's 64-bit one, give the same result."""
    scipy_linalg = pytest.importorskip("scipy.linalg")
    import ctypes
    from pathlib import Path

    libs = Path(scipy_linalg.__file__).parents[2] / "scipy.libs"
    found = sorted(libs.glob("libscipy_openblas-*.so")) if libs.is_dir() else []
    library = ctypes.CDLL(str(found[0])) if found else None
    if library is None or not hasattr(library, "scipy_cblas_sgemm"):
        pytest.skip("no LP64 CBLAS sgemm (SciPy's scipy_cblas_sgemm) in this environment")
    x, dt, A, B, C, D, initial = scan_inputs(2, 90, 8, 16, 2, 32, seed=9)
    want, want_final = kernels.ssd_chunked(x, dt, A, B, C, 32, initial, D)
    monkeypatch.setattr(kernels, "blas_sgemm",
                        lambda: (ctypes.cast(library.scipy_cblas_sgemm, ctypes.c_void_p).value, False))
    y, final = kernels.ssd_chunked(x, dt, A, B, C, 32, initial, D)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(final, want_final, rtol=1e-5, atol=1e-5 * np.abs(want_final).max())


@pytest.mark.parametrize("planted", ["writable by others", "a symlink"])
def test_a_cached_library_anyone_else_could_have_written_is_built_again_with_a_warning(library, tmp_path,
                                                                                     monkeypatch, planted):
    monkeypatch.setenv(kernels.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(kernels, "_LOADED", {})
    assert kernels.library() is not None
    (target,) = tmp_path.glob("numpy_kernels_*.so")
    target.unlink()
    if planted == "a symlink":
        (tmp_path / "elsewhere.so").write_bytes(b"not a library")
        target.symlink_to(tmp_path / "elsewhere.so")
    else:
        target.write_bytes(b"not a library")
        target.chmod(0o666)
    monkeypatch.setattr(kernels, "_LOADED", {})
    with pytest.warns(RuntimeWarning, match="was damaged") as caught:
        assert kernels.library() is not None
    assert len(caught) == 1 and str(target) in str(caught[0].message)
    assert not target.is_symlink() and target.read_bytes() != b"not a library"
    assert not target.stat().st_mode & 0o022


def quantized_rows(out: int, n: int, seed: int):
    """A float32 row, an int8 weight with its row scales and bfloat16 bits of a float32 weight."""
    from portable_ssm.backends.numpy.quant import bfloat16_bits

    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, n)).astype(np.float32), rng.integers(-127, 128, (out, n), dtype=np.int8),
            (rng.random(out) + 0.5).astype(np.float32), bfloat16_bits(rng.standard_normal((out, n)).astype(np.float32)))


@pytest.mark.parametrize(("out", "n"), [(1, 1), (37, 770), (1000, 5), (3352, 768), (5, 1536)])
def test_row_product_widens_int8_and_bfloat16_weights_and_agrees_with_float64(library, out, n):
    from portable_ssm.backends.numpy.quant import widen_rows

    row, q, scale, bits = quantized_rows(out, n, seed=out + n)
    wide = row[0].astype(np.float64)
    for weight, s, ref in ((q, scale, (q.astype(np.float64) @ wide) * scale), (q, None, q.astype(np.float64) @ wide),
                           (bits, None, widen_rows(bits, None, 0, out).astype(np.float64) @ wide)):
        y = kernels.row_product(row, weight, s)
        assert y.dtype == np.float32 and y.shape == (1, out)
        np.testing.assert_allclose(y[0], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_row_product_declines_what_it_does_not_read(library):
    row, q, scale, bits = quantized_rows(8, 16, seed=0)
    assert kernels.row_product(row, q.astype(np.float32), None) is None  # float32 weights keep the BLAS
    assert kernels.row_product(row.astype(np.float64), q, scale) is None
    assert kernels.row_product(np.concatenate([row, row]), q, scale) is None  # one row only
    assert kernels.row_product(row[:, :8], q[:, :8], scale) is None  # a weight that is not contiguous
    assert kernels.row_product(row, q, scale.astype(np.float64)) is None
    assert kernels.row_product(row, q, scale[:4]) is None
    assert kernels.row_product(row[:, :0], q[:, :0].copy(), scale).tolist() == [[0.0] * 8]  # in = 0: zeros


def test_quantized_matmul_takes_the_row_product_for_one_row_and_agrees_with_the_tiles(library, monkeypatch):
    """A decode step's row goes through the kernel; two rows and kernels off take the tiles; all agree."""
    from portable_ssm.backends.numpy.quant import quantized_matmul

    from portable_ssm.quantized import QuantizedWeight

    row, q, scale, bits = quantized_rows(600, 768, seed=3)
    calls: list[np.ndarray | None] = []
    product = kernels.row_product
    monkeypatch.setattr(kernels, "row_product", lambda *a: calls.append(product(*a)) or calls[-1])
    for weight in (QuantizedWeight(q, scale, "int8", np.float32), QuantizedWeight(bits, None, "bfloat16", np.float32)):
        calls.clear()
        one = quantized_matmul(row, weight)
        assert len(calls) == 1 and calls[0] is not None
        two = quantized_matmul(np.concatenate([row, row]), weight)
        monkeypatch.setenv(ENV, "0")
        off = quantized_matmul(row, weight)
        monkeypatch.delenv(ENV)
        assert calls[-1] is None and calls[-2] is None  # two rows, then kernels off: the tiles
        np.testing.assert_allclose(one, off, rtol=1e-5, atol=1e-5 * np.abs(off).max())
        np.testing.assert_allclose(two, np.concatenate([off, off]), rtol=1e-5, atol=1e-5 * np.abs(off).max())


def _products(lib, weight: np.ndarray, x: np.ndarray, scale: np.ndarray | None, kind: int,
              begin: int = 0) -> np.ndarray:
    """The library's rows ``[begin, out)`` of ``weight [out, n] @ x [n]`` (times ``scale``) for the
    storage ``kind`` (3 to 6: the weight's rows, then its tiles: :func:`decode.with_tiles`), -7 before."""
    from portable_ssm.backends.numpy import decode

    out, n = weight.shape
    g = 4 if kind == decode.INT8_SYMMETRIC else 1
    data = decode.with_tiles(weight, g) if kind >= decode.INT8_SYMMETRIC else weight
    y = np.full(out, -7.0, dtype=np.float32)
    lib.portable_ssm_row_product(data.ctypes.data, kind, x.ctypes.data, None if scale is None else scale.ctypes.data,
                                 y.ctypes.data, out, n, begin, out)
    return y


def test_the_vnni_products_are_on_exactly_where_the_build_and_cpu_have_them(library, cpu_isa):
    from portable_ssm.backends import cpu_source

    has_vnni = all(cpu_source.cpu_features().get(f) for f in ("AVX512F", "AVX512BW", "AVX512VL", "AVX512VNNI"))
    assert kernels.vnni_products() == (has_vnni and cpu_isa != "avx2")


@pytest.mark.parametrize(("out", "n"), [(1, 1), (7, 63), (37, 770), (2096, 256), (256, 1024), (5, 4100)])
def test_int8_products_of_symmetric_weights_agree_with_float64_on_every_build(library, out, n):
    """Kind 3 (no -128: through VNNI where the build and CPU have it, digits of x to 24 bits) within a
    float32 dot product's rounding of the float64 product, row tails, blocks of 2048 and all."""
    rng = np.random.default_rng(out * n)
    weight = rng.integers(-127, 128, (out, n), dtype=np.int8)
    scale = (rng.random(out) + 0.5).astype(np.float32)
    for x in (rng.standard_normal(n), rng.standard_normal(n) * np.exp(rng.uniform(-20, 20, n)),
              np.full(n, 1e-30), np.where(np.arange(n) % 2 == 0, 3.0, -2.5)):
        x = x.astype(np.float32)
        ref = (weight.astype(np.float64) @ x.astype(np.float64)) * scale
        bound = (np.abs(weight).astype(np.float64) @ np.abs(x).astype(np.float64)) * scale  # Σ|w||x|
        y = _products(library, weight, x, scale, 3)
        assert np.all(np.abs(y - ref) <= 1e-6 * bound + 1e-37), np.max(np.abs(y - ref) / bound)
        y = _products(library, weight, x, None, 3)
        for begin in (1, 2, 15, 17, 64, 70):  # a row's output is the same float whichever rows share the call
            if begin < out:
                part = _products(library, weight, x, None, 3, begin)
                np.testing.assert_array_equal(part[begin:], y[begin:])
                assert (part[:begin] == -7).all()


@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize(("out", "n"), [(1, 1), (7, 63), (37, 770), (2096, 256), (256, 1024)])
def test_tile_products_agree_with_float64_and_do_not_depend_on_the_rows_sharing_the_call(library, out, n, storage):
    """Kinds 4 to 6 (a market plan's float32, bfloat16 and int8 weights widened from their tiles)
    within a float32 dot product's rounding of the float64 product of the stored values
    (n·2^-24·Σ|w||x|), the scale applied, tails and all, -128 included; a row's output the same float
    whichever rows share the call; NaN and inf as in the row kernel."""
    from portable_ssm.backends.numpy.quant import bfloat16_bits, widen_rows

    rng = np.random.default_rng(out + n)
    weight = rng.standard_normal((out, n)).astype(np.float32)
    kind, rows_kind = {"float32": (4, 0), "bfloat16": (5, 2), "int8": (6, 1)}[storage]
    if storage == "bfloat16":
        weight = bfloat16_bits(weight)
    if storage == "int8":
        weight = rng.integers(-128, 128, (out, n), dtype=np.int8)
    values = weight.astype(np.float32) if storage != "bfloat16" else widen_rows(weight, None, 0, out)  # stored values
    scale = (rng.random(out) + 0.5).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    ref = (values.astype(np.float64) @ x.astype(np.float64)) * scale
    bound = (np.abs(values).astype(np.float64) @ np.abs(x).astype(np.float64)) * scale
    y = _products(library, weight, x, scale, kind)
    assert np.all(np.abs(y - ref) <= (n + 2) * 2.0**-24 * bound), np.max(np.abs(y - ref) / bound)
    for begin in (1, 15, 17, 64, 70):
        if begin < out:
            part = _products(library, weight, x, scale, kind, begin)
            np.testing.assert_array_equal(part[begin:], y[begin:])
            assert (part[:begin] == -7).all()
    x[0] = np.inf
    np.testing.assert_array_equal(np.isnan(_products(library, weight, x, None, kind)),
                                  np.isnan(_products(library, weight, x, None, rows_kind)))
    x[0] = np.nan
    assert np.isnan(_products(library, weight, x, None, kind)).all()


def test_int8_products_of_a_nonfinite_zero_or_tiny_row_are_the_widening_kernels(library):
    """A NaN or inf in x, or x all below 2^-100 (its 24-bit unit would underflow): the float32 widening
    kernel's outputs exactly (NaN stays NaN, inf its infinities)."""
    rng = np.random.default_rng(0)
    weight = rng.integers(-127, 128, (9, 300), dtype=np.int8)
    rows = []
    for special in (np.nan, np.inf, -np.inf):
        x = rng.standard_normal(300).astype(np.float32)
        x[17] = special
        rows.append(x)
    rows += [np.zeros(300, np.float32), (rng.standard_normal(300) * 1e-32).astype(np.float32)]
    for x in rows:
        np.testing.assert_array_equal(_products(library, weight, x, None, 3),
                                      _products(library, weight, x, None, 1))
