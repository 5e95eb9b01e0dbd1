// The hybrid stack's batch-1 decode step in plain pointers (portable_ssm.stack.run_layers for one
// token): a list of residual blocks, each a Mamba-2 mixer, an attention layer, both on one input
// (Falcon-H1's parallel mixer), an MLP or a mixture of experts, behind its RMSNorm and residual
// multiplier, then norm_f and the head, in one OpenMP parallel region as decode_model_run runs the
// pure model. NumPy's library exports it as portable_ssm_decode_hybrid (numpy_kernels.cpp), its
// arrays checked in backends/numpy/hybrid.py.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "decode_model.h"
#include "shared.h"

namespace {

// One attention layer's weights and this token's view of its KV cache: q/k/v/o products (biases
// or null), keys and values [kv, m, hd] (batch row 0) into which this token's land at `slot`,
// valid [m] (the slots holding real tokens, this one's included), RoPE on the first `rotary`
// channels of each head at `position` (0: none) with base theta, scores scaled by `scale`.
struct AttnView {
  RowWeight q, k, v, o;
  const float *q_bias, *k_bias, *v_bias, *o_bias;
  float *keys, *values;
  const uint8_t* valid;
  int64_t heads, kv, hd, m, slot, rotary, position;
  float scale, theta;
};

// An MLP's weights: up [2f or f, d] (gated: [gate; up]), down [d, f]; act 0: SiLU, 1: relu².
struct MlpView {
  RowWeight up, down;
  int64_t f, act;
  bool gated;
};

// A mixture of experts (portable_ssm.blocks.moe): router [E, d] (float32) and the choice's bias
// [E] (or null); experts: expert 0's MLP, each other expert e's weights after it in the stacks (its
// up rows at e·up.out, its down rows at e·down.out, an int8 stack's row scales alike); the top k of
// the E chosen and weighed by softmax over their logits, or by their sigmoids (normalized to sum
// one where `normalize`), times scale; shared: the shared expert's MLP on the same input, or null.
struct MoeView {
  RowWeight router;
  const float* bias;
  MlpView experts;
  const MlpView* shared;
  int64_t k;
  bool sigmoid, normalize;
  float scale;
};

// A residual block: norm [d], then the parts it has (null: not), their outputs summed, times multiplier.
struct BlockView {
  const float* norm;
  const LayerView* mamba;
  const AttnView* attn;
  const MlpView* mlp;
  const MoeView* moe;
  float multiplier;
};

// RoPE (transformers' rotate_half) on the first r channels of one head v [hd], in place, with
// cos/sin [r/2] (the frequencies repeat in the second half).
inline void rope_head(float* v, const float* cos, const float* sin, int64_t r) {
  const int64_t half = r / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = b * cos[i] + a * sin[i];
  }
}

// Lane r of the result: the sum of the eight lanes of a[r] (four horizontal adds, one swap of halves).
inline __m256 sum_lanes8(const __m256* a) {
  // a0..a3: low | high halves
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// scores [c, count] = scale·q_j·keys[s] for the c query heads q [c, hd] and the slots s < count
// (-inf where !valid[s]). Eight slots at a time where hd is a multiple of 8: each head's eight
// products are summed into one vector of eight scores together (sum_lanes8), the keys' block
// staying in L1 across the heads; the rest one slot at a time.
inline void attend_scores(const float* q, int64_t c, const float* keys, const uint8_t* valid, int64_t count,
                          int64_t hd, float scale, float* scores) {
  int64_t s = 0;
  if (hd % 8 == 0) {
    for (; s + 8 <= count; s += 8) {
      for (int64_t j = 0; j < c; ++j) {
        __m256 a[8];
        for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < hd; i += 8) {
          const __m256 qv = _mm256_loadu_ps(q + j * hd + i);
          for (int r = 0; r < 8; ++r) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys + (s + r) * hd + i), a[r]);
        }
        float* e = scores + j * count + s;
        _mm256_storeu_ps(e, _mm256_mul_ps(sum_lanes8(a), _mm256_set1_ps(scale)));
        for (int r = 0; r < 8; ++r) {
          if (!valid[s + r]) e[r] = -INFINITY;
        }
      }
    }
  }
  for (; s < count; ++s) {
    for (int64_t j = 0; j < c; ++j) {
      scores[j * count + s] = valid[s] ? inner(q + j * hd, keys + s * hd, hd) * scale : -INFINITY;
    }
  }
}

