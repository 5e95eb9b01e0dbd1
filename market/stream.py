"""The market model outside training: batch prediction and a streaming predictor, on any backend.

The model is ``features [b, l, F] -> Linear -> Mamba-2 backbone -> Linear -> [b, l]`` (the training
example's ``MarketNet``); ``head`` holds its two linear maps as ``{"inp.weight" [d_model, F],
"inp.bias" [d_model], "head.weight" [1, d_model], "head.bias" [1]}`` on the backbone's backend.

:class:`StreamPredictor` keeps the :class:`~portable_ssm.Mamba2State` and the last ``LOOKBACK``
bars, and turns each new bar into one prediction with :func:`portable_ssm.step`: no window is
recomputed. Its predictions equal :func:`predict` over the same bars (a test holds them together).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from portable_ssm import Mamba2Config, Mamba2State, forward, step, to_backend
from portable_ssm._array import array_backend, device, namespace

from .bars import Bars
from .features import LOOKBACK, Normaliser, bar_features, model_inputs
from .live import HEAD_NAMES, _linear


def predict(x: Any, head: dict[str, Any], params: dict[str, Any], *, config: Mamba2Config) -> Any:
    """Normalised features ``x [b, l, F]`` (the backbone's backend and dtype) -> predictions ``[b, l]``
    (a return, or a direction logit)."""
    u = _linear(x, head["inp.weight"], head["inp.bias"])  # [b, l, d_model]
    y = forward(u, params, config=config)  # [b, l, d_model]
    return _linear(y, head["head.weight"], head["head.bias"])[..., 0]  # [b, l]


class StreamPredictor:
    """One bar in, one prediction out, in O(1) work per bar (the SSM state carries the history).

    Args:
        head: the two linear maps (see the module docstring), on the backbone's backend.
        params: the Mamba-2 backbone's parameter dict; config: its :class:`Mamba2Config`.
        normaliser: the training span's frozen feature statistics.
    """

    def __init__(self, head: dict[str, Any], params: dict[str, Any], *, config: Mamba2Config,
                 normaliser: Normaliser) -> None:
        missing = [n for n in HEAD_NAMES if n not in head]
        if missing:
            raise ValueError(f"head: missing {missing}; expected {list(HEAD_NAMES)}")
        self.head, self.params, self.config, self.normaliser = head, params, config, normaliser
        like = head["inp.weight"]
        self._xp, self._backend, self._device, self._dtype = (namespace(like=like), array_backend(like),
                                                              device(like), like.dtype)
        self._recent: list[tuple[float, ...]] = []  # the last LOOKBACK bars (o, h, l, c, v)
        self.state: Mamba2State | None = None

    def update(self, open: float, high: float, low: float, close: float, volume: float) -> float | None:
        """Takes the bar that just closed; returns the prediction made at its close (None until
        ``LOOKBACK`` bars have been seen, since the first bar has no features)."""
        self._recent = [*self._recent[1 - LOOKBACK:], (open, high, low, close, volume)]
        if len(self._recent) < LOOKBACK:
            return None
        o, h, lo, c, v = np.array(self._recent, dtype=np.float64).T  # [LOOKBACK] each
        bars = Bars(ts_event=np.zeros(LOOKBACK, np.int64), open=o, high=h, low=lo, close=c, volume=v)
        row = model_inputs(bar_features(bars)[-1:], self.normaliser)  # [1, F]; a NaN feature reads 0
        x_t = to_backend(row, self._backend, device=self._device)
        x_t = self._xp.astype(x_t, self._dtype)  # [1, F]
        u = _linear(x_t, self.head["inp.weight"], self.head["inp.bias"])  # [1, d_model]
        y, self.state = step(u, self.state, self.params, config=self.config)
        out = _linear(y, self.head["head.weight"], self.head["head.bias"])  # [1, 1]
        return float(to_backend(out, "numpy")[0, 0])
