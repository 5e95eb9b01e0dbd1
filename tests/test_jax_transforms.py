"""JAX transforms over the public entries: ``jax.grad`` (in params and in x), ``jax.vmap`` and ``jax.jit``
of ``forward`` and ``lm.logits``. Tracers carry no committed device, so the door's device checks must
let them through; the gradients equal torch autograd's on the same float64 weights."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
torch = pytest.importorskip("torch")
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_default_matmul_precision", "highest")
jnp = jax.numpy

import portable_ssm as ps  # noqa: E402
from portable_ssm import lm  # noqa: E402

CONFIG = ps.Mamba2Config(d_model=8, n_layer=1, d_state=4, headdim=4, chunk_size=2, vocab_size=12)
rng = np.random.default_rng(0)
X = rng.standard_normal((2, 4, 8))
IDS = rng.integers(0, 12, (2, 4))
HOST = {k: np.asarray(v) for k, v in ps.init_params(CONFIG, seed=3, dtype="float64").items()}


def _weights(shape: tuple[int, ...], like) -> object:
    """Fixed random weights of ``shape`` in ``like``'s library, for a loss that reads every output."""
    host = np.random.default_rng(1).standard_normal(shape)
    return torch.tensor(host) if isinstance(like, torch.Tensor) else jnp.asarray(host)


def _jax_params() -> dict:
    return {k: jnp.asarray(v) for k, v in HOST.items()}


def _torch_grads(loss_of) -> tuple[dict, torch.Tensor]:
    """Torch autograd of ``loss_of(params, x)`` on the same float64 weights and input."""
    params = {k: torch.tensor(v, requires_grad=True) for k, v in HOST.items()}
    x = torch.tensor(X, requires_grad=True)
    loss_of(params, x).backward()
    return _grads(params), x.grad.numpy()


def _grads(params: dict) -> dict:
    """Each tensor's gradient; zeros for the ones the loss does not read (``embedding.weight`` in forward)."""
    return {k: np.zeros(v.shape) if v.grad is None else v.grad.numpy() for k, v in params.items()}


def _forward_loss(params, x):
    y = ps.forward(x, params, config=CONFIG)
    return (y * _weights(y.shape, y)).sum()


def _logits_loss(params, ids):
    out = lm.logits(ids, params, config=CONFIG)
    return (out * _weights(out.shape, out)).sum()


def _assert_grads_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), want[k], rtol=1e-9, atol=1e-11, err_msg=k)


def test_jax_grad_of_forward_in_params_and_in_x_equals_torch_autograd():
    want_params, want_x = _torch_grads(lambda p, x: _forward_loss(p, x))
    params, x = _jax_params(), jnp.asarray(X)
    grad_params = jax.grad(_forward_loss)(params, x)  # params traced, x a concrete array on cpu
    grad_x = jax.grad(_forward_loss, argnums=1)(params, x)  # the other way round
    _assert_grads_equal(grad_params, want_params)
    np.testing.assert_allclose(np.asarray(grad_x), want_x, rtol=1e-9, atol=1e-11)
    assert grad_x.dtype == jnp.float64 and grad_x.shape == X.shape


def test_jax_grad_of_logits_in_params_equals_torch_autograd():
    params = {k: torch.tensor(v, requires_grad=True) for k, v in HOST.items()}
    _logits_loss(params, torch.tensor(IDS)).backward()
    got = jax.grad(_logits_loss)(_jax_params(), jnp.asarray(IDS))
    _assert_grads_equal(got, _grads(params))


def test_jax_vmap_of_forward_and_logits_equals_the_batched_call():
    params = _jax_params()
    one_row = jax.vmap(lambda x: ps.forward(x[None], params, config=CONFIG)[0])(jnp.asarray(X))
    np.testing.assert_allclose(np.asarray(one_row), np.asarray(ps.forward(jnp.asarray(X), params, config=CONFIG)),
                               rtol=1e-12, atol=1e-12)
    rows = jax.vmap(lambda ids: lm.logits(ids[None], params, config=CONFIG)[0])(jnp.asarray(IDS))
    np.testing.assert_allclose(np.asarray(rows), np.asarray(lm.logits(jnp.asarray(IDS), params, config=CONFIG)),
                               rtol=1e-12, atol=1e-12)
    assert rows.shape == (*IDS.shape, CONFIG.padded_vocab_size)


def test_jax_jit_of_forward_and_logits_equals_the_eager_call():
    params = _jax_params()
    y = jax.jit(lambda p, x: ps.forward(x, p, config=CONFIG))(params, jnp.asarray(X))
    np.testing.assert_allclose(np.asarray(y), np.asarray(ps.forward(jnp.asarray(X), params, config=CONFIG)),
                               rtol=1e-12, atol=1e-12)
    out = jax.jit(lambda p, ids: lm.logits(ids, p, config=CONFIG))(params, jnp.asarray(IDS))
    np.testing.assert_allclose(np.asarray(out), np.asarray(lm.logits(jnp.asarray(IDS), params, config=CONFIG)),
                               rtol=1e-12, atol=1e-12)


def test_jax_grad_through_step_from_a_forward_state():
    params = _jax_params()

    def loss(x):
        _, state = ps.forward(x[:, :3], params, config=CONFIG, return_state=True)
        y_t, _ = ps.step(x[:, 3], state, params, config=CONFIG)
        return (y_t * _weights(y_t.shape, y_t)).sum()

    x = jnp.asarray(X)
    grad = jax.grad(loss)(x)
    direction = _weights(X.shape, x)
    eps = 1e-6  # central finite difference along one direction
    value = jax.jit(loss)
    numeric = (value(x + eps * direction) - value(x - eps * direction)) / (2 * eps)
    np.testing.assert_allclose(float((grad * direction).sum()), float(numeric), rtol=1e-6)
