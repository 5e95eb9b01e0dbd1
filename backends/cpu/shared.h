// What the CPU kernels of two backends share, written once: the SIMD helpers (AVX2 and FMA) and the
// pointer-level loops. torch_ops.cpp builds them into torch ops (at::parallel_for over the rows),
// numpy_kernels.cpp into a plain shared library NumPy's native paths call through ctypes (its thread
// pool over the rows): conv_silu_steps and norm_rows for the conv with SiLU and the gated RMSNorm,
// row_products for a batch-1 decode step's products with float32, int8 or bfloat16 weights and
// scan_forward_item (with the caller's matrix product) for the chunked scan, over work items of
// head_block heads (backends/cpu_source.py), so both backends compute them with the same code.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// sum_i a[i] * b[i] over n floats in cache: two accumulators of eight lanes, then the tail.
inline float inner(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float total = horizontal_sum(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
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
// Sixteen bfloat16 weights read as eight 32-bit pairs, each pair's low half the even element:
// bf16_even and bf16_odd widen them with one shift or one mask.
inline __m256i bf16_pairs(const uint16_t* w) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)); }
inline __m256 bf16_even(__m256i pairs) { return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16)); }
inline __m256 bf16_odd(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
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
inline void prefetch_l2(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

// sum_i w[i] * x[i] over n elements: four accumulators of eight lanes, then the tail; the lines
// kAheadBytes past each step's 32 weights are prefetched (past the row's end they are the next
// row's, which the caller reads next). bfloat16 weights are prefetched into L2 only: a one-row read
// of them went from 21 to 26 GB/s on a 2-core AVX-512 VM whose streaming read is 29, and a 130m
// LM's decode step from 12.3 to 10.9 ms (float32 and int8 weights, no faster so, keep every level).
template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  const char* ahead = reinterpret_cast<const char*>(w) + kAheadBytes;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int64_t line = 0; line < 32 * static_cast<int64_t>(sizeof(T)); line += 64) {
      if constexpr (sizeof(T) == 2) {
        _mm_prefetch(ahead + i * sizeof(T) + line, _MM_HINT_T1);
      } else {
        prefetch(ahead + i * sizeof(T) + line);
      }
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

// sum_i w[r·n + i] * x[i] for R consecutive float32 weight rows r at once, into out[r]: each load of
// x feeds R rows' FMAs and R weight streams are in flight; one accumulator of eight lanes per row,
// then the tail. The streams share kRowsAheadBytes of prefetch: each asks for the line
// kRowsAheadBytes / R ahead of its loads into L2, into the next R rows' starts once past its row's
// end. Eight streams 1 KiB ahead read the 130m LM's 49 products (rows of 768 and 1536 floats) at
// 30.8 to 32.7 GB/s on a 2-core AVX-512 VM whose streaming read is about 32 (into every cache
// level); four 2 KiB ahead, at 30.1 to 32.1 in the same runs. On a 2-core AMD EPYC VM (streaming
// read about 32.5) the granite-4.0-h-350m shape's products read at 26 to 29 GB/s prefetched into
// every level, 30 to 33 into L2 only.
constexpr int64_t kRowsAheadBytes = 8192;

template <int R>
inline void dot_rows(const float* w, const float* x, int64_t n, float* out) {
  constexpr int64_t ahead = kRowsAheadBytes / R / sizeof(float);
  __m256 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {  // 16 floats: one 64-byte line of each row
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    const int64_t next = i + ahead;
    for (int r = 0; r < R; ++r) {
      prefetch_l2(next < n ? w + r * n + next : w + (R + r) * n + (next - n));
      a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * n + i), x0, a[r]);
      a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(w + r * n + i + 8), x1, a[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = horizontal_sum(a[r]) + dot(w + r * n + i, x + i, n - i);
}

// y[r] = (sum_i w[r·n + i] · x[i]) · scale[r] for the weight rows r in [begin, end) (scale null: no
// scale): a batch-1 decode step's product of one float32 row with a float32, int8 (weight-only:
// the row stays float32) or bfloat16 weight [rows, n]. Float32 rows eight at a time, then four
// (dot_rows); int8 and bfloat16 ones, which widen, one at a time (four rows of them were slower).
template <typename T>
inline void row_products(const T* w, const float* x, const float* scale, float* y, int64_t n, int64_t begin,
                         int64_t end) {
  int64_t r = begin;
  if constexpr (std::is_same_v<T, float>) {
    for (; r + 8 <= end; r += 8) dot_rows<8>(w + r * n, x, n, y + r);
    for (; r + 4 <= end; r += 4) dot_rows<4>(w + r * n, x, n, y + r);
  }
  for (; r < end; ++r) y[r] = dot(w + r * n, x, n);
  if (scale != nullptr) {
    for (r = begin; r < end; ++r) y[r] *= scale[r];
  }
}

// A market plan's weights (kinds 3 to 6 of decode_model.h) are their rows, then from byte
// tiles_at(out, n, element bytes) the same weights in tile order: for each 64 rows (a tile of up
// to four blocks of 16 rows), [groups][blocks][16 rows][group], a group being 4 int8 columns for
// kind 3 (one VNNI lane's bytes), else 1 column (float32, bfloat16 or int8), zero past n and past
// out (row_tiles of backends/numpy/decode.py makes them). One group of x then multiplies 16 rows
// at once, each lane summing one row, with no sums across lanes.
inline int64_t tiles_at(int64_t out, int64_t n, int64_t bytes) { return (out * n * bytes + 63) / 64 * 64; }
inline int64_t vnni_groups(int64_t n) { return (n + 3) / 4; }

// tile(blocks, first, lo, hi) for each tile of a tiled weight [out, n] holding rows of [begin, end):
// its first row, the range [lo, hi) of its rows to write (from its first row) and its blocks of 16
// rows as std::integral_constant<int, 1..4>.
template <typename Tile>
inline void each_tile(int64_t out, int64_t begin, int64_t end, const Tile& tile) {
  for (int64_t first = begin / 64 * 64; first < end; first += 64) {
    const int64_t lo = std::max(begin, first) - first, hi = std::min(end, first + 64) - first;
    switch ((std::min(out - first, int64_t{64}) + 15) / 16) {
      case 4: tile(std::integral_constant<int, 4>{}, first, lo, hi); break;
      case 3: tile(std::integral_constant<int, 3>{}, first, lo, hi); break;
      case 2: tile(std::integral_constant<int, 2>{}, first, lo, hi); break;
      default: tile(std::integral_constant<int, 1>{}, first, lo, hi); break;
    }
  }
}

// y[r] = (w[r] · x)·scale[r] for the rows r in [lo, hi) of one tile of B blocks of float32 or int8
// weights (tile: its weights; y and scale from its first row; scale null: none; bfloat16 bits: the
// overload below): each row's terms summed in x's order, one FMA a term.
template <int B, typename T>
inline void widened_tile(const T* tile, const float* x, int64_t n, const float* scale, float* y, int64_t lo,
                         int64_t hi) {
  __m256 acc[2 * B];
  for (int b = 0; b < 2 * B; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; ++c) {
    const __m256 xc = _mm256_set1_ps(x[c]);
    const T* at = tile + c * 16 * B;
    for (int b = 0; b < 2 * B; ++b) acc[b] = _mm256_fmadd_ps(xc, widen8(at, 8 * b), acc[b]);
  }
  alignas(32) float sums[64];
  for (int b = 0; b < 2 * B; ++b) _mm256_store_ps(sums + 8 * b, acc[b]);
  for (int64_t r = lo; r < hi; ++r) y[r] = scale == nullptr ? sums[r] : sums[r] * scale[r];
}

// widened_tile for bfloat16 bits, each row's terms summed in x's order as there: each 32-byte load
// of 16 rows' weights widened as its even rows (a shift) and its odd rows (a mask), two operations
// for sixteen weights where widen8 takes two for eight, and the sums put back in row order. The
// seed shape's bar (benchmarks/MARKET.md) reads its weights from L3, where widen8's operations
// were the bound.
template <int B>
inline void widened_tile(const uint16_t* tile, const float* x, int64_t n, const float* scale, float* y, int64_t lo,
                         int64_t hi) {
  __m256 acc[2 * B];  // per block b: acc[2b] its even rows, acc[2b + 1] its odd rows
  for (int b = 0; b < 2 * B; ++b) acc[b] = _mm256_setzero_ps();
  for (int64_t c = 0; c < n; ++c) {
    const __m256 xc = _mm256_set1_ps(x[c]);
    const uint16_t* at = tile + c * 16 * B;
    for (int b = 0; b < B; ++b) {
      const __m256i pairs = bf16_pairs(at + 16 * b);
      acc[2 * b] = _mm256_fmadd_ps(xc, bf16_even(pairs), acc[2 * b]);
      acc[2 * b + 1] = _mm256_fmadd_ps(xc, bf16_odd(pairs), acc[2 * b + 1]);
    }
  }
  alignas(32) float sums[64];
  for (int b = 0; b < B; ++b) {
    const __m256 low = _mm256_unpacklo_ps(acc[2 * b], acc[2 * b + 1]);  // rows 0-3, 8-11 of the block
    const __m256 high = _mm256_unpackhi_ps(acc[2 * b], acc[2 * b + 1]);  // rows 4-7, 12-15
    _mm256_store_ps(sums + 16 * b, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_store_ps(sums + 16 * b + 8, _mm256_permute2f128_ps(low, high, 0x31));
  }
  for (int64_t r = lo; r < hi; ++r) y[r] = scale == nullptr ? sums[r] : sums[r] * scale[r];
}

// y[r] = (w[r] · x)·scale[r] for the rows r in [begin, end) of a float32, bfloat16-bits or int8
// weight [out, n] (tiles: its tiles; scale null: none), each row's output the same float whichever
// rows share the call. A market step's weights stay in the caches between bars, where row_products'
// sums across lanes at each row's end were a large part of a one-row step (the seed shape's
// float32 bar: 137 -> 87 µs, benchmarks/MARKET.md).
template <typename T>
inline void widened_tile_products(const T* tiles, const float* x, const float* scale, float* y, int64_t out,
                                  int64_t n, int64_t begin, int64_t end) {
  each_tile(out, begin, end, [&](auto blocks, int64_t first, int64_t lo, int64_t hi) {
    widened_tile<decltype(blocks)::value>(tiles + first * n, x, n, scale == nullptr ? nullptr : scale + first,
                                          y + first, lo, hi);
  });
}

#if defined(PORTABLE_SSM_VNNI)
// int8 weights times a float32 row through AVX-512 VNNI (vpdpbusd: unsigned bytes times signed
// bytes, four products summed into each int32 lane), where the CPU has it (vnni_usable): the row x
// [n] becomes q = round(|x| / unit) with unit = max|x| / (2^24 - 1), 24 bits as three unsigned
// byte digits, and its signs; each weight byte takes its x element's sign, so
// w·x = unit · Σ_d 256^d Σ_i (sign_i w_i) digit_d,i, summed exactly in integers. The error is x's
// rounding to 24 bits of its largest element (at most unit / 2 an element) and one float32 rounding
// of the exact sum: within a float32 dot product's. Weights must hold no -128 (its negation does
// not fit a byte): the caller says so with the kind kWeightI8Sym. Rows whose x is not finite, or
// whose largest element is below 2^-100 (unit would underflow), take row_products instead.
#define PORTABLE_SSM_TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

inline bool vnni_usable() {
  static const bool usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return usable;
}

// x [n] as three rows of byte digits into digits [3 · 4·vnni_groups(n)] (zero past n) and, per group
// of 4 elements, the 64-bit mask of a tile row's bytes whose element is negative into signs
// [vnni_groups(n)]; and its unit. False (nothing written) where x is not finite or its largest
// magnitude is below 2^-100.
PORTABLE_SSM_TARGET_VNNI inline bool byte_digits(const float* x, int64_t n, uint8_t* digits, uint64_t* signs,
                                                 float* unit) {
  const int64_t groups = vnni_groups(n), m = 4 * groups;
  __m512 top = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (n - i)) - 1);
    const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(lanes, x + i));  // lanes past n: 0, finite
    finite &= _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    top = _mm512_max_ps(top, a);
  }
  const float largest = _mm512_reduce_max_ps(top);
  if (finite != 0xFFFF || !(largest >= 0x1p-100f)) return false;
  *unit = largest / 16777215.0f;
  const __m512 inverse = _mm512_set1_ps(16777215.0f / largest);
  const __m512i byte = _mm512_set1_epi32(255), most = _mm512_set1_epi32(16777215);
  for (int64_t i = 0; i < m; i += 16) {
    const __mmask16 lanes = m - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (m - i)) - 1);
    const __mmask16 given = n - i >= 16 ? __mmask16(0xFFFF) : n > i ? __mmask16((1u << (n - i)) - 1) : 0;
    const __m512 v = _mm512_maskz_loadu_ps(given, x + i);
    const __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_abs_ps(v), inverse)), most);
    _mm512_mask_cvtepi32_storeu_epi8(digits + i, lanes, _mm512_and_si512(q, byte));
    _mm512_mask_cvtepi32_storeu_epi8(digits + m + i, lanes, _mm512_and_si512(_mm512_srli_epi32(q, 8), byte));
    _mm512_mask_cvtepi32_storeu_epi8(digits + 2 * m + i, lanes, _mm512_srli_epi32(q, 16));
    const uint32_t negative = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
    for (int64_t j = 0; j < 4 && i / 4 + j < groups; ++j) {  // a tile row's 64 bytes: 16 rows of the group's 4
      signs[i / 4 + j] = uint64_t((negative >> (4 * j)) & 15) * 0x1111111111111111ull;
    }
  }
  return true;
}

