"""llama.cpp comparison rows (tooling, not core): the benchmark's random LM in llama.cpp's own runtime.

The rows need llama-cpp-python (``import llama_cpp``, built for this machine: docs/benchmarks.md)
and llama.cpp's converter ``convert_hf_to_gguf.py`` (in the llama-cpp-python sdist, under
``vendor/llama.cpp/``; it needs the ``gguf`` package). The weights are the other rows' weights:
transformers' ``save_pretrained`` of :func:`portable_ssm.bench.calls.transformers_model`, converted
once per run and weight type (f32, f16, q8_0) and loaded with ``Llama(...)``. Token ids go in,
never text (the converter falls back to llama.cpp's bundled GPT-NeoX vocabulary, cut to the model's
size, which must be a multiple of 16 and at most 50432). The hybrid part converts its own
checkpoint folders (:meth:`LlamaCpp.convert`), each with a rebuilt tokenizer
(:func:`~portable_ssm.bench.hybrid_models.write_tokenizer`). Conversion is never timed.
:func:`unavailable` and :func:`hybrid_unavailable` say why rows are skipped. llama_cpp is imported
inside functions only.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import Mamba2Config
from .calls import DECODE_STEPS, DecodeRun, transformers_model
from .hybrid_models import TOKENIZER_ROWS, HybridShape, vocab_file

#: Weight types converted, and the row each gives ("llama.cpp-f32", ...).
OUTTYPES = ("f32", "f16", "q8_0")
ROWS = tuple(f"llama.cpp-{t}" for t in OUTTYPES)
#: Where the converter's path comes from without ``--llama-convert``.
CONVERT_ENV = "PORTABLE_SSM_LLAMA_CONVERT"
#: llama.cpp's largest vocabulary without a tokenizer file (its bundled GPT-NeoX one).
MAX_VOCAB = 50432


def unavailable(converter: str | None, config: Mamba2Config | None = None) -> str | None:
    """Why the llama.cpp rows cannot run (a note for RESULTS.md), or None when they can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama.cpp rows skipped: llama_cpp (llama-cpp-python) is not installed (docs/benchmarks.md)"
    if not converter:
        return (f"llama.cpp rows skipped: no converter given (--llama-convert PATH/TO/convert_hf_to_gguf.py "
                f"or {CONVERT_ENV})")
    if not Path(converter).is_file():
        return f"llama.cpp rows skipped: the converter {converter} is not a file"
    missing = [m for m in ("gguf", "transformers", "torch") if importlib.util.find_spec(m) is None]
    if missing:
        return f"llama.cpp rows skipped: the conversion needs {', '.join(missing)} (pip install gguf==0.19.0 ...)"
    vocab = None if config is None else config.padded_vocab_size
    if vocab is not None and (vocab % 16 or vocab > MAX_VOCAB):
        return f"llama.cpp rows skipped: llama.cpp needs a vocabulary, a multiple of 16 up to {MAX_VOCAB}, not {vocab}"
    return None


def hybrid_unavailable(converter: str | None, shape: HybridShape) -> str | None:
    """Why the llama.cpp rows of a hybrid ``shape`` cannot run (a note for RESULTS.md), or None:
    :func:`unavailable`'s reasons, then the rebuilt tokenizer's (:func:`~.hybrid_models.write_tokenizer`):
    its vocabulary file beside the converter, the ``tokenizers`` package, a vocabulary holding its
    rows, and for granite (whose conversion pads the vocabulary to a multiple of 16) such a multiple."""
    why = unavailable(converter)
    if why is not None:
        return why
    skipped, vocab = f"llama.cpp rows of {shape.name} skipped", shape.vocab_size
    if importlib.util.find_spec("tokenizers") is None:
        return f"{skipped}: its tokenizer is built with the tokenizers package, which is not installed"
    if not vocab_file(str(converter)).is_file():
        return f"{skipped}: {vocab_file(str(converter))} (the vocabulary its tokenizer is rebuilt from) is not a file"
    if vocab < TOKENIZER_ROWS:
        return f"{skipped}: a vocabulary of {vocab} rows is below the {TOKENIZER_ROWS} its tokenizer fills"
    if shape.family == "granitemoehybrid" and vocab % 16:
        return f"{skipped}: llama.cpp's granite conversion needs a vocabulary that is a multiple of 16, not {vocab}"
    return None


@contextlib.contextmanager
def _without_extra_buffers() -> Iterator[None]:
    """Models loaded inside get ``use_extra_bufts = False``: on x86 that turns off only the AMX
    weight repacking, whose q8_0 matmul (``ggml_backend_amx_mul_mat``) crashed on the project's CPU."""
    import llama_cpp.llama_cpp as lib

    default = lib.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params
    try:
        yield
    finally:
        lib.llama_model_default_params = default


def last_logits(model: Any, ids: list[int]) -> Any:
    """Runs ``ids`` through ``model`` (a ``llama_cpp.Llama``) from an empty state: the last
    position's logits, ``[1, vocab]`` float32 (a copy)."""
    model.reset()
    model.eval(ids)
    return _logits(model)


