"""Hand-written CPU kernels for the torch backend: batch-1 decode's one-row matrix products and
every decode step's state update.

A decode step of one row reads every weight once, so its time is the memory bandwidth's. torch's
own GEMV (MKL on some CPUs takes a generic path) and inductor's generated one (one accumulator
and a horizontal sum per weight row) read float32 weights at about 75% of a streaming read,
inductor's widening int8 loads are scalar, and fbgemm's int8 kernel also rounds the row to 8
bits. :data:`SOURCE` holds two small C++ kernels instead:

* ``row_gemv``: ``row [1, in] @ weight.T -> [1, out]`` in float32 for a float32, int8 (times a
  float32 scale per output row: weight-only, the row stays float32) or bfloat16 weight, four FMA
  accumulators per weight row; a float32 weight four rows at a time instead, two accumulators each,
  every load of the row feeding all four; the rows split over torch's intra-op threads, each
  thread prefetching the weights 4 KiB ahead of its loads (the hardware prefetchers stop at every
  4 KiB page);
* ``decode_step``: one layer's step after in_proj (:func:`portable_ssm.mixer.decode_step_ref`:
  conv, SiLU, Δ, state update, ``H @ C``, D skip and gate) for float32 tensors of any batch, the
  heads split over the threads, each new state row multiplied by C as it is written and streamed
  to memory past the caches (eager torch otherwise makes about twenty passes over the state and its
  temporaries; inductor's fused loops in a compiled step come close to the kernel).

``python benchmarks/decode_model_ab.py --against REV`` times the whole-model step against the
kernels of an earlier revision, alternating in one process. On a 2-core AVX-512 VM, the prefetches
and the streamed state took a 130m LM's step from 30.5 to 26.0 ms for float32 weights, 15.0 to 11.0
for int8 and 23.3 to 16.5 for bfloat16 (``--against 74cc866``, the kernels without them).

They are compiled from source on first use with ``torch.utils.cpp_extension`` (the C++ compiler
``torch.compile`` needs on CPU anyway, and ninja; about a minute, once: the build is cached in
torch's extensions folder) and registered as the ops ``portable_ssm_cpu::row_gemv`` and
``portable_ssm_cpu::decode_step``, which compiled graphs call as they call any torch op. They are
used only where they can be: an x86-64 CPU with AVX2 and FMA (as torch reports its CPU capability)
and ``PORTABLE_SSM_CPU_KERNELS`` not ``0``. Where the build fails, one warning says why and torch's
kernels and the array-API step stay; nothing else changes."""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from functools import lru_cache
from typing import Any, NamedTuple

import torch