// The 8 int64 lanes of half `part` of a's 16 int32 lanes.
PORTABLE_SSM_TARGET_VNNI inline __m512i wide_half(__m512i a, int part) {
  return _mm512_cvtepi32_epi64(part == 0 ? _mm512_castsi512_si256(a) : _mm512_extracti64x4_epi64(a, 1));
}
// Groups a pass of tile_digit_products sums in int32: an int32 lane's 4·kDigitGroups products of
// at most 255·127 each (66 M) fit.
constexpr int64_t kDigitGroups = 512;

// y[r] = (w[r] · x)·unit·scale[r] for the rows r in [lo, hi) of one tile of B blocks (tile: its
// bytes, y and scale from its first row; scale null: none), x as byte_digits' digits and signs.
template <int B>
PORTABLE_SSM_TARGET_VNNI inline void tile_digit_products(const int8_t* tile, const uint8_t* digits,
                                                         const uint64_t* signs, int64_t groups, float unit,
                                                         const float* scale, float* y, int64_t lo, int64_t hi) {
  const int64_t m = 4 * groups;
  __m512i total[B][2];  // per block, its rows' exact sums as int64 (rows 0-7, 8-15)
  for (int b = 0; b < B; ++b) total[b][0] = total[b][1] = _mm512_setzero_si512();
  for (int64_t start = 0; start < groups; start += kDigitGroups) {
    const int64_t stop = std::min(groups, start + kDigitGroups);
    __m512i a0[B], a1[B], a2[B];
    for (int b = 0; b < B; ++b) a0[b] = a1[b] = a2[b] = _mm512_setzero_si512();
    for (int64_t g = start; g < stop; ++g) {
      int32_t g0, g1, g2;  // the group's four digits of each place
      std::memcpy(&g0, digits + 4 * g, 4), std::memcpy(&g1, digits + m + 4 * g, 4);
      std::memcpy(&g2, digits + 2 * m + 4 * g, 4);
      const __m512i d0 = _mm512_set1_epi32(g0), d1 = _mm512_set1_epi32(g1), d2 = _mm512_set1_epi32(g2);
      const __mmask64 negative = signs[g];
      const int8_t* at = tile + g * B * 64;
      for (int b = 0; b < B; ++b) {
        const __m512i raw = _mm512_loadu_si512(at + b * 64);
        const __m512i w = _mm512_mask_sub_epi8(raw, negative, _mm512_setzero_si512(), raw);
        a0[b] = _mm512_dpbusd_epi32(a0[b], d0, w);
        a1[b] = _mm512_dpbusd_epi32(a1[b], d1, w);
        a2[b] = _mm512_dpbusd_epi32(a2[b], d2, w);
      }
    }
    for (int b = 0; b < B; ++b) {
      for (int part = 0; part < 2; ++part) {
        const __m512i sum = _mm512_add_epi64(wide_half(a0[b], part),
                                             _mm512_add_epi64(_mm512_slli_epi64(wide_half(a1[b], part), 8),
                                                              _mm512_slli_epi64(wide_half(a2[b], part), 16)));
        total[b][part] = _mm512_add_epi64(total[b][part], sum);
      }
    }
  }
  for (int b = 0; b < B; ++b) {
    const auto below = [](int64_t k) { return k <= 0 ? 0u : k >= 16 ? 0xFFFFu : (1u << k) - 1; };
    const __mmask16 lanes = __mmask16(below(hi - 16 * b) & ~below(lo - 16 * b));
    if (lanes == 0) continue;
    const __m512 sums = _mm512_insertf32x8(_mm512_castps256_ps512(_mm512_cvtepi64_ps(total[b][0])),
                                           _mm512_cvtepi64_ps(total[b][1]), 1);
    __m512 v = _mm512_mul_ps(sums, _mm512_set1_ps(unit));
    if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(lanes, scale + 16 * b));
    _mm512_mask_storeu_ps(y + 16 * b, lanes, v);
  }
}

