"""``portable-ssm``: generate from a pretrained model, inspect or convert checkpoints, run benchmarks.

    portable-ssm generate --model DIR --prompt "Mamba is" [--max-new-tokens 32 --temperature 0.8 ...]
    portable-ssm info DIR
    portable-ssm convert SRC DST [--dtype float64]
    portable-ssm bench [ARGS ...]          (forwarded to portable_ssm.bench.main)

``generate`` encodes the prompt with ``tokenizer.json`` next to the model (the ``tokenizers``
package) when there is one, and reads it as integer ids ("1 2 3") otherwise; it streams the
text to stdout as tokens come and a timing line to stderr. On the default numpy backend with a
safetensors checkpoint it imports neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from .backends import NAMES
from .io import load_pretrained
from .language_model import Mamba2LM


def _tokenizer(model: str) -> Any:
    """The ``tokenizers.Tokenizer`` in the model's directory, or None."""
    folder = model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


def _encode(prompt: str, tokenizer: Any) -> list[int]:
    if tokenizer is not None:
        return tokenizer.encode(prompt).ids
    try:
        ids = [int(v) for v in prompt.split()]
    except ValueError:
        raise ValueError(f"--prompt: without tokenizer.json next to the model the prompt must be integer ids "
                         f"such as '1 2 3', got {prompt!r}") from None
    if not ids:
        raise ValueError("--prompt: expected at least one token")
    return ids


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return tokenizer.decode if tokenizer is not None else (lambda ids: " ".join(str(i) for i in ids))


def _write_new(out: TextIO, text: str, shown: str, final: bool = False) -> str:
    """Writes what ``text`` adds to ``shown``; waits while the tail is an incomplete character."""
    if text == shown or not text.startswith(shown) or (text.endswith("\ufffd") and not final):
        return shown
    out.write(text[len(shown):])
    out.flush()
    return text


def _generate(args: argparse.Namespace, out: TextIO) -> int:
    lm = load_pretrained(args.model, backend=args.backend, dtype=args.dtype, device=args.device)
    tokenizer = _tokenizer(args.model)
    decode, ids = _decoder(tokenizer), _encode(args.prompt, tokenizer)
    prompt_length = len(ids)
    eos = lm.eos_token_id if args.eos_token_id is None else args.eos_token_id
    start = time.perf_counter()
    tokens = lm.stream([ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, eos_token_id=None if eos == -1 else eos)
    shown = _write_new(out, decode(ids), "", final=True)
    for token in tokens:
        ids.append(int(token[0]))
        shown = _write_new(out, decode(ids), shown)
    _write_new(out, decode(ids), shown, final=True)
    out.write("\n")
    seconds = time.perf_counter() - start
    new = len(ids) - prompt_length
    print(f"[{new} tokens in {seconds:.2f} s, {new / max(seconds, 1e-9):.1f} tokens/s, {lm.backend} "
          f"{lm.dtype}]", file=sys.stderr)
    return 0


def _describe(lm: Mamba2LM, out: TextIO) -> None:
    rows = [("layout", lm.layout), ("stored dtype", lm.checkpoint_dtype),
            ("parameters", f"{lm.num_parameters:,}"), ("eos_token_id", lm.eos_token_id),
            ("vocab", f"{lm.vocab_size} (logits rows {lm.config.padded_vocab_size})")]
    rows += [(f"config.{k}", v) for k, v in lm.config.to_dict().items()]
    for key, value in rows:
        out.write(f"{key:<32} {value}\n")


def _info(args: argparse.Namespace, out: TextIO) -> int:
    _describe(load_pretrained(args.path), out)
    return 0


def _convert(args: argparse.Namespace, out: TextIO) -> int:
    lm = load_pretrained(args.src, backend=args.backend, dtype=args.dtype)
    lm.save(args.dst)
    out.write(f"wrote {args.dst}: {lm.num_parameters:,} parameters, {lm.dtype}, "
              f"from a {lm.layout} checkpoint\n")
    return 0


def _bench(argv: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``portable-ssm`` argument parser (one subcommand per action, each with --help)."""
    parser = argparse.ArgumentParser(prog="portable-ssm", description="Mamba-2 on any array backend.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate text from a pretrained model, streamed to stdout",
                              description="Generate from a checkpoint directory or a save_params file.")
    gen.add_argument("--model", required=True, help="checkpoint directory (transformers or state-spaces) "
                     "or a file written by portable-ssm convert")
    gen.add_argument("--prompt", required=True,
                     help="text (with tokenizer.json next to the model) or integer ids '1 2 3'")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to add (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=float, default=None, help="sample in the nucleus of probability p")
    gen.add_argument("--seed", type=int, default=None, help="seed of the sampling noise")
    gen.add_argument("--eos-token-id", type=int, default=None,
                     help="stop at this id (default: the checkpoint's eos_token_id; -1: never stop early)")
    _add_backend_args(gen)
    gen.add_argument("--device", default=None, help="device, e.g. cuda:0 (default: the backend's)")

    info = commands.add_parser("info", help="print a checkpoint's config, parameter count and dtype",
                               description="Describe a checkpoint directory or a save_params file.")
    info.add_argument("path", help="checkpoint directory or save_params file")

    conv = commands.add_parser("convert", help="write a checkpoint as one safetensors file in core names",
                               description="Convert a transformers or state-spaces checkpoint to a "
                                           "portable_ssm safetensors file (checkpoint.save_params).")
    conv.add_argument("src", help="checkpoint directory or save_params file")
    conv.add_argument("dst", help="the .safetensors file to write")
    _add_backend_args(conv)

    commands.add_parser("bench", add_help=False, help="benchmarks (arguments go to portable_ssm.bench; "
                        "see portable-ssm bench --help)")
    return parser


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="numpy", choices=NAMES, help="array library (default numpy)")
    parser.add_argument("--dtype", default=None, help="parameter dtype, e.g. float32, float64, bfloat16 "
                        "(default float32; float64 checkpoints stay float64)")


def main(argv: list[str] | None = None) -> int:
    """Runs ``portable-ssm``; returns the exit status (1 with a message on stderr for a bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    run = {"generate": _generate, "info": _info, "convert": _convert}[args.command]
    try:
        return run(args, sys.stdout)
    except (OSError, ValueError, TypeError, ImportError) as err:
        print(f"portable-ssm {args.command}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