// out [width] = sum over the slots s < count with e[s] != 0 of e[s]·rows[s·hd, +width), then times
// inv: Width floats (a multiple of 8) held in registers across the slots; a slot whose weight is
// exactly 0 is skipped, so a NaN in a slot no query sees never reaches the output.
template <int64_t Width>
inline void weighted_rows(const float* e, const float* rows, int64_t count, int64_t hd, float inv, float* out) {
  constexpr int64_t n = Width / 8;
  __m256 a[n];
  for (int64_t k = 0; k < n; ++k) a[k] = _mm256_setzero_ps();
  for (int64_t s = 0; s < count; ++s) {
    if (e[s] == 0.f) continue;
    const __m256 w = _mm256_set1_ps(e[s]);
    for (int64_t k = 0; k < n; ++k) a[k] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows + s * hd + 8 * k), a[k]);
  }
  for (int64_t k = 0; k < n; ++k) _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(a[k], _mm256_set1_ps(inv)));
}

// out [c, hd] = softmax over the visible slots s <= slot of scale·q_j·keys[s] (c query heads q [c,
// hd] of one KV head), times values[s]: the keys read once for the c heads, each head's output
// 64 (then 32, 16, 8) channels at a time in registers over the values. scores: the thread's own
// [c, slot + 1]. An invisible slot's weight is exactly 0.
inline void attend_group(const float* q, int64_t c, const float* keys, const float* values, const uint8_t* valid,
                         int64_t slot, int64_t hd, float scale, float* scores, float* out) {
  const int64_t count = slot + 1;
  attend_scores(q, c, keys, valid, count, hd, scale, scores);
  for (int64_t j = 0; j < c; ++j) {
    float* e = scores + j * count;
    float top = -INFINITY;
    for (int64_t s = 0; s < count; ++s) top = std::max(top, e[s]);
    const __m256 vtop = _mm256_set1_ps(top), hidden = _mm256_set1_ps(-INFINITY);
    __m256 acc = _mm256_setzero_ps();
    int64_t s = 0;
    for (; s + 8 <= count; s += 8) {
      const __m256 v = _mm256_loadu_ps(e + s);
      const __m256 w = _mm256_andnot_ps(_mm256_cmp_ps(v, hidden, _CMP_EQ_OQ), exp8(_mm256_sub_ps(v, vtop)));
      _mm256_storeu_ps(e + s, w);
      acc = _mm256_add_ps(acc, w);
    }
    float total = horizontal_sum(acc);
    for (; s < count; ++s) {
      e[s] = e[s] == -INFINITY ? 0.f : std::exp(e[s] - top);
      total += e[s];
    }
    const float inv = 1.f / total;
    float* o = out + j * hd;
    int64_t i = 0;
    for (; i + 64 <= hd; i += 64) weighted_rows<64>(e, values + i, count, hd, inv, o + i);
    if (i + 32 <= hd) weighted_rows<32>(e, values + i, count, hd, inv, o + i), i += 32;
    if (i + 16 <= hd) weighted_rows<16>(e, values + i, count, hd, inv, o + i), i += 16;
    if (i + 8 <= hd) weighted_rows<8>(e, values + i, count, hd, inv, o + i), i += 8;
    for (; i < hd; ++i) {  // the last hd % 8 channels
      float sum = 0.f;
      for (int64_t t = 0; t < count; ++t) {
        if (e[t] != 0.f) sum += e[t] * values[t * hd + i];
      }
      o[i] = sum * inv;
    }
  }
}

