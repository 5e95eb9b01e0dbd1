"""What the training examples share: arguments, DDP, the training loop, checkpoints, plots, the JSON line.

A script runs alone (``python examples/train_timeseries.py``) or data-parallel with no change
(``torchrun --nproc_per_node=2 examples/train_timeseries.py``): every process builds the same
global batch for a step from ``(seed, step)`` and trains on its own contiguous slice of it, and DDP
averages the gradients, so the parameters equal a single process's up to rounding (gloo on CPU,
NCCL on GPU). Batches depend on the step alone, so ``--resume`` continues exactly where the last
checkpoint left off.

Checkpoints in ``--out`` (never pickle): ``trainer.safetensors`` is the one file ``--resume`` reads:
the Mamba-2 parameters (``model/<name>``), the rest of the model (``param/<name>``), the optimizer
state (``optim/<name>/<key>``) and, as metadata, the config, the step and the metric history, all
written in one atomic save, so a crash at any moment leaves the previous checkpoint or the new
one, never a mix. ``model.safetensors`` is the export of the same step (core names with the
config, ``portable_ssm.save_params``; what ``load_pretrained`` reads), written after it and
rewritten on ``--resume`` when a crash left it behind. ``curves.png`` is drawn next to them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from portable_ssm.backends.torch import (
    Mamba2Module,
    load_optimizer_state,
    optimizer_state,
    param_groups,
)
from torch import nn
from tqdm import tqdm

from portable_ssm import Mamba2Config
from portable_ssm.io import CheckpointError, load_arrays, save_arrays, save_params
from portable_ssm.io.safetensors import read_header

MODEL_FILE, TRAINER_FILE, PLOT_FILE = "model.safetensors", "trainer.safetensors", "curves.png"


def base_parser(description: str) -> argparse.ArgumentParser:
    """The flags every example takes. Flags without a fixed default are None here and filled by
    :func:`parse`, so ``--quick`` changes only what the command line leaves unset."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small run (a few minutes on a CPU)")
    p.add_argument("--steps", type=int, help="optimizer steps in total (a resumed run stops here too)")
    p.add_argument("--batch-size", type=int, help="global batch, split evenly across processes")
    p.add_argument("--lr", type=float, help="peak learning rate (linear warmup, cosine decay to 10%%)")
    p.add_argument("--weight-decay", type=float, default=0.1,
                   help="AdamW decay (not on A_log, D, dt_bias, norms, biases)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--n-layer", type=int, help="Mamba-2 layers")
    p.add_argument("--d-state", type=int, help="SSM state size per head")
    p.add_argument("--headdim", type=int, help="channels per head")
    p.add_argument("--eval-every", type=int, help="steps between validation runs")
    p.add_argument("--ckpt-every", type=int, help="steps between checkpoints (one is always written last)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initialisation")
    p.add_argument("--out", help="directory for checkpoints and plots")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--stop-at", type=int, help="stop after this step with a checkpoint (then --resume)")
    p.add_argument("--device", default="auto", help="'auto' (cuda when available), 'cpu', 'cuda'")
    p.add_argument("--amp", choices=("none", "bf16"), default="none", help="torch.autocast dtype")
    p.add_argument("--checkpoint-blocks", action="store_true",
                   help="recompute each mixer in backward (less activation memory)")
    return p


def parse(parser: argparse.ArgumentParser, defaults: dict[str, Any], quick: dict[str, Any],
          argv: list[str] | None = None) -> argparse.Namespace:
    """Parses ``argv`` and fills every flag left unset from ``quick`` (with ``--quick``) or
    ``defaults``; ``--help`` shows both."""
    for action in parser._actions:
        if action.dest in defaults:
            fast = quick.get(action.dest, defaults[action.dest])
            action.help += f" (default {defaults[action.dest]}; --quick {fast})"
        elif action.default not in (None, argparse.SUPPRESS) and action.default is not False:
            action.help += f" (default {action.default})"
    args = parser.parse_args(argv)
    for key, value in {**defaults, **(quick if args.quick else {})}.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


