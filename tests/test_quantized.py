"""Low-precision weights: int8 (per-row scales) and bfloat16 storage of the projections, embedding
and head. The storage is exact on every backend, forward / logits / generation through quantized
params equal the float32 model on the dequantized weights, the NumPy and torch fast paths agree
with the array-API reference, torch's decode runs its shipped int8 / bf16 kernels, the params
hold 1/4 and 1/2 of the float32 bytes, and a trained model keeps its logits and greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from conftest import assert_close, rel_err
from portable_ssm.backends import fast_op, load

import portable_ssm as ps
from portable_ssm import quantized
from portable_ssm._array import array_backend, dtype_name
from portable_ssm.bench.quality import PATTERN_LM as TRAINED
from portable_ssm.bench.quality import PERIOD, pattern, train_pattern_lm
from portable_ssm.generation import generate
from portable_ssm.lm import logits, logits_step
from portable_ssm.quantized import QuantizedWeight, dequantize, quantized_matmul_ref

CONFIG = ps.Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=16, ngroups=2, chunk_size=8,
                         vocab_size=50, pad_vocab_size_multiple=1)
HOST = ps.init_params(CONFIG, seed=0)
PROJECTIONS = [k for k in HOST if k.endswith(("in_proj.weight", "out_proj.weight", "embedding.weight"))]
KINDS = ("int8", "bfloat16")


def prompt(b: int = 2, l: int = 13) -> np.ndarray:
    return np.random.default_rng(1).integers(0, CONFIG.vocab_size, (b, l))


def host_dequantized(params: dict) -> dict[str, np.ndarray]:
    """The float32 host params a quantized dict stands for (its weights dequantized by the reference)."""
    out = {}
    for name, value in params.items():
        if isinstance(value, QuantizedWeight):
            value = dequantize(value, xp=load(array_backend(value.data)).namespace())
        out[name] = load(array_backend(value)).to_numpy(value)
    return out


def weights_matrix() -> np.ndarray:
    """A float32 ``[24, 40]`` matrix with an all-zero row and rows of very different magnitudes."""
    w = np.random.default_rng(3).standard_normal((24, 40)).astype(np.float32)
    w *= np.logspace(-3, 2, 24, dtype=np.float32)[:, None]
    w[5] = 0.0
    return w


def test_int8_stores_each_row_rounded_over_its_absmax_scale_on_every_backend(xp):
    w = weights_matrix()
    q = ps.quantize({"embedding.weight": xp.asarray_from(w, "float32")}, "int8")["embedding.weight"]
    assert isinstance(q, QuantizedWeight) and q.kind == "int8" and q.shape == (24, 40)
    assert array_backend(q.data) == xp.name and dtype_name(q.data.dtype) == "int8"
    assert dtype_name(q.scale.dtype) == "float32" and tuple(q.scale.shape) == (24,)
    assert dtype_name(q.dtype) == "float32"  # what it computes in: the activations' dtype
    absmax = np.abs(w).max(axis=1)
    scale = np.where(absmax > 0, absmax, np.float32(1)) / np.float32(127)
    np.testing.assert_array_equal(xp.numpy(q.scale), scale)
    np.testing.assert_array_equal(xp.numpy(q.data), np.round(w / scale[:, None]).astype(np.int8))
    deq = xp.numpy(dequantize(q, xp=xp.namespace))
    assert np.all(np.abs(deq - w) <= scale[:, None] / 2 * (1 + 1e-6))  # half a step of its own row
    np.testing.assert_array_equal(deq[5], 0.0)


def test_bfloat16_keeps_the_nearest_bfloat16_ties_to_even_on_every_backend(xp):
    one_ulp = 2.0 ** -7  # bfloat16's spacing at 1
    special = np.array([1.0, 1 + one_ulp / 2, 1 + 3 * one_ulp / 2, -2.0, 2.0 ** -130, -(2.0 ** -133), 0.0,
                        3.0e38, 1 + one_ulp / 2 + 2.0 ** -20], dtype=np.float32)
    nearest = np.array([1.0, 1.0, 1 + 2 * one_ulp, -2.0, 2.0 ** -130, -(2.0 ** -133), 0.0,
                        3.0e38, 1 + one_ulp], dtype=np.float32)  # [7]: not a bfloat16, checked below
    w = np.concatenate([special, weights_matrix().ravel()[:63]]).reshape(8, 9)  # [8, 9]
    q = ps.quantize({"lm_head.weight": xp.asarray_from(w, "float32")}, "bfloat16")["lm_head.weight"]
    assert q.kind == "bfloat16" and q.scale is None and array_backend(q.data) == xp.name
    assert dtype_name(q.data.dtype) == ("bfloat16" if xp.name in quantized.NATIVE_BFLOAT16 else "uint16")
    deq = xp.numpy(dequantize(q, xp=xp.namespace)).ravel()
    assert dtype_name(deq.dtype) == "float32"
    np.testing.assert_array_equal(deq[[0, 1, 2, 3, 4, 5, 6, 8]], nearest[[0, 1, 2, 3, 4, 5, 6, 8]])
    assert abs(deq[7] - 3.0e38) <= 3.0e38 * 2.0 ** -9  # the largest: within half a bfloat16 step
    bits = load("numpy").bfloat16_bits(w)
    np.testing.assert_array_equal(deq, (bits.astype(np.uint32) << 16).view(np.float32).ravel())


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_logits_and_tokens_equal_the_float32_model_on_its_dequantized_weights(xp, kind):
    params = ps.quantize(ps.cast_params(HOST, "float32", backend=xp.name, device=xp.device), kind)
    assert all(isinstance(params[k], QuantizedWeight) for k in PROJECTIONS)
    reference = host_dequantized(params)
    ids = prompt()
    out = logits(xp.asarray_from(ids, "int64"), params, config=CONFIG)
    # torch's bf16 GEMM (prefill on CUDA, decode everywhere) rounds the projections' inputs and
    # outputs to bfloat16 too; on CPU the 26 prefill rows take the reference
    rtol = 1e-2 if (xp.row, kind) == ("torch-cuda", "bfloat16") else 2e-5
    assert_close(xp, out, logits(ids, reference, config=CONFIG), rtol=rtol, dtype="float32", shape=(2, 13, 50))
    tokens = generate(xp.asarray_from(ids, "int64"), params, config=CONFIG, max_new_tokens=4)
    assert array_backend(tokens) == xp.name and tuple(tokens.shape) == (2, 17)
    if (xp.name, kind) != ("torch", "bfloat16"):
        np.testing.assert_array_equal(xp.numpy(tokens), generate(ids, reference, config=CONFIG, max_new_tokens=4))


@pytest.mark.parametrize("kind", KINDS)
def test_backbone_forward_and_step_accept_quantized_projections(kind):
    c = ps.Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=16)
    host = ps.init_params(c, seed=2)
    params = ps.quantize(host, kind)
    x = np.random.default_rng(0).standard_normal((2, 9, 32)).astype(np.float32)
    y, state = ps.forward(x, params, config=c, return_state=True)
    reference = host_dequantized(params)
    assert rel_err(y, ps.forward(x, reference, config=c)) <= 2e-5
    y_t, _ = ps.step(x[:, 0], state, params, config=c)
    assert rel_err(y_t, ps.step(x[:, 0], state, reference, config=c)[0]) <= 2e-5


def test_untouched_params_are_the_same_arrays_and_float32_kind_converts_nothing():
    same = ps.quantize(HOST, "float32")
    assert same is not HOST and all(same[k] is HOST[k] for k in HOST)
    params = ps.quantize(HOST, "int8")
    kept = [k for k in HOST if k not in PROJECTIONS]
    assert kept and all(params[k] is HOST[k] for k in kept)


def _backend_or_skip(name: str):
    if name == "torch":
        pytest.importorskip("torch")
    return load(name)


@pytest.mark.parametrize("tile_rows", [None, 64], ids=["one tile", "tiles of 64 rows"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 40, 129])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_many_row_quantized_matmul_widens_tiles_and_matches_the_reference(monkeypatch, backend, rows, kind,
                                                                          tile_rows):
    """Prefill's products (more rows than decode's kernels take: numpy 2+, torch 17+) widen the weight
    one tile of at most QUANT_TILE_BYTES at a time, covering every row once; every row count (around
    both switch points, odd sizes) matches the dequantize-then-matmul reference."""
    from portable_ssm.backends.numpy import quant

    b = _backend_or_skip(backend)
    if tile_rows is not None:
        monkeypatch.setattr(quant, "QUANT_TILE_BYTES", 4 * 47 * tile_rows)
    tiles: list[tuple[int, int]] = []
    widen = quant.widen_rows
    monkeypatch.setattr(quant, "widen_rows",
                        lambda d, s, start, stop: tiles.append((start, stop)) or widen(d, s, start, stop))
    w = b.asarray(np.random.default_rng(4).standard_normal((301, 47)).astype(np.float32), None, None)
    q = ps.quantize({"lm_head.weight": w}, kind)["lm_head.weight"]
    v = b.asarray(np.random.default_rng(5).standard_normal((rows, 47)).astype(np.float32), None, None)
    xp = b.namespace()
    out = fast_op(xp, "quantized_matmul")(v, q)
    assert array_backend(out) == backend and dtype_name(out.dtype) == "float32" and tuple(out.shape) == (rows, 301)
    many = rows > (1 if backend == "numpy" else b.CPU_KERNEL_MAX_ROWS)
    if many:
        assert [t[0] for t in tiles] == [0] + [t[1] for t in tiles[:-1]] and tiles[-1][1] == 301
        assert max(stop - start for start, stop in tiles) <= (301 if tile_rows is None else tile_rows)
        assert len(tiles) == (1 if tile_rows is None else 5)
        bound = 2e-6
    else:  # decode: the row kernels (torch's may round the rows, see TORCH_KERNEL_ERR)
        assert not tiles
        bound = max(v for (k, _), v in TORCH_KERNEL_ERR.items() if k == kind) if backend == "torch" else 2e-6
    reference = quantized_matmul_ref(v, q, xp=xp)
    assert rel_err(b.to_numpy(out), b.to_numpy(reference)) <= bound


def test_tile_ranges_cover_the_rows_in_equal_tiles_under_the_byte_bound(monkeypatch):
    from portable_ssm.backends.numpy import quant

    assert quant.tile_ranges(3352, 768) == [(0, 3352)]  # a 130m in_proj: one tile
    head = quant.tile_ranges(50288, 768)
    assert head[0][0] == 0 and head[-1][1] == 50288 and all(a[1] == b[0] for a, b in zip(head, head[1:]))
    assert all(4 * 768 * (stop - start) <= quant.QUANT_TILE_BYTES for start, stop in head)
    assert max(s - t for t, s in head) - min(s - t for t, s in head) <= 1
    monkeypatch.setattr(quant, "QUANT_TILE_BYTES", 1)
    assert quant.tile_ranges(3, 5) == [(0, 1), (1, 2), (2, 3)]  # at least a row a tile
    assert quant.tile_ranges(0, 5) == [(0, 0)]


def _counting(monkeypatch, owner, name: str, arg: int = 1) -> list:
    """Calls of ``owner.name`` from now on, as the dtype of each call's argument ``arg``."""
    calls: list = []
    real = getattr(owner, name)
    monkeypatch.setattr(owner, name, lambda *a, **k: calls.append(a[arg].dtype) or real(*a, **k))
    return calls


