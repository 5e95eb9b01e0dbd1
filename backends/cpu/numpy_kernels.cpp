// NumPy's compiled kernels, a plain shared library called through ctypes: the conv with SiLU, the
// gated RMSNorm, a decode step's product with a quantized weight and the chunked scan (its products
// through the CBLAS sgemm of NumPy's BLAS). Built on first use by backends/numpy/kernels.py, which
// documents them.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "decode_hybrid.h"
#include "decode_model.h"
#include "shared.h"

namespace {

using Sgemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, float, const float*, int64_t, const float*, int64_t,
                         float, float*, int64_t);
using Sgemm32 = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int, float, float*, int);

// scan_forward_item's products through the CBLAS sgemm of NumPy's BLAS (row-major), one call per
// matrix; ilp64: its integers are 64-bit (NumPy's scipy-openblas64 wheels), else 32-bit.
struct BlasGemm {
  void* sgemm;
  bool ilp64;
  void operator()(int64_t count, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
                  int64_t sa, const float* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc,
                  int64_t sc) const {
    constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
    const int opa = ta ? kTrans : kNoTrans, opb = tb ? kTrans : kNoTrans;
    for (int64_t i = 0; i < count; ++i) {
      if (ilp64) {
        reinterpret_cast<Sgemm64>(sgemm)(kRowMajor, opa, opb, m, n, k, 1.f, A + i * sa, lda, B + i * sb, ldb, beta,
                                         C + i * sc, ldc);
      } else {
        reinterpret_cast<Sgemm32>(sgemm)(kRowMajor, opa, opb, static_cast<int>(m), static_cast<int>(n),
                                         static_cast<int>(k), 1.f, A + i * sa, static_cast<int>(lda), B + i * sb,
                                         static_cast<int>(ldb), beta, C + i * sc, static_cast<int>(ldc));
      }
    }
  }
};

// `layers` Mamba layers' views from their tables (portable_ssm_decode_model's, below): sizes from
// s (8 a layer), pointers from ptr (15 a layer); d the residual width, p the head size.
std::vector<LayerView> layer_views(const int64_t* sizes, void* const* pointers, int64_t layers, int64_t d, int64_t p) {
  const auto f = [pointers](int64_t i) { return static_cast<float*>(pointers[i]); };
  std::vector<LayerView> views(layers);
  for (int64_t i = 0; i < layers; ++i) {
    const int64_t* s = sizes + 8 * i;
    const int64_t at = 15 * i;
    LayerView& v = views[i];
    v.h = s[0], v.conv_dim = s[1], v.k = s[2], v.n = s[3], v.d_per_channel = s[6] != 0, v.norm_before_gate = s[7] != 0;
    v.norm = f(at), v.conv_state = f(at + 1), v.conv_w = f(at + 2), v.conv_b = f(at + 3), v.dt_bias = f(at + 4);
    v.A_log = f(at + 5), v.D = f(at + 6), v.gate_norm = f(at + 7), v.H = f(at + 8), v.new_conv = f(at + 9);
    v.Hn = f(at + 10), v.stream = streams(v.Hn, v.n);
    v.in = {pointers[at + 11], s[4], f(at + 12), v.h * p + v.conv_dim + v.h, d};
    v.out = {pointers[at + 13], s[5], f(at + 14), d, v.h * p};
  }
  return views;
}

// The whole-model step's layer views (portable_ssm_decode_model's tables).
std::vector<LayerView> model_views(const int64_t* sizes, void* const* pointers) {
  return layer_views(sizes + 6, pointers + 5, sizes[0], sizes[1], sizes[3]);
}

