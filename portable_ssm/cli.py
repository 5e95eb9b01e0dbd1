"""``portable-ssm``: generate from a pretrained model, inspect or convert checkpoints, run benchmarks.

    portable-ssm generate --model DIR --prompt "Mamba is" [--max-new-tokens 32 --temperature 0.8 ...]
    portable-ssm generate --model DIR --ids --prompt "1 2 3"      (token ids in and out, no tokenizer)
    portable-ssm info DIR
    portable-ssm convert SRC DST.safetensors [--dtype float64]
    portable-ssm bench [ARGS ...]          (forwarded to portable_ssm.bench.main)
    portable-ssm --version

``generate`` encodes the prompt with ``tokenizer.json`` next to the model (the ``tokenizers``
package) when there is one and ``--ids`` is not given, and reads it as integer ids ("1 2 3")
otherwise; it streams the text to stdout as tokens come and a timing line to stderr. On the
default numpy backend with a safetensors checkpoint it imports neither torch nor transformers.

Every command first keeps freed memory in the process for reuse
(:func:`portable_ssm.host.retain_freed_memory`; ``PORTABLE_SSM_RETAIN_MEMORY=0`` turns that off).

Every command reports a bad input (CheckpointError, ValueError, TypeError, ImportError, OSError)
as one ``portable-ssm COMMAND: error: ...`` line on stderr, with the install command when a
package is missing, and exits with status 2 (as argparse does for a bad option). Option values are
checked before anything is loaded (``--max-new-tokens`` >= 0, ``--temperature`` finite >= 0,
``--top-k`` >= 1 and ``--top-p`` in (0, 1] only with ``--temperature`` > 0, ``--seed`` >= 0,
``--eos-token-id`` >= -1). Any other exception is still one line (``error: unexpected ...``,
status 1; Ctrl-C: status 130), never a traceback. Tokenizer files are read and copied only when they
are regular files inside the checkpoint's directory; a symlink out of it or a FIFO is an error
naming the file, and nothing is written then.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from . import __version__
from .backends import NAMES
from .cli_args import ERROR_STATUS, Parser, count, nonempty_path, number
from .host import retain_unless_disabled
from .hybrid_lm import HybridLM
from .io import CheckpointError, load_pretrained
from .io.atomic import replace_atomically
from .io.paths import check_inside, read_regular, regular
from .language_model import Mamba2LM
from .quantized import KINDS

#: Parameter dtypes ``--dtype`` accepts (bfloat16 and float16 need a backend that has them).
DTYPES = ("float16", "bfloat16", "float32", "float64")
#: Exit status of an error that is no bad input (a backend failure, out of memory, a bug).
UNEXPECTED_STATUS = 1
#: Exit status after Ctrl-C, as a shell reports SIGINT.
INTERRUPTED_STATUS = 130
#: Tokenizer files ``convert`` copies next to the file it writes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
#: The largest tokenizer file read or copied (real ones are at most tens of MB).
TOKENIZER_LIMIT = 1 << 30
#: What to install for a missing module.
INSTALL = {"tokenizers": "pip install 'portable-ssm[cli]'", "torch": "pip install 'portable-ssm[torch]'",
           "jax": "pip install 'portable-ssm[jax]'", "jaxlib": "pip install 'portable-ssm[jax]'",
           "cupy": "pip install 'portable-ssm[cupy]'", "array_api_strict": "pip install array-api-strict",
           "tqdm": "pip install tqdm", "matplotlib": "pip install matplotlib",
           "transformers": "pip install transformers"}


def _folder(path: str) -> str:
    """The directory a checkpoint path names: itself, or the folder holding the file."""
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def _tokenizer(model: str) -> Any:
    """The ``tokenizers.Tokenizer`` in the model's directory, or None when there is no tokenizer.json."""
    path = os.path.join(_folder(model), "tokenizer.json")
    if not _tokenizer_file(path, _folder(model)):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as err:
        raise ImportError(f"{path} needs the tokenizers package: {INSTALL['tokenizers']} (or pass --ids "
                          f"with integer token ids)", name="tokenizers") from err
    text = read_regular(path, TOKENIZER_LIMIT)
    try:
        return Tokenizer.from_str(text.decode("utf-8"))
    except Exception:  # tokenizers raises a bare Exception for a file it cannot parse; its text quotes the file
        raise ValueError(f"{path}: not a readable tokenizer.json (not UTF-8 JSON that the tokenizers "
                         f"package accepts)") from None


