"""The chunked scan's backward by hand, in torch ops: what autograd of ``portable_ssm.ssd.ssd_chunked_ref``
returns, as one loop over chunks (last to first) whose ``[h, Q, Q]`` intermediates stay in cache;
the backward of the ``portable_ssm::ssd_scan`` op that ``portable_ssm.backends.torch`` registers
for training on the CPU. In float32 the segment sums are differences of float64 prefix sums, as in
the forward, and the sums over steps behind dA and dD accumulate in float64.

Per chunk and head, with ``a = A·Δ``, ``acs`` its cumulative sum from the chunk's start, ``L[i, j] =
exp(acs_i - acs_j)`` for ``j <= i`` (else 0), ``G = C Bᵀ`` and ``S`` the state entering the chunk
(``[n, p]``), the forward is (MAMBA2_SPEC's SSD form)::

    y_i   = Σ_j G_ij L_ij Δ_j x_j + exp(acs_i) C_i S + D x_i
    S_out = exp(acs_last) S + Σ_j exp(acs_last - acs_j) Δ_j B_j x_jᵀ

and the backward takes each product apart in turn: the diagonal block (``dW = dy xᵀ`` on the lower
triangle gives dx, ``dG`` -> dB and dC, dΔ, and the segment sums' gradient ``dW ⊙ W``), the
entering state's read (dC, the gradient of S, ``acs_i``), the state's update (dx, dB, dΔ,
``acs``), the skip D, and last ``acs`` back to ``a = A·Δ`` through a reverse cumulative sum. The
entering states are recomputed by one pass over the chunks, not kept from the forward.
"""

from __future__ import annotations

import array_api_compat.torch as xp
import torch

from portable_ssm import ssd

from . import torch_kernels


def diagonal_block(prefix: torch.Tensor, G: torch.Tensor, dW: torch.Tensor, delta: torch.Tensor,
                   floor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of one chunk's backward, the diagonal block ``W = G ⊙ L ⊙ Δ_j`` on the lower
    triangle, with ``L_ij = exp(max(prefix_i - prefix_j, floor))`` (float64 prefix sums of A·Δ,
    the difference in the compute dtype) and ``dW = dy xᵀ``. Returns ``(W, dG, dΔ, d acs)``: the
    block's weights, the gradient of ``G`` (summed over each group's heads), of Δ through the
    block, and of the cumulative sums ``acs`` (``seg_ij = acs_i - acs_j``). Shapes: prefix and Δ
    ``[b, g, r, q]``, ``G [b, g, q, q]``, ``dW`` and W ``[b, g, r, q, q]``."""
    q = delta.shape[-1]
    L = (prefix[..., :, None] - prefix[..., None, :]).to(dW.dtype)  # [b, g, r, q, q]
    L.clamp_(min=floor).add_(torch.triu(dW.new_full((q, q), -torch.inf), 1)).exp_()  # 0 above the diagonal
    G = G[:, :, None]  # [b, g, 1, q, q]
    E = dW * L
    L.mul_(G).mul_(delta[..., None, :])  # W
    dG = (E * delta[..., None, :]).sum(dim=2)  # Σ_heads dW ⊙ L ⊙ Δ_j, [b, g, q, q]
    E.mul_(G)  # dW ⊙ L ⊙ G
    ddelta = E.sum(dim=-2)  # [b, g, r, q]
    E.mul_(delta[..., None, :])  # dW ⊙ W: the segment sums' gradient
    dacs = E.sum(dim=-1) - E.sum(dim=-2)  # seg_ij = acs_i - acs_j, [b, g, r, q]
    return L, dG, ddelta, dacs


def _kernel_takes(x: torch.Tensor) -> bool:
    """Whether :func:`ssd_chunked_grad` of ``x``'s scan runs :func:`.torch_kernels.scan_backward`: a
    float32 CPU tensor, where the kernels are built."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and torch_kernels.ready()


