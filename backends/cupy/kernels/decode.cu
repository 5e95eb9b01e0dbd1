// One token of one Mamba-2 layer after in_proj, fused into one launch (MAMBA2_SPEC.md steps 2 to 8,
// the norm and out_proj excluded); portable_ssm.backends.cupy.reference.decode_step_ref is its twin.
//
//   step 2  conv state <- [state[1:], xBC];  xBC <- silu(sum_j w[:, j] * state[:, j] + bias)
//   step 3  x = xBC[:h*p] as [h, p], B = next g*n as [g, n], C = last g*n as [g, n]
//   step 4  delta = clamp(softplus(dt + dt_bias), low, high)        (per head)
//   step 6-7  H <- exp(delta*A) * H + delta * outer(x, B);  y = H @ C + D * x
//   step 8  y <- y * silu(z)                                          (the gate; the norm follows)
//
// Storage T for xBC, dt, z, the conv state and y; F = Acc<T>::type (float, or double for float64)
// for the SSM state, the parameters and all the math.
#include "common.cuh"

// Grid (h, b): one block per head and batch row. Block: any multiple of 32 threads.
//   phase 1: the threads stride over the p + 2n channels this head reads (its x channels, then its
//            group's B and C channels), shift the conv window, convolve, apply SiLU and keep the
//            result in shared memory. The conv state of the head's x channels is written by this
//            block, that of a group's B and C channels by the group's first head only (no races).
//   phase 2: warp w takes the state rows pi = w, w + warps, ...; its lanes stride over n, update
//            H[pi, :] and reduce H[pi, :] @ C with shuffles (deterministic, no atomics).
// Shared memory: (p + 2n) values of F.
template <typename T, typename F>
__device__ void decode_step(const T* __restrict__ xBC, const T* __restrict__ dt, const T* __restrict__ z,
                            const T* __restrict__ conv_state, const F* __restrict__ ssm_state,
                            const F* __restrict__ conv_w, const F* __restrict__ conv_b,
                            const F* __restrict__ dt_bias, const F* __restrict__ A,
                            const F* __restrict__ D, T* __restrict__ y, T* __restrict__ new_conv_state,
                            F* __restrict__ new_ssm_state, int h, int p, int n, int g, int k, int has_bias,
                            int d_per_p, F dt_low, F dt_high) {
    extern __shared__ double shared_raw[];  // double-typed so the buffer is 8-byte aligned
    F* xs = reinterpret_cast<F*>(shared_raw);
    F* Bs = xs + p;
    F* Cs = Bs + n;
    const int head = blockIdx.x;
    const long long row = blockIdx.y;
    const int group = head / (h / g);
    const bool first_of_group = head % (h / g) == 0;
    const long long d_inner = (long long)h * p;
    const long long conv_dim = d_inner + 2LL * g * n;

    // phase 1: conv state shift + conv + SiLU for the channels of this head
    for (int j = threadIdx.x; j < p + 2 * n; j += blockDim.x) {
        long long channel;
        bool owner;
        F* slot;
        if (j < p) {
            channel = (long long)head * p + j;
            owner = true;
            slot = xs + j;
        } else if (j < p + n) {
            channel = d_inner + (long long)group * n + (j - p);
            owner = first_of_group;
            slot = Bs + (j - p);
        } else {
            channel = d_inner + (long long)(g + group) * n + (j - p - n);
            owner = first_of_group;
            slot = Cs + (j - p - n);
        }
        const T* window = conv_state + (row * conv_dim + channel) * k;
        T* new_window = new_conv_state + (row * conv_dim + channel) * k;
        F acc = 0;
        for (int q = 0; q < k; ++q) {
            const T v = q + 1 < k ? window[q + 1] : xBC[row * conv_dim + channel];
            if (owner) {
                new_window[q] = v;
            }
            acc += to_acc(v) * conv_w[channel * k + q];
        }
        if (has_bias) {
            acc += conv_b[channel];
        }
        *slot = silu(acc);
    }
    __syncthreads();

    // phase 2: discretize, update the state rows, read them out with C
    const F delta = acc_min(acc_max(softplus(to_acc(dt[row * h + head]) + dt_bias[head]), dt_low), dt_high);
    const F decay = acc_exp(delta * A[head]);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    const long long state_base = (row * h + head) * (long long)p * n;
    for (int base = 0; base < p; base += warps) {  // the same trip count in every warp
        const int pi = base + warp;
        F part = 0;
        if (pi < p) {
            const F feed = delta * xs[pi];
            for (int ni = lane; ni < n; ni += 32) {
                const long long e = state_base + (long long)pi * n + ni;
                const F s = decay * ssm_state[e] + feed * Bs[ni];
                new_ssm_state[e] = s;
                part += s * Cs[ni];
            }
        }
        const F total = warp_sum(part);
        if (pi < p && lane == 0) {
            const long long out = row * d_inner + (long long)head * p + pi;
            const F skip = D[d_per_p ? head * p + pi : head] * xs[pi];
            store(&y[out], (total + skip) * silu(to_acc(z[out])));
        }
    }
}

#define DECODE_KERNEL(SUFFIX, T, F)                                                                   \
    extern "C" __global__ void decode_step_##SUFFIX(                                                  \
        const T* xBC, const T* dt, const T* z, const T* conv_state, const F* ssm_state,                \
        const F* conv_w, const F* conv_b, const F* dt_bias, const F* A, const F* D, T* y,              \
        T* new_conv_state, F* new_ssm_state, int h, int p, int n, int g, int k, int has_bias,          \
        int d_per_p, F dt_low, F dt_high) {                                                           \
        decode_step<T, F>(xBC, dt, z, conv_state, ssm_state, conv_w, conv_b, dt_bias, A, D, y,        \
                          new_conv_state, new_ssm_state, h, p, n, g, k, has_bias, d_per_p, dt_low,     \
                          dt_high);                                                                   \
    }

DECODE_KERNEL(f32, float, float)
DECODE_KERNEL(f64, double, double)
DECODE_KERNEL(f16, half_bits, float)
DECODE_KERNEL(bf16, bf16_bits, float)
