"""HybridLM.quantize and load_pretrained(weights=...) for every hybrid family: every 2-D
projection stored as int8 or bfloat16 through the Mamba-2 model's QuantizedWeight and matmul, the
MoE experts ``[E, out, in]`` as QuantizedWeight stacks (int8: a scale per row of each expert), its
logits and greedy tokens those of the float32 model on the dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
from test_families import case  # noqa: F401  (the module-scoped tiny model of each family)

import portable_ssm
from portable_ssm.hybrid_lm import HybridLM
from portable_ssm.quantized import QuantizedWeight, dequantize

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
def test_quantized_hybrid_logits_and_tokens_equal_float32_on_the_dequantized_weights(xp, case, kind):  # noqa: F811
    lm = portable_ssm.load_pretrained(case["folder"], backend=xp.name, device=xp.device, weights=kind)
    stored = {k for k, v in lm.params.items() if isinstance(v, QuantizedWeight)}
    leaves = ("proj.weight", "up.weight", "down.weight", "linear.weight", "embedding.weight", "lm_head.weight")
    projections = {k for k in lm.params if k.endswith(leaves)}  # MoE experts [E, out, in] included
    assert stored == projections and all(lm.params[k].kind == kind for k in stored)
    for name in (k for k in stored if ".experts." in k):
        w = lm.params[name]
        assert w.ndim == 3 and w.dtype == xp.float32
        assert w.scale is None if kind == "bfloat16" else tuple(w.scale.shape) == w.shape[:2]
    reference = HybridLM({k: dequantize(v, xp=xp.namespace) if k in stored else v for k, v in lm.params.items()},
                         lm.config, eos_token_id=lm.eos_token_id)
    ids = xp.asarray_from(case["ids"], "int64")
    got = xp.numpy(lm.logits(ids))
    want = xp.numpy(reference.logits(ids))
    assert np.abs(got - want).max() <= 2e-5 * np.abs(want).max()
    assert np.abs(got - case["full"]).max() <= (0.1 if kind == "int8" else 0.05) * np.abs(case["full"]).max()
    np.testing.assert_array_equal(xp.numpy(lm.generate(ids, 4, eos_token_id=None)),
                                  xp.numpy(reference.generate(ids, 4, eos_token_id=None)))


def test_hybrid_weights_kind_and_dtype_are_checked_at_the_door(case):  # noqa: F811
    with pytest.raises(ValueError, match="weights"):
        portable_ssm.load_pretrained(case["folder"], weights="int4")
    with pytest.raises(ValueError, match="weights"):
        portable_ssm.load_pretrained(case["folder"], weights="int8", dtype="float64")
    lm = portable_ssm.load_pretrained(case["folder"])
    assert lm.quantize("float32") is lm
    with pytest.raises(ValueError, match="kind"):
        lm.quantize("int4")


def test_an_int8_expert_stack_stores_what_each_expert_alone_would(xp):
    """A stack ``[E, out, in]`` quantizes as its E matrices one by one (the one int8 rounding,
    over the last axis): the same int8 data and one scale per output row of each expert; its
    bytes count E·out scales; a non-finite entry is named by expert and row."""
    stack = np.random.default_rng(5).normal(size=(3, 4, 6)).astype(np.float32)
    stack[1, 2] = 0.0  # an all-zero row keeps the 2-D path's scale of 1/127
    w = portable_ssm.quantize({"experts.up.weight": xp.asarray_from(stack, "float32")}, "int8",
                              names=["experts.up.weight"])["experts.up.weight"]
    assert w.data.dtype == xp.int8 and w.scale.dtype == xp.float32 and tuple(w.scale.shape) == (3, 4)
    for e in range(3):
        alone = portable_ssm.quantize({"w": xp.asarray_from(stack[e], "float32")}, "int8", names=["w"])["w"]
        np.testing.assert_array_equal(xp.numpy(w.data[e, ...]), xp.numpy(alone.data))
        np.testing.assert_array_equal(xp.numpy(w.scale[e, ...]), xp.numpy(alone.scale))
    assert w.nbytes == 3 * 4 * 6 + 4 * 3 * 4
    stack[2, 1, 3] = np.nan
    with pytest.raises(ValueError, match=r"params\['experts.up.weight'\]: expected finite values, got inf or nan "
                                         r"in expert 2 row 1"):
        portable_ssm.quantize({"experts.up.weight": xp.asarray_from(stack, "float32")}, "int8",
                              names=["experts.up.weight"])