def _logits(model: Any) -> Any:
    import llama_cpp
    import numpy as np

    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(model.ctx, -1), shape=(model.n_vocab(),))
    return row[None].copy()


def _prompt(ids: Any) -> list[int]:
    """The token list llama.cpp takes for ``ids [1, l]`` (one sequence)."""
    return [int(t) for t in ids[0]]


def weight_bytes(path: str) -> int:
    """Bytes of weights one llama.cpp decode step reads from the GGUF file at ``path``: every tensor
    but the token embedding, of which a step reads one row (the converter writes the head apart
    as ``output.weight``)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name != "token_embd.weight")


def greedy_run(model: Any, ids: Any, *, new_tokens: int = DECODE_STEPS + 1,
               scores: list[Any] | None = None) -> DecodeRun:
    """``new_tokens`` greedy tokens after the prompt ``ids [1, l]`` as a
    :class:`~portable_ssm.bench.calls.DecodeRun`: the first after one ``eval`` of the prompt, each
    later one after one ``eval`` of the last token plus the argmax; the weight bytes a step reads
    (:func:`weight_bytes`). With ``scores``, each token's logits ``[1, vocab]`` are appended to it."""

    def tokens() -> Iterator[Any]:
        import numpy as np

        logits, token = last_logits(model, _prompt(ids)), None
        for _ in range(new_tokens):
            if token is not None:
                model.eval([token])
                logits = _logits(model)
            if scores is not None:
                scores.append(logits)
            token = int(np.argmax(logits))
            yield np.asarray([token])

    return DecodeRun(tokens(), contextlib.nullcontext, weight_bytes(model.model_path))


@dataclass
class LlamaCpp:
    """The llama.cpp rows of one run: ``converter`` (``convert_hf_to_gguf.py``), ``threads`` for
    ``n_threads`` and ``n_threads_batch``, and ``workdir`` for the converted files. A config is
    converted once, with the params first given for it (``init_params(config, seed=0)`` for the
    timed rows, as every row's are; the trained LM's for the quality part)."""

    converter: Path
    threads: int
    workdir: Path
    _folders: dict[Mamba2Config, Path] = field(default_factory=dict, init=False, repr=False)
    _files: dict[tuple[Path, str], Path] = field(default_factory=dict, init=False, repr=False)

    def gguf(self, config: Mamba2Config, params: dict[str, Any], outtype: str) -> Path:
        """The GGUF file of ``params`` in ``outtype``, converted on first use (:meth:`convert`)."""
        if config not in self._folders:
            self._folders[config] = self.workdir / f"hf-{len(self._folders)}"
            transformers_model(config, params, lm=True).save_pretrained(self._folders[config])
        return self.convert(self._folders[config], outtype)

    def convert(self, folder: Path, outtype: str) -> Path:
        """The GGUF file of the transformers checkpoint in ``folder`` in ``outtype``, beside it,
        converted on first use (run from the converter's folder: it reads ``models/`` beside it)."""
        if (folder, outtype) not in self._files:
            out = folder.with_name(f"{folder.name}-{outtype}.gguf")
            done = subprocess.run([sys.executable, str(self.converter.resolve()), str(folder.resolve()),
                                   "--outtype", outtype, "--outfile", str(out.resolve())],
                                  cwd=self.converter.resolve().parent, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{self.converter} failed ({done.returncode}) on {folder}:\n{done.stderr[-3000:]}")
            self._files[folder, outtype] = out
        return self._files[folder, outtype]

    def models(self, config: Mamba2Config, params: dict[str, Any], n_ctx: int) -> Any:
        """A context giving ``{row name: llama_cpp.Llama}`` for each weight type of ``params``
        (:meth:`load`)."""
        return self.load({row: self.gguf(config, params, t) for row, t in zip(ROWS, OUTTYPES)}, n_ctx)

    @contextlib.contextmanager
    def load(self, files: dict[str, Path], n_ctx: int) -> Iterator[dict[str, Any]]:
        """``{row name: llama_cpp.Llama}`` of GGUF ``files``, with ``n_ctx`` positions and the
        whole prompt in one logical batch (``n_batch = n_ctx``; llama.cpp's ``n_ubatch`` default of
        512), closed on exit."""
        from llama_cpp import Llama

        with contextlib.ExitStack() as stack:
            loaded = {}
            with _without_extra_buffers():
                for row, path in files.items():
                    model = Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=self.threads,
                                  n_threads_batch=self.threads, logits_all=False, verbose=False)
                    stack.callback(model.close)
                    loaded[row] = model
            yield loaded


def prefill_calls(models: dict[str, Any], ids: Any) -> dict[str, Callable[[], Any]]:
    """A no-argument prompt pass per model: ``ids [1, l]`` -> last logits ``[1, vocab]``."""
    prompt = _prompt(ids)
    return {row: (lambda model=model: last_logits(model, prompt)) for row, model in models.items()}


def thread_count(requested: int | None) -> int:
    """The thread count of the rows that take one (llama.cpp, the bandwidth read): ``--threads``, else every core."""
    return requested or os.cpu_count() or 1