// y[r] = (w[r] · x)·unit·scale[r] for the rows r in [begin, end) of a kind-3 weight [out, n] (no
// -128; tiles: its tiles; scale null: none), x as byte_digits' digits, signs and unit: each row's
// output the same float whichever rows share the call.
inline void digit_products(const int8_t* tiles, const uint8_t* digits, const uint64_t* signs, float unit,
                           const float* scale, float* y, int64_t out, int64_t n, int64_t begin, int64_t end) {
  const int64_t groups = vnni_groups(n);
  each_tile(out, begin, end, [&](auto blocks, int64_t first, int64_t lo, int64_t hi) {
    tile_digit_products<decltype(blocks)::value>(tiles + first * 4 * groups, digits, signs, groups, unit,
                                                 scale == nullptr ? nullptr : scale + first, y + first, lo, hi);
  });
}

#else
inline bool vnni_usable() { return false; }
inline bool byte_digits(const float*, int64_t, uint8_t*, uint64_t*, float*) { return false; }
inline void digit_products(const int8_t*, const uint8_t*, const uint64_t*, float, const float*, float*, int64_t,
                           int64_t, int64_t, int64_t) {}
#endif

// A row x [n]'s byte digits, signs and unit for digit_products, made once for all the row ranges of
// one product (unit 0: x takes row_products: no VNNI here, or x not finite or all below 2^-100).
struct ByteRow {
  std::vector<uint8_t> digits;
  std::vector<uint64_t> signs;
  float unit = 0.f;