// portable_ssm_decode_rows with the inputs x [b, d] and logits [b, head_out] given apart from the tables.
void decode_rows_on(const int64_t* sizes, void* const* pointers, const float* x, float* logits,
                    float* const* conv_rows, float* const* ssm_rows, int64_t b, double eps, double low, double high,
                    const int64_t* options, void* sgemm) {
  const int64_t layers = sizes[0], d = sizes[1], g = sizes[2], p = sizes[3];
  const std::vector<LayerView> views = model_views(sizes, pointers);
  const RowWeight lm_head{pointers[2], sizes[5], static_cast<const float*>(pointers[3]), sizes[4], d};
  const bool gemm_here = sgemm != nullptr && options[1] > 0 && b >= options[1];
  const BlasGemm gemm{sgemm, options[2] != 0};
  const auto product = [&](const RowWeight& w, const float* in, int64_t rows, float* y) {
    if (gemm_here && (w.kind == kWeightF32 || w.kind == kWeightF32Tiles) && w.scale == nullptr) {  // their rows
      gemm(1, false, true, rows, w.out, w.in, in, w.in, 0, static_cast<const float*>(w.data), w.in, 0, 0.f, y, w.out,
           0);  // y [rows, out] = in [rows, w.in] · wᵀ
    } else {
      tiled_products(w, in, rows, y);
    }
  };
  decode_rows_run(x, b, d, views.data(), layers, conv_rows, ssm_rows, static_cast<const float*>(pointers[1]),
                  lm_head, logits, eps, static_cast<float>(low), static_cast<float>(high), g, p, options[0] != 0,
                  product);
}

// The five features of market/features.py's feature_rows for one bar (open o, high h, low lo, close
// c, volume v) after a bar of log close `close_before` and log1p volume `volume_before` (NaN: none):
// {log return, log range, log body, log1p volume, volume change}, NaN throughout for a missing bar
// (a price not finite and positive, a volume not finite and non-negative); carried: the bar's own
// log close and log1p volume.
void bar_features(double o, double h, double lo, double c, double v, double close_before, double volume_before,
                  double* features, double* carried) {
  const auto price = [](double x) { return std::isfinite(x) && x > 0; };
  const bool present = price(o) && price(h) && price(lo) && price(c) && std::isfinite(v) && v >= 0;
  const double nan = std::nan("");
  const double log_close = present ? std::log(c) : nan, log_volume = present ? std::log1p(v) : nan;
  features[0] = log_close - close_before;
  features[1] = present ? std::log(h / lo) : nan;
  features[2] = present ? log_close - std::log(o) : nan;
  features[3] = log_volume;
  features[4] = log_volume - volume_before;
  carried[0] = log_close, carried[1] = log_volume;
}

// A DBN record's field at byte `at` (records are packed: read by memcpy).
template <typename T>
inline T dbn_field(const uint8_t* r, int at) {
  T v;
  std::memcpy(&v, r + at, sizeof v);
  return v;
}
constexpr int64_t kUndefPrice = INT64_MAX;  // DBN's UNDEF_PRICE
// A fixed-point price (1e-9 units) as market/bars.py's fixed_to_float gives it: NaN where undefined,
// else the int64 exactly as a double (|p| <= 2^53) divided by 1e9, one rounding.
inline double dbn_price(int64_t p) { return p == kUndefPrice ? NAN : static_cast<double>(p) / 1e9; }
// A defined price beyond 2^53 units, which fixed_to_float refuses.
inline bool dbn_beyond(int64_t p) {
  return p != kUndefPrice && (p > (int64_t{1} << 53) || p < -(int64_t{1} << 53));
}

// The records of one instrument as market/dbn.py and bars.py select them (check_records, then
// _Selection): each record's length and rtype, a defined ts_event; the instrument `chosen` (-1:
// the file's only one, `only` once seen); ts_event never decreasing (`last`, at record
// `last_index`). take: 1 the record is selected, 0 it is another instrument's, -1 the NumPy path
// would report it (a bad record, a second instrument where none was chosen, time order). store
// writes the carried state back for the next chunk: {only, last, last_index}.
struct DbnSelection {
  int64_t size, rtype, chosen, only, last, last_index;

