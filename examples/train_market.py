"""Forecasting bars of market data with Mamba-2: DBN / csv / parquet in, checkpoint + plots + a JSON line out.

Each bar becomes a feature row (log return, range, body, log volume, volume change; see
``portable_ssm.market.features``); windows of ``--seq-len`` bars, every ``--stride`` bars, are the
sequences ``[b, 60, F]``. The target of bar t is the next ``--horizon`` bars' log return
(``--target return``, squared error) or its sign (``--target direction``, cross-entropy). A
walk-forward split keeps the time order: training windows learn only targets before the boundary,
validation windows start ``--embargo`` bars after it, and the features are normalised with the
training span's statistics. The model is scored at the last bar of each validation window, on the
same bars as the baselines (zero / last return / AR(p), or majority / last sign / AR sign), and
``beats_baseline`` is true only when it beats every one by more than 2 standard errors.

Without ``--data`` a synthetic DBN file is generated into ``--out`` (``--synthetic planted``: return
autocorrelation whose sign follows a volume regime; ``random-walk``: nothing to learn).

    python examples/train_market.py --quick
    python examples/train_market.py --quick --synthetic random-walk
    python examples/train_market.py --data glbx-ohlcv-1m.dbn.zst --steps 3000 --out runs/es
    python examples/train_market.py --data prices.csv --time-col date --close-col close --volume-col volume
    python examples/train_market.py --data desk.dbn.zst --all-instruments --steps 3000 --out runs/desk

Several instruments (``--instrument-id 1 2 3`` or ``--all-instruments``, DBN only) train one model on
all their windows: one boundary time is shared by every instrument (``portable_ssm.market.panel``), the
normaliser is fitted on every instrument's training span, and the saved ``MarketModel`` records them.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from common import Task, base_parser, exported_step, last, parse, report, setup_distributed, teardown, train
from portable_ssm.backends.torch import Mamba2Module
from portable_ssm.market import (
    FEATURES,
    Bars,
    MarketModel,
    Normaliser,
    SharedSplit,
    bar_features,
    baselines,
    compare,
    losses,
    model_inputs,
    read_bars,
    read_bars_by_instrument,
    read_table,
    shared_normaliser,
    shared_split,
    stack_windows,
    synthetic_bars,
    targets,
    trailing_return,
    walk_forward,
    write_ohlcv_dbn,
)
from torch import nn

from portable_ssm import Mamba2Config

DEFAULTS = dict(steps=1500, batch_size=32, lr=2e-3, d_model=64, n_layer=2, d_state=32, headdim=16,
                eval_every=100, ckpt_every=500, out="runs/market")
QUICK = dict(steps=120, batch_size=16, lr=3e-3, d_model=32, n_layer=2, d_state=16, headdim=8, eval_every=120,
             ckpt_every=120)
PREDICTIONS_PLOT = "validation.png"
EVAL_BATCH = 512


class MarketNet(nn.Module):
    """features -> d_model (linear) -> Mamba-2 backbone -> one output per bar: ``[b, l, F] -> [b, l]``.
    Its linear maps are named ``inp`` and ``head`` as ``portable_ssm.market.stream`` expects."""

    def __init__(self, features: int, core: Mamba2Module) -> None:
        super().__init__()
        self.inp = nn.Linear(features, core.config.d_model)
        self.core = core
        self.head = nn.Linear(core.config.d_model, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.core(self.inp(x)))[..., 0]


def several(args: argparse.Namespace) -> bool:
    """Whether the run trains over several instruments of one DBN file."""
    return args.all_instruments or len(args.instrument_id or ()) > 1


def load_instruments(args: argparse.Namespace, out: Path) -> tuple[dict[int, Bars], str]:
    """``{instrument_id: Bars}`` of the run (one entry, keyed by its id or 0, unless several were
    asked for), and the data's path."""
    if several(args):
        if args.data is None or ".dbn" not in Path(args.data).suffixes:
            raise SystemExit("--instrument-id with several ids / --all-instruments: needs --data with a DBN file")
        bars = read_bars_by_instrument(args.data, instrument_ids=args.instrument_id, interval_ns=args.interval_ns)
        return bars, str(args.data)
    bars, source = load_bars(args, out)
    return {args.instrument_id[0] if args.instrument_id else 0: bars}, source


