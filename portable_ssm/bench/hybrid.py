"""The hybrid part (tooling, not core): portable_ssm's HybridLM beside llama.cpp on the same random weights.

Each shape (:mod:`portable_ssm.bench.hybrid_models`) is built by transformers on random weights and
saved to a temporary folder, which portable_ssm loads as a user would
(``load_pretrained(folder, backend="numpy")``, then ``HybridLM.quantize`` for bfloat16 and int8)
and llama.cpp's converter turns into f32, f16 and q8_0 GGUF files (with a rebuilt tokenizer,
:func:`~portable_ssm.bench.hybrid_models.write_tokenizer`). Neither the build nor the conversion is
timed. At batch 1 it times, per context:

- decode: one ``HybridLM.prefill`` of a prompt of random token ids (untimed), then greedy
  ``HybridLM.step`` calls, each timed alone, beside llama.cpp's one ``eval`` of the prompt and
  ``eval`` of each token (:func:`~portable_ssm.bench.llama.greedy_run`), every row's steps side by
  side in rounds (:func:`~portable_ssm.bench.runner.interleaved_decode`);
- prefill: ``HybridLM.prefill(..., logits_to_keep=1)`` of the prompt at float32 weights (the last
  position's logits, as generation asks for them) beside llama.cpp f32's ``eval`` to the last
  logits, side by side in rounds (:func:`~portable_ssm.bench.timing.measure`).

Frameworks are imported inside functions only.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .calls import Clock, DecodeRun
from .hybrid_models import (
    FALCON_H1_05B,
    GRANITE_350M,
    GRANITE_MOE,
    PROMPT_IDS,
    QUICK_GRANITE_MOE,
    QUICK_SHAPES,
    TOKENIZER_ROWS,
    HybridShape,
    vocab_file,
    write_folder,
    write_tokenizer,
)
from .llama import LlamaCpp, greedy_run, hybrid_unavailable, last_logits
from .report import HybridRow
from .timing import interleaved_decode, measure

#: portable_ssm's weight kinds and the llama.cpp row each is held against (the same bytes per weight).
PRECISIONS = (("float32", "llama.cpp-f32"), ("bfloat16", "llama.cpp-f16"), ("int8", "llama.cpp-q8_0"))
#: Prompt tokens before the timed decode steps, and the prefill part's prompt (``--quick``: smaller).
CONTEXTS, QUICK_CONTEXTS = (64, 4096), (16, 64)
PREFILL, QUICK_PREFILL = 2048, 64


def skipped(backends: list[str]) -> str | None:
    """Why the hybrid part cannot run at all (a note for RESULTS.md), or None."""
    if "numpy" not in backends:
        return "hybrid part skipped: it runs portable_ssm on numpy, which is not among the run's backends"
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return f"hybrid part skipped: its models are built with transformers on torch ({', '.join(missing)} missing)"
    return None


def step_run(model: Any, ids: Any, new_tokens: int) -> DecodeRun:
    """``new_tokens`` greedy tokens after ``ids [1, l]`` as a user runs them: the first from
    ``model.prefill`` (room for every new token), each later one from one ``model.step``."""

    def tokens() -> Iterator[Any]:
        import numpy as np

        logits, state = model.prefill(ids, max_len=ids.shape[1] + new_tokens)
        token = np.argmax(logits[:, -1, :], axis=-1)  # [1]
        yield token
        for _ in range(new_tokens - 1):
            logits, state = model.step(token, state)
            token = np.argmax(logits, axis=-1)
            yield token

    return DecodeRun(tokens(), contextlib.nullcontext, None)


def _tokens_equal(a: list[Any], b: list[Any]) -> str:
    return f"{sum(int(x[0]) == int(y[0]) for x, y in zip(a, b))}/{len(a)}"


def _decode_rows(shape: HybridShape, models: dict[str, Any], llama: LlamaCpp | None, files: dict[str, Path],
                 context: int, steps: int, note: str, clock: Clock, settle_s: float) -> list[HybridRow]:
    """Every precision's decode after a prompt of ``context`` random ids, portable_ssm's and
    llama.cpp's rows side by side."""
    import numpy as np

    ids = np.random.default_rng(context).integers(0, PROMPT_IDS, (1, context))
    loading = llama.load(files, n_ctx=context + steps + 1) if llama and files else contextlib.nullcontext({})
    with loading as loaded:
        runs = {p: step_run(models[p], ids, steps + 1) for p in models}
        runs.update({row: greedy_run(m, ids, new_tokens=steps + 1) for row, m in loaded.items()})
        timed, _ = interleaved_decode(runs, lambda: None, clock, settle_s=settle_s, steps=steps)
    rows = []
    for precision, row in PRECISIONS:
        times, tokens = timed[precision]
        theirs = timed.get(row)
        rows.append(HybridRow(shape.name, "decode", context, precision, float(np.median(times)), len(times), row,
                              None if theirs is None else float(np.median(theirs[0])),
                              "" if theirs is None else _tokens_equal(tokens, theirs[1]) + " tokens equal", note))
    return rows


