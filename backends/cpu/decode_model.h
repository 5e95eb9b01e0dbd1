// The whole-model batch-1 decode step in plain pointers, written once for both backends: torch's
// decode_model op (torch_ops.cpp) checks its tensors and calls decode_model_run, NumPy's library
// (numpy_kernels.cpp) exports it as portable_ssm_decode_model, its arrays checked in
// backends/numpy/decode.py. Also the per-row pieces of torch's decode_step (conv_step, head_step),
// and decode_rows_run: that step for many rows of a market stream at once, each weight read once
// per call (NumPy's portable_ssm_decode_rows, backends/numpy/rows.py).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <numeric>
#include <utility>
#include <vector>

#include "shared.h"

namespace {

// A weight's storage as the row kernel reads it. A market plan's (shared.h's tiles after the rows;
// only whole weights, which rows_of does not split): kWeightI8Sym, int8 known to hold no -128 (the
// caller checked), which int8_products may take through VNNI; kWeightF32Tiles, float32,
// kWeightBF16Tiles, bfloat16 bits, and kWeightI8Tiles, int8 (a CPU without VNNI, or a -128), all
// three widened from their tiles.
enum WeightKind : int64_t {
  kWeightF32 = 0, kWeightI8 = 1, kWeightBF16 = 2, kWeightI8Sym = 3, kWeightF32Tiles = 4, kWeightBF16Tiles = 5,
  kWeightI8Tiles = 6
};

// A weight [out, in] as the row kernel reads it: float32, int8 (times a float32 scale per row, or
// none) or bfloat16 bits, contiguous.
struct RowWeight {
  const void* data;
  int64_t kind;  // a WeightKind
  const float* scale;
  int64_t out, in;
};

// y[r] = (w[r] · x)·scale[r] for the rows r in [begin, end) of w; digits: x's (ByteRow), made once
// per product by a caller that takes kWeightI8Sym rows through VNNI (null: row_products). Only a
// market stream's step does (tiled_products) and only its plan has tiles: its weights are read from
// the caches, where the row kernel's sums across lanes and the widening are the cost; a language
// model's decode streams its weights from memory, where the row kernel keeps up with the read (the
// digits' products measured 6% slower there).
inline void row_share(const RowWeight& w, const float* x, float* y, int64_t begin, int64_t end,
                      const ByteRow* digits = nullptr) {
  switch (w.kind) {
    case kWeightF32: row_products(static_cast<const float*>(w.data), x, w.scale, y, w.in, begin, end); break;
    case kWeightF32Tiles:
      widened_tile_products(static_cast<const float*>(w.data) + tiles_at(w.out, w.in, 4) / 4, x, w.scale, y, w.out,
                            w.in, begin, end);
      break;
    case kWeightBF16Tiles:
      widened_tile_products(static_cast<const uint16_t*>(w.data) + tiles_at(w.out, w.in, 2) / 2, x, w.scale, y,
                            w.out, w.in, begin, end);
      break;
    case kWeightI8Tiles:
      widened_tile_products(static_cast<const int8_t*>(w.data) + tiles_at(w.out, w.in, 1), x, w.scale, y, w.out,
                            w.in, begin, end);
      break;
    case kWeightI8Sym:
      if (digits != nullptr) {
        int8_products(static_cast<const int8_t*>(w.data), x, *digits, w.scale, y, w.out, w.in, begin, end);
        break;
      }
      [[fallthrough]];
    case kWeightI8: row_products(static_cast<const int8_t*>(w.data), x, w.scale, y, w.in, begin, end); break;
    default: row_products(static_cast<const uint16_t*>(w.data), x, w.scale, y, w.in, begin, end); break;
  }
}

// Rows [first, first + count) of w as a weight (of a stack [E·out, in] of experts' weights: expert
// e's at first = e·out).
inline RowWeight rows_of(const RowWeight& w, int64_t first, int64_t count) {
  const int64_t bytes = w.kind == kWeightF32 ? 4 : w.kind == kWeightBF16 ? 2 : 1;  // per element
  return {static_cast<const char*>(w.data) + first * w.in * bytes, w.kind,
          w.scale == nullptr ? nullptr : w.scale + first, count, w.in};
}

// v[i] = silu(v[i]), in place.
inline void silu_pass(float* v, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(v + i, silu8(_mm256_loadu_ps(v + i)));
  for (; i < count; ++i) v[i] = silu1(v[i]);
}
// v[i] = (v[i] + d[i]·x[i])·silu(gate[i]), in place; d == nullptr: one d_all for every i; gate ==
// nullptr: no gate (mamba_ssm's norm_before_gate, whose gate follows the norm: gate_pass).
inline void skip_and_gate(float* v, const float* x, const float* d, float d_all, const float* gate, int64_t count) {
  if (gate == nullptr) {
    for (int64_t i = 0; i < count; ++i) v[i] += (d == nullptr ? d_all : d[i]) * x[i];
    return;
  }
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    const __m256 dv = d == nullptr ? _mm256_set1_ps(d_all) : _mm256_loadu_ps(d + i);
    const __m256 y = _mm256_fmadd_ps(dv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(v + i));
    _mm256_storeu_ps(v + i, _mm256_mul_ps(y, silu8(_mm256_loadu_ps(gate + i))));
  }
  for (; i < count; ++i) v[i] = (v[i] + (d == nullptr ? d_all : d[i]) * x[i]) * silu1(gate[i]);
}