#: The environment variable that turns the kernels off (``0``); anything else leaves them on.
ENV = "PORTABLE_SSM_CPU_KERNELS"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The eight float32 weights at w + i, widened from the storage type.
inline __m256 widen8(const float* w, int64_t i) { return _mm256_loadu_ps(w + i); }
inline __m256 widen8(const int8_t* w, int64_t i) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + i))));
}
inline __m256 widen8(const uint16_t* w, int64_t i) {  // bfloat16 bits: the high half of a float32
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline float widen1(float w) { return w; }
inline float widen1(int8_t w) { return static_cast<float>(w); }
inline float widen1(uint16_t w) {
  uint32_t bits = static_cast<uint32_t>(w) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Bytes of weights each thread asks for ahead of its loads (software prefetch into every cache
// level): the hardware prefetchers stop at each 4 KiB page's end and restart late in the next one,
// so a stream of weight rows read only by them runs below the machine's streaming read.
constexpr int64_t kAheadBytes = 4096;

inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

// sum_i w[i] * x[i] over n elements: four accumulators of eight lanes, then the tail; the lines
// kAheadBytes past each step's 32 weights are prefetched (past the row's end they are the next
// row's, which the caller reads next).
template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const char* ahead = reinterpret_cast<const char*>(w) + kAheadBytes;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int64_t line = 0; line < 32 * static_cast<int64_t>(sizeof(T)); line += 64) {
      prefetch(ahead + i * sizeof(T) + line);
    }
    a0 = _mm256_fmadd_ps(widen8(w, i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(widen8(w, i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(widen8(w, i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(widen8(w, i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(widen8(w, i), _mm256_loadu_ps(x + i), a0);
  float total = horizontal_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) total += widen1(w[i]) * x[i];
  return total;
}

// sum_i w[r·n + i] * x[i] for four consecutive float32 weight rows r at once, into out[r]: each
// load of x feeds four rows' FMAs and four weight streams are in flight; two accumulators of eight
// lanes per row, then the tail. Each stream prefetches a quarter of kAheadBytes ahead, into the
// next four rows' starts once past its row's end.
inline void dot4(const float* w, const float* x, int64_t n, float* out) {
  constexpr int64_t ahead = kAheadBytes / 4 / sizeof(float);
  __m256 a[4], b[4];
  for (int r = 0; r < 4; ++r) a[r] = b[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // 16 floats: one 64-byte line of each row
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    const int64_t next = i + ahead;
    for (int r = 0; r < 4; ++r) {
      prefetch(next < n ? w + r * n + next : w + (4 + r) * n + (next - n));
      a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * n + i), x0, a[r]);
      b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * n + i + 8), x1, b[r]);
    }
  }
  for (int r = 0; r < 4; ++r) out[r] = horizontal_sum(_mm256_add_ps(a[r], b[r])) + dot(w + r * n + i, x + i, n - i);
}

template <typename T>
void rows_times(const T* w, const float* x, const float* scale, float* y, int64_t out, int64_t n) {
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    int64_t r = begin;
    // float32 weights four rows at a time; int8 and bfloat16 ones, which widen, one at a time (four
    // rows of them were slower)
    if constexpr (std::is_same_v<T, float>) {
      for (; r + 4 <= end; r += 4) dot4(w + r * n, x, n, y + r);
    }
    for (; r < end; ++r) y[r] = dot(w + r * n, x, n);
    if (scale != nullptr) {
      for (r = begin; r < end; ++r) y[r] *= scale[r];
    }
  });
}

at::Tensor row_gemv(const at::Tensor& row, const at::Tensor& weight, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(row.dim() == 2 && row.size(0) == 1 && row.scalar_type() == at::kFloat && row.is_contiguous(),
              "row_gemv: row must be a contiguous float32 [1, in], got ", row.sizes(), " ", row.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == row.size(1) && weight.is_contiguous(),
              "row_gemv: weight must be a contiguous [out, ", row.size(1), "], got ", weight.sizes());
  const int64_t out = weight.size(0), n = weight.size(1);
  const float* s = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->dim() == 1 && scale->size(0) == out && scale->scalar_type() == at::kFloat &&
                scale->is_contiguous(), "row_gemv: scale must be a contiguous float32 [", out, "]");
    s = scale->data_ptr<float>();
  }
  at::Tensor y = at::empty({1, out}, row.options());
  const float* x = row.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (weight.scalar_type()) {
    case at::kFloat: rows_times(weight.data_ptr<float>(), x, s, yp, out, n); break;
    case at::kChar: rows_times(weight.data_ptr<int8_t>(), x, s, yp, out, n); break;
    case at::kBFloat16:
      rows_times(reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>()), x, s, yp, out, n); break;
    default: TORCH_CHECK(false, "row_gemv: weight must be float32, int8 or bfloat16, got ", weight.scalar_type());
  }
  return y;
}

// exp(v) for eight floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial; relative
// error about 2e-7); inputs clamped to ±88.38, where float32's exp under- or overflows.
inline __m256 exp8(__m256 v) {
  v = _mm256_max_ps(_mm256_min_ps(v, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
  const __m256 k = _mm256_floor_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  v = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), v);
  v = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), v);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, v, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(v, v), v), _mm256_set1_ps(1.0f));
  const __m256i two_k = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(two_k));
}
inline __m256 silu8(__m256 v) {  // v·sigmoid(v) = v / (1 + exp(-v)); a NaN stays NaN through the product
  const __m256 one = _mm256_set1_ps(1.0f);
  return _mm256_mul_ps(v, _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v)))));
}
inline float silu1(float v) { return v / (1.0f + std::exp(-v)); }
inline float softplus1(float v) { return 0.5f * (v + std::fabs(v)) + std::log1p(std::exp(-std::fabs(v))); }

