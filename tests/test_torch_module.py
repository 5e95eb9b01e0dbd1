"""The nn.Module adapter: core names and init, the core's own forward, decay groups, block
checkpointing, autocast, torch.compile, validation at the door and optimizer state round trips."""

from __future__ import annotations

import pytest
from conftest import rel_err

torch = pytest.importorskip("torch")

from portable_ssm.backends.torch import (  # noqa: E402
    Mamba2LMModule,
    Mamba2Module,
    decays,
    detach_state,
    load_optimizer_state,
    optimizer_state,
)

import portable_ssm as ps  # noqa: E402
from portable_ssm import generation, lm  # noqa: E402
from portable_ssm.io import load_arrays, load_params, save_arrays, save_params  # noqa: E402

CONFIG = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, chunk_size=8)
LM_CONFIG = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, vocab_size=20)


def _x(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _probe(y, seed=9):
    """A loss reading every output feature: ``sum(y * w)`` for fixed random w (``mean(y²)`` after
    norm_f would be nearly constant and leave the inner gradients at rounding level)."""
    return (y.float() * _x(*y.shape, seed=seed)).sum()


def _ids(b, l, seed=0):
    return torch.randint(0, 20, (b, l), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("config", [CONFIG, LM_CONFIG, ps.Mamba2Config(d_model=16, headdim=8, d_state=4,
                                                                         vocab_size=9, tie_embeddings=False,
                                                                         bias=True)])
def test_state_dict_keys_are_the_checkpoint_names_and_values_the_core_init(config):
    module = Mamba2Module(config, seed=5)
    expected = ps.init_params(config, seed=5, backend="torch")
    state = module.state_dict()
    assert set(state) == set(ps.param_shapes(config))
    for key, value in expected.items():
        assert isinstance(module.get_parameter(key), torch.nn.Parameter), key
        assert torch.equal(state[key], value), key
    assert module.layers[0].mixer.A_log is module.get_parameter("layers.0.mixer.A_log")


def test_forward_is_the_core_forward_on_the_modules_parameters():
    module = Mamba2Module(CONFIG, seed=1)
    x = _x(2, 11, 16)
    want, want_state = ps.forward(x, ps.init_params(CONFIG, seed=1, backend="torch"), config=CONFIG,
                                  return_state=True)
    with torch.no_grad():  # the same fast paths as the plain tensors' (autograd's differ in rounding only)
        got, state = module(x, return_state=True)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(state.ssm + state.conv, want_state.ssm + want_state.conv))
    recorded, _ = module(x, return_state=True)
    assert recorded.requires_grad
    torch.testing.assert_close(recorded, want, rtol=1e-5, atol=1e-6)


def test_lm_module_forward_is_lm_logits():
    module = Mamba2LMModule(LM_CONFIG, seed=2)
    ids = _ids(2, 9)
    want = lm.logits(ids, ps.init_params(LM_CONFIG, seed=2, backend="torch"), config=LM_CONFIG)
    with torch.no_grad():  # the same fast paths as the plain tensors'
        assert torch.equal(module(ids), want)
    torch.testing.assert_close(module(ids), want, rtol=1e-5, atol=1e-5)
    assert module(ids).shape == (2, 9, LM_CONFIG.padded_vocab_size)


def test_lm_module_needs_a_vocabulary():
    with pytest.raises(ValueError, match="vocab_size"):
        Mamba2LMModule(CONFIG)


def test_param_groups_exempt_ssm_parameters_norms_and_biases_from_decay():
    config = ps.Mamba2Config(d_model=16, n_layer=2, d_state=8, headdim=8, vocab_size=20, bias=True)
    groups = Mamba2Module(config).param_groups(0.1)
    decayed, exempt = groups
    assert decayed["weight_decay"] == 0.1 and exempt["weight_decay"] == 0.0
    assert sorted(decayed["names"]) == sorted(n for n in ps.param_shapes(config)
                                              if n.endswith(("in_proj.weight", "out_proj.weight",
                                                             "conv1d.weight", "embedding.weight")))
    for leaf in ("A_log", "D", "dt_bias", "conv1d.bias", "in_proj.bias", "norm.weight"):
        assert f"layers.1.mixer.{leaf}" in exempt["names"], leaf
    assert {"layers.0.norm.weight", "norm_f.weight"} <= set(exempt["names"])
    assert sum(len(g["params"]) for g in groups) == len(list(Mamba2Module(config).parameters()))
    assert not decays("head.bias") and decays("head.weight") and not decays("core.norm_f.weight")


def _saved_bytes(fn):
    """Bytes autograd keeps for backward while ``fn`` runs forward."""
    total = []

    def pack(t):
        total.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(total)


@pytest.mark.parametrize("lm_head", [False, True])
def test_checkpointed_blocks_give_the_same_values_and_gradients_while_keeping_less(lm_head):
    cls, config = (Mamba2LMModule, LM_CONFIG) if lm_head else (Mamba2Module, CONFIG)
    plain, ckpt = cls(config, seed=3), cls(config, seed=3, checkpoint_blocks=True)
    inputs = _ids(2, 24) if lm_head else _x(2, 24, 16)
    grads, saved = [], []
    for module in (plain, ckpt):
        (out, state), kept = _saved_bytes(lambda m=module: m(inputs, return_state=True))
        (_probe(out) + state.ssm[-1].square().mean()).backward()
        grads.append({n: p.grad for n, p in module.named_parameters()})
        saved.append(kept)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)
    assert saved[1] < 0.5 * saved[0], f"checkpointing kept {saved[1]} bytes vs {saved[0]}"
    with torch.no_grad():
        assert torch.equal(ckpt(inputs), plain(inputs))