// v[i] = v[i]·silu(gate[i]), in place.
inline void gate_pass(float* v, const float* gate, int64_t count) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) {
    _mm256_storeu_ps(v + i, _mm256_mul_ps(_mm256_loadu_ps(v + i), silu8(_mm256_loadu_ps(gate + i))));
  }
  for (; i < count; ++i) v[i] *= silu1(gate[i]);
}

// One row's conv step for `count` channels from cs [count, k] (the window), xin [count] (the new
// inputs), taps w [count, k] and bias [count] (or null): the window shifted by the input into
// ncs [count, k], act [count] = silu(taps · window + bias).
inline void conv_step(const float* cs, const float* xin, const float* w, const float* bias, float* ncs, float* act,
                      int64_t k, int64_t count) {
  int64_t c = 0;
  if (k == 4) {  // d_conv 4 (every model's): two channels' windows a vector, eight channels a pass
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (; c + 8 <= count; c += 8) {
      __m256 taps[4];
      for (int q = 0; q < 4; ++q) {
        const int64_t at = (c + 2 * q) * 4;
        const __m256 window = _mm256_blend_ps(  // [s1 s2 s3 x | t1 t2 t3 x'] of [s0 s1 s2 s3 | t0 t1 t2 t3]
            _mm256_permute_ps(_mm256_loadu_ps(cs + at), _MM_SHUFFLE(0, 3, 2, 1)),
            _mm256_set_m128(_mm_set1_ps(xin[c + 2 * q + 1]), _mm_set1_ps(xin[c + 2 * q])), 0x88);
        _mm256_storeu_ps(ncs + at, window);
        taps[q] = _mm256_mul_ps(window, _mm256_loadu_ps(w + at));
      }
      // [c, c+2, c+4, c+6 | c+1, c+3, c+5, c+7]: each (w0·s1 + w1·s2) + (w2·s3 + w3·x), then in order
      const __m256 sums = _mm256_hadd_ps(_mm256_hadd_ps(taps[0], taps[1]), _mm256_hadd_ps(taps[2], taps[3]));
      __m256 out = _mm256_permutevar8x32_ps(sums, order);
      if (bias != nullptr) out = _mm256_add_ps(out, _mm256_loadu_ps(bias + c));
      _mm256_storeu_ps(act + c, out);
    }
  }
  for (; c < count; ++c) {
    const float* s = cs + c * k;
    float* o = ncs + c * k;
    for (int64_t j = 0; j + 1 < k; ++j) o[j] = s[j + 1];
    o[k - 1] = xin[c];
    float acc = 0.f;
    if (k == 4) {
      acc = (o[0] * w[c * k] + o[1] * w[c * k + 1]) + (o[2] * w[c * k + 2] + o[3] * w[c * k + 3]);  // as above
    } else {
      for (int64_t j = 0; j < k; ++j) acc += o[j] * w[c * k + j];
    }
    act[c] = bias == nullptr ? acc : acc + bias[c];
  }
  silu_pass(act, count);
}