// v[i] = silu(v[i]), in place.
inline void silu_pass(float* v, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(v + i, silu8(_mm256_loadu_ps(v + i)));
  for (; i < count; ++i) v[i] = silu1(v[i]);
}
// v[i] = (v[i] + d[i]·x[i])·silu(gate[i]), in place; d == nullptr: one d_all for every i.
inline void skip_and_gate(float* v, const float* x, const float* d, float d_all, const float* gate, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 dv = d == nullptr ? _mm256_set1_ps(d_all) : _mm256_loadu_ps(d + i);
    const __m256 y = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(v + i));
    _mm256_storeu_ps(v + i, _mm256_mul_ps(y, silu8(_mm256_loadu_ps(gate + i))));
  }
  for (; i < count; ++i) v[i] = (v[i] + (d == nullptr ? d_all : d[i]) * x[i]) * silu1(gate[i]);
}

inline void check_f32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == at::kFloat && t.is_contiguous(), "decode_step: ", name,
              " must be a contiguous float32 tensor of rank ", dim, ", got ", t.sizes(), " ", t.scalar_type());
}

// One token of one layer after in_proj (portable_ssm.mixer.decode_step_ref): the conv step and SiLU,
// Δ = clamp(softplus(dt + dt_bias)), H' = exp(Δ·A)·H + Δ·outer(x, B), y = (H' @ C + D·x)·silu(z).
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_step(
    const at::Tensor& xBC, const at::Tensor& dt, const at::Tensor& z, const at::Tensor& conv_state,
    const at::Tensor& ssm_state, const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias,
    const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, double low, double high,
    int64_t ngroups, int64_t headdim) {
  check_f32(xBC, "xBC", 2); check_f32(dt, "dt", 2); check_f32(z, "z", 2); check_f32(conv_state, "conv_state", 3);
  check_f32(ssm_state, "ssm_state", 4); check_f32(conv_weight, "conv_weight", 2); check_f32(dt_bias, "dt_bias", 1);
  check_f32(A, "A", 1); check_f32(D, "D", D.dim());
  const int64_t b = xBC.size(0), conv_dim = xBC.size(1), k = conv_state.size(2), h = dt.size(1);
  const int64_t p = headdim, n = ssm_state.size(3), g = ngroups, d_inner = h * p;
  TORCH_CHECK(g > 0 && h % g == 0 && conv_dim == d_inner + 2 * g * n && k > 0, "decode_step: inconsistent sizes");
  TORCH_CHECK(dt.size(0) == b && z.size(0) == b && z.size(1) == d_inner && conv_state.size(0) == b &&
              conv_state.size(1) == conv_dim && conv_weight.size(0) == conv_dim && conv_weight.size(1) == k &&
              ssm_state.size(0) == b && ssm_state.size(1) == h && ssm_state.size(2) == p &&
              dt_bias.size(0) == h && A.size(0) == h && D.size(0) == h && (D.dim() == 1 || D.size(1) == p),
              "decode_step: shapes do not match xBC ", xBC.sizes(), " and ssm_state ", ssm_state.sizes());
  const float* bias = nullptr;
  if (conv_bias.has_value()) {
    check_f32(*conv_bias, "conv_bias", 1);
    TORCH_CHECK(conv_bias->size(0) == conv_dim, "decode_step: conv_bias must be [", conv_dim, "]");
    bias = conv_bias->data_ptr<float>();
  }
  at::Tensor act = at::empty({b, conv_dim}, xBC.options());
  at::Tensor new_conv = at::empty_like(conv_state), new_ssm = at::empty_like(ssm_state);
  at::Tensor y = at::empty({b, d_inner}, xBC.options());
  const float *xin = xBC.data_ptr<float>(), *cs = conv_state.data_ptr<float>(), *w = conv_weight.data_ptr<float>();
  float *ap = act.data_ptr<float>(), *ncs = new_conv.data_ptr<float>();
  for (int64_t i = 0; i < b * conv_dim; ++i) {  // one channel of one row: shift the window in, dot the taps
    const int64_t c = i % conv_dim;
    const float* s = cs + i * k;
    float* o = ncs + i * k;
    float acc = 0.f;
    for (int64_t j = 0; j + 1 < k; ++j) {
      o[j] = s[j + 1];
      acc += o[j] * w[c * k + j];
    }
    o[k - 1] = xin[i];
    acc += xin[i] * w[c * k + k - 1];
    ap[i] = bias == nullptr ? acc : acc + bias[c];
  }
  silu_pass(ap, b * conv_dim);
  const float *dtp = dt.data_ptr<float>(), *zp = z.data_ptr<float>(), *H = ssm_state.data_ptr<float>();
  const float *dbp = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Dp = D.data_ptr<float>();
  const bool d_per_channel = D.dim() == 2;
  float *Hn = new_ssm.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float lo = static_cast<float>(low), hi = static_cast<float>(high);
  // The new state goes straight to memory (non-temporal stores, where its rows are 32-byte aligned):
  // it is read again only by the next token, after every weight has passed through the caches, and
  // ordinary stores would first read each line of the fresh buffer.
  const bool stream = reinterpret_cast<uintptr_t>(Hn) % 32 == 0 && n % 8 == 0;
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {  // one head of one row
      const int64_t row = bh / h, head = bh % h, group = head / (h / g);
      const float step = std::min(std::max(softplus1(dtp[bh] + dbp[head]), lo), hi);  // Δ
      const float decay = std::exp(step * Ap[head]);  // exp(Δ·A)
      const float* x = ap + row * conv_dim + head * p;
      const float* B = ap + row * conv_dim + d_inner + group * n;
      const float* C = ap + row * conv_dim + d_inner + g * n + group * n;
      float* out = yp + row * d_inner + head * p;
      const __m256 vdecay = _mm256_set1_ps(decay);
      for (int64_t i = 0; i < p; ++i) {  // H'[i, :] = decay·H[i, :] + Δ·x[i]·B, and H'[i, :] @ C
        const float* hrow = H + (bh * p + i) * n;
        float* nrow = Hn + (bh * p + i) * n;
        const float feed = step * x[i];
        const __m256 vfeed = _mm256_set1_ps(feed);
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
          __m256 v = _mm256_fmadd_ps(vfeed, _mm256_loadu_ps(B + j), _mm256_mul_ps(vdecay, _mm256_loadu_ps(hrow + j)));
          if (stream) {
            _mm256_stream_ps(nrow + j, v);
          } else {
            _mm256_storeu_ps(nrow + j, v);
          }
          acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(C + j), acc);
        }
        float dot = horizontal_sum(acc);
        for (; j < n; ++j) {
          nrow[j] = decay * hrow[j] + feed * B[j];
          dot += nrow[j] * C[j];
        }
        out[i] = dot;
      }
      skip_and_gate(out, x, d_per_channel ? Dp + head * p : nullptr, Dp[head], zp + row * d_inner + head * p, p);
    }
    _mm_sfence();  // the streamed rows are visible before the step returns
  });
  return {y, new_conv, new_ssm};
}