  void make(const float* x, int64_t n) {
    unit = 0.f;
    if (!vnni_usable()) return;
    digits.resize(static_cast<size_t>(12 * vnni_groups(n)));
    signs.resize(static_cast<size_t>(vnni_groups(n)));
    if (!byte_digits(x, n, digits.data(), signs.data(), &unit)) unit = 0.f;
  }
};

// row_products of the rows [begin, end) of a kind-3 weight w [out, n] (int8 holding no -128, its
// VNNI tiles after it), through digit_products where x's digits were made (digits.unit > 0).
inline void int8_products(const int8_t* w, const float* x, const ByteRow& digits, const float* scale, float* y,
                          int64_t out, int64_t n, int64_t begin, int64_t end) {
  if (digits.unit > 0.f) {
    digit_products(w + tiles_at(out, n, 1), digits.digits.data(), digits.signs.data(), digits.unit, scale, y, out, n,
                   begin, end);
  } else {
    row_products(w, x, scale, y, n, begin, end);
  }
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
// 1 / (1 + exp(-v)); 0 below -88.38, where exp(-v) overflows to inf in std::exp and NumPy (exp8's
// clamp would leave about 4e-39 there, which a norm of such gates scales back up)
inline __m256 sigmoid8(__m256 v) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
  return _mm256_andnot_ps(_mm256_cmp_ps(v, _mm256_set1_ps(-88.3762626647949f), _CMP_LT_OQ), s);
}
inline __m256 silu8(__m256 v) { return _mm256_mul_ps(v, sigmoid8(v)); }  // a NaN stays NaN through the product
inline float silu1(float v) { return v / (1.0f + std::exp(-v)); }
inline float softplus1(float v) { return 0.5f * (v + std::fabs(v)) + std::log1p(std::exp(-std::fabs(v))); }