// One channel's state row: H'[:m] = decay·H[:m] + feed·B into nrow (streamed where `stream`), m = n
// rounded down to 8; returns the eight-lane sums of H'[:m]·C.
inline __m256 channel_step(const float* hrow, float* nrow, __m256 vdecay, __m256 vfeed, const float* B, const float* C,
                           int64_t n, bool stream) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j + 8 <= n; j += 8) {
    if (j % 16 == 0) prefetch(hrow + j + kAheadBytes / sizeof(float));
    const __m256 v = _mm256_fmadd_ps(vfeed, _mm256_loadu_ps(B + j), _mm256_mul_ps(vdecay, _mm256_loadu_ps(hrow + j)));
    if (stream) {
      _mm256_stream_ps(nrow + j, v);
    } else {
      _mm256_storeu_ps(nrow + j, v);
    }
    acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(C + j), acc);
  }
  return acc;
}

// One head of one row after the conv: Δ = clamp(softplus(dt + dt_bias), lo, hi), H' = exp(Δ·A)·H +
// Δ·outer(x, B) into Hn [p, n] (streamed past the caches where `stream`), out [p] = (H' @ C + D·x)·silu(gate)
// with D per channel (d [p]) or one d_all (d null).
inline void head_step(float dt, float dt_bias, float A, float lo, float hi, const float* x, const float* B,
                      const float* C, const float* H, float* Hn, bool stream, const float* d, float d_all,
                      const float* gate, float* out, int64_t p, int64_t n) {
  const float step = std::min(std::max(softplus1(dt + dt_bias), lo), hi);  // Δ
  const float decay = std::exp(step * A);  // exp(Δ·A)
  const __m256 vdecay = _mm256_set1_ps(decay);
  int64_t i = 0;
  if (n % 8 == 0) {  // eight channels at a time, their eight-lane sums reduced together
    for (; i + 8 <= p; i += 8) {
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) {
        acc[c] = channel_step(H + (i + c) * n, Hn + (i + c) * n, vdecay, _mm256_set1_ps(step * x[i + c]), B, C, n,
                              stream);
      }
      const __m256 low = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
      const __m256 high = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
      _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20),
                                              _mm256_permute2f128_ps(low, high, 0x31)));
    }
  }
  for (; i < p; ++i) {  // H'[i, :] = decay·H[i, :] + Δ·x[i]·B, and H'[i, :] @ C
    const float* hrow = H + i * n;
    float* nrow = Hn + i * n;
    const float feed = step * x[i];
    float dot = horizontal_sum(channel_step(hrow, nrow, vdecay, _mm256_set1_ps(feed), B, C, n, stream));
    for (int64_t j = n / 8 * 8; j < n; ++j) {
      nrow[j] = decay * hrow[j] + feed * B[j];
      dot += nrow[j] * C[j];
    }
    out[i] = dot;
  }
  skip_and_gate(out, x, d, d_all, gate, p);
}

// Whether new states may be streamed past the caches (non-temporal stores): rows of n floats from
// a 32-byte aligned buffer. They are read again only by the next token, after every weight has
// passed through the caches, and ordinary stores would first read each line of the fresh buffer.
inline bool streams(const float* Hn, int64_t n) { return reinterpret_cast<uintptr_t>(Hn) % 32 == 0 && n % 8 == 0; }

// Layer i of decode_model in raw pointers: its tensors, new states and sizes, checked at the entry.
struct LayerView {
  const float *norm, *conv_state, *conv_w, *conv_b, *dt_bias, *A_log, *D, *gate_norm, *H;
  float *new_conv, *Hn;
  RowWeight in, out;
  int64_t h, conv_dim, k, n;
  bool d_per_channel, stream, norm_before_gate;
};

// Thread t's share [begin, end) of `count` items among `threads`, the bounds inside multiples of `align`.
inline std::pair<int64_t, int64_t> share(int64_t count, int64_t t, int64_t threads, int64_t align) {
  auto bound = [&](int64_t i) { return i == threads ? count : count * i / threads / align * align; };
  return {bound(t), bound(t + 1)};
}

