"""HybridLM.quantize and load_pretrained(weights=...) for every hybrid family: every 2-D
projection stored as int8 or bfloat16 through the Mamba-2 model's QuantizedWeight and matmul,
its logits and greedy tokens those of the float32 model on the dequantized weights."""

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
    projections = {k for k in lm.params if k.endswith(leaves) and "experts." not in k}
    assert stored == projections and all(lm.params[k].kind == kind for k in stored)
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
