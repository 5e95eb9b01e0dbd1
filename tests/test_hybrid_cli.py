"""``portable-ssm generate`` on a hybrid family's folder: the tokens HybridLM.generate gives,
with the same flags (weights, sampling) as a Mamba-2 folder."""

from __future__ import annotations

import numpy as np
import pytest
from test_families import case  # noqa: F401  (the module-scoped tiny model of each family)

import portable_ssm
from portable_ssm.cli import main

pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.mark.parametrize("flags, options", [
    ([], {}),
    (["--weights", "int8"], {}),
    (["--temperature", "0.7", "--top-k", "10", "--seed", "3"], dict(temperature=0.7, top_k=10, seed=3)),
], ids=["greedy", "int8", "sampled"])
def test_cli_generate_on_a_hybrid_folder_prints_the_models_tokens(case, capsys, flags, options):  # noqa: F811
    argv = ["generate", "--model", case["folder"], "--ids", "--prompt", "1 2 3", "--max-new-tokens", "4",
            "--eos-token-id", "-1"] + flags
    assert main(argv) == 0
    weights = flags[1] if flags[:1] == ["--weights"] else "float32"
    lm = portable_ssm.load_pretrained(case["folder"], weights=weights)
    want = np.asarray(lm.generate([[1, 2, 3]], 4, eos_token_id=None, **options))[0]  # the prompt, then 4 new
    out = capsys.readouterr()
    assert out.out == " ".join(str(i) for i in want) + "\n" and len(want) == 7
    assert "4 tokens" in out.err and "numpy float32" in out.err


def test_cli_generate_refuses_ids_outside_the_hybrid_vocabulary(case, capsys):  # noqa: F811
    assert main(["generate", "--model", case["folder"], "--ids", "--prompt", "1 64", "--max-new-tokens", "2"]) != 0
    out = capsys.readouterr()
    assert "--prompt" in out.err and "[0, 64)" in out.err and out.out == ""