// exp8 where v may exceed float32's range or be NaN: +inf above it and NaN for NaN, as std::exp
// (exp8 clamps both to its range; the segment sums of a negative Δ or a NaN input reach it).
inline __m256 exp8_nan(__m256 v) {
  const __m256 special = _mm256_or_ps(_mm256_cmp_ps(v, _mm256_set1_ps(88.3762626647949f), _CMP_GT_OQ),
                                      _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_ps(exp8(v), _mm256_add_ps(v, _mm256_set1_ps(INFINITY)), special);
}

// The causal depthwise conv and SiLU of a training forward, and its backward, V's lanes of channels
// at a time (Lanes8: eight in a vector; Lanes1: one): xp = [history; x] is the row's input with the
// k-1 steps before it, y_t = silu(bias + Σ_j w_j xp_{t+j}). Tensors are one row's
// [steps, d] (history [k-1, d]); taps [k, d] (the weight transposed).
struct Lanes8 {
  using T = __m256;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T zero() { return _mm256_setzero_ps(); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T one() { return _mm256_set1_ps(1.0f); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T sigmoid(T v) { return sigmoid8(v); }
  static T set(float v) { return _mm256_set1_ps(v); }
};
struct Lanes1 {
  using T = float;
  static T load(const float* p) { return *p; }
  static void store(float* p, T v) { *p = v; }
  static T zero() { return 0.f; }
  static T fma(T a, T b, T c) { return a * b + c; }
  static T add(T a, T b) { return a + b; }
  static T mul(T a, T b) { return a * b; }
  static T one() { return 1.f; }
  static T sub(T a, T b) { return a - b; }
  static T sigmoid(T v) { return 1.f / (1.f + std::exp(-v)); }
  static T set(float v) { return v; }
};

struct ConvRow {  // one row's tensors and sizes; row(P) is xp's step P (x's steps xs floats apart)
  const float *x, *history, *taps, *bias;
  int64_t l, d, k, xs;
  const float* row(int64_t P) const { return P < k - 1 ? history + P * d : x + (P - k + 1) * xs; }
};

template <typename V>
inline typename V::T conv_pre(const ConvRow& r, int64_t t, int64_t c) {  // bias + Σ_j w_j xp_{t+j}
  typename V::T acc = r.bias == nullptr ? V::zero() : V::load(r.bias + c);
  for (int64_t j = 0; j < r.k; ++j) acc = V::fma(V::load(r.taps + j * r.d + c), V::load(r.row(t + j) + c), acc);
  return acc;
}

// The backward's threads take 64 channels at a time (four cache lines of each step), walking the
// steps d floats apart, across the 4 KiB pages within which the hardware prefetchers work: so each
// step's lines are prefetched kConvAhead steps ahead.
constexpr int64_t kConvBlock = 64;
constexpr int64_t kConvAhead = 16;

// The lines of channels [c0, c1) of step t of a [steps, d] tensor whose steps are stride floats
// apart, into the caches.
inline void prefetch_step(const float* base, int64_t t, int64_t steps, int64_t stride, int64_t c0, int64_t c1) {
  if (t < steps) {
    for (int64_t c = c0; c < c1; c += 16) prefetch(base + t * stride + c);
  }
}

// Channels [c0, c1) of steps [t0, t1), V::width at a time.
template <typename V>
void conv_silu_lanes(const ConvRow& r, float* y, int64_t t0, int64_t t1, int64_t c0, int64_t c1) {
  for (int64_t t = t0; t < t1; ++t) {
    for (int64_t c = c0; c < c1; c += sizeof(typename V::T) / sizeof(float)) {
      const typename V::T pre = conv_pre<V>(r, t, c);
      V::store(y + t * r.d + c, V::mul(pre, V::sigmoid(pre)));
    }
  }
}

// v[c] = y[c]·silu(z[c]) over [c0, c1) (z == nullptr: y[c]); also s[c] = sigmoid(z[c]) where s != nullptr.
template <typename V>
void gate_lanes(const float* y, const float* z, float* v, float* s, int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c += sizeof(typename V::T) / sizeof(float)) {
    if (z == nullptr) {
      V::store(v + c, V::load(y + c));
      continue;
    }
    const typename V::T zc = V::load(z + c), sc = V::sigmoid(zc);
    if (s != nullptr) V::store(s + c, sc);
    V::store(v + c, V::mul(V::load(y + c), V::mul(zc, sc)));
  }
}

inline void gate_row(const float* y, const float* z, float* v, float* s, int64_t d) {
  const int64_t split = d / 8 * 8;
  gate_lanes<Lanes8>(y, z, v, s, 0, split);
  gate_lanes<Lanes1>(y, z, v, s, split, d);
}

// 1 / sqrt(mean(v²) + eps) over v's m channels.
inline float inverse_rms(const float* v, int64_t m, double eps) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(dot(v, v, m)) / static_cast<double>(m) + eps));
}