// The rows of a product a thread takes at a time from a shared product (a multiple of 8, so every
// row goes through the same kernel, dot_rows<8> or the tail's, as under a static split).
constexpr int64_t kChunkRows = 16;

// One thread's share of one product's chunks not yet taken: [front, back) packed in one word with
// kMade set by the thread that first touches it (0: not made yet), alone in its cache line.
struct alignas(64) Span {
  std::atomic<uint64_t> word{0};
};
constexpr uint64_t kMade = uint64_t{1} << 63;
constexpr uint64_t kChunkMask = (uint64_t{1} << 31) - 1;

// Thread t of a team of `size`, inside its parallel region, taking its part of the products every
// thread of the team asks for in the same order (spans up to end: `size` per product; a product past
// them runs as the static split, each thread its own share, so a short count costs balance, never
// memory past the array). Each thread starts on
// its static share of a product's rows, one stream through the weight from its front; a thread
// whose share is done takes chunks from the backs of the others' shares, so where one thread falls
// behind (a slower stream, its core taken away for a while) the others finish its rows instead of
// waiting for it at the next barrier.
class Team {
 public:
  Team(Span* spans, const Span* end, int64_t t, int64_t size) : t(t), size(size), next_(spans), end_(end) {}

  // y[r] = (w[r]·x)·scale[r] + bias[r] (bias null: none) for the rows of w this thread takes;
  // every row is written after the team's next barrier.
  void products(const RowWeight& w, const float* x, float* y, const float* bias = nullptr) {
    rows(w.out, [&](int64_t r0, int64_t r1) {
      row_share(w, x, y, r0, r1);
      if (bias != nullptr) {
        for (int64_t r = r0; r < r1; ++r) y[r] += bias[r];
      }
    });
  }

  // y[r] = Σ_i c[i]·(w[i][r]·x[i]) (each product times its row scales), summed in the order of i,
  // for `count` weights of one height (w[i].out) and their inputs x[i] [w[i].in], as one product:
  // the rows this thread takes, every row written after the team's next barrier.
  void weighted_sum(const RowWeight* w, const float* const* x, const float* c, int64_t count, float* y) {
    rows(w[0].out, [&](int64_t r0, int64_t r1) {
      float part[kChunkRows];
      for (int64_t i = 0; i < count; ++i) {
        row_share(rows_of(w[i], r0, r1 - r0), x[i], part, 0, r1 - r0);
        for (int64_t r = r0; r < r1; ++r) y[r] = i == 0 ? c[i] * part[r - r0] : y[r] + c[i] * part[r - r0];
      }
    });
  }

  const int64_t t, size;

 private:
  // The next chunk of owner's share of `chunks`, from its front or back; -1 when none is left.
  int64_t take(Span& span, int64_t chunks, int64_t owner, bool front) const {
    uint64_t word = span.word.load();
    if (word == 0) {
      const auto [f, b] = share(chunks, owner, size, 1);
      const uint64_t made = kMade | static_cast<uint64_t>(f) | static_cast<uint64_t>(b) << 32;
      if (span.word.compare_exchange_strong(word, made)) word = made;
    }
    while (true) {
      const int64_t f = static_cast<int64_t>(word & kChunkMask), b = static_cast<int64_t>(word >> 32 & kChunkMask);
      if (f >= b) return -1;
      const uint64_t taken = front ? word + 1 : word - (uint64_t{1} << 32);
      if (span.word.compare_exchange_weak(word, taken)) return front ? f : b - 1;
    }
  }

  // run(r0, r1) for the chunks of a product of `height` rows this thread takes (its spans the next
  // `size`): its own share's from the front, then the others' from their backs.
  template <typename Run>
  void rows(int64_t height, const Run& run) {
    const int64_t chunks = (height + kChunkRows - 1) / kChunkRows;
    const auto chunk = [&](int64_t c) { run(c * kChunkRows, std::min(height, (c + 1) * kChunkRows)); };
    if (end_ - next_ < size) {  // no spans left: every thread its static share
      const auto [f, b] = share(chunks, t, size, 1);
      for (int64_t c = f; c < b; ++c) chunk(c);
      return;
    }
    Span* spans = next_;
    next_ += size;
    for (int64_t c; (c = take(spans[t], chunks, t, true)) >= 0;) chunk(c);
    for (int64_t i = 1; i < size; ++i) {
      const int64_t other = (t + i) % size;
      for (int64_t c; (c = take(spans[other], chunks, other, false)) >= 0;) chunk(c);
    }
  }