  int take(const uint8_t* r, int64_t index) {
    const int64_t ts = dbn_field<int64_t>(r, 8);  // < 0: an undefined ts_event (a u64 beyond 2^63 - 1)
    if (r[0] * 4 != size || r[1] != rtype || ts < 0) return -1;
    const int64_t instrument = dbn_field<uint32_t>(r, 4);
    if (chosen >= 0 && instrument != chosen) return 0;
    if (chosen < 0 && only < 0) only = instrument;
    if ((chosen < 0 && instrument != only) || ts < last) return -1;
    last = ts, last_index = index;
    return 1;
  }
  void store(int64_t* state) const { state[0] = only, state[1] = last, state[2] = last_index; }
};

}  // namespace

extern "C" {

// Positions [begin, end) of the b·l steps of y [b, l, d] = silu(causal depthwise conv of x): x's
// channels contiguous, its steps xs floats apart and its rows xb; history [b, k-1, d], taps [k, d]
// and bias [d] (or null) contiguous.
void portable_ssm_conv_silu(const float* x, int64_t xb, int64_t xs, const float* history, const float* taps,
                            const float* bias, float* y, int64_t l, int64_t d, int64_t k, int64_t begin,
                            int64_t end) {
  for (int64_t row = begin / l; row * l < end; ++row) {
    const ConvRow r{x + row * xb, history + row * (k - 1) * d, taps, bias, l, d, k, xs};
    conv_silu_steps(r, y + row * l * d, std::max(begin - row * l, int64_t{0}), std::min(end - row * l, l));
  }
}

// Rows [begin, end) of out [rows, d] = rmsnorm(y·silu(z)) ⊙ w over groups of m channels: y's rows
// ys floats apart, z's zs (z null: no gate), channels contiguous.
void portable_ssm_gated_rms_norm(const float* y, int64_t ys, const float* z, int64_t zs, const float* w, float* out,
                                 int64_t d, int64_t m, double eps, int64_t begin, int64_t end) {
  norm_rows(y, ys, z, zs, w, out, d, m, eps, begin, end);
}

// Rows [begin, end) of out [rows, f] = y·silu(z) (a gated MLP's hidden units: y its up, z its
// gate), y's rows ys floats apart and z's zs, channels contiguous.
void portable_ssm_silu_gate(const float* y, int64_t ys, const float* z, int64_t zs, float* out, int64_t f,
                            int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) gate_row(y + row * ys, z + row * zs, out + row * f, nullptr, f);
}