template <typename V>
void scale_lanes(const float* v, const float* w, float r, float* out, int64_t c0, int64_t c1) {
  const typename V::T rv = V::set(r);
  for (int64_t c = c0; c < c1; c += sizeof(typename V::T) / sizeof(float)) {
    V::store(out + c, V::mul(V::load(w + c), V::mul(V::load(v + c), rv)));
  }
}

// Steps [t0, t1) of one row of the conv and SiLU into y, the row's [l, d] output.
inline void conv_silu_steps(const ConvRow& r, float* y, int64_t t0, int64_t t1) {
  const int64_t split = r.d / 8 * 8;  // eight channels a vector, then one at a time
  conv_silu_lanes<Lanes8>(r, y, t0, t1, 0, split);
  conv_silu_lanes<Lanes1>(r, y, t0, t1, split, r.d);
}

// Rows [begin, end) of out [rows, d] = rmsnorm(y·silu(z)) ⊙ w over groups of m channels: y's rows
// ys floats apart, z's zs (z == nullptr: no gate).
inline void norm_rows(const float* y, int64_t ys, const float* z, int64_t zs, const float* w, float* out, int64_t d,
                      int64_t m, double eps, int64_t begin, int64_t end) {
  std::vector<float> v(d);
  for (int64_t i = begin; i < end; ++i) {
    gate_row(y + i * ys, z == nullptr ? nullptr : z + i * zs, v.data(), nullptr, d);
    for (int64_t start = 0; start < d; start += m) {
      const float r = inverse_rms(v.data() + start, m, eps);
      const int64_t split = start + m / 8 * 8;
      scale_lanes<Lanes8>(v.data(), w, r, out + i * d, start, split);
      scale_lanes<Lanes1>(v.data(), w, r, out + i * d, split, start + m);
    }
  }
}

// The chunked scan's forward in raw pointers, for the kernels of both backends: sizes as
// portable_ssm.ssd.ssd_chunked_ref's (no seq_idx), x [b, l, h, p], B and C [b, l, g, n] with packed
// rows at any row and step stride (slices of the conv's output: steps xl, bl, cl floats apart, rows
// xr, br, cr), dt [b, l, h], A [h], D [h] or [h, p] (d_per_channel) or null, initial [b, h, p, n] or
// null, contiguous; y [b, l, h, p] and final [b, h, p, n] written. Q: the chunk length, block: heads
// per work item (items = b·g·blocks), lowest: the decay floor, safe: see scan_forward_item.
struct ScanView {
  int64_t b, l, h, p, g, n, r;
  const float *x, *dt, *A, *B, *C, *D, *initial;
  bool d_per_channel;
  int64_t xr, xl, br, bl, cr, cl;
  float *y, *final;
  int64_t Q, block, blocks;
  float lowest;
  bool safe;
};