  Span* next_;  // the spans of this thread's next product
  const Span* end_;  // one past the last
};

// One Mamba-2 mixer of a batch-1 step on thread t of a team of `team`, inside its parallel region:
// normed [d] (the block's input, every thread the same floats) -> out [d] (out_proj's output, each
// thread writing its share of the rows; complete after the caller's next barrier). Shared scratch:
// zxbcdt [in_proj's rows], act and y [d_inner]; the thread's own: gated [d_inner], bc [2·g·n] and
// spare [2·g·n·k]. The thread takes a share of in_proj's rows and of the heads, and computes the conv
// of the groups' B and C channels itself (thread 0 writes their new window once every thread has
// read the old one). Each state entry is read before it is written, by the thread that writes it,
// or before a barrier that precedes the write: the new states may be the old ones (new_conv ==
// conv_state and Hn == H: updated in place). L.gate_norm null: no norm, y·silu(z) straight into
// out_proj (mamba_ssm's rmsnorm=False); L.norm_before_gate: rmsnorm(y)·silu(z).
inline void mamba_share(const LayerView& L, const float* normed, float* zxbcdt, float* act, float* y, float* gated,
                        float* bc, float* spare, float* out, double eps, float lo, float hi, int64_t g, int64_t p,
                        Team& team) {
  const int64_t d_inner = L.h * p, k = L.k, n = L.n, t = team.t;
  team.products(L.in, normed, zxbcdt);
#pragma omp barrier
  const float* xBC = zxbcdt + d_inner;  // [x (d_inner), B (g·n), C (g·n)]
  conv_step(L.conv_state + d_inner * k, xBC + d_inner, L.conv_w + d_inner * k,
            L.conv_b == nullptr ? nullptr : L.conv_b + d_inner, spare, bc, k, 2 * g * n);
  const auto [h0, h1] = share(L.h, t, team.size, 1);
  conv_step(L.conv_state + h0 * p * k, xBC + h0 * p, L.conv_w + h0 * p * k,
            L.conv_b == nullptr ? nullptr : L.conv_b + h0 * p, L.new_conv + h0 * p * k, act + h0 * p, k,
            (h1 - h0) * p);
  for (int64_t hd = h0; hd < h1; ++hd) {
    const int64_t group = hd / (L.h / g);
    head_step(zxbcdt[d_inner + L.conv_dim + hd], L.dt_bias[hd], -std::exp(L.A_log[hd]), lo, hi, act + hd * p,
              bc + group * n, bc + (g + group) * n, L.H + hd * p * n, L.Hn + hd * p * n, L.stream,
              L.d_per_channel ? L.D + hd * p : nullptr, L.D[hd], L.norm_before_gate ? nullptr : zxbcdt + hd * p,
              y + hd * p, p, n);
  }
  _mm_sfence();  // the streamed rows are visible before the step returns
#pragma omp barrier
  if (t == 0) std::copy(spare, spare + 2 * g * n * k, L.new_conv + d_inner * k);  // read by none now
  if (L.gate_norm != nullptr) norm_rows(y, d_inner, nullptr, 0, L.gate_norm, gated, d_inner, d_inner / g, eps, 0, 1);
  if (L.norm_before_gate) gate_pass(gated, zxbcdt, d_inner);
  team.products(L.out, L.gate_norm != nullptr ? gated : y, out);
}

// The largest in_proj output (at least min_width), d_inner, B and C, and conv window of `views`.
struct MambaWidths {
  int64_t widest, inner, bc, window;
};
inline MambaWidths mamba_widths(const LayerView* views, int64_t layers, int64_t min_width, int64_t g, int64_t p) {
  MambaWidths w{min_width, 0, 0, 0};
  for (int64_t i = 0; i < layers; ++i) {
    const LayerView& v = views[i];
    w.widest = std::max(w.widest, v.in.out), w.inner = std::max(w.inner, v.h * p);
    w.bc = std::max(w.bc, 2 * g * v.n), w.window = std::max(w.window, 2 * g * v.n * v.k);
  }
  return w;
}