def _tokenizer_file(path: str, folder: str) -> bool:
    """Whether the tokenizer file ``path`` is there: True for a regular file inside ``folder``, False
    when absent; CheckpointError naming it when it is a FIFO, directory or device, or a symlink that
    resolves outside ``folder`` (its bytes are never read, copied or quoted then)."""
    if not regular(path):
        return False
    check_inside(path, folder, "the checkpoint directory")
    return True


def _encode(prompt: str, tokenizer: Any) -> list[int]:
    if tokenizer is not None:
        ids = tokenizer.encode(prompt).ids
        if not ids:
            raise ValueError(f"--prompt: the tokenizer encodes {prompt[:40]!r} as no tokens; expected at least one")
        return ids
    try:
        ids = [int(v) for v in prompt.split()]
    except ValueError:
        raise ValueError(f"--prompt: without a tokenizer (--ids, or no tokenizer.json next to the model) the "
                         f"prompt must be integer ids such as '1 2 3', got {prompt!r}") from None
    if not ids:
        raise ValueError("--prompt: expected at least one token")
    return ids


def _check_sampling_flags(args: argparse.Namespace) -> None:
    """ValueError naming the flag for sampling options given with greedy decoding (they would be ignored)."""
    if args.temperature == 0:
        for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)):
            if value is not None:
                raise ValueError(f"{flag}: only with sampling (--temperature > 0); --temperature 0 is greedy "
                                 f"and would ignore it")


def _check_ids(ids: list[int], eos: int | None, vocab: int) -> None:
    """ValueError naming the flag for prompt ids or an --eos-token-id outside the model's vocabulary."""
    wrong = [i for i in ids if not 0 <= i < vocab]
    if wrong:
        raise ValueError(f"--prompt: expected token ids in [0, {vocab}) for this model, got {wrong[0]}")
    if eos is not None and not -1 <= eos < vocab:
        raise ValueError(f"--eos-token-id: expected an id in [0, {vocab}) or -1 (never stop early), got {eos}")


def _decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    return tokenizer.decode if tokenizer is not None else (lambda ids: " ".join(str(i) for i in ids))


def _write_new(out: TextIO, text: str, shown: str, final: bool = False) -> str:
    """Writes what ``text`` adds to ``shown``; waits while the tail is an incomplete character."""
    if text == shown or not text.startswith(shown) or (text.endswith("\ufffd") and not final):
        return shown
    out.write(text[len(shown):])
    out.flush()
    return text


def _check_device(backend: str, device: str | None) -> None:
    """ValueError for a ``--device`` the backend cannot place arrays on (e.g. cuda on a CPU-only torch)."""
    if device is None:
        return
    if backend == "torch":
        import torch

        try:
            kind = torch.device(device).type
        except RuntimeError as err:
            raise ValueError(f"--device {device!r}: not a torch device ({err})") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device {device}: this torch has no CUDA device (torch.cuda.is_available() is "
                             f"False); use --device cpu or a CUDA build of torch")
    elif backend == "jax":
        import jax

        platform = device.partition(":")[0]
        try:
            jax.devices(platform)
        except RuntimeError as err:
            raise ValueError(f"--device {device}: jax has no {platform!r} device ({err})") from None


def _load(args: argparse.Namespace, path: str) -> Mamba2LM | HybridLM:
    _check_device(args.backend, getattr(args, "device", None))
    return load_pretrained(path, backend=args.backend, dtype=args.dtype, device=getattr(args, "device", None),
                           weights=getattr(args, "weights", "float32"))