// One attention layer of a batch-1 step on thread t of `team` (see mamba_share): normed [d] -> out
// [d] (o_proj's rows shared; complete after the caller's next barrier). Shared scratch: q [h·hd],
// fresh [2·kv·hd] (the new key and value), heads [h·hd]; the thread's own: scores [rep·m], rope [r].
// The new key and value are written into the cache at A.slot before any thread attends.
inline void attention_share(const AttnView& A, const float* normed, float* q, float* fresh, float* heads,
                            float* scores, float* rope, float* out, Team& team) {
  const int64_t hd = A.hd, rep = A.heads / A.kv, kw = A.kv * hd, t = team.t;
  team.products(A.q, normed, q, A.q_bias);
  team.products(A.k, normed, fresh, A.k_bias);
  team.products(A.v, normed, fresh + kw, A.v_bias);
  const int64_t half = A.rotary / 2;
  for (int64_t i = 0; i < half; ++i) {  // transformers' rope tables in float32: inv_freq = theta^(-2i/r)
    const float inv_freq = 1.f / std::pow(A.theta, static_cast<float>(2 * i) / static_cast<float>(A.rotary));
    const float angle = static_cast<float>(A.position) * inv_freq;
    rope[i] = std::cos(angle), rope[half + i] = std::sin(angle);
  }
#pragma omp barrier
  const auto [k0, k1] = share(A.kv, t, team.size, 1);
  for (int64_t kh = k0; kh < k1; ++kh) {
    float* key = fresh + kh * hd;
    if (half) rope_head(key, rope, rope + half, A.rotary);
    std::copy(key, key + hd, A.keys + (kh * A.m + A.slot) * hd);
    std::copy(fresh + kw + kh * hd, fresh + kw + (kh + 1) * hd, A.values + (kh * A.m + A.slot) * hd);
  }
  const int64_t parts = std::min(rep, std::max<int64_t>(1, (team.size + A.kv - 1) / A.kv));  // items per KV head
  const auto [i0, i1] = share(A.kv * parts, t, team.size, 1);
  for (int64_t item = i0; item < i1; ++item) {  // this thread's query heads rope'd before the barrier
    const int64_t kh = item / parts, part = item % parts;
    for (int64_t j = kh * rep + rep * part / parts; j < kh * rep + rep * (part + 1) / parts; ++j) {
      if (half) rope_head(q + j * hd, rope, rope + half, A.rotary);
    }
  }
#pragma omp barrier
  for (int64_t item = i0; item < i1; ++item) {
    const int64_t kh = item / parts, part = item % parts;
    const int64_t j0 = kh * rep + rep * part / parts, j1 = kh * rep + rep * (part + 1) / parts;
    attend_group(q + j0 * hd, j1 - j0, A.keys + kh * A.m * hd, A.values + kh * A.m * hd, A.valid, A.slot, hd,
                 A.scale, scores, heads + j0 * hd);
  }
#pragma omp barrier
  team.products(A.o, heads, out, A.o_bias);
}

// Thread t's share of an MLP's activation: act [f] = act(gate)·up (gated: up [2f] = [gate; up]) or
// act(up) (up [f]) for the hidden units of its share; every unit written after the team's next barrier.
inline void activate_share(const MlpView& M, const float* up, float* act, const Team& team) {
  const auto [a0, a1] = share(M.f, team.t, team.size, 8);
  const float* lin = M.gated ? up + M.f : nullptr;  // gated: act(gate)·up, gate the first half
  if (M.act == 0) {
    std::copy(up + a0, up + a1, act + a0);
    silu_pass(act + a0, a1 - a0);
  } else {
    for (int64_t i = a0; i < a1; ++i) act[i] = up[i] > 0.f ? up[i] * up[i] : 0.f;
  }
  if (lin != nullptr) {
    for (int64_t i = a0; i < a1; ++i) act[i] *= lin[i];
  }
}

// One MLP of a batch-1 step on thread t of `team`: normed [d] -> out [d] (down's rows shared;
// complete after the caller's next barrier). Shared scratch: up [2f or f], act [f].
inline void mlp_share(const MlpView& M, const float* normed, float* up, float* act, float* out, Team& team) {
  team.products(M.up, normed, up);
#pragma omp barrier
  activate_share(M, up, act, team);
#pragma omp barrier
  team.products(M.down, act, out);
}

// A thread's own scratch for MoE blocks of at most E experts choosing k: choice [E], picks [k],
// and per down product (the k chosen experts' and the shared expert's) its weight, view and input.
struct MoeScratch {
  std::vector<float> choice, weights;
  std::vector<int64_t> picks;
  std::vector<RowWeight> downs;
  std::vector<const float*> inputs;
  MoeScratch(int64_t E, int64_t k) : choice(E), weights(k + 1), picks(k), downs(k + 1), inputs(k + 1) {}
};

