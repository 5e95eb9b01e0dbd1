"""What low-precision weights cost in quality (tooling, not core): every decode row on a *trained* LM.

Random weights amplify any rounding (the 130m-shaped random LM's greedy tokens part after a few
steps even between two float32 runs), so the benchmark's quality figures come from a small LM
trained for the purpose: :data:`PATTERN_LM` learns to continue a repeating 24-token sequence
(:func:`pattern`) in about 150 AdamW steps on torch (:func:`train_pattern_lm`). Each decode row
(portable_ssm's backends and weight kinds, llama.cpp's f32, f16 and q8_0 conversions of the same
weights) then decodes it greedily, its logits recorded each step, and :func:`quality_rows` compares
them with numpy at float32 weights. Frameworks are imported inside functions only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..config import Mamba2Config
from .calls import DecodeRun, decode_run, decode_target
from .llama import LlamaCpp, greedy_run

#: The trained LM: two layers, d_model 32, a vocabulary of 16 (a multiple of 16, as llama.cpp needs).
PATTERN_LM = Mamba2Config(d_model=32, n_layer=2, d_state=16, headdim=16, vocab_size=16, chunk_size=32)
PERIOD = 24
#: Prompt tokens (the pattern's first ones) and greedy tokens decoded after them.
PROMPT, NEW_TOKENS = 16, 64
#: Training steps of a full run (the loss ends below 0.2: the model continues the pattern).
TRAIN_STEPS = 150
#: The reference row: numpy with float32 weights.
REFERENCE = "numpy"


def pattern() -> Any:
    """The repeating token sequence the model learns: ``[PERIOD]`` ids below 16 (24 from 16, so some
    token recurs and the model must use its context)."""
    import numpy as np

    return np.random.default_rng(0).integers(0, PATTERN_LM.vocab_size, PERIOD)


def train_pattern_lm(steps: int = TRAIN_STEPS) -> tuple[dict[str, Any], float]:
    """:data:`PATTERN_LM` trained ``steps`` AdamW steps (lr 1e-2) on batches of 8 windows of 33
    pattern tokens from random offsets, on torch: ``(float32 params as numpy arrays, last loss)``.
    Deterministic (seeds 0 and 1); about 10 s on one core for 150 steps."""
    import numpy as np
    import torch

    from ..backends.torch import Mamba2LMModule

    torch.manual_seed(0)
    model = Mamba2LMModule(PATTERN_LM, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rng, tokens, vocab = np.random.default_rng(1), pattern(), PATTERN_LM.vocab_size
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        offsets = rng.integers(0, PERIOD, 8)
        seq = torch.from_numpy(tokens[(offsets[:, None] + np.arange(33)) % PERIOD])  # [8, 33]
        out = model(seq[:, :-1])  # [8, 32, vocab]
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, vocab), seq[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {k: v.detach().numpy().copy() for k, v in model.params().items()}, loss.item()


@dataclass(frozen=True)
class QualityRow:
    """One decode row on the trained LM: its ``weights`` kind, the relative logits error
    ``‖Δ‖/‖ref‖`` over the steps up to and including the first whose token differs from the
    reference's (later steps see other inputs), the greedy tokens ``equal`` to the reference's and
    those ``on_pattern`` (continuing the learnt sequence), of ``total``."""

    backend: str
    weights: str
    logits_err: float
    equal: int
    on_pattern: int
    total: int


def compare(backend: str, weights: str, tokens: Any, scores: Any, ref_tokens: Any, ref_scores: Any,
            expected: Any) -> QualityRow:
    """A :class:`QualityRow` from one row's ``tokens [new]`` and ``scores [new, vocab]`` against the
    reference's and the pattern's ``expected [new]`` tokens."""
    import numpy as np

    differ = np.flatnonzero(tokens != ref_tokens)
    upto = len(tokens) if differ.size == 0 else int(differ[0]) + 1
    err = np.linalg.norm(scores[:upto] - ref_scores[:upto]) / np.linalg.norm(ref_scores[:upto])
    return QualityRow(backend, weights, float(err), int((tokens == ref_tokens).sum()),
                      int((tokens == expected).sum()), len(tokens))


def _recorded(run: Callable[[list[Any]], DecodeRun]) -> tuple[Any, Any]:
    """Runs a decode to its end, its scores recorded: ``(tokens [new], scores [new, vocab])``."""
    import numpy as np

    scores: list[Any] = []
    decode = run(scores)
    with decode.context():
        tokens = [int(np.asarray(t).reshape(-1)[0]) for t in decode.tokens]
    return np.asarray(tokens), np.concatenate([np.asarray(s, np.float32).reshape(1, -1) for s in scores])


def quality_rows(backends: list[str], params: dict[str, Any], llama: LlamaCpp | None = None) -> list[QualityRow]:
    """Every decode row of ``backends`` (transformers and numpy-ref excepted) and, with ``llama``,
    llama.cpp's rows (:data:`~portable_ssm.bench.llama.ROWS`) on ``params`` (trained, numpy):
    :data:`NEW_TOKENS` greedy tokens after the pattern's first :data:`PROMPT`, compared with numpy
    at float32 weights (whose own row, first, shows how well the float32 model continues the pattern)."""
    import numpy as np

    ids = pattern()[None, :PROMPT]  # [1, PROMPT]
    expected = pattern()[np.arange(PROMPT, PROMPT + NEW_TOKENS) % PERIOD]

    def ours(backend: str) -> Callable[[list[Any]], DecodeRun]:
        return lambda scores: decode_run(backend, PATTERN_LM, params, ids, new_tokens=NEW_TOKENS, scores=scores)

    runs = {b: (ours(b), decode_target(b)[1]) for b in dict.fromkeys([REFERENCE, *backends])
            if b not in ("transformers", "numpy-ref")}
    models = contextlib.nullcontext({}) if llama is None else llama.models(PATTERN_LM, params, PROMPT + NEW_TOKENS)
    with models as loaded:
        for row, model in loaded.items():
            runs[row] = ((lambda scores, model=model: greedy_run(model, ids, new_tokens=NEW_TOKENS, scores=scores)),
                         row.rsplit("-", 1)[1])
        done = {b: _recorded(run) for b, (run, _) in runs.items()}
    ref_tokens, ref_scores = done[REFERENCE]
    return [compare(b, weights, *done[b], ref_tokens, ref_scores, expected) for b, (_, weights) in runs.items()]


def quality_notes(loss: float, steps: int) -> Iterator[str]:
    """The RESULTS.md notes of the quality part."""
    yield (f"quality: {PATTERN_LM.n_layer}-layer d_model {PATTERN_LM.d_model} LM trained {steps} AdamW steps on torch "
           f"to continue a repeating {PERIOD}-token sequence (last loss {loss:.3f}); each decode row, and llama.cpp's "
           f"conversions of the same weights, decodes {NEW_TOKENS} greedy tokens after its first {PROMPT}; "
           f"reference: {REFERENCE} with float32 weights")