// Each row r of s [rows, cols] (contiguous) of attention scores becomes its unnormalized softmax:
// exp(scale·s - top) in the columns the row sees and exactly 0 in the others, top the row's largest
// scale·s among those it sees; inv[r] = 1 / the row's sum. Every row sees the columns below `first`;
// column c >= first is seen by row r where visible[(r % period)·ld + c - first] != 0 (bools).
void portable_ssm_masked_softmax(float* s, int64_t rows, int64_t cols, float scale, const uint8_t* visible,
                                 int64_t ld, int64_t period, int64_t first, float* inv) {
  const int64_t open = std::min(first, cols) / 8 * 8;  // [0, open): vectors every row sees
  const int64_t masked = std::min(cols, (first + 7) / 8 * 8);  // [open, masked): one at a time; then masked vectors
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * cols;
    const uint8_t* mask = visible + (r % period) * ld - first;  // mask[c] for columns c >= first
    const auto sees = [&](int64_t c) { return c < first || mask[c] != 0; };
    const auto lanes = [&](int64_t c) {  // the eight columns from c >= first that the row sees, as lanes
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mask + c)));
      return _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
    };
    __m256 top8 = _mm256_set1_ps(-INFINITY);
    int64_t c = 0;
    for (; c < open; c += 8) top8 = _mm256_max_ps(top8, _mm256_mul_ps(_mm256_loadu_ps(row + c), vscale));
    for (c = masked; c + 8 <= cols; c += 8) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(row + c), vscale);
      top8 = _mm256_max_ps(top8, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), v, lanes(c)));
    }
    float top = horizontal_max(top8);
    for (int64_t j = open; j < masked; ++j) top = sees(j) ? std::max(top, row[j] * scale) : top;
    for (int64_t j = c; j < cols; ++j) top = sees(j) ? std::max(top, row[j] * scale) : top;
    const __m256 vtop = _mm256_set1_ps(top);  // a NaN score drops out of top but not out of its exp
    __m256 acc = _mm256_setzero_ps();
    for (c = 0; c < open; c += 8) {
      const __m256 e = exp8_nan(_mm256_fmsub_ps(_mm256_loadu_ps(row + c), vscale, vtop));
      _mm256_storeu_ps(row + c, e);
      acc = _mm256_add_ps(acc, e);
    }
    for (c = masked; c + 8 <= cols; c += 8) {
      const __m256 e = _mm256_and_ps(exp8_nan(_mm256_fmsub_ps(_mm256_loadu_ps(row + c), vscale, vtop)), lanes(c));
      _mm256_storeu_ps(row + c, e);
      acc = _mm256_add_ps(acc, e);
    }
    float total = horizontal_sum(acc);
    const auto one = [&](int64_t j) {
      row[j] = sees(j) ? std::exp(row[j] * scale - top) : 0.f;
      total += row[j];
    };
    for (int64_t j = open; j < masked; ++j) one(j);
    for (int64_t j = c; j < cols; ++j) one(j);
    inv[r] = 1.f / total;
  }
}

// Rows [begin, end) of y [rows] = (w [rows, n] @ x [n]) · scale [rows] (scale null: none) by the
// step's row kernel (row_share), w's kind a WeightKind: 0 float32, 1 int8, 2 bfloat16 bits
// (uint16), 3 int8 with no -128 (through VNNI where usable), 4 float32, 5 bfloat16 bits and 6
// int8, each of the last four its rows then its tiles (a market plan's); all contiguous.
void portable_ssm_row_product(const void* w, int64_t kind, const float* x, const float* scale, float* y, int64_t rows,
                              int64_t n, int64_t begin, int64_t end) {
  ByteRow digits;
  if (kind == kWeightI8Sym) digits.make(x, n);
  row_share({w, kind, scale, rows, n}, x, y, begin, end, kind == kWeightI8Sym ? &digits : nullptr);
}

// 1 where this build's int8 products with no -128 go through AVX-512 VNNI (compiled in and the CPU
// has it), else 0.
int64_t portable_ssm_vnni_usable() { return vnni_usable() ? 1 : 0; }

// Work items [begin, end) of the chunked scan's forward (scan_forward_item; items = b·g·blocks):
// sizes = {b, l, h, p, g, n, xr, xl, br, bl, cr, cl, Q, block, d_per_channel, safe, ilp64} and
// pointers = {x, dt, A, B, C, D, initial, y, final, sgemm} (D and initial may be null). Returns the
// sum of the items' outputs and final entries in float64.
double portable_ssm_scan_forward(const int64_t* sizes, void* const* pointers, double lowest, int64_t begin,
                                 int64_t end) {
  const int64_t* s = sizes;
  const int64_t r = s[2] / s[4];
  const auto in = [pointers](int i) { return static_cast<const float*>(pointers[i]); };
  const ScanView view{s[0], s[1], s[2], s[3], s[4], s[5], r, in(0), in(1), in(2), in(3), in(4), in(5), in(6),
                      s[14] != 0, s[6], s[7], s[8], s[9], s[10], s[11], static_cast<float*>(pointers[7]),
                      static_cast<float*>(pointers[8]), s[12], s[13], (r + s[13] - 1) / s[13],
                      static_cast<float>(lowest), s[15] != 0};
  const BlasGemm gemm{pointers[9], s[16] != 0};
  double total = 0.0;
  for (int64_t item = begin; item < end; ++item) total += scan_forward_item(view, item, gemm);
  return total;
}

