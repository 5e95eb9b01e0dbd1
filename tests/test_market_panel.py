"""Many instruments, one time boundary: no window straddles it, the normaliser reads training spans only,
and each instrument's windows are the single-instrument path's."""

from __future__ import annotations

import numpy as np
import pytest
from portable_ssm.market import (
    Bars,
    Normaliser,
    bar_features,
    model_inputs,
    shared_normaliser,
    shared_split,
    split_at,
    stack_windows,
    synthetic_bars,
    walk_forward,
    windows,
)

WINDOW, HORIZON, EMBARGO = 8, 2, 3


def _shifted(bars: Bars, start_ns: int, step_ns: int) -> Bars:
    ts = start_ns + step_ns * np.arange(len(bars), dtype=np.int64)
    return Bars(ts_event=ts, open=bars.open, high=bars.high, low=bars.low, close=bars.close, volume=bars.volume)


def _two_instruments() -> dict[int, Bars]:
    """Instrument 7 starts later and has bars twice as often as instrument 3: their bar indices differ
    at any one time, so an index boundary would straddle in time."""
    return {7: _shifted(synthetic_bars("random-walk", 500, seed=1), 3_000, 30),
            3: _shifted(synthetic_bars("random-walk", 300, seed=2), 0, 60)}


def test_windows_of_two_instruments_never_straddle_the_shared_boundary():
    bars = _two_instruments()
    split = shared_split(bars, window=WINDOW, horizon=HORIZON, embargo=EMBARGO, val_fraction=0.3)
    assert split.instruments == (3, 7)
    last_train, first_val = [], []
    for i, s in split.splits.items():
        ts = bars[i].ts_event
        assert s.train_ends.size and s.val_ends.size
        # training: features and targets (bar e + horizon) all before the boundary time
        last_train.append(ts[s.train_ends.max() + HORIZON])
        # validation: every bar of every window at or after it, and embargo bars past the boundary bar
        first_val.append(ts[s.val_ends.min() - WINDOW + 1])
        assert s.val_ends.min() - WINDOW + 1 >= s.boundary + EMBARGO
    assert max(last_train) < split.boundary_ns <= min(first_val)


def test_the_normaliser_is_fitted_on_the_training_spans_only():
    bars = _two_instruments()
    split = shared_split(bars, window=WINDOW, horizon=HORIZON, embargo=EMBARGO, val_fraction=0.3)
    features = {i: bar_features(b) for i, b in bars.items()}
    fitted = shared_normaliser(features, split)
    # anything at or after each boundary bar changed wildly: the statistics do not move
    spoiled = {i: np.where(np.arange(f.shape[0])[:, None] >= split.splits[i].boundary, 1e6, f)
               for i, f in features.items()}
    again = shared_normaliser(spoiled, split)
    np.testing.assert_array_equal(fitted.mean, again.mean)
    np.testing.assert_array_equal(fitted.std, again.std)
    rows = np.concatenate([features[i][1:split.splits[i].boundary] for i in (3, 7)])
    rows = rows[np.isfinite(rows).all(axis=1)]
    np.testing.assert_array_equal(fitted.mean, rows.mean(axis=0))


def test_each_instruments_windows_equal_the_single_instrument_paths():
    bars = _two_instruments()
    split = shared_split(bars, window=WINDOW, horizon=HORIZON, embargo=EMBARGO, val_fraction=0.3)
    normaliser = shared_normaliser({i: bar_features(b) for i, b in bars.items()}, split)
    inputs = {i: model_inputs(bar_features(b), normaliser) for i, b in bars.items()}
    x, owner = stack_windows(inputs, {i: s.train_ends for i, s in split.splits.items()}, WINDOW)
    for i, b in bars.items():
        alone = split_at(split.splits[i].boundary, len(b), len(b), window=WINDOW, horizon=HORIZON, embargo=EMBARGO)
        np.testing.assert_array_equal(split.splits[i].train_ends, alone.train_ends)
        np.testing.assert_array_equal(split.splits[i].val_ends, alone.val_ends)
        np.testing.assert_array_equal(x[owner == i], windows(model_inputs(bar_features(b), normaliser),
                                                             alone.train_ends, WINDOW))
    assert list(np.unique(owner)) == [3, 7] and (np.diff(owner) >= 0).all()


def test_one_instrument_splits_and_normalises_as_walk_forward_does():
    bars = _shifted(synthetic_bars("random-walk", 500, seed=3), 0, 60)
    shared = shared_split({5: bars}, window=WINDOW, horizon=HORIZON, embargo=EMBARGO, val_fraction=0.2)
    alone = walk_forward(len(bars), window=WINDOW, horizon=HORIZON, embargo=EMBARGO, val_fraction=0.2)[0]
    assert shared.splits[5].boundary == alone.boundary
    np.testing.assert_array_equal(shared.splits[5].train_ends, alone.train_ends)
    np.testing.assert_array_equal(shared.splits[5].val_ends, alone.val_ends)
    features = bar_features(bars)
    one, many = Normaliser.fit(features, alone.boundary), shared_normaliser({5: features}, shared)
    np.testing.assert_array_equal(one.mean, many.mean)
    np.testing.assert_array_equal(one.std, many.std)


def test_an_instrument_wholly_after_the_boundary_only_validates():
    bars = _two_instruments()
    bars[9] = _shifted(synthetic_bars("random-walk", 100, seed=4), 10**9, 60)
    split = shared_split(bars, window=WINDOW, horizon=HORIZON, embargo=EMBARGO, boundary_ns=10**9)
    assert split.splits[9].train_ends.size == 0 and split.splits[9].val_ends.size > 0


def test_bad_arguments_are_refused_by_name():
    bars = _two_instruments()
    with pytest.raises(TypeError, match="bars"):
        shared_split([bars[3]], window=WINDOW, horizon=HORIZON, embargo=EMBARGO)
    with pytest.raises(TypeError, match="instrument id"):
        shared_split({1.0: bars[3]}, window=WINDOW, horizon=HORIZON, embargo=EMBARGO)
    with pytest.raises(ValueError, match="no instrument has a training window"):
        shared_split(bars, window=WINDOW, horizon=HORIZON, embargo=EMBARGO, boundary_ns=0)
    split = shared_split(bars, window=WINDOW, horizon=HORIZON, embargo=EMBARGO)
    with pytest.raises(ValueError, match="features"):
        shared_normaliser({3: bar_features(bars[3])}, split)