// One token through the whole language model at batch 1 (portable_ssm.lm.decode: the residual
// blocks with their mixers' steps, norm_f and the head), from the embedded token x0 [d]: layers
// views (checked by the caller), the final norm [d] and the head into out [head.out]; threads: the
// team's size (1 inside another parallel region).
//
// One parallel region runs the whole token, its threads meeting at three barriers a layer
// (mamba_share's two, and out_proj's output complete) where a call per kernel forked and joined the
// threads four times, with dispatch and allocations, between them. Each thread keeps its own copy
// of the residual and of the normed rows (the same arithmetic on the same values: the same floats).
inline void decode_model_run(const float* x0, int64_t d, const LayerView* views, int64_t layers,
                             const float* final_norm, const RowWeight& lm_head, float* out, double eps, float lo,
                             float hi, int64_t g, int64_t p, int threads) {
  const MambaWidths w = mamba_widths(views, layers, d, g, p);
  std::vector<float> zxbcdt(w.widest), act(w.inner), y(w.inner), hidden(d);
  std::vector<Span> spans((2 * layers + 1) * threads);
#pragma omp parallel num_threads(threads)
  {
    Team team(spans.data(), spans.data() + spans.size(), omp_get_thread_num(), omp_get_num_threads());
    std::vector<float> residual(x0, x0 + d), normed(d), gated(w.inner), bc(w.bc), spare(w.window);
    for (int64_t i = 0; i < layers; ++i) {
      if (i > 0) {
        for (int64_t c = 0; c < d; ++c) residual[c] += hidden[c];
      }
      norm_rows(residual.data(), d, nullptr, 0, views[i].norm, normed.data(), d, d, eps, 0, 1);
      mamba_share(views[i], normed.data(), zxbcdt.data(), act.data(), y.data(), gated.data(), bc.data(),
                  spare.data(), hidden.data(), eps, lo, hi, g, p, team);
#pragma omp barrier
    }
    if (layers > 0) {
      for (int64_t c = 0; c < d; ++c) residual[c] += hidden[c];
    }
    norm_rows(residual.data(), d, nullptr, 0, final_norm, normed.data(), d, d, eps, 0, 1);
    team.products(lm_head, normed.data(), out);
  }
}

}  // namespace