def _unpacked(params: dict) -> dict:
    """``params`` with their quantized weights' fbgemm copies dropped (torch's other kernels then run)."""
    return {k: dataclasses.replace(v, packed=None) if isinstance(v, QuantizedWeight) else v for k, v in params.items()}


@pytest.mark.parametrize("packed", [True, False], ids=["fbgemm", "unpacked"])
@pytest.mark.parametrize("kind", KINDS)
def test_torch_decode_runs_the_shipped_low_precision_kernels_and_matches_the_reference(monkeypatch, kind, packed):
    torch = pytest.importorskip("torch")
    backend = load("torch")
    params = ps.quantize(ps.cast_params(HOST, "float32", backend="torch"), kind)
    if packed and any(v.packed is None for v in params.values() if isinstance(v, QuantizedWeight)):
        pytest.skip("fbgemm does not run on this CPU")
    params = params if packed else _unpacked(params)
    ids = torch.from_numpy(prompt())
    _, state = logits(ids, params, config=CONFIG, return_state=True)
    if packed:
        calls, expected = _counting(monkeypatch, backend, "packed_linear", arg=0), [torch.float32]
    elif kind == "int8":
        calls, expected = _counting(monkeypatch, torch, "_weight_int8pack_mm"), [torch.int8]
    else:
        calls, expected = _counting(monkeypatch, backend.F, "linear"), [torch.bfloat16]
    out, _ = logits_step(ids[:, -1], state, params, config=CONFIG)
    assert calls == expected * (2 * CONFIG.n_layer + 1)
    monkeypatch.delitem(backend.FAST_OPS, "quantized_matmul")
    reference, _ = logits_step(ids[:, -1], state, params, config=CONFIG)
    assert out.dtype == torch.float32 and tuple(out.shape) == (2, 50)
    assert rel_err(out.numpy(), reference.numpy()) <= TORCH_KERNEL_ERR[kind, packed]


