"""Market data for portable_ssm: DBN / csv / parquet bars, leak-free features, baselines, streaming.

Installed as ``portable_ssm.market`` (from the repository's ``market/`` folder, like ``backends/``):
host-side data tooling that uses NumPy freely, kept out of the array-API core. Needs the
``[market]`` extra (databento-dbn) for DBN files and ``[data]`` (pandas, pyarrow) for tables.
``import portable_ssm`` does not import it.

    bars        Bars, read_bars / read_bars_by_instrument (DBN), read_table (csv/parquet), write_ohlcv_dbn,
                fixed_to_float, resample
    dbn         iter_records, layout: DBN / DBN+zstd in chunks of NumPy structured records
    _checks     MarketDataError: the one error a malformed, truncated or unordered file raises
    features    bar_features, targets, Normaliser, model_inputs, windows, walk_forward, split_at, Split
    baselines   baselines (zero, last return, AR(p), majority), losses, compare
    panel       shared_split, SharedSplit, shared_normaliser, stack_windows: many instruments, one time boundary
    model       MarketModel: backbone, head, normaliser and settings; save / load a run directory
    live        MarketStream: N instruments, a batch row each, joining and leaving, one step per bar
    numpy_step  NumpyStep: MarketStream's in-place NumPy step where the compiled library is not built
    stream      predict (batch over features), StreamPredictor (one instrument, the first streaming path)
    synthetic   synthetic_bars (random walk, or a planted volume-regime component)
"""

from ._checks import MarketDataError
from .bars import (
    Bars,
    fixed_to_float,
    float_to_fixed,
    ohlcv_records,
    read_bars,
    read_bars_by_instrument,
    read_dbn_columns,
    read_table,
    resample,
    write_ohlcv_dbn,
)
from .baselines import baselines, compare, losses
from .dbn import iter_records, layout
from .features import (
    FEATURES,
    LOOKBACK,
    Normaliser,
    Split,
    bar_features,
    feature_rows,
    model_inputs,
    split_at,
    targets,
    trailing_return,
    walk_forward,
    windows,
)
from .live import MarketStream
from .model import MarketModel
from .panel import SharedSplit, shared_normaliser, shared_split, stack_windows
from .stream import StreamPredictor, predict
from .synthetic import synthetic_bars

__all__ = [
    "Bars", "FEATURES", "LOOKBACK", "MarketDataError", "MarketModel", "MarketStream", "Normaliser", "SharedSplit",
    "Split", "StreamPredictor", "bar_features", "baselines", "compare", "feature_rows", "fixed_to_float",
    "float_to_fixed", "iter_records", "layout", "losses", "model_inputs", "ohlcv_records", "predict", "read_bars",
    "read_bars_by_instrument", "read_dbn_columns", "read_table", "resample", "shared_normaliser", "shared_split",
    "split_at", "stack_windows", "synthetic_bars", "targets", "trailing_return", "walk_forward", "windows",
    "write_ohlcv_dbn",
]