// The whole-model batch-1 decode step (decode_model_run), its arrays checked by the caller
// (backends/numpy/decode.py): sizes = {layers, d, g, p, head_out, head_kind} then per layer
// {h, conv_dim, k, n, in_kind, out_kind, d_per_channel, norm_before_gate}; pointers = {x [d], norm_f [d], head,
// head_scale, logits [head_out]} then per layer {norm, conv_state, conv_w, conv_b, dt_bias, A_log, D,
// gate_norm, ssm_state, new_conv, new_ssm, in_w, in_scale, out_w, out_scale} (the scales and conv_b
// may be null); weights' kinds 0: float32, 1: int8, 2: bfloat16 bits. threads: the team's size.
void portable_ssm_decode_model(const int64_t* sizes, void* const* pointers, double eps, double low, double high,
                               int64_t threads) {
  const int64_t layers = sizes[0], d = sizes[1], g = sizes[2], p = sizes[3];
  const std::vector<LayerView> views = model_views(sizes, pointers);
  const RowWeight lm_head{pointers[2], sizes[5], static_cast<const float*>(pointers[3]), sizes[4], d};
  decode_model_run(static_cast<const float*>(pointers[0]), d, views.data(), layers,
                   static_cast<const float*>(pointers[1]), lm_head, static_cast<float*>(pointers[4]), eps,
                   static_cast<float>(low), static_cast<float>(high), g, p, static_cast<int>(threads));
}

// decode_rows_run on the tables of portable_ssm_decode_model (x [b, d], logits [b, head_out]; its
// per-layer state slots unused) for b rows whose states are at conv_rows and ssm_rows [b, layers]:
// one thread, each row's state updated in place. options = {stream, gemm_rows, ilp64}: the float32
// products of calls with at least gemm_rows rows (0: none) go to the CBLAS sgemm (NumPy's
// OpenBLAS, held at one thread by the caller), the others to the row kernel (tiled_products).
void portable_ssm_decode_rows(const int64_t* sizes, void* const* pointers, float* const* conv_rows,
                              float* const* ssm_rows, int64_t b, double eps, double low, double high,
                              const int64_t* options, void* sgemm) {
  decode_rows_on(sizes, pointers, static_cast<const float*>(pointers[0]), static_cast<float*>(pointers[4]), conv_rows,
                 ssm_rows, b, eps, low, high, options, sgemm);
}