def ssd_chunked_grad(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                     chunk_size: int, initial_states: torch.Tensor | None, D: torch.Tensor | None,
                     dy: torch.Tensor, dfinal: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """Gradients ``(dx, dΔ, dA, dB, dC, dD, d initial_states)`` (None for an input that is None) of
    ``sum(dy·y) + sum(dfinal·final)`` for ``(y, final) = ssd_chunked_ref(x, dt, A, B, C, chunk_size,
    initial_states, D=D)`` (no ``seq_idx``). Shapes as the reference: ``x, dy [b, l, h, p]``, Δ
    ``[b, l, h]``, A ``[h]``, ``B, C [b, l, g, n]``, D ``[h]``, ``[h, p]`` or None, initial_states
    ``[b, h, p, n]`` or None, dfinal ``[b, h, p, n]``; one float dtype; no autograd recording.
    Float32 CPU tensors go through :mod:`.torch_kernels`' C++ backward
    (:func:`.torch_kernels.scan_backward`, the same steps in one pass per block of heads) where
    :func:`.torch_kernels.ready`; the torch ops below are the reference it is tested against."""
    if _kernel_takes(x):
        return torch_kernels.scan_backward(x, dt, A, B, C, D, initial_states, dy, dfinal, chunk_size)
    b, l, h, p = x.shape
    g, n = B.shape[-2:]
    r = h // g
    rp = r * p
    Q = chunk_size
    c = -(-l // Q)
    dtype = x.dtype
    floor = ssd.decay_floor(dtype, xp=xp)
    # the per-step decays of every chunk, Δ zero-padded to whole chunks: [b, g, r, c, Q]
    step = x.new_zeros((b, h, c * Q))
    step[..., :l] = dt.permute(0, 2, 1)
    step = step.reshape(b, g, r, c, Q)  # Δ
    a_all = step * A.reshape(g, r, 1, 1)  # A·Δ <= 0
    acs_all = torch.cumsum(a_all, dim=-1)  # from each chunk's start
    prefix = torch.cumsum(a_all, dim=-1, dtype=torch.float64)  # segment sums as differences of these
    suffix = torch.zeros_like(a_all)  # Σ_{k>s} A·Δ_k, a suffix sum (as the forward)
    suffix[..., :-1] = torch.cumsum(a_all[..., 1:].flip(-1), dim=-1).flip(-1)
    from_start = ssd.decay(acs_all, xp=xp)  # exp(acs_i)
    to_end = ssd.decay(suffix, xp=xp)  # exp(acs_last - acs_j)
    fed_weight = to_end * step  # exp(acs_last - acs_j) Δ_j: what x_j feeds the leaving state
    chunk_decay = ssd.decay(acs_all[..., -1], xp=xp)  # [b, g, r, c]
    decay_rows = chunk_decay.repeat_interleave(p, dim=2)  # repeated over each head's p columns, [b, g, r·p, c]

    xg = x.reshape(b, l, g, r, p)
    Bg, Cg = B.permute(0, 2, 1, 3), C.permute(0, 2, 1, 3)  # [b, g, l, n]
    # the state entering each chunk, recomputed: [c, b, g, n, r·p]
    entering = x.new_empty((c, b, g, n, rp))
    if initial_states is None:
        entering[0] = 0
    else:  # [b, h, p, n] -> [b, g, n, r·p]
        entering[0] = initial_states.reshape(b, g, r, p, n).permute(0, 1, 4, 2, 3).reshape(b, g, n, rp)
    for i in range(c - 1):
        t0, t1 = i * Q, (i + 1) * Q
        weight = fed_weight[..., i, :].permute(0, 3, 1, 2)  # [b, Q, g, r]
        fed = (xg[:, t0:t1] * weight[..., None]).permute(0, 2, 1, 3, 4).reshape(b, g, Q, rp)  # [b, g, Q, r·p]
        torch.mul(entering[i], decay_rows[..., i][:, :, None, :], out=entering[i + 1])
        entering[i + 1] += Bg[:, :, t0:t1].transpose(-1, -2) @ fed

    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dxg = dx.view(b, l, g, r, p)
    ddt = x.new_empty((b, l, g, r))
    dB, dC = x.new_empty((b, g, l, n)), x.new_empty((b, g, l, n))
    dA = x.new_zeros((g, r), dtype=torch.float64)
    dD = x.new_zeros((g, r, p), dtype=torch.float64)
    dS = dfinal.reshape(b, g, r, p, n).permute(0, 1, 4, 2, 3).reshape(b, g, n, rp)  # leaving the last chunk
    for i in reversed(range(c)):
        t0 = i * Q
        t1 = min(t0 + Q, l)
        q = t1 - t0
        Bc, Cc = Bg[:, :, t0:t1], Cg[:, :, t0:t1]  # [b, g, q, n]
        xh = xg[:, t0:t1].permute(0, 2, 3, 1, 4)  # [b, g, r, q, p]
        dyh = dy[:, t0:t1].reshape(b, q, g, r, p).permute(0, 2, 3, 1, 4)
        delta = step[..., i, :q]  # Δ [b, g, r, q]
        fs, te, v = from_start[..., i, :q], to_end[..., i, :q], fed_weight[..., i, :q]  # [b, g, r, q]
        S = entering[i]  # [b, g, n, r·p]

        # 1. the diagonal block: W = G ⊙ L ⊙ Δ_j on the lower triangle
        G = Cc @ Bc.transpose(-1, -2)  # [b, g, q, q]
        dW = dyh @ xh.transpose(-1, -2)  # dy xᵀ, [b, g, r, q, q]
        W, dG, ddelta, dacs = diagonal_block(prefix[..., i, :q], G, dW, delta, floor)
        dxh = W.transpose(-1, -2) @ dyh  # Wᵀ dy, [b, g, r, q, p]
        dCc = dG @ Bc  # [b, g, q, n]
        dBc = dG.transpose(-1, -2) @ Cc

        # 2. the entering state read by C and decayed to each step: exp(acs_i) C_i S
        Sh = S.view(b, g, n, r, p).permute(0, 1, 3, 4, 2)  # [b, g, r, p, n]
        read = dyh @ Sh  # dy S_hᵀ per head, [b, g, r, q, n]
        read.mul_(fs[..., None])  # ⊙ exp(acs_i)
        dacs += (read * Cc[:, :, None]).sum(dim=-1)  # dy_i · exp(acs_i) C_i S
        dCc += read.sum(dim=2)
        dyf = (dyh * fs[..., None]).permute(0, 1, 3, 2, 4).reshape(b, g, q, rp)  # dy ⊙ exp(acs_i)
        dS_in = Cc.transpose(-1, -2) @ dyf  # [b, g, n, r·p]

        # 3. the state's update: S_out = exp(acs_last) S + Σ_j exp(acs_last - acs_j) Δ_j B_j x_jᵀ
        dS_in += decay_rows[..., i][:, :, None, :] * dS
        dlast = chunk_decay[..., i] * (dS * S).sum(dim=2).view(b, g, r, p).sum(dim=-1)  # [b, g, r]
        BdS = (Bc @ dS).view(b, g, q, r, p).permute(0, 1, 3, 2, 4)  # [b, g, r, q, p]
        dxh += v[..., None] * BdS
        dv = (BdS * xh).sum(dim=-1)  # [b, g, r, q]
        dBc += (xh * v[..., None]).permute(0, 1, 3, 2, 4).reshape(b, g, q, rp) @ dS.transpose(-1, -2)
        ddelta += dv * te
        d_to_end = dv * v  # the gradient of each exponent acs_last - acs_j, [b, g, r, q]
        dacs -= d_to_end
        dacs[..., q - 1] += dlast + d_to_end.sum(dim=-1)

        # 4. the skip D
        if D is not None:
            dxh += dyh * D.reshape(g, r, 1, -1)
            dD += (dyh * xh).sum(dim=(0, 3), dtype=torch.float64)  # [g, r, p]

        # 5. acs back to a = A·Δ: da_k = Σ_{t >= k} dacs_t
        da = torch.cumsum(dacs.flip(-1), dim=-1).flip(-1)  # [b, g, r, q]
        dA += (da * delta).sum(dim=(0, 3), dtype=torch.float64)
        ddelta += da * A.reshape(g, r, 1)
        dxg[:, t0:t1] = dxh.permute(0, 3, 1, 2, 4)
        ddt[:, t0:t1] = ddelta.permute(0, 3, 1, 2)
        dB[:, :, t0:t1], dC[:, :, t0:t1] = dBc, dCc
        dS = dS_in
    dD_out = None if D is None else (dD.sum(dim=-1) if D.ndim == 1 else dD).reshape(D.shape).to(dtype)
    d_initial = (None if initial_states is None
                 else dS.view(b, g, n, r, p).permute(0, 1, 3, 4, 2).reshape(b, h, p, n))
    return (dx, ddt.reshape(b, l, h), dA.reshape(h).to(dtype), dB.permute(0, 2, 1, 3).contiguous(),
            dC.permute(0, 2, 1, 3).contiguous(), dD_out, d_initial)
