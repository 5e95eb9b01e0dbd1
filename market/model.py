"""The market model as one object: what a training run saves, loaded from its run directory in one call.

A run directory holds three files, each written atomically (temporary file, fsync, rename):

    model.safetensors   the Mamba-2 backbone (:func:`portable_ssm.save_params`, config inside)
    head.safetensors    the input and output maps: inp.weight [d_model, F], inp.bias [d_model],
                        head.weight [1, d_model], head.bias [1]
    market.json         features, normaliser mean/std, target kind, horizon, target scale,
                        window length, instruments, where the data came from, and how the
                        backbone's projections are stored ("weights": "float32", "int8" or
                        "bfloat16"; absent in files before it: "float32")

A model of :meth:`MarketModel.quantize` (projections stored as int8 or bfloat16) is saved as the
float32 values its quantized weights stand for (each exactly representable, so quantizing them
again at :meth:`MarketModel.load` gives back the same int8 rows and scales, or the same bfloat16
bits): safetensors here holds plain arrays only (:func:`portable_ssm.save_params` refuses a
:class:`~portable_ssm.QuantizedWeight`), so the file is float32-sized and the kind lives in
market.json.

:meth:`MarketModel.load` checks each (MarketDataError naming the file for market.json,
CheckpointError for the safetensors files); :meth:`MarketModel.predict` runs the batch forward
over bars and :meth:`MarketModel.stream` gives a :class:`~portable_ssm.market.MarketStream` that
predicts the same numbers one bar at a time, for any number of instruments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from portable_ssm import Mamba2Config, load_arrays, load_params, save_arrays, save_params, to_backend
from portable_ssm._array import array_backend, device, namespace
from portable_ssm.io.atomic import replace_atomically
from portable_ssm.io.errors import CheckpointError
from portable_ssm.io.strict_json import loads
from portable_ssm.quantized import KINDS, QuantizedWeight, dequantize, quantize

from ._checks import MarketDataError, as_path, check_choice, check_int, check_real, open_regular
from .bars import Bars
from .features import FEATURES, TARGETS, Normaliser, bar_features, model_inputs
from .live import HEAD_NAMES, MarketStream, check_head
from .stream import predict as predict_features

MODEL_FILE, HEAD_FILE, MARKET_FILE = "model.safetensors", "head.safetensors", "market.json"
FORMAT = "portable_ssm.market/1"
MAX_JSON_BYTES = 1 << 20
#: The backbone's parameters (their last two parts) :meth:`MarketModel.quantize` stores in low
#: precision: the mixers' projections, nearly all of the weight bytes a bar reads.
PROJECTIONS = ("in_proj.weight", "out_proj.weight")


@dataclass(frozen=True)
class MarketModel:
    """features -> Linear -> Mamba-2 backbone -> Linear, with the settings it was trained under.

    Attributes:
        config, params: the backbone; head: the two linear maps (:data:`HEAD_NAMES`) on its backend.
        normaliser: the training span's feature statistics.
        target: ``"return"`` (outputs times ``target_scale`` are log returns) or ``"direction"``
            (outputs are logits of an up move); horizon: bars ahead (int >= 1).
        seq_len: the training window length; instruments: the instrument ids trained on.
        info: provenance (data file, split boundary), JSON-serialisable.

    The backbone's projections may be stored as int8 or bfloat16 (:meth:`quantize`,
    :attr:`weights`); the batch forward and every stream then compute with those same weights.
    """

    config: Mamba2Config
    params: dict[str, Any]
    head: dict[str, Any]
    normaliser: Normaliser
    target: str = "return"
    horizon: int = 1
    target_scale: float = 1.0
    seq_len: int = 60
    instruments: tuple[int, ...] = ()
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_head(self.head, self.config, len(FEATURES))
        if not isinstance(self.normaliser, Normaliser) or self.normaliser.mean.shape != (len(FEATURES),):
            raise ValueError(f"normaliser: expected a Normaliser of {len(FEATURES)} features")
        check_choice("target", self.target, TARGETS)
        check_int("horizon", self.horizon, minimum=1)
        check_int("seq_len", self.seq_len, minimum=1)
        check_real("target_scale", self.target_scale, low=0.0, high=math.inf, open_low=True, open_high=True)
        object.__setattr__(self, "instruments", tuple(check_int("instruments", i, minimum=0)
                                                      for i in self.instruments))
        kinds = {name: _kind(w) for name, w in self.params.items() if _is_projection(name)}
        if len(set(kinds.values())) > 1:
            raise ValueError(f"params: the projections must share one storage kind, got {kinds}")

    @property
    def weights(self) -> str:
        """How the backbone's projections are stored: ``"float32"``, ``"int8"`` or ``"bfloat16"``."""
        return next((_kind(w) for name, w in self.params.items() if _is_projection(name)), "float32")

    def quantize(self, kind: str) -> MarketModel:
        """This model with the backbone's projections (``in_proj``, ``out_proj``) stored as ``kind``:
        ``"int8"`` (one float32 scale per output row), ``"bfloat16"``, or ``"float32"`` (this model).
        The head and everything else stay float32 (the input map and the head are under 1% of the
        bytes a bar reads, and the head's error would land on the prediction unnormalised).
        :meth:`predict` and :meth:`stream` of the result compute with the quantized weights, so its
        streaming equals its batch forward within float32 rounding; its predictions differ from
        this model's by the quantization (about 1e-2 relative for int8, less for bfloat16).
        On torch, int8 weights keep no fbgemm copy (:func:`portable_ssm.quantize` adds one, whose
        kernel rounds the activations to 8 bits as well): every product is weight-only, as the
        stream's. ValueError naming ``kind`` for an unknown kind, or when this model is already
        stored in another low precision (quantize its float32 model)."""
        kind = check_choice("kind", kind, KINDS)
        if kind == self.weights:
            return self
        if self.weights != "float32":
            raise ValueError(f"kind: this model's projections are already {self.weights!r}, got {kind!r}; "
                             f"quantize the float32 model instead")
        names = [name for name in self.params if _is_projection(name)]
        params = quantize(self.params, kind, names=names)
        if kind == "int8":  # torch's fbgemm copy would round each product's rows to 8 bits too: weight-only here
            params = {k: dataclasses.replace(w, packed=None) if k in names else w for k, w in params.items()}
        return dataclasses.replace(self, params=params)

    def predict(self, bars: Bars) -> np.ndarray:
        """Model outputs ``[N]`` float64 at each bar's close over one instrument's ``bars`` (the
        batch forward); NaN at bar 0, which has no features."""
        x = model_inputs(bar_features(bars)[1:], self.normaliser)[None]  # [1, N - 1, F]
        like = self.head["inp.weight"]
        x_b = to_backend(x, array_backend(like), device=device(like))
        out = np.asarray(to_backend(predict_features(x_b, self.head, self.params, config=self.config), "numpy"),
                         dtype=np.float64)[0]  # [N - 1]
        return np.concatenate([[np.nan], out])

    def to_target(self, outputs: np.ndarray) -> np.ndarray:
        """Outputs in the target's units: log returns (``target="return"``) or P(up) (``"direction"``)."""
        outputs = np.asarray(outputs, dtype=np.float64)
        return outputs * self.target_scale if self.target == "return" else 1.0 / (1.0 + np.exp(-outputs))

    def stream(self, instruments: tuple[int, ...] | list[int] | None = None, *, fast: bool = True) -> MarketStream:
        """A :class:`MarketStream` over ``instruments`` (default: those trained on, or none);
        ``fast=False`` steps through :func:`portable_ssm.step` alone (the reference)."""
        chosen = self.instruments if instruments is None else instruments
        return MarketStream(self.head, self.params, config=self.config, normaliser=self.normaliser,
                            instruments=chosen, fast=fast)

    def save(self, run: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> None:
        """Writes the three files of the module docstring into ``run`` (created if missing);
        ``metadata`` goes into model.safetensors (:func:`portable_ssm.save_params`). Quantized
        projections are written as the float32 values they stand for (module docstring)."""
        run = as_path("run", run)
        run.mkdir(parents=True, exist_ok=True)
        params = {name: dequantize(w, xp=namespace(like=w.data)) if isinstance(w, QuantizedWeight) else w
                  for name, w in self.params.items()}
        save_params(run / MODEL_FILE, params, self.config, metadata=metadata)
        save_arrays(run / HEAD_FILE, self.head)
        text = json.dumps({"format": FORMAT, "features": list(FEATURES), "mean": self.normaliser.mean.tolist(),
                           "std": self.normaliser.std.tolist(), "target": self.target, "horizon": self.horizon,
                           "target_scale": self.target_scale, "seq_len": self.seq_len,
                           "instruments": list(self.instruments), "info": self.info, "weights": self.weights},
                          indent=1)
        replace_atomically(run / MARKET_FILE, lambda f: f.write(text.encode()))

    @classmethod
    def load(cls, run: str | os.PathLike, *, backend: str = "numpy", device: Any = None) -> MarketModel:
        """The model :meth:`save` (or ``examples/train_market.py``) wrote into ``run``, on ``backend``,
        its projections stored as market.json's ``"weights"`` says (quantized here, on ``backend``)."""
        run = as_path("run", run)
        settings = _read_settings(run / MARKET_FILE)
        kind = settings.pop("weights")
        params, config = load_params(run / MODEL_FILE, backend=backend, device=device)
        head, _ = load_arrays(run / HEAD_FILE, backend=backend, device=device)
        if set(head) != set(HEAD_NAMES):
            raise CheckpointError(f"{run / HEAD_FILE}: expected the tensors {list(HEAD_NAMES)}, got {sorted(head)}")
        try:
            return cls(config=config, params=params, head=head, **settings).quantize(kind)
        except (TypeError, ValueError) as err:
            raise MarketDataError(f"{run}: the saved model does not fit together ({err})") from None


def _read_settings(path: Path) -> dict[str, Any]:
    """market.json's fields as MarketModel arguments; MarketDataError naming the file when malformed."""
    f, size = open_regular(path)
    with f:
        if size > MAX_JSON_BYTES:
            raise MarketDataError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} a market.json may hold")
        text = f.read(MAX_JSON_BYTES + 1)
    try:
        data = loads(text, str(path))
    except CheckpointError as err:
        raise MarketDataError(str(err)) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise MarketDataError(f"{path}: not a market model file (expected \"format\": {FORMAT!r})")
    if data.get("features") != list(FEATURES):
        raise MarketDataError(f"{path}: features {data.get('features')!r}; this version computes {list(FEATURES)}")
    weights = data.get("weights", "float32")
    if weights not in KINDS:
        raise MarketDataError(f"{path}: \"weights\" must be one of {list(KINDS)}, got {weights!r}")
    try:
        normaliser = Normaliser(mean=np.array(data["mean"], dtype=np.float64),
                                std=np.array(data["std"], dtype=np.float64))
        return {"normaliser": normaliser, "target": data["target"], "horizon": data["horizon"],
                "target_scale": data["target_scale"], "seq_len": data["seq_len"],
                "instruments": tuple(data["instruments"]), "info": dict(data.get("info", {})), "weights": weights}
    except (KeyError, TypeError, ValueError) as err:
        raise MarketDataError(f"{path}: malformed field ({type(err).__name__}: {err})") from None




def _is_projection(name: str) -> bool:
    return ".".join(name.split(".")[-2:]) in PROJECTIONS


def _kind(weight: Any) -> str:
    """A projection's storage: its :class:`QuantizedWeight` kind, or ``"float32"`` for a plain array."""
    return weight.kind if isinstance(weight, QuantizedWeight) else "float32"
