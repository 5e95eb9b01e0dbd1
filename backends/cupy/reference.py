"""The array-API twins of the CuPy kernels: what each kernel must equal, on any backend.

All three are in the core: :func:`portable_ssm.conv.causal_conv1d_ref`,
:func:`portable_ssm.ssd.ssd_chunked_ref` and :func:`portable_ssm.mixer.decode_step_ref` (the fused
decode step's twin, which the torch backend's CPU kernel equals too). Nothing here imports cupy.
"""

from __future__ import annotations

from portable_ssm.conv import causal_conv1d_ref
from portable_ssm.mixer import decode_step_ref
from portable_ssm.ssd import ssd_chunked_ref

__all__ = ["causal_conv1d_ref", "decode_step_ref", "ssd_chunked_ref"]
