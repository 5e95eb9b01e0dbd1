"""Market data for portable_ssm: DBN / csv / parquet bars, leak-free features, baselines, streaming.

Installed as ``portable_ssm.market`` (from the repository's ``market/`` folder, like ``backends/``):
host-side data tooling that uses NumPy freely, kept out of the array-API core. Needs the
``[market]`` extra (databento-dbn) for DBN files and ``[data]`` (pandas, pyarrow) for tables.
``import portable_ssm`` does not import it.

    bars        Bars, read_bars (DBN), read_table (csv/parquet), write_ohlcv_dbn, fixed_to_float
    features    bar_features, targets, Normaliser, windows, walk_forward, Split
    baselines   baselines (zero, last return, AR(p), majority), losses, compare
    stream      predict (batch), StreamPredictor (one bar at a time through portable_ssm.step)
    synthetic   synthetic_bars (random walk, or a planted volume-regime component)
"""

from .bars import Bars, fixed_to_float, float_to_fixed, read_bars, read_dbn_columns, read_table, write_ohlcv_dbn
from .baselines import baselines, compare, losses
from .features import (
    FEATURES,
    LOOKBACK,
    Normaliser,
    Split,
    bar_features,
    targets,
    trailing_return,
    walk_forward,
    windows,
)
from .stream import StreamPredictor, predict
from .synthetic import synthetic_bars

__all__ = [
    "FEATURES", "LOOKBACK", "Bars", "Normaliser", "Split", "StreamPredictor", "bar_features", "baselines",
    "compare", "fixed_to_float", "float_to_fixed", "losses", "predict", "read_bars", "read_dbn_columns",
    "read_table", "synthetic_bars", "targets", "trailing_return", "walk_forward", "windows", "write_ohlcv_dbn",
]
