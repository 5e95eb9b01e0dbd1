"""Transformer blocks shared by the hybrid families: attention (GQA, RoPE, KV cache), MLPs, MoE.

Written once against the array API with the scan's rules: no in-place ops, static shapes, float32
compute for half inputs. No family logic lives here; :mod:`portable_ssm.families` maps each
checkpoint onto these blocks through :mod:`portable_ssm.stack`.
"""

from .attention import AttentionSpec, KVCache, attention, attention_ref, empty_kv_cache, rope_tables
from .mlp import MLPSpec, mlp
from .moe import MoESpec, moe, moe_dense_ref

__all__ = ["AttentionSpec", "KVCache", "MLPSpec", "MoESpec", "attention", "attention_ref", "empty_kv_cache",
           "mlp", "moe", "moe_dense_ref", "rope_tables"]
