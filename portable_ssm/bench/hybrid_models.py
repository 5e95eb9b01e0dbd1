"""The hybrid part's models (tooling, not core): random transformers checkpoints of two public shapes.

:data:`GRANITE_350M` is shaped as IBM's granite-4.0-h-350m (transformers' ``GraniteMoeHybrid``:
32 layers, attention at 9, 17, 25 and 31, Mamba-2 elsewhere, each followed by one SwiGLU MLP, no
experts, no RoPE, tied embeddings) and :data:`FALCON_H1_05B` as TII's Falcon-H1-0.5B (transformers'
``FalconH1``: 36 layers each running attention and Mamba-2 in parallel, then a SwiGLU MLP);
:data:`GRANITE_MOE` is four layers of granite-4.0-h-tiny, whose MLPs are mixtures of experts. Both
configs are recalled from the public ``config.json`` files, not read from them: the layer counts,
widths, heads, state sizes and vocabularies are what the author remembers, the muP multipliers too
(they change no timing). :data:`QUICK_SHAPES` are tiny variants for ``--quick`` runs; they keep
the real vocabularies, so the head and the tokenizer rule are the same as the full shapes'.

:func:`write_folder` builds a shape with transformers on random weights (``torch.manual_seed``)
and saves it, :func:`write_tokenizer` adds a tokenizer that llama.cpp's converter accepts (see
there). Frameworks are imported inside functions only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: transformers 5 saves ``layer_types`` under these names; the Hub's checkpoints, and llama.cpp's
#: converter (which counts only ``"attention"`` layers), use the old ones.
HUB_LAYER_NAMES = {"full_attention": "attention", "linear_attention": "mamba"}

#: llama.cpp's bundled vocabulary the tokenizer is rebuilt from (in ``models/`` beside the converter).
VOCAB_FILE = "ggml-vocab-deepseek-coder.gguf"
#: The rows that vocabulary's tokenizer fills: its 32000 BPE tokens and its BOS and EOS (32013,
#: 32014). A shape's vocabulary must hold them; the converter names the rows past them ``[PAD i]``.
TOKENIZER_ROWS = 32015
#: Prompt ids are drawn below this: ordinary tokens of the tokenizer, valid in every shape.
PROMPT_IDS = 32000
#: DeepSeek-Coder's pre-tokenizer as llama.cpp's ``llama-vocab.cpp`` writes it (split each regex
#: off in turn, then single digits, then GPT-2's byte mapping): with it the rebuilt tokenizer encodes
#: the converter's probe text to the ids it knows as ``deepseek-coder``.
_SPLITS = ("[\r\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[一-龥ࠀ-一가-퟿]+")


@dataclass(frozen=True, eq=False)
class HybridShape:
    """One benchmarked hybrid model: its name in the tables, transformers' model class name, and
    the keyword arguments of its config class."""

    name: str
    model_class: str
    config: Mapping[str, Any]

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def family(self) -> str:
        """``"granitemoehybrid"`` or ``"falcon_h1"`` (the converter's vocabulary rules differ)."""
        return "granitemoehybrid" if self.model_class.startswith("GraniteMoeHybrid") else "falcon_h1"


def _granite(name: str, *, layers: int, attention: tuple[int, ...], d: int, heads: int, kv_heads: int,
             mamba_heads: int, d_state: int, d_ff: int, experts: int = 0, top_k: int = 0,
             d_expert: int = 0) -> HybridShape:
    """A GraniteMoeHybrid shape: ``d_ff`` the (shared) MLP's width; ``experts`` > 0: a mixture of that
    many experts of width ``d_expert``, ``top_k`` chosen, beside the shared MLP."""
    kinds = ["attention" if i in attention else "mamba" for i in range(layers)]
    return HybridShape(name, "GraniteMoeHybridForCausalLM", {
        "vocab_size": 100352, "hidden_size": d, "num_hidden_layers": layers, "layer_types": kinds,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "position_embedding_type": "nope",
        "mamba_n_heads": mamba_heads, "mamba_d_head": 2 * d // mamba_heads, "mamba_expand": 2,
        "mamba_d_state": d_state, "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_chunk_size": 256,
        "shared_intermediate_size": d_ff, "intermediate_size": d_expert if experts else d_ff,
        "num_local_experts": experts, "num_experts_per_tok": top_k, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "attention_multiplier": 0.015625, "embedding_multiplier": 12.0, "residual_multiplier": 0.246,
        "logits_scaling": 3.0})


def _falcon(name: str, *, layers: int, d: int, heads: int, kv_heads: int, head_dim: int, mamba_heads: int,
            mamba_head: int, d_state: int, d_ff: int) -> HybridShape:
    return HybridShape(name, "FalconH1ForCausalLM", {
        "vocab_size": 32784, "hidden_size": d, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": d_ff, "mamba_d_ssm": mamba_heads * mamba_head, "mamba_n_heads": mamba_heads,
        "mamba_d_head": mamba_head, "mamba_d_state": d_state, "mamba_n_groups": 1, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_chunk_size": 128, "mamba_rms_norm": False, "mamba_norm_before_gate": False,
        "tie_word_embeddings": False, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e11},
        "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375, "key_multiplier": 0.390625,
        "embedding_multiplier": 5.656854249492381, "lm_head_multiplier": 0.0390625,
        "mlp_multipliers": [0.8838834764831844, 0.5859375], "ssm_in_multiplier": 1.25,
        "ssm_out_multiplier": 0.23570226039551587,
        "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]})


#: granite-4.0-h-350m's shape, recalled from memory of its config.json (not read from it): d 768,
#: 12 heads / 4 KV heads of 64, Mamba 48 heads x 32 (expand 2: 1536), state 128, one group, conv 4,
#: shared MLP 2048, vocabulary 100352.
GRANITE_350M = _granite("granite-4.0-h-350m", layers=32, attention=(9, 17, 25, 31), d=768, heads=12, kv_heads=4,
                        mamba_heads=48, d_state=128, d_ff=2048)
#: Falcon-H1-0.5B's shape, recalled from memory of tiiuae/Falcon-H1-0.5B's config.json (not read
#: from it; check before quoting): d 1024, 36 layers, 8 heads / 2 KV heads of 64, Mamba width 1536
#: (24 heads x 64), state 128, one group, no Mamba norm, MLP 2048, vocabulary 32784, untied head,
#: RoPE theta 1e11, and its muP multipliers.
FALCON_H1_05B = _falcon("falcon-h1-0.5b", layers=36, d=1024, heads=8, kv_heads=2, head_dim=64, mamba_heads=24,
                        mamba_head=64, d_state=128, d_ff=2048)
#: A slice of granite-4.0-h-tiny (GraniteMoeHybrid with experts; its shape recalled from memory of
#: the public config, not read from it): 4 of its 40 layers, attention at layer 1, d 1536, 12 heads /
#: 4 KV heads, Mamba 48 heads x 64, state 128, 64 experts of 512 with 6 chosen beside a shared MLP of
#: 1024, vocabulary 100352. The whole model (7B) does not fit twice in float32, portable_ssm's and
#: llama.cpp's, beside their bfloat16 and 8-bit copies in the project's 24 GiB; its layers are the same.
GRANITE_MOE = _granite("granite-4.0-h-tiny-4-layers", layers=4, attention=(1,), d=1536, heads=12, kv_heads=4,
                       mamba_heads=48, d_state=128, d_ff=1024, experts=64, top_k=6, d_expert=512)
#: ``--quick``: the same families at d 64 (a few layers, the real vocabularies).
QUICK_SHAPES = (_granite("tiny-granite-h", layers=4, attention=(1, 3), d=64, heads=4, kv_heads=2, mamba_heads=4,
                         d_state=16, d_ff=128),
                _falcon("tiny-falcon-h1", layers=3, d=64, heads=4, kv_heads=2, head_dim=16, mamba_heads=4,
                        mamba_head=32, d_state=16, d_ff=128))
#: ``--quick``'s GRANITE_MOE: 8 experts of 96, 2 chosen.
QUICK_GRANITE_MOE = _granite("tiny-granite-moe", layers=4, attention=(1,), d=64, heads=4, kv_heads=2, mamba_heads=4,
                             d_state=16, d_ff=128, experts=8, top_k=2, d_expert=96)


def write_folder(shape: HybridShape, folder: Path, seed: int = 0) -> None:
    """``shape`` built by transformers on random weights (``torch.manual_seed(seed)``, its own
    initialisation) and saved to ``folder`` (``save_pretrained``), its ``layer_types`` spelled as
    the Hub's checkpoints spell them (:data:`HUB_LAYER_NAMES`)."""
    import torch
    import transformers

    model_class = getattr(transformers, shape.model_class)
    config_class = model_class.config_class
    torch.manual_seed(seed)
    model = model_class(config_class(**shape.config)).eval()
    model.save_pretrained(folder)
    del model
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    if isinstance(raw.get("layer_types"), list):
        raw["layer_types"] = [HUB_LAYER_NAMES.get(kind, kind) for kind in raw["layer_types"]]
        path.write_text(json.dumps(raw, indent=2))


def vocab_file(converter: str | os.PathLike) -> Path:
    """Where :func:`write_tokenizer` reads its vocabulary: ``models/`` beside the converter."""
    return Path(converter).resolve().parent / "models" / VOCAB_FILE


def write_tokenizer(folder: Path, vocab: Path) -> None:
    """A tokenizer in ``folder`` (``tokenizer.json`` and its config) that llama.cpp's converter
    takes for these architectures: Falcon-H1's conversion always reads one, and it is the only way
    past the bundled GPT-NeoX vocabulary's 50432 rows for granite's 100352. It is DeepSeek-Coder's
    byte-level BPE, rebuilt from llama.cpp's own copy ``vocab`` (:data:`VOCAB_FILE`: its ordinary
    tokens and merges, BOS and EOS, the pre-tokenizer of :data:`_SPLITS`), so the converter
    recognises its pre-tokenizer; the converter fills the rows past :data:`TOKENIZER_ROWS` with
    ``[PAD i]``, so the head keeps the shape's size. Token ids go in, never text."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fields = GGUFReader(vocab).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    kinds = [int(fields["tokenizer.ggml.token_type"].parts[i][0]) for i in fields["tokenizer.ggml.token_type"].data]
    merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
    bos, eos = (int(fields[f"tokenizer.ggml.{k}_token_id"].parts[-1][0]) for k in ("bos", "eos"))
    if max(bos, eos) + 1 != TOKENIZER_ROWS:
        raise RuntimeError(f"{vocab}: expected BOS and EOS below {TOKENIZER_ROWS}, got {bos} and {eos}")
    normal = 1  # gguf.TokenType.NORMAL
    ids = {token: i for i, token in enumerate(tokens) if kinds[i] == normal or i in (bos, eos)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=[tuple(m.split(" ", 1)) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), "isolated") for p in _SPLITS]
        + [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(tokens[bos], special=True), AddedToken(tokens[eos], special=True)])
    tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", special_tokens=[(tokens[bos], bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tokens[bos], eos_token=tokens[eos]).save_pretrained(folder)


def random_params(config: Any, *, seed: int = 0, dt: float = 0.01, norm_noise: float = 0.0) -> dict[str, Any]:
    """Random NumPy weights for every parameter of the hybrid ``config``
    (:func:`portable_ssm.stack.param_shapes`): matrices U(±1/sqrt(fan_in)), A_log log(1..h),
    dt_bias softplus⁻¹(``dt``), norms and D one plus ``norm_noise`` standard normal."""
    import math

    import numpy as np

    from ..stack import param_shapes

    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes(config).items():
        if name.endswith("A_log"):
            out[name] = np.log(np.arange(1, shape[0] + 1, dtype=np.float32))
        elif name.endswith("dt_bias"):
            out[name] = np.full(shape, math.log(math.expm1(dt)), dtype=np.float32)
        elif len(shape) == 1 or name.endswith(".D"):
            out[name] = (1 + norm_noise * rng.standard_normal(shape)).astype(np.float32)
        else:
            bound = 1.0 / math.sqrt(math.prod(shape[1:]))
            out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return out
