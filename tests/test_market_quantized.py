"""A market model stored in int8 or bfloat16 (MarketModel.quantize): its streams equal its own batch
forward within float32 rounding on the fast path (RowsStep, NumPy and torch views) and the reference,
its predictions stay near the float32 model's, it survives save/load bit for bit, bad kinds are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("databento_dbn")
from portable_ssm.backends.numpy import kernels as numpy_kernels  # noqa: E402
from portable_ssm.market import MarketDataError, MarketModel, synthetic_bars  # noqa: E402
from test_market_model import _model, _stream_and_compare, _with_nan  # noqa: E402

from portable_ssm import QuantizedWeight, load_params, to_backend  # noqa: E402
from portable_ssm._array import namespace  # noqa: E402
from portable_ssm.quantized import dequantize  # noqa: E402

KINDS = ("int8", "bfloat16")
BACKENDS = ("numpy", "torch")


def _backend(name: str) -> None:
    if name == "torch":
        pytest.importorskip("torch")


def _storage(weight: QuantizedWeight) -> list[np.ndarray]:
    """A quantized weight's storage on the host: int8 data and scales, or bfloat16's values (widened
    exactly, so equal values are equal bits whether they were torch bfloat16 or NumPy uint16 bits)."""
    parts = [weight.data, weight.scale] if weight.kind == "int8" else [dequantize(weight, xp=namespace(w=weight.data))]
    return [np.asarray(to_backend(part, "numpy")) for part in parts]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fast", [True, False], ids=["fast path", "portable_ssm.step"])
def test_a_quantized_model_streams_instruments_joining_and_leaving_equal_to_its_own_batch_forward(kind, backend,
                                                                                                 fast):
    _backend(backend)
    model = _model(backend).quantize(kind)
    series = {i: synthetic_bars(("planted", "random-walk")[i % 2], 24, seed=20 + i) for i in range(6)}
    series[3] = _with_nan(series[3], 9)
    joins, leaves = {i: 0 if i < 4 else 2 + 3 * i for i in series}, {1: 15}  # 4 and 5 join later, 1 leaves
    stream = model.stream(instruments=[], fast=fast)
    assert (stream._bar is not None) == (fast and numpy_kernels.library() is not None)  # torch: host views
    _stream_and_compare(model, stream, series, joins, leaves, skipping=2, count=24)
    assert stream.instruments == (0, 2, 3, 4, 5)


@pytest.mark.parametrize(("kind", "bound"), [("int8", 2e-2), ("bfloat16", 1e-2)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_predictions_stay_near_the_float32_models_and_use_the_quantized_weights(kind, bound, backend):
    _backend(backend)
    model = _model(backend)
    quantized = model.quantize(kind)
    assert quantized.weights == kind and model.weights == "float32"
    for name, value in quantized.params.items():
        projection = name.endswith(("in_proj.weight", "out_proj.weight"))
        assert isinstance(value, QuantizedWeight) == projection and (projection or value is model.params[name])
    assert quantized.head is model.head  # the head stays float32
    bars = synthetic_bars("planted", 60, seed=8)
    want, got = model.predict(bars)[1:], quantized.predict(bars)[1:]
    assert not np.array_equal(got, want)  # the batch forward computes with the quantized weights
    assert np.max(np.abs(got - want)) <= bound * np.max(np.abs(want))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_saved_quantized_model_loads_back_with_the_same_stored_weights_bit_for_bit(tmp_path, kind, backend):
    _backend(backend)
    model = _model().quantize(kind)
    model.save(tmp_path)
    assert json.loads((tmp_path / "market.json").read_text())["weights"] == kind
    plain, _ = load_params(tmp_path / "model.safetensors")  # the file holds plain float32 arrays
    assert all(a.dtype == np.float32 for a in plain.values())
    back = MarketModel.load(tmp_path, backend=backend)
    assert back.weights == kind
    for name, weight in model.params.items():
        if isinstance(weight, QuantizedWeight):
            for a, b in zip(_storage(weight), _storage(back.params[name]), strict=True):
                np.testing.assert_array_equal(a, b, err_msg=name)
    bars = synthetic_bars("random-walk", 40, seed=3)
    np.testing.assert_allclose(back.predict(bars), model.predict(bars), rtol=1e-5, atol=1e-6)


def test_a_market_json_without_weights_loads_float32_and_one_with_a_bad_kind_is_refused_naming_it(tmp_path):
    _model().save(tmp_path)
    data = json.loads((tmp_path / "market.json").read_text())
    del data["weights"]
    (tmp_path / "market.json").write_text(json.dumps(data))
    assert MarketModel.load(tmp_path).weights == "float32"  # files from before the field
    data["weights"] = "int4"
    (tmp_path / "market.json").write_text(json.dumps(data))
    with pytest.raises(MarketDataError, match=r"market.json.*weights.*'int4'"):
        MarketModel.load(tmp_path)


def test_bad_kinds_are_refused_by_name():
    model = _model()
    with pytest.raises(ValueError, match=r"kind: expected one of .*got 'int4'"):
        model.quantize("int4")
    with pytest.raises(TypeError, match="kind"):
        model.quantize(8)
    int8 = model.quantize("int8")
    assert int8.quantize("int8") is int8 and model.quantize("float32") is model
    with pytest.raises(ValueError, match="kind: this model's projections are already 'int8'"):
        int8.quantize("bfloat16")


def test_a_model_whose_projections_mix_storage_kinds_is_refused():
    model = _model()
    mixed = {**model.params, "layers.0.mixer.in_proj.weight": model.quantize("int8").params[
        "layers.0.mixer.in_proj.weight"]}
    with pytest.raises(ValueError, match="params: the projections must share one storage kind"):
        MarketModel(config=model.config, params=mixed, head=model.head, normaliser=model.normaliser)


def test_a_run_whose_weights_cannot_be_quantized_is_a_market_data_error_naming_it(tmp_path):
    model = _model()
    params = dict(model.params)
    params["layers.1.mixer.out_proj.weight"] = params["layers.1.mixer.out_proj.weight"].copy()
    params["layers.1.mixer.out_proj.weight"][3, 2] = np.inf  # no int8 scale holds it
    MarketModel(config=model.config, params=params, head=model.head, normaliser=model.normaliser).save(tmp_path)
    data = json.loads((tmp_path / "market.json").read_text())
    (tmp_path / "market.json").write_text(json.dumps({**data, "weights": "int8"}))
    with pytest.raises(MarketDataError, match=r"does not fit together.*out_proj.weight.*row 3"):
        MarketModel.load(tmp_path)