// out = weight · x / sqrt(mean(x²) + eps) over each of `groups` equal slices of x [1, d].
at::Tensor grouped_rms_norm(const at::Tensor& x, const at::Tensor& weight, int64_t groups, float eps) {
  const int64_t d = x.size(1), width = d / groups;
  at::Tensor out = at::empty_like(x);
  const float *v = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t start = 0; start < d; start += width) {
    const float inv = 1.0f / std::sqrt(dot(v + start, v + start, width) / static_cast<float>(width) + eps);
    for (int64_t j = start; j < start + width; ++j) o[j] = w[j] * (v[j] * inv);
  }
  return out;
}

inline void check_layers(at::TensorList list, int64_t layers, const char* name) {
  TORCH_CHECK(static_cast<int64_t>(list.size()) == layers, "decode_model: ", name, " must hold one tensor per layer (",
              layers, "), got ", list.size());
}

// One token through the whole language model at batch 1 (portable_ssm.lm.decode: the residual
// blocks with their mixers' steps, norm_f and the head), from the embedded token x [1, d_model].
// Layer i's in_proj output is [z, xBC, dt] (no gated MLP, no projection biases); its gated norm
// follows the gate (norm_before_gate=False). Weights are float32, int8 (with row scales) or
// bfloat16; every other tensor float32. Returns (logits [1, rows], new conv states, new ssm states).
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decode_model(
    const at::Tensor& x, at::TensorList conv_states, at::TensorList ssm_states, at::TensorList norms,
    at::TensorList in_weights, const c10::List<c10::optional<at::Tensor>>& in_scales, at::TensorList conv_weights,
    const c10::List<c10::optional<at::Tensor>>& conv_biases, at::TensorList dt_biases, at::TensorList A_logs,
    at::TensorList Ds, at::TensorList gate_norms, at::TensorList out_weights,
    const c10::List<c10::optional<at::Tensor>>& out_scales, const at::Tensor& norm_f, const at::Tensor& head,
    const c10::optional<at::Tensor>& head_scale, double eps, double low, double high, int64_t ngroups,
    int64_t headdim) {
  const int64_t layers = conv_states.size();
  check_f32(x, "x", 2);
  TORCH_CHECK(x.size(0) == 1, "decode_model: x must be one row [1, d_model], got ", x.sizes());
  for (auto [list, name] : {std::pair{ssm_states, "ssm_states"}, {norms, "norms"}, {in_weights, "in_weights"},
                            {conv_weights, "conv_weights"}, {dt_biases, "dt_biases"}, {A_logs, "A_logs"}, {Ds, "Ds"},
                            {gate_norms, "gate_norms"}, {out_weights, "out_weights"}}) {
    check_layers(list, layers, name);
  }
  TORCH_CHECK(static_cast<int64_t>(in_scales.size()) == layers && static_cast<int64_t>(conv_biases.size()) == layers &&
              static_cast<int64_t>(out_scales.size()) == layers,
              "decode_model: in_scales, conv_biases and out_scales must hold one entry per layer (", layers, ")");
  const float e = static_cast<float>(eps);
  std::vector<at::Tensor> convs, ssms;
  at::Tensor residual = x, hidden;
  for (int64_t i = 0; i < layers; ++i) {
    if (i > 0) residual = residual + hidden;
    check_f32(norms[i], "norms[i]", 1); check_f32(gate_norms[i], "gate_norms[i]", 1);
    TORCH_CHECK(norms[i].size(0) == x.size(1), "decode_model: norms[", i, "] must be [", x.size(1), "]");
    const at::Tensor zxbcdt = row_gemv(grouped_rms_norm(residual, norms[i], 1, e), in_weights[i], in_scales.get(i));
    const int64_t h = dt_biases[i].size(0), d_inner = h * headdim, conv_dim = conv_weights[i].size(0);
    TORCH_CHECK(zxbcdt.size(1) == d_inner + conv_dim + h && gate_norms[i].size(0) == d_inner,
                "decode_model: layer ", i, "'s in_proj gives ", zxbcdt.size(1), " outputs, not [z, xBC, dt] = ",
                d_inner + conv_dim + h);
    auto [y, conv, ssm] = decode_step(
        zxbcdt.narrow(1, d_inner, conv_dim), zxbcdt.narrow(1, d_inner + conv_dim, h), zxbcdt.narrow(1, 0, d_inner),
        conv_states[i], ssm_states[i], conv_weights[i].reshape({conv_dim, -1}), conv_biases.get(i), dt_biases[i],
        -at::exp(A_logs[i]), Ds[i], low, high, ngroups, headdim);
    hidden = row_gemv(grouped_rms_norm(y, gate_norms[i], ngroups, e), out_weights[i], out_scales.get(i));
    TORCH_CHECK(hidden.size(1) == x.size(1), "decode_model: layer ", i, "'s out_proj gives ", hidden.size(1),
                " outputs, not d_model = ", x.size(1));
    convs.push_back(std::move(conv));
    ssms.push_back(std::move(ssm));
  }
  check_f32(norm_f, "norm_f", 1);
  TORCH_CHECK(norm_f.size(0) == x.size(1), "decode_model: norm_f must be [", x.size(1), "], got ", norm_f.sizes());
  const at::Tensor out = grouped_rms_norm(layers > 0 ? residual + hidden : x, norm_f, 1, e);
  return {row_gemv(out, head, head_scale), convs, ssms};
}

}  // namespace