// One bar of a market stream (portable_ssm.market.MarketStream.update) in one call, for the k rows
// `rows` (distinct, in [0, n); null: rows 0..k-1) of n instruments. bar = {fields [5, k] float64
// (open, high, low, close, volume), carry [2, n] float64 (each row's last log close and log1p
// volume, updated), seen [n] bytes (whether the row has had a bar; set), mean [5], std [5] float64,
// inp_t [5, d] and inp_b [d] float32 (the head's input map), head_bias [1] float32, conv_table and
// ssm_table [n, layers] (each row's state addresses), x [k, d] and logits [k, head_out] float32
// scratch, then portable_ssm_decode_rows's sizes, pointers, options and sgemm, and reals {eps, low,
// high} float64}. Each row's features (bar_features) normalised as model_inputs does ((f - mean) /
// std, non-finite -> 0, then float32), mapped by the input map, and the rows that had a bar before
// stepped together by portable_ssm_decode_rows; out [k] float64 = their logit + head_bias, NaN for a
// row's first bar (its state untouched).
void portable_ssm_market_bar(void* const* bar, const int64_t* rows, int64_t k, int64_t n, double* out) {
  const int64_t* sizes = static_cast<const int64_t*>(bar[12]);
  const int64_t layers = sizes[0], d = sizes[1], head_out = sizes[4];
  const double* fields = static_cast<const double*>(bar[0]);
  double* carry = static_cast<double*>(bar[1]);
  uint8_t* seen = static_cast<uint8_t*>(bar[2]);
  const double *mean = static_cast<const double*>(bar[3]), *deviation = static_cast<const double*>(bar[4]);
  const float *inp_t = static_cast<const float*>(bar[5]), *inp_b = static_cast<const float*>(bar[6]);
  const float head_bias = *static_cast<const float*>(bar[7]);
  float* const* conv_table = static_cast<float* const*>(bar[8]);
  float* const* ssm_table = static_cast<float* const*>(bar[9]);
  float* x = static_cast<float*>(bar[10]);
  float* logits = static_cast<float*>(bar[11]);
  const double* reals = static_cast<const double*>(bar[16]);  // eps, low, high
  std::vector<float*> conv_rows, ssm_rows;
  std::vector<int64_t> stepped;  // the positions j in [0, k) of the rows that step, in order
  for (int64_t j = 0; j < k; ++j) {
    const int64_t r = rows == nullptr ? j : rows[j];
    double features[5], carried[2];
    bar_features(fields[j], fields[k + j], fields[2 * k + j], fields[3 * k + j], fields[4 * k + j], carry[r],
                 carry[n + r], features, carried);
    carry[r] = carried[0], carry[n + r] = carried[1];
    out[j] = std::nan("");
    if (!seen[r]) {
      seen[r] = 1;
      continue;
    }
    float* u = x + static_cast<int64_t>(stepped.size()) * d;  // the stepping rows' inputs, packed
    for (int64_t c = 0; c < d; ++c) u[c] = 0.f;
    for (int64_t i = 0; i < 5; ++i) {
      const double normal = (features[i] - mean[i]) / deviation[i];
      const float xi = std::isfinite(normal) ? static_cast<float>(normal) : 0.f;
      for (int64_t c = 0; c < d; ++c) u[c] += xi * inp_t[i * d + c];
    }
    for (int64_t c = 0; c < d; ++c) u[c] += inp_b[c];
    stepped.push_back(j);
    conv_rows.insert(conv_rows.end(), conv_table + r * layers, conv_table + (r + 1) * layers);
    ssm_rows.insert(ssm_rows.end(), ssm_table + r * layers, ssm_table + (r + 1) * layers);
  }
  const int64_t b = static_cast<int64_t>(stepped.size());
  if (b == 0) return;
  decode_rows_on(sizes, static_cast<void* const*>(bar[13]), x, logits, conv_rows.data(), ssm_rows.data(), b, reals[0],
                 reals[1], reals[2], static_cast<const int64_t*>(bar[14]), bar[15]);
  for (int64_t t = 0; t < b; ++t) out[stepped[t]] = static_cast<double>(logits[t * head_out] + head_bias);
}