def load_bars(args: argparse.Namespace, out: Path) -> tuple[Bars, str]:
    """The bars of ``--data`` (DBN, csv, parquet), or a generated DBN file in ``out``; and its path."""
    if args.data is None:
        path = out / f"synthetic-{args.synthetic}-seed{args.seed}.dbn"
        out.mkdir(parents=True, exist_ok=True)
        write_ohlcv_dbn(path, synthetic_bars(args.synthetic, args.bars, seed=args.seed))
        return read_bars(path), str(path)
    path = Path(args.data)
    if ".dbn" in path.suffixes:
        instrument = args.instrument_id[0] if args.instrument_id else None
        return read_bars(path, instrument_id=instrument, interval_ns=args.interval_ns), str(path)
    if args.time_col is None or args.close_col is None:
        raise SystemExit("--data: a csv/parquet table needs --time-col and --close-col (columns are never guessed)")
    return read_table(path, time=args.time_col, close=args.close_col, open=args.open_col, high=args.high_col,
                      low=args.low_col, volume=args.volume_col), str(path)


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--data", help="a .dbn / .dbn.zst file (OHLCV, trades, MBP-1) or a .csv / .parquet table")
    p.add_argument("--time-col", help="table: the timestamp column")
    p.add_argument("--close-col", help="table: the close (or price) column")
    p.add_argument("--open-col", help="table: open column (default: the close)")
    p.add_argument("--high-col", help="table: high column (default: the close)")
    p.add_argument("--low-col", help="table: low column (default: the close)")
    p.add_argument("--volume-col", help="table: volume column (default: zeros)")
    p.add_argument("--interval-ns", type=int, help="DBN trades / MBP-1: bar length in nanoseconds")
    p.add_argument("--instrument-id", type=int, nargs="+", help="DBN: the instrument(s), when a file holds "
                   "several; more than one trains over all of them with one shared time boundary")
    p.add_argument("--all-instruments", action="store_true", help="DBN: train over every instrument in the file")
    p.add_argument("--synthetic", choices=("planted", "random-walk"), default="planted",
                   help="without --data: what the generated DBN file holds")
    p.add_argument("--bars", type=int, default=12000, help="without --data: bars to generate")
    p.add_argument("--target", choices=("return", "direction"), default="return", help="what to predict")
    p.add_argument("--horizon", type=int, default=1, help="k: the target is the next k bars' log return")
    p.add_argument("--seq-len", type=int, default=60, help="bars per window")
    p.add_argument("--stride", type=int, default=1, help="bars between training window ends")
    p.add_argument("--embargo", type=int, help="bars between the boundary and the first validation window "
                   "(default: the horizon)")
    p.add_argument("--val-fraction", type=float, default=0.2, help="share of the bars that validates")
    p.add_argument("--folds", type=int, default=1, help="walk-forward folds tiling the validation share")
    p.add_argument("--fold", type=int, default=-1, help="which fold to train and score (default the last)")
    p.add_argument("--ar-order", type=int, default=5, help="p of the AR(p) baseline")
    args = parse(p, DEFAULTS, QUICK, argv)
    if args.embargo is None:
        args.embargo = args.horizon
    if several(args) and args.folds != 1:
        raise SystemExit("--folds: several instruments train on one shared split (--folds 1)")
    return args


def split_instruments(args: argparse.Namespace, bars: dict[int, Bars],
                      raw: dict[int, np.ndarray]) -> tuple[SharedSplit, Normaliser]:
    """The walk-forward split of each instrument and the normaliser fitted on the training spans:
    one instrument as ``walk_forward`` cuts it (any fold), several about one shared boundary time."""
    if len(bars) == 1:
        (instrument, only), = bars.items()
        split = walk_forward(len(only), window=args.seq_len, horizon=args.horizon, embargo=args.embargo,
                             folds=args.folds, val_fraction=args.val_fraction, stride=args.stride)[args.fold]
        boundary_ns = int(only.ts_event[split.boundary]) if split.boundary < len(only) else -1
        return (SharedSplit(boundary_ns=boundary_ns, splits={instrument: split}),
                Normaliser.fit(raw[instrument], split.boundary))
    shared = shared_split(bars, window=args.seq_len, horizon=args.horizon, embargo=args.embargo,
                          val_fraction=args.val_fraction, stride=args.stride)
    return shared, shared_normaliser(raw, shared)