// One work item of the chunked scan's forward: the heads [first, first + bw) of one group and row,
// as NumPy's native loop (portable_ssm.backends.numpy.ops.ssd_chunked) computes them: per chunk of
// q steps and head, with a = A·Δ, acs its float32 cumulative sum from the chunk's start, pre its
// float64 one and S the state entering the chunk ([n, p] per head),
//   y_i   = Σ_{j<=i} exp(max(pre_i - pre_j, floor)) (C_i·B_j) Δ_j x_j + exp(acs_i) C_i S + D x_i
//   S_out = exp(acs_last) S + Σ_j exp(acs_last - acs_j) Δ_j B_jᵀ x_j
// (exp(v) flushed to 0 below floor outside the diagonal block, as portable_ssm.ssd.decay does). The
// block's state is [n, bw·p], so the entering state's read (C S), the state's update (Bᵀ X) and
// C Bᵀ are one matrix product each for the block, the diagonal blocks one batch of bw. gemm(count,
// ta, tb, m, n, k, A, lda, sa, B, ldb, sb, beta, C, ldc, sc) is the backend's row-major product:
// C_i = op(A_i) op(B_i) + beta C_i for i < count, X_i = X + i·sx, op(X) = Xᵀ where tx, [m, k] [k, n].
// Returns the sum of the item's outputs and final entries in float64 (non-finite wherever one of
// them is). With `safe` (the call again,
// for a non-finite input), a non-finite x_j·Δ_j enters the diagonal blocks' product as 0, so 0·inf
// above the diagonal cannot reach the steps before j, and its column's outputs are nan from step j
// on (what portable_ssm.ssd.poison adds in the reference): every other product reads only steps up
// to its row, so the outputs before a non-finite input equal the first call's bit for bit.
template <typename Gemm>
double scan_forward_item(const ScanView& v, int64_t item, const Gemm& gemm) {
  const int64_t l = v.l, h = v.h, p = v.p, n = v.n, Q = v.Q;
  const float lowest = v.lowest;
  const auto decay = [lowest](float e) { return e >= lowest ? std::exp(e) : 0.f; };
  const int64_t row = item / (v.g * v.blocks), group = (item / v.blocks) % v.g, first = (item % v.blocks) * v.block;
  const int64_t bw = std::min(v.block, v.r - first), h0 = group * v.r + first, wide = bw * p;
  std::vector<float> S(n * wide, 0.f), G(Q * Q), off(Q * wide), W(bw * Q * Q), diag(bw * Q * p), fed(Q * wide);
  std::vector<float> from_start(bw * Q), chunk_decay(bw), acs(Q), suffix(Q);
  std::vector<float> masked(v.safe ? bw * Q * p : 0);  // safe: x with its non-finite x·Δ as 0, [bw, q, p]
  std::vector<int64_t> first_bad(v.safe ? wide : 0);  // safe: each column's first non-finite x·Δ (q: none)
  std::vector<double> pre(Q);
  if (v.initial != nullptr) {  // [b, h, p, n] -> the block's [n, bw·p]
    for (int64_t hh = 0; hh < bw; ++hh)
      for (int64_t c = 0; c < p; ++c)
        for (int64_t k = 0; k < n; ++k) S[k * wide + hh * p + c] = v.initial[((row * h + h0 + hh) * p + c) * n + k];
  }
  double total = 0.0;
  for (int64_t t0 = 0; t0 < l; t0 += Q) {
    const int64_t q = std::min(Q, l - t0);
    // the chunk's rows of B and C, [q, n] each (read in place), and of x, [q, h, p]
    const float* Bc = v.B + row * v.br + t0 * v.bl + group * n;
    const float* Cc = v.C + row * v.cr + t0 * v.cl + group * n;
    const float* xc = v.x + row * v.xr + t0 * v.xl;
    gemm(1, false, true, q, q, n, Cc, v.cl, 0, Bc, v.bl, 0, 0.f, G.data(), q, 0);  // C Bᵀ, [q, q]
    gemm(1, false, false, q, wide, n, Cc, v.cl, 0, S.data(), wide, 0, 0.f, off.data(), wide, 0);  // C S, [q, bw·p]
    for (int64_t hh = 0; hh < bw; ++hh) {
      const int64_t head = h0 + hh;
      const float Ah = v.A[head];
      const float* d = v.dt + (row * l + t0) * h + head;  // Δ_j at d[j·h]
      float run = 0.f;
      double prun = 0.0;
      for (int64_t j = 0; j < q; ++j) {
        const float a = d[j * h] * Ah;
        run += a;
        prun += static_cast<double>(a);
        acs[j] = run;
        pre[j] = prun;
      }
      suffix[q - 1] = 0.f;
      for (int64_t j = q - 2; j >= 0; --j) suffix[j] = suffix[j + 1] + d[(j + 1) * h] * Ah;
      for (int64_t i = 0; i < q; ++i) from_start[hh * Q + i] = decay(acs[i]);
      chunk_decay[hh] = decay(acs[q - 1]);
      float* w = W.data() + hh * q * q;
      for (int64_t i = 0; i < q; ++i) {  // W_ij = exp(max(pre_i - pre_j, floor)) G_ij Δ_j, j <= i
        float* wi = w + i * q;
        const float* gi = G.data() + i * q;
        for (int64_t j = 0; j <= i; ++j) wi[j] = std::max(static_cast<float>(pre[i] - pre[j]), lowest);
        int64_t j = 0;
        for (; j + 8 <= i + 1; j += 8) {
          const __m256 dj = _mm256_set_ps(d[(j + 7) * h], d[(j + 6) * h], d[(j + 5) * h], d[(j + 4) * h],
                                          d[(j + 3) * h], d[(j + 2) * h], d[(j + 1) * h], d[j * h]);
          const __m256 L = exp8_nan(_mm256_loadu_ps(wi + j));
          _mm256_storeu_ps(wi + j, _mm256_mul_ps(_mm256_mul_ps(L, _mm256_loadu_ps(gi + j)), dj));
        }
        for (; j <= i; ++j) wi[j] = std::exp(wi[j]) * gi[j] * d[j * h];
        std::fill(wi + i + 1, wi + q, 0.f);
        if (v.D != nullptr && !v.d_per_channel) wi[i] += v.D[head];  // y_i += D x_i through the diagonal
      }
      for (int64_t j = 0; j < q; ++j) {  // x_j exp(acs_last - acs_j) Δ_j: what x_j feeds the leaving state
        const float weight = decay(suffix[j]) * d[j * h];
        const float* xj = xc + j * v.xl + head * p;
        float* fj = fed.data() + j * wide + hh * p;
        for (int64_t c = 0; c < p; ++c) fj[c] = xj[c] * weight;
      }
      if (v.safe) {
        std::fill(first_bad.begin() + hh * p, first_bad.begin() + (hh + 1) * p, q);
        for (int64_t j = q - 1; j >= 0; --j) {
          const float* xj = xc + j * v.xl + head * p;
          float* mj = masked.data() + (hh * q + j) * p;
          for (int64_t c = 0; c < p; ++c) {
            const bool finite = std::isfinite(xj[c] * d[j * h]);
            mj[c] = finite ? xj[c] : 0.f;
            if (!finite) first_bad[hh * p + c] = j;
          }
        }
      }
    }
    // the diagonal blocks, [bw, q, p]: each head's W [q, q] times its x [q, p] (masked: packed)
    gemm(bw, false, false, q, p, q, W.data(), q, q * q, v.safe ? masked.data() : xc + h0 * p, v.safe ? p : v.xl,
         v.safe ? q * p : p, 0.f, diag.data(), p, q * p);
    for (int64_t i = 0; i < q; ++i) {
      for (int64_t hh = 0; hh < bw; ++hh) {
        const int64_t head = h0 + hh;
        const float* xi = xc + i * v.xl + head * p;
        const float* dg = diag.data() + (hh * q + i) * p;
        const float* of = off.data() + i * wide + hh * p;
        const float fs = from_start[hh * Q + i];
        float* out = v.y + ((row * l + t0 + i) * h + head) * p;
        __m256 acc = _mm256_setzero_ps();
        int64_t c = 0;
        for (; c + 8 <= p; c += 8) {
          __m256 e = _mm256_fmadd_ps(_mm256_set1_ps(fs), _mm256_loadu_ps(of + c), _mm256_loadu_ps(dg + c));
          if (v.d_per_channel) e = _mm256_fmadd_ps(_mm256_loadu_ps(v.D + head * p + c), _mm256_loadu_ps(xi + c), e);
          _mm256_storeu_ps(out + c, e);
          acc = _mm256_add_ps(acc, e);
        }
        float s = horizontal_sum(acc);
        for (; c < p; ++c) {
          out[c] = dg[c] + fs * of[c] + (v.d_per_channel ? v.D[head * p + c] * xi[c] : 0.f);
          s += out[c];
        }
        if (v.safe) {
          for (c = 0; c < p; ++c) {
            if (i >= first_bad[hh * p + c]) out[c] = NAN;
          }
        }
        total += s;
      }
    }
    for (int64_t k = 0; k < n; ++k)  // the state decayed over the chunk, then what the chunk feeds it
      for (int64_t hh = 0; hh < bw; ++hh) {
        float* sk = S.data() + k * wide + hh * p;
        const float cd = chunk_decay[hh];
        for (int64_t c = 0; c < p; ++c) sk[c] *= cd;
      }
    gemm(1, true, false, n, wide, q, Bc, v.bl, 0, fed.data(), wide, 0, 1.f, S.data(), wide, 0);  // S += Bᵀ X
  }
  for (int64_t hh = 0; hh < bw; ++hh)  // the block's [n, bw·p] -> [b, h, p, n]
    for (int64_t c = 0; c < p; ++c)
      for (int64_t k = 0; k < n; ++k) {
        const float e = S[k * wide + hh * p + c];
        v.final[((row * h + h0 + hh) * p + c) * n + k] = e;
        total += e;
      }
  return total;
}

}  // namespace