def _generate(args: argparse.Namespace, out: TextIO) -> int:
    _check_sampling_flags(args)
    tokenizer = None if args.ids else _tokenizer(args.model)
    decode, ids = _decoder(tokenizer), _encode(args.prompt, tokenizer)
    lm = _load(args, args.model)
    _check_ids(ids, args.eos_token_id, lm.vocab_size)
    prompt_length = len(ids)
    eos = lm.eos_token_id if args.eos_token_id is None else args.eos_token_id
    start = time.perf_counter()
    tokens = lm.stream([ids], args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, seed=args.seed, eos_token_id=None if eos == -1 else eos,
                       compile=True if args.compile else None)
    if isinstance(lm, HybridLM):  # its stream yields (token, state)
        tokens = (token for token, _ in tokens)
    shown = _write_new(out, decode(ids), "", final=True)
    for token in tokens:
        ids.append(int(token[0]))
        shown = _write_new(out, decode(ids), shown)
    _write_new(out, decode(ids), shown, final=True)
    out.write("\n")
    seconds = time.perf_counter() - start
    new = len(ids) - prompt_length
    print(f"[{new} tokens in {seconds:.2f} s, {new / max(seconds, 1e-9):.1f} tokens/s, {lm.backend} "
          f"{lm.dtype}{'' if args.weights == 'float32' else ' ' + args.weights + ' weights'}]", file=sys.stderr)
    return 0


def _describe(lm: Mamba2LM, out: TextIO) -> None:
    if hasattr(lm, "describe"):  # a hybrid family's model (portable_ssm.hybrid_lm.HybridLM)
        for key, value in lm.describe():
            out.write(f"{key:<32} {value}\n")
        return
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
    if not args.dst.endswith(".safetensors"):
        raise ValueError(f"DST: expected a .safetensors file name (convert writes safetensors only, never "
                         f"pickle), got {args.dst!r}")
    src = _folder(args.src)
    names = [name for name in TOKENIZER_FILES if _tokenizer_file(os.path.join(src, name), src)]
    lm = _load(args, args.src)
    try:
        lm.save(args.dst)
    except OSError as err:  # the saver writes a temporary file beside DST: name the user's path
        raise OSError(err.errno, err.strerror or str(err), args.dst) from err
    copied = _copy_tokenizer(src, os.path.dirname(os.path.abspath(args.dst)), names)
    out.write(f"wrote {args.dst}: {lm.num_parameters:,} parameters, {lm.dtype}, from a {lm.layout} checkpoint"
              + (f"; copied {', '.join(copied)}" if copied else "") + "\n")
    return 0


def _copy_tokenizer(src: str, dst: str, names: list[str]) -> list[str]:
    """Copies the tokenizer files ``names`` (checked by :func:`_tokenizer_file`) of folder ``src``
    into folder ``dst``, each replaced atomically (a symlink already at the target is replaced,
    never written through); returns the names copied."""
    copied = []
    for name in names:
        source, target = os.path.join(src, name), os.path.join(dst, name)
        if os.path.exists(target) and os.path.samefile(source, target):
            continue
        data = read_regular(source, TOKENIZER_LIMIT)
        replace_atomically(target, lambda f, data=data: f.write(data))
        copied.append(name)
    return copied


def _bench(argv: list[str]) -> int:
    from .bench import main as bench_main

    return bench_main(argv)


