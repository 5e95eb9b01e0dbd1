"""The chunked scan's memory is linear in l: a 65k-step sequence stays within a tracemalloc bound."""

from __future__ import annotations

import tracemalloc

import numpy as np

import portable_ssm as ps
from portable_ssm.ssd import SEGMENT_TOKENS


def test_ssd_scan_over_65k_steps_needs_its_io_plus_one_segment_of_memory():
    """Bound, in bytes of float32 (itemsize 4), with S = min(l, SEGMENT_TOKENS) and Q the chunk size:

        peak <= 3·IO + 8·SEG,  IO = b·l·(h·p + 2·g·n + h)·4   (x, Δ, B, C, y and their copies)
                               SEG = b·S·h·Q·4                (one segment's [Q, Q] blocks per head)

    That is O(b·l·(h·p + g·n) + b·S·h·Q): within O(b·l·h·Q), never O(l²). Here 3·IO + 8·SEG is
    35.5 MiB, while one [b, l, h, Q] buffer is 32 MiB (a scan without segments peaks at about
    four of them) and one [l, l] matrix would be 16 GiB.
    """
    b, l, h, p, g, n = 1, 65536, 2, 4, 1, 8
    rng = np.random.default_rng(0)
    args = dict(x=rng.standard_normal((b, l, h, p), dtype=np.float32),
                dt=rng.standard_normal((b, l, h), dtype=np.float32),
                A=-np.exp(rng.uniform(-1.0, 1.0, h)).astype(np.float32),
                B=rng.standard_normal((b, l, g, n), dtype=np.float32),
                C=rng.standard_normal((b, l, g, n), dtype=np.float32))
    Q, S = ps.choose_chunk_size(l), min(l, SEGMENT_TOKENS)
    io, seg = b * l * (h * p + 2 * g * n + h) * 4, b * S * h * Q * 4
    tracemalloc.start()
    try:
        y = ps.ssd_scan(**args, dt_softplus=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert y.shape == (b, l, h, p) and y.dtype == np.float32
    assert np.all(np.isfinite(y))
    bound = 3 * io + 8 * seg
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > 3·IO + 8·SEG = {bound / 2**20:.1f} MiB"
    assert bound < 1.2 * b * l * h * Q * 4, "the shape no longer tells segmented from unsegmented scans"