#: Error bounds of torch's kernels against the reference (max |Δ| / max |ref|): fbgemm's int8 rounds
#: the rows to 8 bits (7-bit range, one scale per call), measured 0.010-0.017 for one matmul and 0.037
#: through the random model's five; its float16 kernel on bfloat16 weights 3e-7 (exact weights,
#: float32 sums in another order); unpacked:
#: int8pack sums float32 products in another order, torch's bf16 GEMM rounds the rows and the
#: result to bfloat16 too (relative 2^-9 each).
TORCH_KERNEL_ERR = {("int8", True): 6e-2, ("bfloat16", True): 2e-5, ("int8", False): 2e-5,
                    ("bfloat16", False): 1e-2}


@pytest.mark.parametrize("packed", [True, False], ids=["fbgemm", "unpacked"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 40])
def test_torch_quantized_matmul_matches_the_reference_for_decode_and_prefill_rows(kind, rows, packed):
    torch = pytest.importorskip("torch")
    w = torch.from_numpy(np.random.default_rng(4).standard_normal((300, 48)).astype(np.float32))
    q = ps.quantize({"lm_head.weight": w}, kind)["lm_head.weight"]
    q = q if packed else dataclasses.replace(q, packed=None)
    v = torch.from_numpy(np.random.default_rng(5).standard_normal((rows, 48)).astype(np.float32))
    out = load("torch").quantized_matmul(v, q)
    assert out.dtype == torch.float32 and tuple(out.shape) == (rows, 300)
    reference = quantized_matmul_ref(v, q, xp=load("torch").namespace())
    # 1 row: torch's kernels; 40 rows: tiles widened exactly, float32 GEMM
    bound = TORCH_KERNEL_ERR[kind, packed and q.packed is not None] if rows == 1 else 2e-5
    assert rel_err(out.numpy(), reference.numpy()) <= bound


