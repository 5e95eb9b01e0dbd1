"""Selective copying (the Mamba paper's synthetic task): recall scattered tokens, in order.

A sample is ``--length`` content positions holding ``--tokens`` data tokens (values 1..V, V =
``--vocab``) at random positions, the noise token 0 everywhere else, then ``--tokens`` marker
tokens (V+1). At the i-th marker the model must output the i-th data token; loss and accuracy
count the marker positions only (chance is 1/V).

Two models get the same budget. The Mamba-2 language model is selective: Δ, B and C come from
the input. The linear time-invariant (LTI) baseline is the same model with the in_proj rows that
produce B, C and Δ zeroed and frozen, so Δ = softplus(dt_bias) and B, C = silu(conv1d.bias) are
constants: a gated LTI state-space model (like H3) that cannot choose what to keep by content.

    python examples/train_selective_copy.py --quick
    torchrun --nproc_per_node=2 examples/train_selective_copy.py --quick
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from common import Task, base_parser, last, parse, plot, report, setup_distributed, teardown, train
from portable_ssm.backends.torch import Mamba2LMModule
from torch import nn

from portable_ssm import Mamba2Config

DEFAULTS = dict(steps=3000, batch_size=64, lr=5e-3, d_model=128, n_layer=2, d_state=64, eval_every=200,
                ckpt_every=1000, out="runs/selective_copy", tokens=8, length=64, headdim=8)
QUICK = dict(steps=1500, batch_size=32, lr=5e-3, d_model=64, n_layer=2, d_state=32, eval_every=100,
             ckpt_every=500, tokens=4, length=48)
VAL_SAMPLES = 512


def selective_copy(rng: np.random.Generator, n: int, length: int, tokens: int,
                   vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [n, length + tokens], targets [n, tokens])``: data tokens at sorted random positions."""
    ids = np.zeros((n, length + tokens), np.int64)
    positions = np.sort(np.argsort(rng.random((n, length)), axis=1)[:, :tokens], axis=1)  # [n, tokens]
    targets = rng.integers(1, vocab + 1, (n, tokens))
    ids[np.arange(n)[:, None], positions] = targets
    ids[:, length:] = vocab + 1  # the markers
    return ids, targets


def make_lti(model: Mamba2LMModule) -> None:
    """Zeroes and freezes the in_proj rows producing B, C and Δ (packed ``[z, x, B, C, dt]``), so
    the SSM no longer depends on the input: Δ, B, C become learned constants."""
    c = model.config
    for layer in model.layers:
        weight = layer.mixer.in_proj.weight
        keep = (torch.arange(weight.shape[0], device=weight.device) < 2 * c.d_inner).to(weight.dtype)[:, None]
        with torch.no_grad():
            weight.mul_(keep)
        weight.register_hook(lambda grad, keep=keep: grad * keep)


def build(args: argparse.Namespace, device: torch.device, *, lti: bool) -> Mamba2LMModule:
    config = Mamba2Config(d_model=args.d_model, n_layer=args.n_layer, d_state=args.d_state,
                          headdim=args.headdim, vocab_size=args.vocab + 2, pad_vocab_size_multiple=8)
    model = Mamba2LMModule(config, seed=args.seed, device=device, checkpoint_blocks=args.checkpoint_blocks)
    if lti:
        make_lti(model)
    return model


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, help="data tokens to copy per sample")
    p.add_argument("--length", type=int, help="content positions before the markers")
    p.add_argument("--vocab", type=int, default=8, help="distinct data tokens")
    p.add_argument("--no-baseline", action="store_true",
                   help="train the selective model only (lti_accuracy is null, beats_baseline false)")
    return parse(p, DEFAULTS, QUICK, argv)


def main() -> None:
    args = arguments()
    if args.tokens > args.length:
        raise SystemExit(f"--tokens {args.tokens} cannot exceed --length {args.length}")
    started = time.time()
    dist = setup_distributed(args.device)
    val_ids, val_targets = (torch.from_numpy(a).to(dist.device) for a in
                            selective_copy(np.random.default_rng([args.seed, 0]), VAL_SAMPLES, args.length,
                                           args.tokens, args.vocab))

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([args.seed, 1, step])
        ids, targets = selective_copy(rng, args.batch_size, args.length, args.tokens, args.vocab)
        return torch.from_numpy(ids), torch.from_numpy(targets)

    def marker_logits(net: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return net(ids)[:, args.length:, :].float()  # [b, tokens, padded_vocab]

    def loss(net: nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = marker_logits(net, ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(net: nn.Module) -> dict[str, float]:
        logits = marker_logits(net, val_ids)
        accuracy = (logits.argmax(dim=-1) == val_targets).float().mean()
        return {"val_loss": float(loss(net, val_ids, val_targets)), "val_accuracy": float(accuracy)}

    histories = {}
    for name, lti in (("selective", False), ("lti", True))[:1 if args.no_baseline else 2]:
        model = build(args, dist.device, lti=lti)
        task = Task(f"selective copy: {name}", model, model, batch, loss, evaluate)
        histories[name] = train(task, args, dist, Path(args.out) / name)
    accuracy = last(histories["selective"], "val_accuracy")
    baseline = last(histories["lti"], "val_accuracy") if "lti" in histories else None
    if dist.is_main:
        curves = {f"{k} val_accuracy": h["val_accuracy"] for k, h in histories.items()}
        plot(Path(args.out) / "accuracy.png", curves, title="selective copying: selective vs LTI")
    report(dist, {"example": "selective_copy", "accuracy": accuracy, "lti_accuracy": baseline,
                  "chance": 1.0 / args.vocab, "tokens": args.tokens, "length": args.length,
                  "steps": args.steps, "processes": dist.world, "seconds": round(time.time() - started, 1),
                  "beats_baseline": baseline is not None and accuracy >= 0.9 and accuracy - baseline >= 0.2})
    teardown(dist)


if __name__ == "__main__":
    main()
