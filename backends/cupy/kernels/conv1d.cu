// Causal depthwise conv1d over a whole sequence (MAMBA2_SPEC.md step 2), the conv only (no SiLU):
// portable_ssm.conv.causal_conv1d_ref, which this must equal.
//
//   y[b, t, c] = sum_j w[c, j] * in[b, t + j - (k-1), c] + bias[c]
//
// where a time index tau < 0 reads the incoming conv state, state[b, c, tau + k] (the state keeps the
// last k inputs; its slot 0 is never read). With seq_idx [b, l] (packed sequences) a tap reads zero
// when it belongs to another sequence than t; the incoming state belongs to each row's first sequence.
// Storage T (float16/bfloat16 bits, float32, float64); weights and bias already in F = Acc<T>::type.
#include "common.cuh"

// Grid: 1-D grid-stride over the b*l*d outputs, channel fastest, so a warp reads 32 neighbouring
// channels of one time step (coalesced) and each tap re-reads rows the previous step brought to cache.
template <typename T, typename F>
__device__ void conv1d_forward(const T* __restrict__ x, const F* __restrict__ w, const F* __restrict__ bias,
                               const T* __restrict__ state, const long long* __restrict__ seq,
                               T* __restrict__ y, long long b, long long l, long long d, int k,
                               int has_bias, int has_state, int has_seq) {
    GRID_STRIDE_LOOP(i, b * l * d) {
        const long long c = i % d;
        const long long t = (i / d) % l;
        const long long row = i / (d * l);
        const long long id_t = has_seq ? seq[row * l + t] : 0;
        const bool state_in_sequence = !has_seq || seq[row * l] == id_t;
        F acc = 0;
        for (int j = 0; j < k; ++j) {  // taps in the reference's order: the oldest first
            const long long tau = t + j - (k - 1);
            F v = 0;
            if (tau >= 0) {
                if (!has_seq || seq[row * l + tau] == id_t) {
                    v = to_acc(x[(row * l + tau) * d + c]);
                }
            } else if (has_state && state_in_sequence) {
                v = to_acc(state[(row * d + c) * k + (tau + k)]);
            }
            acc += v * w[c * k + j];
        }
        if (has_bias) {
            acc += bias[c];
        }
        store(&y[i], acc);
    }
}

// The returned conv state: new_state[b, c, j] = the input at time l - k + j (the incoming state's
// slot for times < 0, zeros without one), zero where that input belongs to an earlier sequence than
// the row's last one. Grid: 1-D grid-stride over the b*d*k entries (j fastest, as stored).
template <typename T>
__device__ void conv1d_final_state(const T* __restrict__ x, const T* __restrict__ state,
                                   const long long* __restrict__ seq, T* __restrict__ new_state,
                                   long long b, long long l, long long d, int k, int has_state, int has_seq) {
    GRID_STRIDE_LOOP(i, b * d * k) {
        const long long j = i % k;
        const long long c = (i / k) % d;
        const long long row = i / (k * d);
        const long long tau = l - k + j;
        const bool kept = !has_seq || seq[row * l + (tau >= 0 ? tau : 0)] == seq[row * l + l - 1];
        if (kept && tau >= 0) {
            new_state[i] = x[(row * l + tau) * d + c];
        } else if (kept && has_state) {
            new_state[i] = state[(row * d + c) * k + (tau + k)];
        } else {
            store(&new_state[i], (typename Acc<T>::type)0);
        }
    }
}

#define CONV1D_KERNELS(SUFFIX, T, F)                                                                     \
    extern "C" __global__ void conv1d_forward_##SUFFIX(                                                  \
        const T* x, const F* w, const F* bias, const T* state, const long long* seq, T* y, long long b,   \
        long long l, long long d, int k, int has_bias, int has_state, int has_seq) {                      \
        conv1d_forward<T, F>(x, w, bias, state, seq, y, b, l, d, k, has_bias, has_state, has_seq);       \
    }                                                                                                    \
    extern "C" __global__ void conv1d_final_state_##SUFFIX(                                              \
        const T* x, const T* state, const long long* seq, T* new_state, long long b, long long l,          \
        long long d, int k, int has_state, int has_seq) {                                                \
        conv1d_final_state<T>(x, state, seq, new_state, b, l, d, k, has_state, has_seq);                 \
    }

CONV1D_KERNELS(f32, float, float)
CONV1D_KERNELS(f64, double, double)
CONV1D_KERNELS(f16, half_bits, float)
CONV1D_KERNELS(bf16, bf16_bits, float)