def test_torch_packs_cpu_weights_for_fbgemm_except_bfloat16_beyond_float16s_range():
    torch = pytest.importorskip("torch")
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("fbgemm does not run on this CPU")
    w = torch.from_numpy(weights_matrix())
    for kind in KINDS:
        q = ps.quantize({"lm_head.weight": w}, kind)["lm_head.weight"]
        assert q.packed is not None and q.packed.kind == kind and q.packed.out_features == 24
    huge = ps.quantize({"lm_head.weight": w * 1e4}, "bfloat16")["lm_head.weight"]  # rows up to ~1e6 > 65504
    assert huge.packed is None
    v = torch.ones(1, 40)
    assert rel_err(load("torch").quantized_matmul(v, huge).numpy(),
                   quantized_matmul_ref(v, huge, xp=load("torch").namespace()).numpy()) <= 1e-2


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_quantized_params_hold_a_quarter_int8_and_half_bfloat16_of_the_float32_bytes(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    c = ps.Mamba2Config(d_model=256, n_layer=2, d_state=32, headdim=64, vocab_size=1024)
    params = ps.init_params(c, backend=backend)
    full = ps.params_nbytes(params)
    assert full == 4 * sum(int(np.prod(s)) for s in ps.param_shapes(c).values())
    for kind, low, high in (("int8", 0.25, 0.27), ("bfloat16", 0.5, 0.51)):
        q = ps.quantize(params, kind)
        for name in PROJECTIONS:  # the storage really is that small, scales included
            w = q[name]
            assert w.nbytes == w.data.nbytes + (0 if w.scale is None else w.scale.nbytes)
        assert low < ps.params_nbytes(q) / full < high, (kind, ps.params_nbytes(q) / full)


def test_quantize_and_load_pretrained_name_what_is_wrong(tmp_path):
    with pytest.raises(ValueError, match="kind: expected one of 'float32', 'bfloat16', 'int8', got 'int4'"):
        ps.quantize(HOST, "int4")
    with pytest.raises(TypeError, match="params: expected a dict"):
        ps.quantize([HOST], "int8")
    with pytest.raises(TypeError, match=r"params\['embedding.weight'\]: expected a float32 \[out, in\] matrix, got "
                                        r"float64 of shape \(50, 32\)"):
        ps.quantize(ps.cast_params(HOST, "float64"), "int8")
    with pytest.raises(TypeError, match=r"params\['embedding.weight'\]: already quantized \(int8\)"):
        ps.quantize(ps.quantize(HOST, "int8"), "bfloat16")
    name = "layers.1.mixer.out_proj.weight"
    bad = dict(HOST, **{name: np.full_like(HOST[name], np.nan)})
    with pytest.raises(ValueError, match=rf"params\['{name}'\]: expected finite values"):
        ps.quantize(bad, "int8")
    ps.Mamba2LM(HOST, CONFIG).save(tmp_path / "m.safetensors")
    with pytest.raises(ValueError, match="weights: expected one of"):
        ps.load_pretrained(tmp_path / "m.safetensors", weights="int4")
    with pytest.raises(TypeError, match="save: this model holds quantized weights"):
        ps.Mamba2LM(HOST, CONFIG).quantize("int8").save(tmp_path / "q.safetensors")


@pytest.mark.parametrize("kind", KINDS)
def test_load_pretrained_weights_option_quantizes_the_loaded_model(tmp_path, kind):
    ps.Mamba2LM(HOST, CONFIG, eos_token_id=3).save(tmp_path / "m.safetensors")
    lm = ps.load_pretrained(tmp_path / "m.safetensors", weights=kind)
    assert all(isinstance(lm.params[k], QuantizedWeight) and lm.params[k].kind == kind for k in PROJECTIONS)
    assert lm.eos_token_id == 3 and lm.dtype == "float32" and lm.backend == "numpy"
    assert lm.num_parameters == ps.Mamba2LM(HOST, CONFIG).num_parameters
    ids = prompt()
    assert rel_err(lm.logits(ids), logits(ids, host_dequantized(lm.params), config=CONFIG)) <= 2e-5


# --- quality on a trained model: random weights would exaggerate what rounding does ---

@pytest.fixture(scope="module")
def trained_params():
    """The benchmark's pattern LM (:func:`portable_ssm.bench.quality.train_pattern_lm`: 2 layers
    trained 150 AdamW steps, about 10 s on one idle core) as float32 numpy params. Torch runs on one
    thread meanwhile (the tests that use it too), as the model is too small to gain from more."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    params, loss = train_pattern_lm()
    assert loss < 0.2, f"the tiny LM did not learn its pattern (loss {loss:.3f})"
    yield params
    torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind, max_err", [("int8", 1e-2), ("bfloat16", 1e-2)])
def test_trained_model_keeps_its_logits_and_greedy_tokens_with_low_precision_weights(
        trained_params, backend, kind, max_err):
    # measured here: logits error ‖Δ‖/‖ref‖ 0.0041 int8, 0.0018 bf16 (the 80 rows take the reference
    # on CPU; generation decodes with torch's fbgemm kernels, see the decode-step test below); greedy
    # agreement 1.0 everywhere. The bounds leave 2.4x (int8) and 2.9x (bf16) for other BLAS
    # summation orders and torch versions.
    params = ps.cast_params(trained_params, "float32", backend=backend)
    ids = pattern()[np.arange(80) % PERIOD][None]  # [1, 80]: three and a third periods
    ids = ps.to_backend(ids, backend)
    q = ps.quantize(params, kind)
    ref, out = (load(backend).to_numpy(logits(ids, p, config=TRAINED)) for p in (params, q))
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert err <= max_err, f"{kind} logits relative error {err:.4f} > {max_err}"
    assert np.mean(out.argmax(-1) == ref.argmax(-1)) >= 0.95
    new = [load(backend).to_numpy(generate(ids[:, :16], p, config=TRAINED, max_new_tokens=64))[0, 16:]
           for p in (params, q)]
    assert np.mean(new[0] == new[1]) >= 0.95, f"{kind}: greedy agreement {np.mean(new[0] == new[1]):.3f}"
    # the float32 model learnt the pattern, so agreeing with it means continuing the pattern
    assert np.mean(new[0] == pattern()[np.arange(16, 80) % PERIOD]) >= 0.95


def _stepped_logits(ids, params, backend: str) -> np.ndarray:
    """The logits ``[1, l - 1, vocab]`` of decode steps over ``ids [1, l]`` after a one-token prefill."""
    _, state = logits(ids[:, :1], params, config=TRAINED, return_state=True)
    out = []
    for t in range(1, ids.shape[1]):
        step, state = logits_step(ids[:, t], state, params, config=TRAINED)
        out.append(load(backend).to_numpy(step))
    return np.stack(out, axis=1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_trained_model_keeps_its_decode_step_logits_with_low_precision_weights(trained_params, backend, kind):
    # decode runs the backends' low-precision kernels (one row per call); measured ‖Δ‖/‖ref‖: 0.0041
    # int8 and 0.0018 bf16 on NumPy and with torch's bf16 (fbgemm's float16 kernel, exact weights);
    # 0.0151 with torch's int8 (fbgemm also rounds the rows to 8 bits, as llama.cpp's q8_0 does)
    params = ps.cast_params(trained_params, "float32", backend=backend)
    ids = ps.to_backend(pattern()[np.arange(60) % PERIOD][None], backend)
    ref, out = (_stepped_logits(ids, p, backend) for p in (params, ps.quantize(params, kind)))
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert err <= (3e-2 if (backend, kind) == ("torch", "int8") else 1e-2), f"{kind} decode logits error {err:.4f}"
    assert np.mean(out.argmax(-1) == ref.argmax(-1)) >= 0.95


def test_a_quantized_weight_answers_with_its_own_storage_namespace_whatever_was_seen_before():
    torch = pytest.importorskip("torch")
    from portable_ssm._array import backend_name, namespace

    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    on_numpy = ps.quantize({"embedding.weight": w}, "int8")["embedding.weight"]
    on_torch = ps.quantize({"embedding.weight": torch.from_numpy(w)}, "int8")["embedding.weight"]
    for _ in range(2):  # namespaces are remembered by type for the libraries' arrays, never for wrappers
        assert backend_name(namespace(w=on_numpy)) == "numpy" and backend_name(namespace(w=on_torch)) == "torch"
    with pytest.raises(TypeError, match="w is a torch array but v is a numpy array"):
        namespace(v=on_numpy, w=on_torch)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stacked", [False, True], ids=["matrix rows", "stacked experts"])
def test_numpy_take_rows_widens_the_chosen_entries_to_the_bit_of_the_reference(kind, stacked):
    """The embedding lookup and a MoE block's chosen experts on NumPy (its ``take_rows`` fast op)
    equal the standard functions' widening bit for bit, repeated and unordered ids included; the
    bfloat16 weight holds every finite bit pattern's neighbourhood (subnormals, ±0, large values)."""
    rng = np.random.default_rng(11)
    shape = (6, 9, 40) if stacked else (64, 48)
    w = (rng.standard_normal(shape) * 2.0 ** rng.integers(-140, 100, shape)).astype(np.float32)
    q = ps.quantize({"lm_head.weight": w}, kind)["lm_head.weight"]
    ids = np.array([3, 0, 3, 5])
    xp = load("numpy").namespace()
    native = fast_op(xp, "take_rows")
    got, ref = native(q, ids), quantized.take_rows_ref(q, ids, xp=xp)
    assert got.dtype == np.float32 and got.shape == ref.shape == (4, *shape[1:])
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))
