"""collate: padded and packed batches of variable-length samples, on every backend.

Both layouts must give each sample what it gives alone: padding never reaches a real step's output
(whatever the pad value), a packed row run with its seq_idx equals per-sample forwards, and
unpack/to_padded cut the outputs back. Bad sample lists fail at the door, naming the sample.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import assert_close, tol

import portable_ssm as ps
from portable_ssm._array import array_backend, dtype_name
from portable_ssm.data import Batch, collate, to_padded, unpack

LENGTHS = (3, 7, 1, 5)
D = 4


def host_samples(lengths=LENGTHS, d: int = D, seed: int = 0, lead: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, n, d) if lead else (n, d)) for n in lengths]


def padded(pieces: list[np.ndarray], value: float) -> np.ndarray:
    """The expected ``[B, L_max, ...]`` layout, built with numpy."""
    longest = max(p.shape[0] for p in pieces)
    out = np.full((len(pieces), longest, *pieces[0].shape[1:]), value, dtype=pieces[0].dtype)
    for i, p in enumerate(pieces):
        out[i, :p.shape[0]] = p
    return out


@pytest.mark.parametrize("lead", [False, True], ids=["[L, D]", "[1, L, D]"])
def test_pad_mode_layout(xp, dtype, lead):
    host = [s.astype(dtype) for s in host_samples(lead=lead)]
    batch = collate([xp.asarray_from(s, dtype) for s in host], mode="pad", pad_value=-2.5)
    rows = [s[0] if lead else s for s in host]
    assert isinstance(batch, Batch) and batch.mode == "pad" and batch.seq_idx is None
    assert_close(xp, batch.x, padded(rows, -2.5), rtol=0.0, dtype=dtype, shape=(4, 7, D))
    assert_close(xp, batch.lengths, np.array(LENGTHS), rtol=0.0, dtype="int32", shape=(4,))
    assert batch.sizes == LENGTHS
    mask = np.arange(7)[None, :] < np.array(LENGTHS)[:, None]
    assert array_backend(batch.mask) == xp.name and dtype_name(batch.mask.dtype) == "bool"
    assert np.array_equal(xp.numpy(batch.mask), mask)


def test_pack_mode_layout(xp, dtype):
    host = [s.astype(dtype) for s in host_samples()]
    batch = collate([xp.asarray_from(s, dtype) for s in host], mode="pack")
    assert batch.mode == "pack" and batch.mask is None
    assert_close(xp, batch.x, np.concatenate(host)[None], rtol=0.0, dtype=dtype, shape=(1, 16, D))
    assert_close(xp, batch.seq_idx, np.repeat(np.arange(4), LENGTHS)[None], rtol=0.0, dtype="int32",
                 shape=(1, 16))
    assert_close(xp, batch.lengths, np.array(LENGTHS), rtol=0.0, dtype="int32")


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_targets_are_collated_like_the_samples(xp, mode):
    rng = np.random.default_rng(1)
    tokens = [rng.integers(0, 50, (1, n)) for n in LENGTHS]
    batch = collate([xp.asarray_from(s, "float32") for s in host_samples(lead=True)], mode=mode,
                    targets=[xp.asarray_from(t, "int64") for t in tokens], target_pad_value=-100)
    rows = [t[0] for t in tokens]
    expected = padded(rows, -100) if mode == "pad" else np.concatenate(rows)[None]
    assert_close(xp, batch.targets, expected, rtol=0.0, dtype="int64")


def test_original_report_one_sequence_per_sample_becomes_one_batch():
    samples = host_samples(lengths=(60,) * 8, d=256, lead=True)  # the loader's [1, 60, 256] each
    assert tuple(collate(samples).x.shape) == (8, 60, 256)
    assert tuple(collate(samples, mode="pack").x.shape) == (1, 480, 256)
    assert np.array_equal(collate(samples).x, np.concatenate(samples, axis=0))


@pytest.mark.parametrize("mode", ["pad", "pack"])
def test_unpack_returns_the_samples(xp, mode):
    host = host_samples(seed=2)
    batch = collate([xp.asarray_from(s, "float64") for s in host], mode=mode)
    pieces = unpack(batch.x, batch)
    assert len(pieces) == len(host)
    for piece, expected in zip(pieces, host, strict=True):
        assert_close(xp, piece, expected, rtol=0.0, dtype="float64")
    assert_close(xp, to_padded(batch.x, batch, pad_value=9.0), padded(host, 9.0), rtol=0.0)


CFG = ps.Mamba2Config(d_model=D, n_layer=2, d_state=4, headdim=4, ngroups=2)


def per_sample(params: dict, host: list[np.ndarray]) -> list[np.ndarray]:
    return [ps.forward(s[None], params, config=CFG)[0] for s in host]


def test_padding_does_not_leak_into_real_steps():
    params = ps.init_params(CFG, seed=3, dtype="float64")
    host = host_samples(seed=3)
    expected = per_sample(params, host)
    for pad_value in (0.0, 1e3, -7.0):
        batch = collate(host, mode="pad", pad_value=pad_value)
        for got, want in zip(unpack(ps.forward(batch.x, params, config=CFG), batch), expected, strict=True):
            assert np.abs(got - want).max() <= 1e-10 * np.abs(want).max()


def test_packed_forward_equals_each_sample_alone(xp, dtype):
    params = ps.init_params(CFG, seed=4, dtype="float64")
    host = host_samples(lengths=(3, 6, 1), seed=4)
    expected = per_sample(params, host)
    batch = collate([xp.asarray_from(s, dtype) for s in host], mode="pack")
    on_xp = ps.cast_params(params, dtype, backend=xp.name, device=xp.device)
    y = xp.call(ps.forward, batch.x, on_xp, config=CFG, seq_idx=batch.seq_idx)
    rtol = tol(dtype) if dtype == "float64" else 1e-5
    for got, want in zip(unpack(y, batch), expected, strict=True):
        assert_close(xp, got, want, rtol=rtol, dtype=dtype)
    assert_close(xp, to_padded(y, batch), padded(expected, 0.0), rtol=rtol, dtype=dtype, shape=(3, 6, D))


def test_empty_list_is_rejected():
    with pytest.raises(ValueError, match="samples: expected at least one sample"):
        collate([])


def test_a_single_array_is_not_a_list_of_samples():
    with pytest.raises(TypeError, match="samples: expected a list"):
        collate(np.zeros((2, 3, D)))


def test_mismatched_feature_size_names_the_sample_and_both_sizes():
    samples = host_samples(lead=True)
    samples[2] = np.zeros((1, 1, D + 1))
    with pytest.raises(ValueError, match=r"samples\[2\]: feature size \[5\] but samples\[0\] has \[4\]"):
        collate(samples)


def test_mismatched_rank_names_the_sample_and_both_ranks():
    samples = host_samples()
    samples[1] = samples[1][None]
    with pytest.raises(ValueError, match=r"samples\[1\]: rank 3 .* but samples\[0\] has rank 2"):
        collate(samples, mode="pack")


def test_a_batched_sample_is_rejected():
    samples = host_samples(lead=True)
    samples[3] = np.zeros((2, 5, D))
    with pytest.raises(ValueError, match=r"samples\[3\]: expected one sequence \[1, L, \.\.\.\]"):
        collate(samples)


def test_a_sample_of_wrong_rank_is_rejected():
    with pytest.raises(ValueError, match=r"samples\[0\]: expected shape \[L, D\] or \[1, L, D\]"):
        collate([np.zeros(5)])


def test_an_empty_sample_is_rejected():
    with pytest.raises(ValueError, match=r"samples\[1\]: empty sequence"):
        collate([np.zeros((2, D)), np.zeros((0, D))])


def test_mixed_dtypes_are_a_type_error_naming_both():
    with pytest.raises(TypeError, match=r"samples\[1\] is float32 but samples\[0\] is float64"):
        collate([np.zeros((2, D)), np.zeros((3, D), dtype=np.float32)])


def test_mixed_backends_are_a_type_error_naming_both():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"samples\[1\] is a torch array but samples\[0\] is a numpy array"):
        collate([np.zeros((2, D)), torch.zeros((3, D), dtype=torch.float64)])


def test_target_errors_name_the_target():
    samples = host_samples(lengths=(2, 3))
    with pytest.raises(ValueError, match=r"targets: expected one array per sample \(2\), got 1"):
        collate(samples, targets=[np.zeros(2)])
    with pytest.raises(ValueError, match=r"targets\[1\]: length 4 but samples\[1\] has length 3"):
        collate(samples, targets=[np.zeros(2), np.zeros(4)])


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="mode: expected one of"):
        collate(host_samples(), mode="bucket")


def test_unpack_checks_the_output_layout():
    batch = collate(host_samples(), mode="pack")
    with pytest.raises(ValueError, match=r"y: expected shape \[1, sum\(L_i\), \.\.\.\] = \[1, 16\]"):
        unpack(np.zeros((4, 7, D)), batch)
