"""Malformed input to every public non-I/O function: a ValueError or TypeError naming the argument.

Each case calls one entry point with one argument broken (wrong rank, wrong type, str, None, list,
bool where an int belongs, zero or negative sizes, NaN in a config float, float token ids, ...)
and asserts that the error is one of the two documented types and that its message names the
argument; any other exception (IndexError, ZeroDivisionError, a broadcast error from inside) fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import portable_ssm as ps
from portable_ssm import generation, lm

RNG = np.random.default_rng(0)
B_, L_, H_, P_, G_, N_ = 1, 10, 2, 3, 1, 4


def _f(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


X = _f(B_, L_, H_, P_)
DT = np.abs(_f(B_, L_, H_)) * 0.1
A = -np.ones(H_, np.float32)
BC = _f(B_, L_, G_, N_)
STATE = np.zeros((B_, H_, P_, N_), np.float32)
CFG = ps.Mamba2Config(d_model=8, n_layer=1, d_state=4, headdim=4)
LM_CFG = ps.Mamba2Config(d_model=8, n_layer=1, d_state=4, headdim=4, vocab_size=300)
PARAMS = ps.init_params(CFG)
LM_PARAMS = ps.init_params(LM_CFG)
XM = _f(1, 5, 8)
IDS = np.array([[1, 2, 3]], np.int64)


def scan_args(**changes: Any) -> tuple[tuple, dict]:
    """(x, dt, A, B, C) and keywords with some replaced."""
    args = {"x": X, "dt": DT, "A": A, "B": BC, "C": BC, **changes}
    pos = tuple(args.pop(k) for k in ("x", "dt", "A", "B", "C"))
    return pos, args


def step_args(**changes: Any) -> tuple[tuple, dict]:
    args = {"state": STATE, "x": X[:, 0], "dt": DT[:, 0], "A": A, "B": BC[:, 0], "C": BC[:, 0], **changes}
    pos = tuple(args.pop(k) for k in ("state", "x", "dt", "A", "B", "C"))
    return pos, args


def _scan_cases(fn_name: str) -> list[tuple[str, str, Callable[[], Any]]]:
    fn = getattr(ps, fn_name)

    def call(**changes: Any) -> Callable[[], Any]:
        pos, kw = scan_args(**changes)
        return lambda: fn(*pos, **kw)

    return [
        (f"{fn_name}-x-list", "x", call(x=X.tolist())),
        (f"{fn_name}-x-None", "x", call(x=None)),
        (f"{fn_name}-x-str", "x", call(x="x")),
        (f"{fn_name}-x-rank3", "x", call(x=X[0])),
        (f"{fn_name}-x-int", "x", call(x=np.ones(X.shape, np.int32))),
        (f"{fn_name}-dt-rank2", "dt", call(dt=DT[0])),
        (f"{fn_name}-dt-length", "dt", call(dt=DT[:, :3])),
        (f"{fn_name}-A-rank2", "A", call(A=A[None])),
        (f"{fn_name}-A-bool", "A", call(A=A < 0)),
        (f"{fn_name}-B-zero-groups", "B", call(B=np.zeros((B_, L_, 0, N_), np.float32),
                                               C=np.zeros((B_, L_, 0, N_), np.float32))),
        (f"{fn_name}-B-groups-not-dividing", "B", call(B=_f(B_, L_, 3, N_), C=_f(B_, L_, 3, N_))),
        (f"{fn_name}-C-n", "C", call(C=_f(B_, L_, G_, N_ + 1))),
        (f"{fn_name}-C-float64", "C", call(C=BC.astype(np.float64))),
        (f"{fn_name}-D-rank3", "D", call(D=np.ones((H_, P_, 1), np.float32))),
        (f"{fn_name}-z-shape", "z", call(z=X[:, :, :1])),
        (f"{fn_name}-chunk-zero", "chunk_size", call(chunk_size=0)),
        (f"{fn_name}-chunk-negative", "chunk_size", call(chunk_size=-4)),
        (f"{fn_name}-chunk-float", "chunk_size", call(chunk_size=4.0)),
        (f"{fn_name}-chunk-str", "chunk_size", call(chunk_size="4")),
        (f"{fn_name}-chunk-bool", "chunk_size", call(chunk_size=True)),
        (f"{fn_name}-dt-limit-str", "dt_limit", call(dt_limit="ab")),
        (f"{fn_name}-dt-limit-None", "dt_limit", call(dt_limit=None)),
        (f"{fn_name}-dt-limit-nan", "dt_limit", call(dt_limit=(math.nan, 1.0))),
        (f"{fn_name}-dt-limit-reversed", "dt_limit", call(dt_limit=(1.0, 0.5))),
        (f"{fn_name}-dt-softplus-str", "dt_softplus", call(dt_softplus="yes")),
        (f"{fn_name}-dt-softplus-None", "dt_softplus", call(dt_softplus=None)),
        (f"{fn_name}-return-final-int", "return_final_states", call(return_final_states=2)),
        (f"{fn_name}-initial-states-dtype", "initial_states", call(initial_states=STATE.astype(np.float64))),
        (f"{fn_name}-initial-states-shape", "initial_states", call(initial_states=STATE[:, :1])),
        (f"{fn_name}-seq-idx-float", "seq_idx", call(seq_idx=np.zeros((B_, L_), np.float32))),
        (f"{fn_name}-seq-idx-shape", "seq_idx", call(seq_idx=np.zeros((B_, L_ + 1), np.int64))),
        (f"{fn_name}-dt-bias-shape", "dt_bias", call(dt_bias=np.zeros(H_ + 1, np.float32))),
    ]


def _step_cases() -> list[tuple[str, str, Callable[[], Any]]]:
    def call(**changes: Any) -> Callable[[], Any]:
        pos, kw = step_args(**changes)
        return lambda: ps.ssd_step(*pos, **kw)

    return [
        ("ssd_step-state-None", "state", call(state=None)),
        ("ssd_step-state-list", "state", call(state=STATE.tolist())),
        ("ssd_step-state-shape", "state", call(state=STATE[:, :1])),
        ("ssd_step-x-rank4", "x", call(x=X)),
        ("ssd_step-B-zero-groups", "B", call(B=np.zeros((B_, 0, N_), np.float32),
                                             C=np.zeros((B_, 0, N_), np.float32))),
        ("ssd_step-dt-softplus-int", "dt_softplus", call(dt_softplus=1)),
        ("ssd_step-dt-limit-str", "dt_limit", call(dt_limit="ab")),
    ]


def _config_cases() -> list[tuple[str, str, Callable[[], Any]]]:
    cases = []
    for field in ("d_model", "n_layer", "d_state", "d_conv", "expand", "headdim", "ngroups", "chunk_size",
                  "pad_vocab_size_multiple"):
        for bad in (0, -1, "4", None, 4.0, True, [4]):
            kw = {"d_model": 8, "headdim": 4, field: bad}
            cases.append((f"Mamba2Config-{field}-{bad!r}", field, lambda kw=kw: ps.Mamba2Config(**kw)))
    for field, bad in (("vocab_size", 0), ("vocab_size", True), ("vocab_size", 3.0), ("vocab_size", "10"),
                       ("dt_min", math.nan), ("dt_max", math.nan), ("dt_min", "0.1"), ("dt_max", math.inf),
                       ("dt_init_floor", math.nan), ("dt_init_floor", -1.0), ("dt_init_floor", None),
                       ("norm_eps", math.nan), ("norm_eps", math.inf), ("norm_eps", None),
                       ("initializer_range", math.nan), ("initializer_range", -1.0), ("initializer_range", "x"),
                       ("dt_limit", (math.nan, 1.0)), ("dt_limit", "ab"), ("dt_limit", None), ("dt_limit", (0.0,)),
                       ("A_init_range", (math.nan, 2.0)), ("A_init_range", (1.0, math.inf)),
                       ("A_init_range", None), ("A_init_range", 3.0),
                       ("D_has_hdim", "yes"), ("conv_bias", 1), ("bias", None), ("residual_in_fp32", "no"),
                       ("tie_embeddings", 0), ("rescale_prenorm_residual", "True")):
        kw = {"d_model": 8, "headdim": 4, field: bad}
        cases.append((f"Mamba2Config-{field}-{bad!r}", field, lambda kw=kw: ps.Mamba2Config(**kw)))
    cases.append(("Mamba2Config-ngroups-not-dividing", "ngroups",
                  lambda: ps.Mamba2Config(d_model=8, headdim=4, ngroups=3)))
    return cases


def _model_cases() -> list[tuple[str, str, Callable[[], Any]]]:
    state = ps.empty_state(CFG, 1, XM)
    return [
        ("forward-x-rank2", "x", lambda: ps.forward(XM[0], PARAMS, config=CFG)),
        ("forward-x-list", "x", lambda: ps.forward(XM.tolist(), PARAMS, config=CFG)),
        ("forward-x-None", "x", lambda: ps.forward(None, PARAMS, config=CFG)),
        ("forward-x-int", "x", lambda: ps.forward(np.ones((1, 5, 8), np.int64), PARAMS, config=CFG)),
        ("forward-x-d-model", "x", lambda: ps.forward(_f(1, 5, 9), PARAMS, config=CFG)),
        ("forward-config-None", "config", lambda: ps.forward(XM, PARAMS)),
        ("forward-config-dict", "config", lambda: ps.forward(XM, PARAMS, config=CFG.to_dict())),
        ("forward-params-list", "params", lambda: ps.forward(XM, [PARAMS], config=CFG)),
        ("forward-params-missing", "params", lambda: ps.forward(XM, {}, config=CFG)),
        ("forward-backend-str", "backend", lambda: ps.forward(XM, PARAMS, config=CFG, backend="nope")),
        ("forward-backend-int", "backend", lambda: ps.forward(XM, PARAMS, config=CFG, backend=3)),
        ("forward-state-tuple", "initial_state", lambda: ps.forward(XM, PARAMS, config=CFG, initial_state=(1,))),
        ("forward-return-state-str", "return_state", lambda: ps.forward(XM, PARAMS, config=CFG, return_state="y")),
        ("forward-seq-idx-float", "seq_idx",
         lambda: ps.forward(XM, PARAMS, config=CFG, seq_idx=np.zeros((1, 5), np.float32))),
        ("step-x-rank3", "x", lambda: ps.step(XM, state, PARAMS, config=CFG)),
        ("step-x-None", "x", lambda: ps.step(None, state, PARAMS, config=CFG)),
        ("step-state-list", "state", lambda: ps.step(XM[:, 0], [1], PARAMS, config=CFG)),
        ("step-config-None", "config", lambda: ps.step(XM[:, 0], state, PARAMS, config=None)),
        ("init_params-config-None", "config", lambda: ps.init_params(None)),
        ("init_params-config-dict", "config", lambda: ps.init_params(CFG.to_dict())),
        ("init_params-seed-str", "seed", lambda: ps.init_params(CFG, seed="0")),
        ("init_params-seed-float", "seed", lambda: ps.init_params(CFG, seed=0.5)),
        ("init_params-seed-negative", "seed", lambda: ps.init_params(CFG, seed=-1)),
        ("init_params-seed-bool", "seed", lambda: ps.init_params(CFG, seed=True)),
        ("init_params-backend", "backend", lambda: ps.init_params(CFG, backend="nope")),
        ("init_params-backend-None", "backend", lambda: ps.init_params(CFG, backend=None)),
        ("init_params-dtype-int", "dtype", lambda: ps.init_params(CFG, dtype="int32")),
        ("init_params-dtype-unknown", "dtype", lambda: ps.init_params(CFG, dtype="float128x")),
        ("init_params-dtype-None", "dtype", lambda: ps.init_params(CFG, dtype=None)),
        ("param_shapes-config-None", "config", lambda: ps.param_shapes(None)),
        ("param_shapes-config-int", "config", lambda: ps.param_shapes(8)),
        ("cast_params-params-list", "params", lambda: ps.cast_params([PARAMS], "float64")),
        ("cast_params-dtype-int", "dtype", lambda: ps.cast_params(PARAMS, "int8")),
        ("cast_params-dtype-None", "dtype", lambda: ps.cast_params(PARAMS, None)),
        ("cast_params-backend", "backend", lambda: ps.cast_params(PARAMS, "float64", backend="nope")),
        ("to_backend-backend", "backend", lambda: ps.to_backend(XM, "nope")),
        ("to_backend-backend-None", "backend", lambda: ps.to_backend(XM, None)),
        ("to_backend-x-str", "x", lambda: ps.to_backend("x", "numpy")),
        ("to_backend-x-list", "x", lambda: ps.to_backend([1.0], "numpy")),
        ("to_backend-dtype", "dtype", lambda: ps.to_backend(XM, "numpy", dtype="float99")),
        ("empty_state-config", "config", lambda: ps.empty_state(None, 1, XM)),
        ("empty_state-batch-zero", "batch", lambda: ps.empty_state(CFG, 0, XM)),
        ("empty_state-batch-negative", "batch", lambda: ps.empty_state(CFG, -1, XM)),
        ("empty_state-batch-str", "batch", lambda: ps.empty_state(CFG, "1", XM)),
        ("empty_state-batch-bool", "batch", lambda: ps.empty_state(CFG, True, XM)),
        ("empty_state-batch-float", "batch", lambda: ps.empty_state(CFG, 1.0, XM)),
        ("empty_state-like-list", "like", lambda: ps.empty_state(CFG, 1, [1.0])),
        ("empty_state-like-int", "like", lambda: ps.empty_state(CFG, 1, np.ones(3, np.int64))),
        ("choose_chunk_size-negative", "length", lambda: ps.choose_chunk_size(-1)),
        ("choose_chunk_size-str", "length", lambda: ps.choose_chunk_size("5")),
        ("choose_chunk_size-float", "length", lambda: ps.choose_chunk_size(5.0)),
        ("choose_chunk_size-bool", "length", lambda: ps.choose_chunk_size(True)),
        ("choose_chunk_size-None", "length", lambda: ps.choose_chunk_size(None)),
        ("choose_chunk_size-max-zero", "max_chunk", lambda: ps.choose_chunk_size(5, 0)),
        ("choose_chunk_size-max-str", "max_chunk", lambda: ps.choose_chunk_size(5, "8")),
        ("discretize-dt-scalar", "dt", lambda: ps.discretize(np.float32(1.0), A)),
        ("discretize-dt-list", "dt", lambda: ps.discretize([1.0, 2.0], A)),
        ("discretize-dt-int", "dt", lambda: ps.discretize(np.ones(H_, np.int32), A)),
        ("discretize-A-rank2", "A", lambda: ps.discretize(DT, A[None])),
        ("discretize-A-length", "A", lambda: ps.discretize(DT, A[:1])),
        ("discretize-dt-bias", "dt_bias", lambda: ps.discretize(DT, A, dt_bias=A[:1])),
        ("discretize-softplus-str", "dt_softplus", lambda: ps.discretize(DT, A, dt_softplus="no")),
        ("discretize-limit", "dt_limit", lambda: ps.discretize(DT, A, dt_limit=(2.0, 1.0))),
    ]


def _data_cases() -> list[tuple[str, str, Callable[[], Any]]]:
    seqs = [_f(3, 8), _f(5, 8)]
    batch = ps.collate(seqs)
    return [
        ("collate-samples-empty", "samples", lambda: ps.collate([])),
        ("collate-samples-array", "samples", lambda: ps.collate(seqs[0])),
        ("collate-samples-str", "samples", lambda: ps.collate("ab")),
        ("collate-samples-None", "samples", lambda: ps.collate(None)),
        ("collate-samples-rank", "samples", lambda: ps.collate([seqs[0], _f(5)])),
        ("collate-samples-features", "samples", lambda: ps.collate([seqs[0], _f(5, 9)])),
        ("collate-samples-lists", "samples", lambda: ps.collate([[1.0, 2.0]])),
        ("collate-mode", "mode", lambda: ps.collate(seqs, mode="zip")),
        ("collate-mode-None", "mode", lambda: ps.collate(seqs, mode=None)),
        ("collate-targets-count", "targets", lambda: ps.collate(seqs, targets=[seqs[0]])),
        ("collate-targets-array", "targets", lambda: ps.collate(seqs, targets=seqs[0])),
        ("unpack-batch-None", "batch", lambda: ps.unpack(batch.x, None)),
        ("unpack-y-shape", "y", lambda: ps.unpack(batch.x[:, :2], batch)),
        ("unpack-y-list", "y", lambda: ps.unpack(batch.x.tolist(), batch)),
        ("to_padded-batch-dict", "batch", lambda: ps.to_padded(batch.x, {})),
        ("to_padded-y-rank", "y", lambda: ps.to_padded(batch.x[0], batch)),
        ("to_padded-pad-value-str", "pad_value", lambda: ps.to_padded(batch.x, batch, pad_value="0")),
    ]


def _lm_cases() -> list[tuple[str, str, Callable[[], Any]]]:
    kw = {"config": LM_CFG}
    state = ps.empty_state(LM_CFG, 1, _f(1, 1, 8))
    return [
        ("logits-ids-float", "input_ids", lambda: lm.logits(IDS.astype(np.float32), LM_PARAMS, **kw)),
        ("logits-ids-bool", "input_ids", lambda: lm.logits(IDS > 1, LM_PARAMS, **kw)),
        ("logits-ids-rank", "input_ids", lambda: lm.logits(IDS[0], LM_PARAMS, **kw)),
        ("logits-ids-list", "input_ids", lambda: lm.logits(IDS.tolist(), LM_PARAMS, **kw)),
        ("logits-ids-negative", "input_ids", lambda: lm.logits(-IDS, LM_PARAMS, **kw)),
        ("logits-ids-too-large", "input_ids", lambda: lm.logits(IDS + 10_000, LM_PARAMS, **kw)),
        ("logits-config-backbone", "vocab_size", lambda: lm.logits(IDS, PARAMS, config=CFG)),
        ("logits_step-token-float", "token",
         lambda: lm.logits_step(IDS[:, 0].astype(np.float64), state, LM_PARAMS, **kw)),
        ("logits_step-token-too-large", "token", lambda: lm.logits_step(IDS[:, 0] + 5000, state, LM_PARAMS, **kw)),
        ("logits_step-token-rank", "token", lambda: lm.logits_step(IDS, state, LM_PARAMS, **kw)),
        ("logits_step-state", "state", lambda: lm.logits_step(IDS[:, 0], None, LM_PARAMS, **kw)),
        ("generate-ids-float", "input_ids",
         lambda: generation.generate(IDS.astype(np.float32), LM_PARAMS, max_new_tokens=2, **kw)),
        ("generate-ids-uint8-narrow", "input_ids",
         lambda: generation.generate(IDS.astype(np.uint8), LM_PARAMS, max_new_tokens=2, **kw)),
        ("generate-ids-int8-narrow", "input_ids",
         lambda: generation.generate(IDS.astype(np.int8), LM_PARAMS, max_new_tokens=2, **kw)),
        ("generate-ids-out-of-range", "input_ids",
         lambda: generation.generate(IDS + 400, LM_PARAMS, max_new_tokens=2, **kw)),
        ("generate-ids-empty", "input_ids",
         lambda: generation.generate(IDS[:, :0], LM_PARAMS, max_new_tokens=2, **kw)),
        ("generate-max-new-negative", "max_new_tokens",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=-1, **kw)),
        ("generate-max-new-float", "max_new_tokens",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=2.0, **kw)),
        ("generate-max-new-None", "max_new_tokens",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=None, **kw)),
        ("generate-temperature-nan", "temperature",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, temperature=math.nan, **kw)),
        ("generate-temperature-inf", "temperature",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, temperature=math.inf, **kw)),
        ("generate-temperature-str", "temperature",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, temperature="1", **kw)),
        ("generate-top-k-zero", "top_k",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, temperature=1.0, top_k=0, **kw)),
        ("generate-top-p-nan", "top_p",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, temperature=1.0, top_p=math.nan, **kw)),
        ("generate-seed-str", "seed",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, temperature=1.0, seed="1", **kw)),
        ("generate-eos-float", "eos_token_id",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, eos_token_id=1.0, **kw)),
        ("generate-vocab-size-zero", "vocab_size",
         lambda: generation.generate(IDS, LM_PARAMS, max_new_tokens=1, vocab_size=0, **kw)),
        ("generate-config-None", "config", lambda: generation.generate(IDS, LM_PARAMS, config=None,
                                                                       max_new_tokens=1)),
        ("next_token-logits-rank", "logits", lambda: generation.next_token(_f(2, 3, 4))),
        ("next_token-logits-int", "logits", lambda: generation.next_token(np.ones((2, 3), np.int64))),
        ("next_token-rng", "rng", lambda: generation.next_token(_f(2, 3), temperature=1.0, rng=None)),
    ]


CASES = (_scan_cases("ssd_scan") + _scan_cases("selective_scan") + _step_cases() + _config_cases()
         + _model_cases() + _data_cases() + _lm_cases())


@pytest.mark.parametrize("name, argument, call", CASES, ids=[c[0] for c in CASES])
def test_malformed_input_raises_value_or_type_error_naming_the_argument(name: str, argument: str,
                                                                         call: Callable[[], Any]) -> None:
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert argument in str(info.value), f"{name}: the message does not name {argument!r}: {info.value}"


@pytest.mark.parametrize("fn", [ps.ssd_scan, ps.selective_scan])
def test_chunk_size_beyond_the_length_is_capped_at_the_length(fn: Callable[..., Any]) -> None:
    pos, _ = scan_args()
    huge = fn(*pos, chunk_size=10**12)  # uncapped this would ask for 10^24 floats
    assert huge.shape == X.shape and huge.dtype == X.dtype
    np.testing.assert_array_equal(huge, fn(*pos, chunk_size=L_))


def test_choose_chunk_size_caps_an_explicit_maximum_at_the_length() -> None:
    assert ps.choose_chunk_size(10, 100_000) == 10
    assert ps.choose_chunk_size(0) == 1
    assert ps.choose_chunk_size(300) == 60


def test_generate_accepts_narrow_int_ids_when_the_vocabulary_fits() -> None:
    cfg = ps.Mamba2Config(d_model=8, n_layer=1, d_state=4, headdim=4, vocab_size=100)
    params = ps.init_params(cfg)
    out = generation.generate(IDS.astype(np.uint8), params, config=cfg, max_new_tokens=3)
    wide = generation.generate(IDS, params, config=cfg, max_new_tokens=3)
    assert out.dtype == np.uint8 and out.shape == (1, 6)
    np.testing.assert_array_equal(out.astype(np.int64), wide)