// The hybrid stack's batch-1 decode step (decode_hybrid_run), its arrays checked by the caller
// (backends/numpy/hybrid.py). sizes = {blocks, n_mamba, n_attn, n_mlp, n_moe, d, g, p, head_out,
// head_kind}, then per Mamba layer portable_ssm_decode_model's 8, per attention layer {heads, kv, hd,
// m, slot, rotary, position, q_kind, k_kind, v_kind, o_kind}, per MLP {f, act, gated, up_kind,
// down_kind}, per MoE {experts, k, sigmoid, normalize, experts' MLP, shared expert's MLP (-1:
// none)}, per block {mamba, attention, mlp, moe} (indices, -1: none); pointers = {x [d], norm_f [d],
// head, head_scale, logits [head_out]}, then per Mamba layer portable_ssm_decode_model's 15, per
// attention layer {q, q_scale, q_bias, k, k_scale, k_bias, v, v_scale, v_bias, o, o_scale, o_bias,
// keys, values, valid (bytes)}, per MLP {up, up_scale, down, down_scale} (the experts' MLP: their
// stacks [E, 2f or f, d] and [E, d, f], the scales [E, rows]), per MoE {router [E, d] (float32),
// bias [E] (or null)}, per block {norm}; reals = {eps, mamba_eps, low, high}, then per attention
// layer {scale, theta}, per block {multiplier}, per MoE {scale}.
void portable_ssm_decode_hybrid(const int64_t* sizes, void* const* pointers, const double* reals, int64_t threads) {
  const int64_t count = sizes[0], n_mamba = sizes[1], n_attn = sizes[2], n_mlp = sizes[3], n_moe = sizes[4],
                d = sizes[5], g = sizes[6], p = sizes[7];
  const int64_t* s = sizes + 10;
  void* const* ptr = pointers + 5;
  const std::vector<LayerView> mambas = layer_views(s, ptr, n_mamba, d, p);
  s += 8 * n_mamba, ptr += 15 * n_mamba;
  const auto f = [](void* v) { return static_cast<float*>(v); };
  std::vector<AttnView> attns(n_attn);
  for (int64_t i = 0; i < n_attn; ++i, s += 11, ptr += 15) {
    const int64_t heads = s[0], kv = s[1], hd = s[2];
    AttnView& A = attns[i];
    A.q = {ptr[0], s[7], f(ptr[1]), heads * hd, d}, A.q_bias = f(ptr[2]);
    A.k = {ptr[3], s[8], f(ptr[4]), kv * hd, d}, A.k_bias = f(ptr[5]);
    A.v = {ptr[6], s[9], f(ptr[7]), kv * hd, d}, A.v_bias = f(ptr[8]);
    A.o = {ptr[9], s[10], f(ptr[10]), d, heads * hd}, A.o_bias = f(ptr[11]);
    A.keys = f(ptr[12]), A.values = f(ptr[13]), A.valid = static_cast<const uint8_t*>(ptr[14]);
    A.heads = heads, A.kv = kv, A.hd = hd, A.m = s[3], A.slot = s[4], A.rotary = s[5], A.position = s[6];
    A.scale = static_cast<float>(reals[4 + 2 * i]), A.theta = static_cast<float>(reals[5 + 2 * i]);
  }
  std::vector<MlpView> mlps(n_mlp);
  for (int64_t i = 0; i < n_mlp; ++i, s += 5, ptr += 4) {
    const int64_t width = s[0], gated = s[2];
    mlps[i] = {{ptr[0], s[3], f(ptr[1]), gated ? 2 * width : width, d}, {ptr[2], s[4], f(ptr[3]), d, width}, width,
               s[1], gated != 0};
  }
  std::vector<MoeView> moes(n_moe);
  const double* multipliers = reals + 4 + 2 * n_attn;
  for (int64_t i = 0; i < n_moe; ++i, s += 6, ptr += 2) {
    moes[i] = {{ptr[0], kWeightF32, nullptr, s[0], d}, f(ptr[1]), mlps[s[4]], s[5] < 0 ? nullptr : &mlps[s[5]], s[1],
               s[2] != 0, s[3] != 0, static_cast<float>(multipliers[count + i])};
  }
  std::vector<BlockView> blocks(count);
  for (int64_t b = 0; b < count; ++b, s += 4, ++ptr) {
    blocks[b] = {f(ptr[0]), s[0] < 0 ? nullptr : &mambas[s[0]], s[1] < 0 ? nullptr : &attns[s[1]],
                 s[2] < 0 ? nullptr : &mlps[s[2]], s[3] < 0 ? nullptr : &moes[s[3]],
                 static_cast<float>(multipliers[b])};
  }
  const RowWeight lm_head{pointers[2], sizes[9], f(pointers[3]), sizes[8], d};
  decode_hybrid_run(f(pointers[0]), d, blocks.data(), count, mambas.data(), n_mamba, f(pointers[1]), lm_head,
                    f(pointers[4]), reals[0], reals[1], static_cast<float>(reals[2]), static_cast<float>(reals[3]),
                    g, p, static_cast<int>(threads));
}

