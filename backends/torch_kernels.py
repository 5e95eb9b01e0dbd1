"""Hand-written CPU kernels for the torch backend: the one-row matrix products of batch-1 decode.

A decode step of one row reads every weight once, so its time is the memory bandwidth's. torch's
own GEMV (MKL on some CPUs takes a generic path) and inductor's generated one (one accumulator
and a horizontal sum per weight row) read float32 weights at about 75% of a streaming read,
inductor's widening int8 loads are scalar, and fbgemm's int8 kernel also rounds the row to 8
bits. :data:`SOURCE` is one small C++ kernel instead: ``row [1, in] @ weight.T -> [1, out]`` in
float32 for a float32, int8 (times a float32 scale per output row: weight-only, the row stays
float32) or bfloat16 weight, four FMA accumulators per weight row, the rows split over torch's
intra-op threads.

It is compiled from source on first use with ``torch.utils.cpp_extension`` (the C++ compiler
``torch.compile`` needs on CPU anyway, and ninja; about a minute, once: the build is cached in
torch's extensions folder) and registered as the op ``portable_ssm_cpu::row_gemv``, which
compiled graphs call as they call any torch op. It is used only where it can be: an x86-64 CPU
with AVX2 and FMA (as torch reports its CPU capability) and ``PORTABLE_SSM_CPU_KERNELS`` not
``0``. Where the build fails, one warning says why and torch's kernels stay; nothing else changes.
"""

from __future__ import annotations

import hashlib
import os
import platform
import warnings
from functools import lru_cache

import torch

#: The environment variable that turns the kernels off (``0``); anything else leaves them on.
ENV = "PORTABLE_SSM_CPU_KERNELS"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

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

// sum_i w[i] * x[i] over n elements: four accumulators of eight lanes, then the tail.
template <typename T>
inline float dot(const T* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
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

template <typename T>
void rows_times(const T* w, const float* x, const float* scale, float* y, int64_t out, int64_t n) {
  at::parallel_for(0, out, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float v = dot(w + r * n, x, n);
      y[r] = scale == nullptr ? v : v * scale[r];
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

}  // namespace

TORCH_LIBRARY(portable_ssm_cpu, m) {
  m.def("row_gemv(Tensor row, Tensor weight, Tensor? scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(portable_ssm_cpu, CPU, m) { m.impl("row_gemv", &row_gemv); }
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
        warnings.warn(f"portable_ssm: the CPU decode kernel could not be built ({first_line}); batch-1 decode "
                      f"uses torch's own kernels (set {ENV}=0 to skip the attempt)", RuntimeWarning, stacklevel=4)
        return False
    torch.library.register_fake("portable_ssm_cpu::row_gemv")(_row_gemv_shape)
    return True


def _row_gemv_shape(row: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    return row.new_empty((1, weight.shape[0]))


def ensure() -> bool:
    """Whether the kernel may be used now, building it first (once per process) if it was not tried
    yet; call it outside ``torch.compile`` tracing (generation's compiler does, before tracing)."""
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