@dataclass(frozen=True)
class Dist:
    """This process's place in a (possibly one-process) data-parallel job."""

    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> Dist:
    """Joins the torchrun job when ``WORLD_SIZE`` > 1 (NCCL on GPU, gloo on CPU), else one process."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = torch.device(f"cuda:{local}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if world > 1:
        torch_dist.init_process_group("nccl" if use_cuda else "gloo")
    return Dist(rank=rank, world=world, device=dev)


def teardown(dist: Dist) -> None:
    """Leaves the job: every process waits at a barrier until the main one has finished its last
    evaluation and checkpoint, then all destroy the process group together (a process tearing gloo
    down while its peer is still busy can abort at exit)."""
    if dist.world > 1:
        torch_dist.barrier()
        torch_dist.destroy_process_group()


@dataclass
class Task:
    """One training job: a model holding a Mamba-2 ``core``, batches by step, a loss, an evaluation."""

    name: str
    model: nn.Module  # contains core (or is it)
    core: Mamba2Module
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # step -> global (inputs, targets)
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]  # validation metrics (main process)
    history: dict[str, list[list[float]]] = field(default_factory=dict)  # metric -> [[step, value]]


def _lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup over 5% of the steps, then cosine decay to 10% of the peak."""
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def _shard(batch: tuple[torch.Tensor, ...], dist: Dist) -> tuple[torch.Tensor, ...]:
    """This process's contiguous slice of the global batch, on its device."""
    size = batch[0].shape[0]
    if size % dist.world:
        raise SystemExit(f"--batch-size {size} must be a multiple of the {dist.world} processes")
    per = size // dist.world
    return tuple(t[dist.rank * per:(dist.rank + 1) * per].to(dist.device) for t in batch)


def _extras(task: Task) -> dict[str, nn.Parameter]:
    """The model's parameters outside the Mamba-2 core (input/output heads)."""
    core = {id(p) for p in task.core.parameters()}
    return {n: p for n, p in task.model.named_parameters() if id(p) not in core}