def test_autocast_bf16_runs_the_ssm_in_float32_and_tracks_float32():
    torch.manual_seed(0)
    inp, module = torch.nn.Linear(8, 16), Mamba2Module(CONFIG, seed=4)
    x = _x(2, 20, 8)
    ref, ref_state = module(inp(x), return_state=True)
    _probe(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    module.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = inp(x)
        assert h.dtype == torch.bfloat16  # what the core gets from an autocast matmul
        y, state = module(h, return_state=True)
        y2 = module(inp(_x(2, 5, 8, seed=1)), initial_state=state)  # the state can be carried on
    assert y.dtype == torch.float32 and y2.shape == (2, 5, 16)
    assert all(s.dtype == torch.float32 for s in state.ssm + state.conv)
    assert (y - ref).abs().max() / ref.abs().max() < 0.05
    assert (state.ssm[-1] - ref_state.ssm[-1]).abs().max() / ref_state.ssm[-1].abs().max() < 0.05
    _probe(y).backward()
    for name, p in module.named_parameters():
        assert p.grad.dtype == torch.float32, name
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), ref_grads[name].flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


@pytest.mark.filterwarnings("ignore::UserWarning")  # dynamo notes array_api_compat's lru_caches
@pytest.mark.parametrize("checkpoint_blocks", [False, True])
def test_torch_compile_traces_one_whole_graph_matching_eager_values_and_gradients(checkpoint_blocks):
    torch._dynamo.reset()
    eager = Mamba2Module(CONFIG, seed=6)
    module = Mamba2Module(CONFIG, seed=6, checkpoint_blocks=checkpoint_blocks)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # any graph break raises
    x = _x(2, 10, 16)
    for m in (eager, compiled):
        _probe(m(x)).backward()
    torch.testing.assert_close(compiled(x), eager(x), rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), module.parameters()):
        assert rel_err(q.grad.numpy(), p.grad.numpy()) < 1e-5, name  # float32 sums in another order


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("checkpoint_blocks", [False, True])
def test_compiled_training_keeps_the_scan_op_in_one_graph_with_the_references_gradients(monkeypatch,
                                                                                     checkpoint_blocks):
    from portable_ssm.backends import torch as torch_backend
    from portable_ssm.backends import torch_scan

    torch._dynamo.reset()
    reference = Mamba2Module(CONFIG, seed=6)
    with monkeypatch.context() as patch:  # autograd of the reference scan, which the op replaces
        patch.setattr(torch_backend, "_scan_op_takes", lambda *tensors: False)
        want = reference(_x(2, 20, 16))
        _probe(want).backward()
    calls = []
    monkeypatch.setattr(torch_scan, "ssd_chunked_grad",
                        lambda *a, _real=torch_scan.ssd_chunked_grad: calls.append(1) or _real(*a))
    module = Mamba2Module(CONFIG, seed=6, checkpoint_blocks=checkpoint_blocks)
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)  # any graph break raises
    y = compiled(_x(2, 20, 16))
    _probe(y).backward()
    assert len(calls) == CONFIG.n_layer  # each layer's backward ran the op's
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(reference.named_parameters(), module.parameters()):
        assert rel_err(q.grad.numpy(), p.grad.numpy()) < 1e-4, name  # float32 sums in another order


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("scan_op", [False, True], ids=["reference-scan", "scan-op"])
def test_compile_option_runs_inductors_code_matching_eager_values_and_gradients_without_recompiling(monkeypatch,
                                                                                                  scan_op):
    from portable_ssm.backends import torch as torch_backend

    if not scan_op:  # autograd of the reference scan instead of the portable_ssm::ssd_scan op
        monkeypatch.setattr(torch_backend, "_scan_op_takes", lambda *tensors: False)
    torch._dynamo.reset()
    eager, module = Mamba2Module(CONFIG, seed=6), Mamba2Module(CONFIG, seed=6, compile=True)
    x = _x(2, 10, 16)
    for m in (eager, module):
        _probe(m(x)).backward()
    torch.testing.assert_close(module(x), eager(x), rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(eager.named_parameters(), module.parameters()):
        assert rel_err(q.grad.numpy(), p.grad.numpy()) < 1e-4, name  # inductor fuses: sums in another order
    counters = torch._dynamo.utils.counters
    frames = counters["stats"]["unique_graphs"]
    module(_x(2, 10, 16))  # the same shape again: the compiled graph is reused
    assert counters["stats"]["unique_graphs"] == frames


def test_lm_module_compiles_as_one_graph():
    torch._dynamo.reset()
    module = Mamba2LMModule(LM_CONFIG, seed=1)
    ids = torch.randint(0, LM_CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(ids), module(ids), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("checkpoint_blocks", [False, True])
def test_bad_inputs_are_refused_at_the_door(checkpoint_blocks):
    module = Mamba2Module(CONFIG, checkpoint_blocks=checkpoint_blocks)
    with pytest.raises(TypeError, match="float64.*float32|float32.*float64"):
        module(_x(2, 5, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x: expected shape \[b, l, d_model\]"):
        module(_x(2, 5, 12))
    with pytest.raises(TypeError, match="initial_state: expected a Mamba2State"):
        module(_x(2, 5, 16), initial_state=(1, 2))
    lm_module = Mamba2LMModule(LM_CONFIG, checkpoint_blocks=checkpoint_blocks)
    with pytest.raises(TypeError, match="input_ids: expected an integer dtype"):
        lm_module(_x(2, 5))


def test_bf16_parameters_compute_in_float32_and_return_bf16():
    module = Mamba2Module(CONFIG, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    y, state = module(_x(2, 7, 16).bfloat16(), return_state=True)
    assert y.dtype == torch.bfloat16 and state.ssm[0].dtype == torch.float32
    _probe(y).backward()
    assert torch.isfinite(module.layers[0].mixer.A_log.grad).all()


@pytest.mark.parametrize("checkpoint_blocks", [False, True])
def test_packed_batches_from_collate_give_each_sequence_its_own_output(checkpoint_blocks):
    module = Mamba2Module(CONFIG, seed=7, checkpoint_blocks=checkpoint_blocks)
    samples = [_x(5, 16, seed=1), _x(9, 16, seed=2), _x(3, 16, seed=3)]
    batch = ps.collate(samples, mode="pack")
    packed = module(batch.x, seq_idx=batch.seq_idx)
    _probe(packed).backward()
    assert module.layers[0].mixer.A_log.grad.abs().max() > 0
    with torch.no_grad():
        for piece, sample in zip(ps.unpack(packed, batch), samples):
            torch.testing.assert_close(piece, module(sample[None, ...])[0], rtol=1e-5, atol=1e-5)


def test_detach_state_cuts_the_graph_but_keeps_the_values():
    module = Mamba2Module(CONFIG)
    _, state = module(_x(1, 6, 16), return_state=True)
    cut = detach_state(state)
    assert all(not t.requires_grad for t in cut.ssm + cut.conv)
    assert all(torch.equal(a, b) for a, b in zip(cut.ssm + cut.conv, state.ssm + state.conv))


def test_checkpoint_files_load_back_into_a_module(tmp_path):
    module = Mamba2LMModule(LM_CONFIG, seed=8)
    save_params(tmp_path / "m.safetensors", module.params(), LM_CONFIG)
    params, config = load_params(tmp_path / "m.safetensors", backend="torch")
    fresh = Mamba2LMModule(config, seed=9)
    fresh.load_state_dict(params)
    assert torch.equal(fresh(_ids(1, 4)), module(_ids(1, 4)))


def test_optimizer_state_round_trip_continues_training_identically(tmp_path):
    def run(module, optimizer, steps):
        for i in range(steps):
            optimizer.zero_grad()
            _probe(module(_x(2, 6, 16, seed=i))).backward()
            optimizer.step()

    a = Mamba2Module(CONFIG, seed=1)
    opt_a = torch.optim.AdamW(a.param_groups(0.1), lr=1e-2)
    run(a, opt_a, 2)
    tensors, meta = optimizer_state(opt_a, a)
    assert "layers.0.mixer.A_log/exp_avg" in tensors
    save_arrays(tmp_path / "opt.safetensors", tensors, metadata=meta)
    b = Mamba2Module(CONFIG, seed=2)
    b.load_state_dict(a.state_dict())
    opt_b = torch.optim.AdamW(b.param_groups(0.0), lr=5.0)
    loaded, loaded_meta = load_arrays(tmp_path / "opt.safetensors", backend="torch")
    load_optimizer_state(opt_b, b, loaded, loaded_meta)
    assert opt_b.param_groups[0]["lr"] == 1e-2 and opt_b.param_groups[0]["weight_decay"] == 0.1
    run(a, opt_a, 2)
    run(b, opt_b, 2)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ValueError, match="'nope/exp_avg' belongs to no parameter"):
        load_optimizer_state(opt_b, b, {"nope/exp_avg": torch.zeros(1)}, loaded_meta)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["float32", "int8", "bfloat16"])
def test_compiled_decode_step_matches_eager_as_one_graph_per_batch_size(kind):
    torch._dynamo.reset()
    params = ps.quantize(ps.init_params(LM_CONFIG, seed=3, backend="torch"), kind)
    ids = _ids(2, 5, seed=4)
    xp = ps.backends.load("torch").namespace()
    eager_step = generation._decoder(LM_CONFIG, xp, False, None)
    compiled_step = generation._decoder(LM_CONFIG, xp, False, True)
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.inference_mode():  # as generation runs (guards tell inference tensors from others)
        _, state = lm.logits(ids, params, config=LM_CONFIG, return_state=True)
        for b in (1, 2):  # one row: torch's decode_linear multiplies and sums under compile
            token, sub = ids[:b, -1].clone(), ps.Mamba2State(conv=tuple(c[:b].clone() for c in state.conv),
                                                     ssm=tuple(s[:b].clone() for s in state.ssm))
            want, want_state = eager_step(token, sub, None, params)
            got, got_state = compiled_step(token, sub, None, params)
            assert rel_err(got.numpy(), want.numpy()) < 1e-5, b  # the same kernels, sums in another order
            assert rel_err(got_state.ssm[1].numpy(), want_state.ssm[1].numpy()) < 1e-5, b
        graphs = counters["stats"]["unique_graphs"]
        assert graphs == 2 and not counters["graph_break"], dict(counters["graph_break"])
        eager = generation.generate(ids, params, config=LM_CONFIG, max_new_tokens=6)
        compiled = generation.generate(ids, params, config=LM_CONFIG, max_new_tokens=6, compile=True)
        assert torch.equal(compiled, eager)
        assert counters["stats"]["unique_graphs"] == graphs  # batch 2 again: its graph is reused


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("kind", ["float32", "bfloat16"])
def test_compiled_one_row_product_streams_the_weight_against_a_stored_row(monkeypatch, kind):
    """Where the CPU row kernel is not built, a compiled decode row's producers (here a norm) run once
    into a buffer; inductor would otherwise recompute them, a square root and a division per
    element, inside every weight row's loop. The code of the 300-row loop must therefore read the
    row, not compute it."""
    from portable_ssm.backends import torch_kernels
    from portable_ssm.backends.torch import compiled, decode_linear, quantized_matmul
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(torch_kernels, "_ACTIVE", [False])
    monkeypatch.setattr(torch_kernels, "ensure", lambda: False)

    weight = ps.quantize({"out_proj.weight": _x(300, 64, seed=1)}, kind)["out_proj.weight"]
    product = decode_linear if kind == "float32" else quantized_matmul

    def normed_product(x, w):
        return product(x / torch.sqrt(torch.mean(x * x, dim=-1, keepdim=True)), w)  # [1, 64] @ w.T

    x = _x(1, 64, seed=2)
    torch._dynamo.reset()
    with torch.inference_mode():
        got, codes = run_and_get_code(compiled(normed_product), x, weight)
        want = normed_product(x, weight)
    assert rel_err(got.numpy(), want.numpy()) < 1e-5
    kernel = "".join(codes).split("x0<static_cast<int64_t>(300L)")  # the weight rows' loop, then the rest
    assert len(kernel) == 2 and "sqrt" not in kernel[1].split("'''")[0], "".join(codes)  # to its source's end


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_lm_module_generate_decodes_through_torch_compile_with_compile_true():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, module = Mamba2LMModule(LM_CONFIG, seed=2), Mamba2LMModule(LM_CONFIG, seed=2, compile=True)
    ids = _ids(1, 4, seed=5)
    want = eager.generate(ids, max_new_tokens=5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0
    assert torch.equal(module.generate(ids, max_new_tokens=5), want)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the decode step; prefill stays eager
    assert torch.equal(module.generate(ids, max_new_tokens=5, compile=False), want)


def test_compile_option_is_checked_at_the_door():
    params = ps.init_params(LM_CONFIG, seed=0)
    ids = _ids(1, 3).numpy()
    with pytest.raises(TypeError, match="compile: expected True, False or None"):
        generation.generate(ids, params, config=LM_CONFIG, max_new_tokens=2, compile="yes")
    with pytest.raises(ValueError, match="compile: backend 'numpy' has no compiler"):
        generation.generate(ids, params, config=LM_CONFIG, max_new_tokens=2, compile=True)
    assert generation.generate(ids, params, config=LM_CONFIG, max_new_tokens=2, compile=False).shape == (1, 5)


@pytest.mark.parametrize("d_ssm", [None, 16])
def test_in_proj_output_splits_with_one_backward_that_concatenates_gradients(d_ssm):
    """torch's fast ``split`` (``torch.split``) cuts the in_proj output and xBC into the slices'
    values, and their gradient is one concatenation: no slice backward zero-filling a full-size
    gradient per part."""
    import array_api_compat.torch as txp

    from portable_ssm.mixer import _split, _split_xbc

    config = ps.Mamba2Config(d_model=16, n_layer=1, d_state=8, headdim=8, d_ssm=d_ssm)  # d_ssm 16: d_mlp 16
    width = config.d_in_proj
    v = torch.randn(2, 5, width, dtype=torch.float64, requires_grad=True)
    mlp, z, xBC, dt = _split(v, config, xp=txp)
    x, B, C = _split_xbc(xBC, config, xp=txp)
    parts = [p for p in (mlp, z, x.reshape(2, 5, -1), B.reshape(2, 5, -1), C.reshape(2, 5, -1), dt) if p is not None]
    torch.testing.assert_close(torch.cat(parts, dim=-1), v, rtol=0, atol=0)
    assert (mlp is None) == (config.d_mlp == 0)
    assert {type(p.grad_fn).__name__ for p in (z, xBC, dt)} == {"SplitWithSizesBackward0"}
    weights = [torch.randn(p.shape, dtype=p.dtype) for p in parts]
    (grad,) = torch.autograd.grad(sum((p * w).sum() for p, w in zip(parts, weights)), v)
    torch.testing.assert_close(grad, torch.cat([w.reshape(2, 5, -1) for w in weights], dim=-1), rtol=0, atol=0)