def build_parser() -> argparse.ArgumentParser:
    """The ``portable-ssm`` argument parser (one subcommand per action, each with --help)."""
    parser = Parser(prog="portable-ssm", description="Mamba-2 on any array backend.")
    parser.add_argument("--version", action="version", version=f"portable-ssm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = commands.add_parser("generate", help="generate text from a pretrained model, streamed to stdout",
                              description="Generate from a checkpoint directory or a save_params file.")
    gen.add_argument("--model", required=True, type=nonempty_path,
                     help="checkpoint directory (transformers or state-spaces) or a file written by "
                          "portable-ssm convert")
    gen.add_argument("--prompt", required=True,
                     help="text (with tokenizer.json next to the model) or integer ids '1 2 3'")
    gen.add_argument("--ids", action="store_true",
                     help="the prompt is integer token ids and the output is ids: no tokenizer is loaded "
                          "(no tokenizers package needed)")
    gen.add_argument("--max-new-tokens", type=count(0), default=32, help="tokens to add (default 32)")
    gen.add_argument("--temperature", type=number(0.0, math.inf, low_open=False), default=0.0,
                     help="0 is greedy (default); > 0 samples")
    gen.add_argument("--top-k", type=count(1), default=None,
                     help="sample among the k most likely tokens (with --temperature > 0)")
    gen.add_argument("--top-p", type=number(0.0, 1.0, low_open=True), default=None,
                     help="sample in the nucleus of probability p in (0, 1] (with --temperature > 0)")
    gen.add_argument("--seed", type=count(0), default=None, help="seed of the sampling noise")
    gen.add_argument("--eos-token-id", type=count(-1), default=None,
                     help="stop at this id (default: the checkpoint's eos_token_id; -1: never stop early)")
    _add_backend_args(gen)
    gen.add_argument("--device", default=None, help="device, e.g. cpu or cuda:0 (default: the backend's)")
    gen.add_argument("--weights", default="float32", choices=KINDS,
                     help="storage of the projections, embedding and head (default float32; see "
                          "portable_ssm.quantize)")
    gen.add_argument("--compile", action="store_true",
                     help="compile the decode step (torch: torch.compile, about 35 s before the first "
                          "token of a 130m model; jax compiles anyway)")

    info = commands.add_parser("info", help="print a checkpoint's config, parameter count and dtype",
                               description="Describe a checkpoint directory or a save_params file.")
    info.add_argument("path", type=nonempty_path, help="checkpoint directory or save_params file")

    conv = commands.add_parser("convert", help="write a checkpoint as one safetensors file in core names",
                               description="Convert a transformers or state-spaces checkpoint to a "
                                           "portable_ssm safetensors file (checkpoint.save_params); the "
                                           f"tokenizer files ({', '.join(TOKENIZER_FILES)}) next to SRC are "
                                           "copied next to DST.")
    conv.add_argument("src", type=nonempty_path, help="checkpoint directory or save_params file")
    conv.add_argument("dst", type=nonempty_path, help="the .safetensors file to write (other suffixes are refused)")
    _add_backend_args(conv)

    commands.add_parser("build-kernels", help="build the CPU kernels now, not at the first call",
                        description="Build NumPy's and torch's CPU kernels into their caches (once; a later "
                                    "upgrade whose sources differ builds again).")
    commands.add_parser("bench", add_help=False, help="benchmarks (arguments go to portable_ssm.bench; "
                        "see portable-ssm bench --help)")
    return parser


def _build_kernels(args: argparse.Namespace, out: TextIO) -> int:
    from portable_ssm.backends.kernel_build import build_kernels

    return build_kernels(out)


def _add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="numpy", choices=NAMES, help="array library (default numpy)")
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="parameter dtype (default float32; "
                        "float64 checkpoints stay float64)")


def _message(err: Exception) -> str:
    """The one line an error is reported as: OSErrors name their path, ImportErrors what to install."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.filename}: {err.strerror}" if err.filename else err.strerror
    text = str(err)
    if isinstance(err, ImportError) and "pip install" not in text:
        hint = INSTALL.get((err.name or "").split(".")[0])
        text += f" ({hint})" if hint else ""
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    """Runs ``portable-ssm``; returns the exit status (2 with one ``error:`` line on stderr for a bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        command, run = "bench", lambda: _bench(argv[1:])
    else:
        args = build_parser().parse_args(argv)
        command = args.command
        action = {"generate": _generate, "info": _info, "convert": _convert, "build-kernels": _build_kernels}[command]
        run = lambda: action(args, sys.stdout)  # noqa: E731
    try:
        retain_unless_disabled()
        return run()
    except (CheckpointError, OSError, ValueError, TypeError, ImportError) as err:
        print(f"portable-ssm {command}: error: {_message(err)}", file=sys.stderr)
        return ERROR_STATUS
    except KeyboardInterrupt:
        print(f"portable-ssm {command}: error: interrupted", file=sys.stderr)
        return INTERRUPTED_STATUS
    except Exception as err:  # noqa: BLE001 (a bug or a backend failure: still one line, never a traceback)
        print(f"portable-ssm {command}: error: unexpected {type(err).__name__}: {_message(err)}", file=sys.stderr)
        return UNEXPECTED_STATUS


if __name__ == "__main__":
    sys.exit(main())