TORCH_LIBRARY(portable_ssm_cpu, m) {
  m.def("row_gemv(Tensor row, Tensor weight, Tensor? scale) -> Tensor");
  m.def("decode_step(Tensor xBC, Tensor dt, Tensor z, Tensor conv_state, Tensor ssm_state, Tensor conv_weight, "
        "Tensor? conv_bias, Tensor dt_bias, Tensor A, Tensor D, float low, float high, int ngroups, int headdim) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("decode_model(Tensor x, Tensor[] conv_states, Tensor[] ssm_states, Tensor[] norms, Tensor[] in_weights, "
        "Tensor?[] in_scales, Tensor[] conv_weights, Tensor?[] conv_biases, Tensor[] dt_biases, Tensor[] A_logs, "
        "Tensor[] Ds, Tensor[] gate_norms, Tensor[] out_weights, Tensor?[] out_scales, Tensor norm_f, Tensor head, "
        "Tensor? head_scale, float eps, float low, float high, int ngroups, int headdim) "
        "-> (Tensor, Tensor[], Tensor[])");
}
TORCH_LIBRARY_IMPL(portable_ssm_cpu, CPU, m) {
  m.impl("row_gemv", &row_gemv);
  m.impl("decode_step", &decode_step);
  m.impl("decode_model", &decode_model);
}
"""

#: The compiler's flags: AVX2 and FMA code; OpenMP, so ``at::parallel_for`` splits the rows over
#: torch's threads (the symbols resolve to the OpenMP runtime torch has loaded; none is linked).
CFLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp")
#: Weight dtypes the kernel reads.
WEIGHT_DTYPES = (torch.float32, torch.int8, torch.bfloat16)


@lru_cache(maxsize=1)
def _cpu_has_avx2() -> bool:
    """Whether this is an x86-64 CPU on which torch runs AVX2 (or AVX512) code (fixed per process)."""
    machine = platform.machine().lower()
    return machine in ("x86_64", "amd64") and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def enabled() -> bool:
    """Whether the kernels may be used here: not turned off by :data:`ENV`, an x86-64 CPU with AVX2."""
    return os.environ.get(ENV, "").strip() != "0" and _cpu_has_avx2()


_BUILT: list[bool] = []  # empty until the first build attempt, then whether it loaded
_ACTIVE = [False]  # whether the kernel is loaded and enabled, as ensure() last found


def _build() -> bool:
    """Compile and load :data:`SOURCE` (True), or warn why it could not be (False)."""
    from torch.utils import cpp_extension

    name = "portable_ssm_cpu_" + hashlib.sha256(" ".join([SOURCE, *CFLAGS]).encode()).hexdigest()[:16]
    try:
        cpp_extension.load_inline(name, cpp_sources=[SOURCE], extra_cflags=list(CFLAGS), is_python_module=False,
                                  verbose=False)
    except Exception as error:  # no compiler or ninja, or a failed build: torch's kernels stay
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        warnings.warn(f"portable_ssm: the CPU decode kernels could not be built ({first_line}); decode uses "
                      f"torch's own kernels (set {ENV}=0 to skip the attempt)", RuntimeWarning, stacklevel=4)
        return False
    torch.library.register_fake("portable_ssm_cpu::row_gemv")(_row_gemv_shape)
    torch.library.register_fake("portable_ssm_cpu::decode_step")(_decode_step_shapes)
    torch.library.register_fake("portable_ssm_cpu::decode_model")(_decode_model_shapes)
    return True


def _row_gemv_shape(row: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return row.new_empty((1, weight.shape[0]))


def _decode_step_shapes(xBC: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, conv_state: torch.Tensor,
                        ssm_state: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return z.new_empty(z.shape), conv_state.new_empty(conv_state.shape), ssm_state.new_empty(ssm_state.shape)


def _decode_model_shapes(x: torch.Tensor, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor],
                         *rest: Any) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    head = rest[ModelWeights._fields.index("head")]  # rest: the weights' fields, then the scalars
    return (x.new_empty((1, head.shape[0])), [c.new_empty(c.shape) for c in conv_states],
            [h.new_empty(h.shape) for h in ssm_states])


def ensure() -> bool:
    """Whether the kernels may be used now, building them first (once per process) if that was not
    tried yet; call it outside ``torch.compile`` tracing (generation's compiler does, before tracing)."""
    usable = enabled()
    if usable and not _BUILT:
        _BUILT.append(_build())
    _ACTIVE[0] = usable and _BUILT[0]
    return _ACTIVE[0]


def ready() -> bool:
    """Whether the kernel was found usable by the last :func:`ensure` (never builds; a graph being
    traced reads this flag)."""
    return _ACTIVE[0]


def row_product(row: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``row [1, in] @ weight.T -> [1, out]`` in float32 (each output times ``scale [out]`` when given)."""
    return torch.ops.portable_ssm_cpu.row_gemv(row, weight, scale)


#: The dtype every tensor of the fused decode step must have.
DECODE_DTYPE = torch.float32


def decode_step(xBC: torch.Tensor, dt: torch.Tensor, z: torch.Tensor, conv_state: torch.Tensor,
                ssm_state: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                dt_bias: torch.Tensor, A: torch.Tensor, D: torch.Tensor, dt_limit: tuple[float, float],
                ngroups: int, headdim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`portable_ssm.mixer.decode_step_ref` (which documents the arguments) in one pass over
    the state for float32 CPU tensors: the state is read once and written once, each new row
    multiplied by C as it is written (the array-API step reads it a second time for C). Returns
    ``(y [b, h·p], new_conv_state, new_ssm_state)``; the inputs are left untouched."""
    low, high = dt_limit
    return torch.ops.portable_ssm_cpu.decode_step(
        xBC.contiguous(), dt.contiguous(), z.contiguous(), conv_state.contiguous(), ssm_state.contiguous(),
        conv_weight.contiguous(), None if conv_bias is None else conv_bias.contiguous(), dt_bias.contiguous(),
        A.contiguous(), D.contiguous(), float(low), float(high), ngroups, headdim)


class ModelWeights(NamedTuple):
    """A language model's tensors as :func:`decode_model` reads them, one entry per layer in each
    list (``in_scales`` / ``out_scales``: int8 row scales or None; ``conv_biases``: None without)."""

    norms: list[torch.Tensor]
    in_weights: list[torch.Tensor]
    in_scales: list[torch.Tensor | None]
    conv_weights: list[torch.Tensor]
    conv_biases: list[torch.Tensor | None]
    dt_biases: list[torch.Tensor]
    A_logs: list[torch.Tensor]
    Ds: list[torch.Tensor]
    gate_norms: list[torch.Tensor]
    out_weights: list[torch.Tensor]
    out_scales: list[torch.Tensor | None]
    norm_f: torch.Tensor
    head: torch.Tensor
    head_scale: torch.Tensor | None


def decode_model(x: torch.Tensor, conv_states: list[torch.Tensor], ssm_states: list[torch.Tensor],
                 weights: ModelWeights, eps: float, dt_limit: tuple[float, float], ngroups: int,
                 headdim: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """One decode step of a whole language model at batch 1 in one call: :func:`portable_ssm.lm.decode`
    after the embedding (each layer's norm, in_proj, :func:`decode_step`, gated norm, out_proj and
    residual, then norm_f and the head, the products through ``row_gemv``), for ``x [1, d_model]``
    float32 and contiguous float32 tensors (the weights also int8 with row scales or bfloat16). The
    variant it computes: in_proj's output ``[z, xBC, dt]`` (no gated MLP), no projection biases, the
    gated norm after the gate. Returns ``(logits [1, rows], new conv states, new ssm states)``; the
    inputs are left untouched."""
    low, high = dt_limit
    return torch.ops.portable_ssm_cpu.decode_model(x, conv_states, ssm_states, *weights, float(eps), float(low),
                                                   float(high), ngroups, headdim)