def save_checkpoint(out: Path, task: Task, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Writes trainer.safetensors (everything ``--resume`` needs, in one atomic save), then the
    model.safetensors export of the same step and curves.png into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    tensors, meta = optimizer_state(optimizer, task.model)
    arrays = {**{f"model/{n}": p for n, p in task.core.params().items()},
              **{f"param/{n}": p for n, p in _extras(task).items()},
              **{f"optim/{k}": v for k, v in tensors.items()}}
    save_arrays(out / TRAINER_FILE, arrays, metadata={
        **meta, "step": str(step), "config": json.dumps(task.core.config.to_dict()),
        "history": json.dumps(task.history)})
    export_model(out, task, step)
    plot(out / PLOT_FILE, task.history, title=task.name)


def export_model(out: Path, task: Task, step: int) -> None:
    """Writes the core parameters of ``step`` as model.safetensors (``portable_ssm.save_params``)."""
    save_params(out / MODEL_FILE, task.core.params(), task.core.config, metadata={"step": str(step)})


def exported_step(out: Path) -> str | None:
    """The step model.safetensors in ``out`` was exported at; None when it is missing or unreadable."""
    try:
        return (read_header(out / MODEL_FILE)[0].get("__metadata__") or {}).get("step")
    except (CheckpointError, OSError):
        return None


def _metadata(path: Path, meta: dict[str, str], key: str) -> Any:
    """The JSON metadata entry ``key`` of the trainer file; CheckpointError naming both otherwise."""
    if key not in meta:
        raise CheckpointError(f"{path}: no {key!r} metadata (not a checkpoint of these examples, or of an "
                              f"older version)")
    try:
        return json.loads(meta[key])
    except ValueError as err:
        raise CheckpointError(f"{path}: the {key!r} metadata is corrupt ({err})") from None


def load_checkpoint(out: Path, task: Task, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Restores what :func:`save_checkpoint` wrote (trainer.safetensors alone); returns the step to
    continue from."""
    path = out / TRAINER_FILE
    if not path.exists():
        raise SystemExit(f"--resume: no checkpoint in {out} (expected {path})")
    arrays, meta = load_arrays(path, backend="torch", device=device)
    step = _metadata(path, meta, "step")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{path}: the 'step' metadata is {meta['step']!r}, expected a non-negative integer")
    try:
        config = Mamba2Config.from_dict(_metadata(path, meta, "config"))
    except (TypeError, ValueError) as err:
        raise CheckpointError(f"{path}: the 'config' metadata is corrupt ({err})") from None
    if config != task.core.config:
        diff = [k for k, v in config.to_dict().items() if task.core.config.to_dict()[k] != v]
        raise SystemExit(f"--resume: the checkpoint's model differs from these flags in {', '.join(diff)}")
    targets = {f"model/{n}": p for n, p in task.core.named_parameters()}
    targets.update({f"param/{n}": p for n, p in _extras(task).items()})
    missing = sorted(set(targets) - set(arrays))
    if missing:
        raise CheckpointError(f"{path}: tensor {missing[0]!r} is missing")
    with torch.no_grad():
        for key, target in sorted(targets.items()):
            if target.shape != arrays[key].shape:
                raise SystemExit(f"--resume: tensor {key!r} {tuple(arrays[key].shape)} of {path} "
                                 f"does not fit this model (different flags?)")
            target.copy_(arrays[key])
    optim = {k[len("optim/"):]: v for k, v in arrays.items() if k.startswith("optim/")}
    load_optimizer_state(optimizer, task.model, optim, meta)
    task.history = _metadata(path, meta, "history")
    return step


def plot(path: Path, history: dict[str, list[list[float]]], *, title: str) -> None:
    """One panel per metric family (losses on a log scale, accuracies) against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = sorted({"accuracy" if "acc" in k else "loss" for k in history})
    fig, axes = plt.subplots(1, len(families), figsize=(6 * len(families), 4), squeeze=False)
    for ax, family in zip(axes[0], families):
        for key in (k for k in history if ("acc" in k) == (family == "accuracy")):
            steps, values = zip(*history[key])
            ax.plot(steps, values, label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(family)
        if family == "loss":
            ax.set_yscale("log")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _record(history: dict[str, list[list[float]]], step: int, values: dict[str, float]) -> None:
    """Appends ``[step, value]`` to each metric's curve."""
    for key, value in values.items():
        history.setdefault(key, []).append([step, float(value)])


def train(task: Task, args: argparse.Namespace, dist: Dist, out: Path) -> dict[str, list[list[float]]]:
    """AdamW (decay groups from ``param_groups``) over ``args.steps`` steps with DDP when the job
    has several processes; evaluates, checkpoints and plots from the main process."""
    task.model.to(dist.device)
    optimizer = torch.optim.AdamW(param_groups(task.model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    start = load_checkpoint(out, task, optimizer, dist.device) if args.resume else 0
    if args.resume and dist.is_main and exported_step(out) != str(start):  # a crash cut the last save short
        export_model(out, task, start)
    net = task.model
    if dist.world > 1:
        net = nn.parallel.DistributedDataParallel(task.model, device_ids=None if dist.device.type == "cpu"
                                                  else [dist.device.index])
    amp = torch.autocast(dist.device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    end = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    bar = tqdm(range(start, end), initial=start, total=args.steps, desc=task.name,
               disable=not dist.is_main, file=sys.stderr)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, args)
        inputs, targets = _shard(task.batch(step), dist)
        with amp:
            loss = task.loss(net, inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(task.model.parameters(), args.clip)
        optimizer.step()
        done = step + 1
        logged = loss.detach().float()
        if dist.world > 1:
            torch_dist.all_reduce(logged, op=torch_dist.ReduceOp.AVG)
        if not dist.is_main:
            continue
        _record(task.history, done, {"train_loss": logged.item()})
        if done % args.eval_every == 0 or done == args.steps:
            task.model.eval()
            with torch.no_grad(), amp:
                metrics = task.evaluate(task.model)
            task.model.train()
            _record(task.history, done, metrics)
            bar.set_postfix({k: f"{v:.4g}" for k, v in metrics.items()})
        if done % args.ckpt_every == 0 or done == end:
            save_checkpoint(out, task, optimizer, done)
    bar.close()
    return task.history


def last(history: dict[str, list[list[float]]], key: str) -> float:
    """The latest value of a metric (nan when it was never recorded)."""
    curve = history.get(key)
    return curve[-1][1] if curve else math.nan


def report(dist: Dist, result: dict[str, Any]) -> None:
    """Prints the final metrics as one JSON line, from the main process only."""
    if dist.is_main:
        print(json.dumps(result), flush=True)