// The k experts M chooses from the router's logits [E] into picks [k] and their weights [k], as
// portable_ssm.blocks.moe.route chooses them: scores (the logits, or their sigmoids), k rounds of
// argmax over the scores plus the bias (ties to the lowest index, a NaN first, as NumPy's argmax),
// the chosen scores softmaxed (sigmoid: normalized where M.normalize), times M.scale. choice: scratch [E].
inline void route(const MoeView& M, const float* logits, float* choice, int64_t* picks, float* weights) {
  const int64_t E = M.router.out;
  const auto score = [&](int64_t e) { return M.sigmoid ? 1.f / (1.f + std::exp(-logits[e])) : logits[e]; };
  for (int64_t e = 0; e < E; ++e) choice[e] = M.bias == nullptr ? score(e) : score(e) + M.bias[e];
  for (int64_t j = 0; j < M.k; ++j) {
    int64_t best = 0;
    for (int64_t e = 1; e < E; ++e) {
      if (choice[e] > choice[best] || (std::isnan(choice[e]) && !std::isnan(choice[best]))) best = e;
    }
    picks[j] = best, weights[j] = score(best);
    choice[best] = -INFINITY;
  }
  float top = -INFINITY, total = 0.f;  // softmax: exp(w - top) / Σ; sigmoid: w / (Σ + 1e-20) or w
  for (int64_t j = 0; j < M.k; ++j) top = std::max(top, weights[j]);
  for (int64_t j = 0; j < M.k; ++j) {
    if (!M.sigmoid) weights[j] = std::exp(weights[j] - top);
    total += weights[j];
  }
  for (int64_t j = 0; j < M.k; ++j) {
    const float w = !M.sigmoid ? weights[j] / total : M.normalize ? weights[j] / (total + 1e-20f) : weights[j];
    weights[j] = w * M.scale;
  }
}

// One MoE block of a batch-1 step on thread t of `team`: normed [d] -> out [d] (the downs' weighted
// sum's rows shared; complete after the caller's next barrier), reading the chosen experts' weights
// only. Shared scratch: logits [E], up [k·up.out + the shared expert's up.out] and act [k·f + its
// f] (each chosen expert's rows in turn, the shared expert's last); the thread's own: own. The
// router's product (with the shared expert's up), then every thread routes for itself (the same
// floats) and the k ups go back to back before one barrier; the activations are shared out as
// mlp_share's, and the k downs (with the shared expert's) summed in one product.
inline void moe_share(const MoeView& M, const float* normed, float* logits, float* up, float* act, float* out,
                      MoeScratch& own, Team& team) {
  const MlpView& X = M.experts;
  const int64_t k = M.k, width = X.up.out, f = X.f;
  team.products(M.router, normed, logits);
  if (M.shared != nullptr) team.products(M.shared->up, normed, up + k * width);
#pragma omp barrier
  route(M, logits, own.choice.data(), own.picks.data(), own.weights.data());
  for (int64_t j = 0; j < k; ++j) team.products(rows_of(X.up, own.picks[j] * width, width), normed, up + j * width);
#pragma omp barrier
  for (int64_t j = 0; j < k; ++j) activate_share(X, up + j * width, act + j * f, team);
  if (M.shared != nullptr) activate_share(*M.shared, up + k * width, act + k * f, team);
#pragma omp barrier
  for (int64_t j = 0; j < k; ++j) {
    own.downs[j] = rows_of(X.down, own.picks[j] * X.down.out, X.down.out), own.inputs[j] = act + j * f;
  }
  if (M.shared != nullptr) own.downs[k] = M.shared->down, own.inputs[k] = act + k * f, own.weights[k] = 1.f;
  team.weighted_sum(own.downs.data(), own.inputs.data(), own.weights.data(), k + (M.shared != nullptr), out);
}

// Sizes of the scratch a hybrid step's blocks need at most.
struct HybridWidths {
  MambaWidths mamba;
  int64_t q, fresh, scores, rope, up, f, experts, k;
};