def _prefill_row(shape: HybridShape, model: Any, llama: LlamaCpp | None, files: dict[str, Path], length: int,
                 note: str, repeats: int, clock: Clock, sample_s: float, settle_s: float) -> HybridRow:
    """float32 prefill of ``length`` random ids, portable_ssm's beside llama.cpp f32's."""
    import numpy as np

    ids = np.random.default_rng(length).integers(0, PROMPT_IDS, (1, length))
    row = PRECISIONS[0][1]
    loading = llama.load({row: files[row]}, n_ctx=length) if llama and files else contextlib.nullcontext({})
    with loading as loaded:
        fns = {"float32": lambda: model.prefill(ids, logits_to_keep=1)[0][:, -1, :]}
        if loaded:
            fns[row] = functools.partial(last_logits, loaded[row], [int(t) for t in ids[0]])
        measured = measure(fns, repeats, clock, sample_s=sample_s, settle_s=settle_s)
    seconds, runs, _, _, ours = measured["float32"]
    if row not in measured:
        return HybridRow(shape.name, "prefill", length, "float32", seconds, runs, row, note=note)
    theirs = measured[row][4]
    err = float(np.max(np.abs(theirs - ours)) / max(float(np.max(np.abs(ours))), 1e-30))
    return HybridRow(shape.name, "prefill", length, "float32", seconds, runs, row, measured[row][0],
                     f"last logits rel err {err:.1e}")


def shape_rows(shape: HybridShape, llama: LlamaCpp | None, converter: str | None, *, contexts: tuple[int, ...],
               prefill: int | None, steps: int, repeats: int, clock: Clock, sample_s: float, settle_s: float,
               notes: list[str]) -> list[HybridRow]:
    """The rows of one shape: its checkpoint written to a temporary folder (removed after), loaded by
    portable_ssm and, with ``llama`` where :func:`~portable_ssm.bench.llama.hybrid_unavailable` allows
    (``converter``: the run's converter path), converted for llama.cpp; then the decode rows at each
    of ``contexts`` (``steps`` timed steps each) and the float32 prefill row (``prefill`` tokens;
    None: none). Each row missing llama.cpp's time says why; a reason of this shape's own goes into
    ``notes`` too."""
    from ..io import load_pretrained

    why = hybrid_unavailable(converter, shape)
    if why is not None and llama is not None:  # a reason the run's other llama.cpp rows do not share
        notes.append(why)
    note = why or ("" if llama is not None else "llama.cpp rows skipped (see the notes)")
    workdir = None if llama is None else llama.workdir
    with tempfile.TemporaryDirectory(prefix="portable-ssm-hybrid-", dir=workdir) as tmp:
        folder = Path(tmp) / shape.name
        write_folder(shape, folder)
        files = {}
        if llama is not None and why is None:
            write_tokenizer(folder, vocab_file(llama.converter))
            files = {row: llama.convert(folder, row.removeprefix("llama.cpp-")) for _, row in PRECISIONS}
        base = load_pretrained(folder, backend="numpy")
        models = {precision: base.quantize(precision) for precision, _ in PRECISIONS}
        rows = [r for context in contexts
                for r in _decode_rows(shape, models, llama, files, context, steps, note, clock, settle_s)]
        if prefill is not None:
            rows.append(_prefill_row(shape, models["float32"], llama, files, prefill, note, repeats, clock, sample_s,
                                     settle_s))
    return rows


#: ``--hybrid-shapes`` keys: each shape and its ``--quick`` stand-in.
SHAPE_KEYS = {"granite": (GRANITE_350M, QUICK_SHAPES[0]), "falcon": (FALCON_H1_05B, QUICK_SHAPES[1]),
              "granite-moe": (GRANITE_MOE, QUICK_GRANITE_MOE)}
#: The shapes a run takes unless ``--hybrid-shapes`` says otherwise (issue 48's two).
DEFAULT_SHAPES = ("granite", "falcon")


def part(keys: list[str], llama: LlamaCpp | None, converter: str | None, backends: list[str], *, quick: bool,
         max_len: int | None, steps: int, repeats: int, clock: Clock, sample_s: float, settle_s: float,
         notes: list[str]) -> list[HybridRow]:
    """The hybrid part: :func:`shape_rows` of each shape of ``keys`` (:data:`SHAPE_KEYS` keys;
    ``quick``: the tiny shapes), contexts and prefill lengths above ``max_len`` left out; no rows,
    with a note, where it cannot run (:func:`skipped`)."""
    why = skipped(backends)
    if why is not None:
        notes.append(why)
        return []
    shapes = [SHAPE_KEYS[key][quick] for key in SHAPE_KEYS if key in keys]
    contexts = tuple(c for c in (QUICK_CONTEXTS if quick else CONTEXTS) if max_len is None or c <= max_len)
    prefill = QUICK_PREFILL if quick else PREFILL
    notes.append(f"hybrid: {', '.join(s.name for s in shapes)} built by transformers on random weights "
                 "(torch.manual_seed(0)), saved and loaded by portable_ssm.load_pretrained(backend='numpy'), "
                 "HybridLM.quantize('bfloat16' / 'int8'); decode: b=1, HybridLM.prefill of a prompt of "
                 f"{' and '.join(map(str, contexts)) or 'no'} random ids (untimed), then {steps} greedy "
                 "HybridLM.step calls timed one by one, side by side in rounds with llama.cpp's (its f32 beside "
                 "float32, f16 beside bfloat16, q8_0 beside int8); prefill: float32 HybridLM.prefill "
                 "(logits_to_keep=1: the last position's logits) beside llama.cpp f32's eval to them; the "
                 "llama.cpp files carry a tokenizer rebuilt from llama.cpp's bundled DeepSeek-Coder vocabulary, "
                 f"the rows past its {TOKENIZER_ROWS} named [PAD i] by the converter, so each head keeps the "
                 "shape's vocabulary")
    return [row for shape in shapes
            for row in shape_rows(shape, llama, converter, contexts=contexts,
                                  prefill=prefill if max_len is None or prefill <= max_len else None, steps=steps,
                                  repeats=repeats, clock=clock, sample_s=sample_s, settle_s=settle_s, notes=notes)]