namespace {

// y [b, w.out] = x [b, w.in] · wᵀ (times w's row scales) through the row kernel: the weight read
// once per tile of x rows (the tile's rows stay in L2 while eight weight rows at a time pass
// them), each output the same floats as row_share's for that row alone (decode_model_run's).
// int8 rows with no -128 through VNNI: each x row's byte digits made once, not once per block of rows.
inline void tiled_products(const RowWeight& w, const float* x, int64_t b, float* y) {
  const int64_t tile = std::max<int64_t>(8, (int64_t{256} << 10) / (4 * w.in));  // x rows in 256 KiB
  const bool int8 = w.kind == kWeightI8Sym, tiles = w.kind >= kWeightI8Sym;  // kinds 3..6 are read by tiles
  thread_local std::vector<ByteRow> digits;  // kept by the thread between calls, as decode_rows_run's scratch
  if (int8 && static_cast<int64_t>(digits.size()) < b) digits.resize(static_cast<size_t>(b));
  for (int64_t j = 0; int8 && j < b; ++j) digits[j].make(x + j * w.in, w.in);
  const int64_t block = tiles ? 64 : 8;  // weight rows a pass: a tile, or 8 rows of the row kernel
  for (int64_t j0 = 0; j0 < b; j0 += tile) {
    const int64_t j1 = std::min(b, j0 + tile);
    for (int64_t r0 = 0; r0 < w.out; r0 += block) {
      const int64_t r1 = std::min(w.out, r0 + block);
      for (int64_t j = j0; j < j1; ++j) {
        row_share(w, x + j * w.in, y + j * w.out, r0, r1, int8 ? &digits[j] : nullptr);
      }
    }
  }
}

// One token for b rows of a market stream through the whole model on one thread, each row its own
// state updated in place (row j's layer i conv state at conv_rows[j·layers + i], ssm state at
// ssm_rows[j·layers + i]): decode_model_run's arithmetic row by row (views' state pointers unused)
// except the products, which product(weight, x [b, in], b, y [b, out]) computes for all rows at
// once (each weight read once per call, where b rows one at a time read it b times). With
// tiled_products every output is the same float as decode_model_run's for that row alone. stream:
// new states streamed past the caches (states far larger than the caches).
template <typename Product>
inline void decode_rows_run(const float* x0, int64_t b, int64_t d, const LayerView* views, int64_t layers,
                            float* const* conv_rows, float* const* ssm_rows, const float* final_norm,
                            const RowWeight& lm_head, float* out, double eps, float lo, float hi, int64_t g,
                            int64_t p, bool stream, const Product& product) {
  const MambaWidths w = mamba_widths(views, layers, d, g, p);
  // The step's arrays, carved from scratch kept by the thread between calls: a bar of one row
  // allocated and zeroed them in about a microsecond, a fiftieth of it.
  thread_local std::vector<float> scratch;
  const int64_t widths[] = {b * d, b * d, b * w.widest, b * w.inner, b * d, w.inner, w.inner, w.bc, w.window};
  float* part[9];
  scratch.resize(static_cast<size_t>(std::accumulate(std::begin(widths), std::end(widths), int64_t{0})));
  int64_t at = 0;
  for (int i = 0; i < 9; at += widths[i++]) part[i] = scratch.data() + at;
  float *residual = part[0], *normed = part[1], *zxbcdt = part[2], *gated = part[3], *hidden = part[4], *act = part[5],
        *y = part[6], *bc = part[7], *spare = part[8];
  std::copy(x0, x0 + b * d, residual);
  for (int64_t i = 0; i < layers; ++i) {
    const LayerView& L = views[i];
    const int64_t d_inner = L.h * p, k = L.k, n = L.n, width = L.in.out;
    if (i > 0) {
      for (int64_t c = 0; c < b * d; ++c) residual[c] += hidden[c];
    }
    norm_rows(residual, d, nullptr, 0, L.norm, normed, d, d, eps, 0, b);
    product(L.in, normed, b, zxbcdt);
    for (int64_t j = 0; j < b; ++j) {
      float* conv = conv_rows[j * layers + i];
      float* H = ssm_rows[j * layers + i];
      const float* row = zxbcdt + j * width;  // [z (d_inner), x, B, C, dt (h)]
      const float* xBC = row + d_inner;
      conv_step(conv + d_inner * k, xBC + d_inner, L.conv_w + d_inner * k,
                L.conv_b == nullptr ? nullptr : L.conv_b + d_inner, spare, bc, k, 2 * g * n);
      conv_step(conv, xBC, L.conv_w, L.conv_b, conv, act, k, d_inner);
      std::copy(spare, spare + 2 * g * n * k, conv + d_inner * k);
      const bool streamed = stream && streams(H, n);
      for (int64_t hd = 0; hd < L.h; ++hd) {
        const int64_t group = hd / (L.h / g);
        head_step(row[d_inner + L.conv_dim + hd], L.dt_bias[hd], -std::exp(L.A_log[hd]), lo, hi,
                  act + hd * p, bc + group * n, bc + (g + group) * n, H + hd * p * n,
                  H + hd * p * n, streamed, L.d_per_channel ? L.D + hd * p : nullptr, L.D[hd], row + hd * p,
                  y + hd * p, p, n);
      }
      norm_rows(y, d_inner, nullptr, 0, L.gate_norm, gated + j * d_inner, d_inner, d_inner / g, eps, 0,
                1);
    }
    product(L.out, gated, b, hidden);
  }
  if (layers > 0) {
    for (int64_t c = 0; c < b * d; ++c) residual[c] += hidden[c];
  }
  norm_rows(residual, d, nullptr, 0, final_norm, normed, d, d, eps, 0, b);
  product(lm_head, normed, b, out);
  _mm_sfence();  // the streamed rows are visible before the step returns
}

}  // namespace