// One token through the hybrid stack at batch 1 from the embedded token x0 [d]: the blocks (their
// views checked by the caller), the final norm [d] and the head into out [head.out]; mambas: the
// Mamba views the blocks point into (for the scratch sizes); threads: the team's size. Each thread
// keeps its own residual and normed rows; every part ends at a barrier, then each thread adds the
// block's output (the two parts' sum for a parallel mixer) times its multiplier to its residual.
inline void decode_hybrid_run(const float* x0, int64_t d, const BlockView* blocks, int64_t count,
                              const LayerView* mambas, int64_t n_mamba, const float* final_norm,
                              const RowWeight& lm_head, float* out, double eps, double mamba_eps, float lo, float hi,
                              int64_t g, int64_t p, int threads) {
  HybridWidths w{mamba_widths(mambas, n_mamba, d, g, p), 0, 0, 0, 0, 0, 0, 0, 0};
  int64_t products = 1;  // the head's
  for (int64_t b = 0; b < count; ++b) {
    if (const AttnView* A = blocks[b].attn) {
      w.q = std::max(w.q, A->heads * A->hd), w.fresh = std::max(w.fresh, 2 * A->kv * A->hd);
      w.scores = std::max(w.scores, A->heads / A->kv * A->m), w.rope = std::max(w.rope, A->rotary);
    }
    if (const MlpView* M = blocks[b].mlp) w.up = std::max(w.up, M->up.out), w.f = std::max(w.f, M->f);
    if (const MoeView* M = blocks[b].moe) {
      const MlpView* S = M->shared;
      w.up = std::max(w.up, M->k * M->experts.up.out + (S != nullptr ? S->up.out : 0));
      w.f = std::max(w.f, M->k * M->experts.f + (S != nullptr ? S->f : 0));
      w.experts = std::max(w.experts, M->router.out), w.k = std::max(w.k, M->k);
      products += 2 + M->k + (S != nullptr);  // router, ups, the downs' sum, the shared expert's up
    }
    products += 2 * (blocks[b].mamba != nullptr) + 4 * (blocks[b].attn != nullptr) + 2 * (blocks[b].mlp != nullptr);
  }
  std::vector<float> zxbcdt(w.mamba.widest), act(w.mamba.inner), y(w.mamba.inner), hidden(d), second(d), q(w.q),
      fresh(w.fresh), heads(w.q), up(w.up), mlp_act(w.f), logits(w.experts);
  std::vector<Span> spans(products * threads);
#pragma omp parallel num_threads(threads)
  {
    Team team(spans.data(), spans.data() + spans.size(), omp_get_thread_num(), omp_get_num_threads());
    std::vector<float> residual(x0, x0 + d), normed(d), gated(w.mamba.inner), bc(w.mamba.bc), spare(w.mamba.window),
        scores(w.scores), rope(w.rope);
    MoeScratch own(w.experts, w.k);
    for (int64_t b = 0; b < count; ++b) {
      const BlockView& B = blocks[b];
      norm_rows(residual.data(), d, nullptr, 0, B.norm, normed.data(), d, d, eps, 0, 1);
      if (B.mamba != nullptr) {
        mamba_share(*B.mamba, normed.data(), zxbcdt.data(), act.data(), y.data(), gated.data(), bc.data(),
                    spare.data(), hidden.data(), mamba_eps, lo, hi, g, p, team);
      }
      if (B.attn != nullptr) {
        attention_share(*B.attn, normed.data(), q.data(), fresh.data(), heads.data(), scores.data(), rope.data(),
                        B.mamba != nullptr ? second.data() : hidden.data(), team);
      }
      if (B.mlp != nullptr) mlp_share(*B.mlp, normed.data(), up.data(), mlp_act.data(), hidden.data(), team);
      if (B.moe != nullptr) {
        moe_share(*B.moe, normed.data(), logits.data(), up.data(), mlp_act.data(), hidden.data(), own, team);
      }
#pragma omp barrier
      const float m = B.multiplier;
      if (B.mamba != nullptr && B.attn != nullptr) {
        for (int64_t c = 0; c < d; ++c) residual[c] += (hidden[c] + second[c]) * m;
      } else {
        for (int64_t c = 0; c < d; ++c) residual[c] += hidden[c] * m;
      }
    }
    norm_rows(residual.data(), d, nullptr, 0, final_norm, normed.data(), d, d, eps, 0, 1);
    team.products(lm_head, normed.data(), out);
  }
}

}  // namespace