def main() -> None:
    args = arguments()
    started = time.time()
    out = Path(args.out)
    dist = setup_distributed(args.device)
    bars, source = load_instruments(args, out)
    raw = {i: bar_features(b) for i, b in bars.items()}  # {id: [N_i, F]}
    split, normaliser = split_instruments(args, bars, raw)
    train_ends = {i: s.train_ends for i, s in split.splits.items()}
    val_ends = {i: s.val_ends for i, s in split.splits.items()}
    x_all = {i: model_inputs(r, normaliser) for i, r in raw.items()}  # [N_i, F] float32; NaN features read 0
    target = {i: targets(b, horizon=args.horizon, kind=args.target) for i, b in bars.items()}  # {id: [N_i]}
    trained = np.concatenate([target[i][e] for i, e in train_ends.items()])  # [n_train]
    scale = float(trained.std()) if args.target == "return" else 1.0
    y_all = {i: np.nan_to_num(t / scale).astype(np.float32) for i, t in target.items()}  # NaN only past training
    x_train = torch.from_numpy(stack_windows(x_all, train_ends, args.seq_len)[0])  # [n_train, L, F]
    y_train = torch.from_numpy(stack_windows(y_all, train_ends, args.seq_len)[0])  # [n_train, L]
    x_val = torch.from_numpy(stack_windows(x_all, val_ends, args.seq_len)[0]).to(dist.device)  # [n_val, L, F]
    y_val = torch.from_numpy(np.concatenate([y_all[i][e] for i, e in val_ends.items()])).to(dist.device)  # [n_val]

    config = Mamba2Config(d_model=args.d_model, n_layer=args.n_layer, d_state=args.d_state, headdim=args.headdim)
    torch.manual_seed(args.seed)
    core = Mamba2Module(config, seed=args.seed, device=dist.device, checkpoint_blocks=args.checkpoint_blocks)
    model = MarketNet(len(FEATURES), core).to(dist.device)
    objective = nn.MSELoss() if args.target == "return" else nn.BCEWithLogitsLoss()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.from_numpy(np.random.default_rng([args.seed, 1, step]).integers(0, len(x_train), args.batch_size))
        return x_train[rows], y_train[rows]

    def loss(net: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return objective(net(inputs).float(), labels)

    def last_outputs(net: nn.Module) -> torch.Tensor:
        return torch.cat([net(x_val[i:i + EVAL_BATCH])[:, -1].float() for i in range(0, len(x_val), EVAL_BATCH)])

    latest: dict[str, torch.Tensor] = {}  # the last evaluation's outputs, reused when it ran at the end

    def evaluate(net: nn.Module) -> dict[str, float]:
        latest["val"] = last_outputs(net)
        return {"val_loss": float(objective(latest["val"], y_val))}

    task = Task("market", model, core, batch, loss, evaluate)
    history = train(task, args, dist, out)
    if dist.is_main:
        finished = args.stop_at is None or args.stop_at >= args.steps  # then train() evaluated at the end
        if not finished or "val" not in latest:
            model.eval()
            with torch.no_grad():
                latest["val"] = last_outputs(model)
        output = latest["val"].cpu().double().numpy()  # [n_val]
        prediction = output * scale if args.target == "return" else 1.0 / (1.0 + np.exp(-output))
        model_loss, base_loss = instrument_losses(args, bars, raw, target, split, prediction)
        result = score(args, model_loss, base_loss)
        market_model(model, args, normaliser, scale, source, split).save(out, metadata={"step": exported_step(out)
                                                                                     or str(args.steps)})
        plot_validation(out / PREDICTIONS_PLOT, model_loss, base_loss)
        say(result)
        report(dist, {"example": "market", "data": source, "target": args.target, "horizon": args.horizon,
                      **result, "val_objective": last(history, "val_loss"),
                      "bars": sum(len(b) for b in bars.values()), "instruments": list(bars),
                      "train_windows": len(x_train), "val_windows": len(x_val),
                      "steps": args.steps, "seed": args.seed, "seconds": round(time.time() - started, 1)})
    teardown(dist)


def instrument_losses(args: argparse.Namespace, bars: dict[int, Bars], raw: dict[int, np.ndarray],
                      target: dict[int, np.ndarray], split: SharedSplit,
                      prediction: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """:func:`per_bar_losses` of each instrument (its slice of ``prediction``, ids ascending), joined."""
    pieces, start = [], 0
    for i, s in split.splits.items():
        stop = start + len(s.val_ends)
        if len(s.val_ends):
            pieces.append(per_bar_losses(args, bars[i], raw[i][:, 0], target[i], s, prediction[start:stop]))
        start = stop
    return (np.concatenate([m for m, _ in pieces]),
            {name: np.concatenate([b[name] for _, b in pieces]) for name in pieces[0][1]})


def per_bar_losses(args: argparse.Namespace, bars: Bars, returns: np.ndarray, target: np.ndarray, split,
                   prediction: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """``(model loss [n_val], {baseline: loss [n_val]})`` at the validation ends, baselines fitted on training."""
    trailing = trailing_return(bars, horizon=args.horizon)
    base = baselines(args.target, returns=returns, trailing=trailing, target=target, train_ends=split.train_ends,
                     val_ends=split.val_ends, order=args.ar_order)
    truth = target[split.val_ends]
    return losses(args.target, prediction, truth), {n: losses(args.target, p, truth) for n, p in base.items()}


def score(args: argparse.Namespace, model_loss: np.ndarray, base_loss: dict[str, np.ndarray]) -> dict:
    """The model's and each baseline's mean validation loss, and the model's win over each (z-scores)."""
    wins = {name: compare(model_loss, loss, block=args.horizon) for name, loss in base_loss.items()}
    return {"metric": "mse" if args.target == "return" else "error_rate", "val_loss": float(model_loss.mean()),
            "baselines": {name: float(loss.mean()) for name, loss in base_loss.items()},
            "z_vs_baselines": {name: round(w["z"], 2) for name, w in wins.items()},
            "beats_baseline": all(w["beaten"] for w in wins.values())}


def say(result: dict) -> None:
    """States plainly whether the model beats the baselines (on stderr, so the JSON stays the last line)."""
    lost = [f"{n} ({result['baselines'][n]:.4g}, z={z:.2f})" for n, z in result["z_vs_baselines"].items() if z <= 2]
    verdict = ("beats every baseline by more than 2 standard errors" if result["beats_baseline"] else
               f"does NOT beat the baselines: {', '.join(lost)}; its predictions are not better than these")
    print(f"model {result['metric']} {result['val_loss']:.4g}: {verdict}", file=sys.stderr)


def market_model(model: MarketNet, args: argparse.Namespace, normaliser: Normaliser, scale: float, source: str,
                 split: SharedSplit) -> MarketModel:
    """The trained net as a :class:`MarketModel` (what ``stream_market.py`` loads with ``MarketModel.load``)."""
    head = {name: p.detach().float().cpu().contiguous() for name, p in model.named_parameters()
            if name.split(".")[0] in ("inp", "head")}
    params = {name: p.detach().cpu() for name, p in model.core.params().items()}
    return MarketModel(config=model.core.config, params=params, head=head, normaliser=normaliser,
                       target=args.target, horizon=args.horizon, target_scale=scale, seq_len=args.seq_len,
                       instruments=split.instruments if several(args) else tuple(args.instrument_id or ()),
                       info={"data": source, "boundary_ns": split.boundary_ns,
                             "boundary": {str(i): s.boundary for i, s in split.splits.items()},
                             "first_val_end": {str(i): int(s.val_ends[0]) for i, s in split.splits.items()
                                               if len(s.val_ends)}})


def plot_validation(path: Path, model_loss: np.ndarray, base_loss: dict[str, np.ndarray]) -> None:
    """Cumulative loss saved over each baseline across the validation bars (rising = the model wins)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for name, loss in base_loss.items():
        ax.plot(np.cumsum(loss - model_loss), label=f"vs {name}")
    ax.axhline(0.0, color="k", lw=0.5)
    ax.set_xlabel("validation bar")
    ax.set_ylabel("cumulative loss saved")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