// One chunk of DBN trade (mbp = 0) or MBP-1 (mbp = 1) records [n] cut into bars of `interval` ns,
// the arithmetic of market/bars.py's NumPy path (_events, _BarCutter.add) for the records a
// DbnSelection takes: each selected record's price (trades) or mid (MBP-1; the traded size only
// where action is 'T'), where defined, joins the bar of ts_event / interval; bars [6, n] (bucket,
// open, high, low, close, volume) and buckets [n] get the chunk's bars in order. Returns how many,
// state updated; or -1, state untouched, where the chunk holds anything for the NumPy path to
// report (DbnSelection's, or a price beyond 2^53 units).
int64_t portable_ssm_event_bars(const uint8_t* records, int64_t n, int64_t size, int64_t rtype, int64_t mbp,
                                int64_t chosen, int64_t first, int64_t interval, int64_t* state, int64_t* buckets,
                                double* bars) {
  DbnSelection select{size, rtype, chosen, state[0], state[1], state[2]};
  int64_t k = -1;
  double* row[6];
  for (int j = 0; j < 6; ++j) row[j] = bars + j * n;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* r = records + i * size;
    const int taken = select.take(r, first + i);
    if (taken < 0) return -1;
    if (taken == 0) continue;
    double value, volume = dbn_field<uint32_t>(r, 24);
    if (mbp) {
      const int64_t bid = dbn_field<int64_t>(r, 48), ask = dbn_field<int64_t>(r, 56);
      if (dbn_beyond(bid) || dbn_beyond(ask)) return -1;
      value = (dbn_price(bid) + dbn_price(ask)) / 2, volume = r[28] == 'T' ? volume : 0.0;
    } else {
      const int64_t p = dbn_field<int64_t>(r, 16);
      if (dbn_beyond(p)) return -1;
      value = dbn_price(p);
    }
    if (std::isnan(value)) continue;
    const int64_t bucket = select.last / interval;
    if (k < 0 || bucket != buckets[k]) {
      ++k;
      buckets[k] = bucket, row[0][k] = static_cast<double>(bucket), row[1][k] = row[2][k] = row[3][k] = value;
      row[5][k] = 0.0;
    }
    row[2][k] = std::max(row[2][k], value), row[3][k] = std::min(row[3][k], value);
    row[4][k] = value, row[5][k] += volume;
  }
  select.store(state);
  return k + 1;
}

// One chunk of DBN OHLCV records [n] as market/bars.py's columns (_columns) of the records a
// DbnSelection takes, written from row `at` of ts [.] (int64), open, high, low, close [.] (float64,
// UNDEF_PRICE as NaN) and volume [.] (int64), which have room for n more. Returns how many, state
// updated; or -1, state untouched, where the chunk holds anything for the NumPy path to report
// (DbnSelection's, or a price beyond 2^53 units).
int64_t portable_ssm_ohlcv_columns(const uint8_t* records, int64_t n, int64_t size, int64_t rtype, int64_t chosen,
                                   int64_t first, int64_t* state, int64_t at, int64_t* ts, double* open, double* high,
                                   double* low, double* close, int64_t* volume) {
  DbnSelection select{size, rtype, chosen, state[0], state[1], state[2]};
  double* prices[4] = {open + at, high + at, low + at, close + at};
  int64_t m = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* r = records + i * size;
    const int taken = select.take(r, first + i);
    if (taken < 0) return -1;
    if (taken == 0) continue;
    for (int j = 0; j < 4; ++j) {
      const int64_t p = dbn_field<int64_t>(r, 16 + 8 * j);
      if (dbn_beyond(p)) return -1;
      prices[j][m] = dbn_price(p);
    }
    ts[at + m] = select.last, volume[at + m] = dbn_field<int64_t>(r, 48);
    ++m;
  }
  select.store(state);
  return m;
}

}  // extern "C"
