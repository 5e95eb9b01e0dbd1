// Device helpers shared by the portable_ssm CuPy kernels.
//
// No #include of any system or CUDA header: the sources compile under NVRTC (what cupy.RawModule
// uses at run time) and nvcc alike, with CUDA's built-in device functions only. float16 and
// bfloat16 storage travel as raw 16-bit patterns (CuPy has no bfloat16 dtype) and are converted
// here with integer arithmetic, round-to-nearest-even, the same code on every architecture.
// All math runs in Acc<T>::type: float for float16/bfloat16/float32 storage, double for float64.
#ifndef PORTABLE_SSM_COMMON_CUH
#define PORTABLE_SSM_COMMON_CUH

struct half_bits {
    unsigned short bits;  // IEEE binary16
};
struct bf16_bits {
    unsigned short bits;  // bfloat16: the high half of a float32
};

template <typename T> struct Acc { typedef float type; };
template <> struct Acc<double> { typedef double type; };

__device__ __forceinline__ float half_to_float(unsigned short h) {
    const unsigned sign = (h & 0x8000u) << 16;
    const unsigned exponent = (h >> 10) & 0x1fu;
    const unsigned mantissa = h & 0x3ffu;
    if (exponent == 0x1fu) {  // inf or nan
        return __uint_as_float(sign | 0x7f800000u | (mantissa << 13));
    }
    if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float32
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return __uint_as_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

// float32 -> binary16, round to nearest even (F. Giesen's float_to_half_fast3_rtne).
__device__ __forceinline__ unsigned short float_to_half(float f) {
    unsigned u = __float_as_uint(f);
    const unsigned sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    unsigned out;
    if (u >= 0x47800000u) {  // >= 2^16: inf, or nan (kept quiet)
        out = u > 0x7f800000u ? 0x7e00u : 0x7c00u;
    } else if (u < 0x38800000u) {  // below 2^-14: the float adder rounds into the subnormal grid
        const float magic = __uint_as_float(126u << 23);  // 0.5
        out = __float_as_uint(__uint_as_float(u) + magic) - 126u * (1u << 23);
    } else {  // normal: rebias the exponent, add the rounding bias (plus 1 when the kept lsb is odd)
        const unsigned odd = (u >> 13) & 1u;
        u += 0xc8000fffu + odd;  // (15 - 127) << 23, as unsigned, plus 0xfff
        out = u >> 13;
    }
    return (unsigned short)(out | sign);
}

__device__ __forceinline__ unsigned short float_to_bf16(float f) {
    const unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);  // nan stays a (quiet) nan
    }
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// Loads to the accumulation type, stores back to the storage type.
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(half_bits v) { return half_to_float(v.bits); }
__device__ __forceinline__ float to_acc(bf16_bits v) { return __uint_as_float(((unsigned)v.bits) << 16); }

__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(double* p, double v) { *p = v; }
__device__ __forceinline__ void store(half_bits* p, float v) { p->bits = float_to_half(v); }
__device__ __forceinline__ void store(bf16_bits* p, float v) { p->bits = float_to_bf16(v); }

// float / double overloads under one name each.
__device__ __forceinline__ float acc_exp(float v) { return expf(v); }
__device__ __forceinline__ double acc_exp(double v) { return exp(v); }
__device__ __forceinline__ float acc_min(float a, float b) { return fminf(a, b); }
__device__ __forceinline__ double acc_min(double a, double b) { return fmin(a, b); }
__device__ __forceinline__ float acc_max(float a, float b) { return fmaxf(a, b); }
__device__ __forceinline__ double acc_max(double a, double b) { return fmax(a, b); }

// exp(exponent) for a sum of A·Δ <= 0, flushed to exactly 0 below `floor` (portable_ssm.ssd.decay_floor,
// passed in by the caller); a NaN exponent gives 0 too, as portable_ssm.ssd.decay.
template <typename F> __device__ __forceinline__ F decay_factor(F exponent, F floor) {
    return exponent >= floor ? acc_exp(exponent) : (F)0;
}

// v is neither inf nor NaN: v - v is 0 exactly for finite v (IEEE arithmetic; no fast-math anywhere).
template <typename F> __device__ __forceinline__ bool is_finite(F v) { return v - v == (F)0; }

// softplus and silu written as portable_ssm._array writes them, so kernel and reference agree.
__device__ __forceinline__ float softplus(float v) { return fmaxf(v, 0.0f) + log1pf(expf(-fabsf(v))); }
__device__ __forceinline__ double softplus(double v) { return fmax(v, 0.0) + log1p(exp(-fabs(v))); }
__device__ __forceinline__ float silu(float v) { return v * (0.5f * (1.0f + tanhf(0.5f * v))); }
__device__ __forceinline__ double silu(double v) { return v * (0.5 * (1.0 + tanh(0.5 * v))); }

// Sum over the 32 lanes of a warp by a butterfly of shuffles: deterministic, no atomics.
// Every lane of the warp must call it.
template <typename A> __device__ __forceinline__ A warp_sum(A v) {
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// The fastest-varying coordinate of the row-major flat index `rest` along an axis of `extent`; `rest`
// keeps the slower ones. Peel the axes fastest first; what is left is the slowest coordinate.
__device__ __forceinline__ long long peel(long long& rest, long long extent) {
    const long long coordinate = rest % extent;
    rest /= extent;
    return coordinate;
}

// Grid-stride loop over `total` elements of a 1-D launch (64-bit indices).
#define GRID_STRIDE_LOOP(i, total)                                                  \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (total); \
         i += (long long)gridDim.x * blockDim.x)

#endif  // PORTABLE_SSM_COMMON_CUH
