// The chunked SSD scan's non-matmul parts (MAMBA2_SPEC.md, "Chunked SSD"); the three matmuls
// (C Bᵀ, M X and the chunk/entering-state products) run in cuBLAS through cupy.matmul. Together they
// equal portable_ssm.ssd.ssd_chunked, step for step:
//
//   chunk cumsum   acs = cumsum(A·Δ) inside each chunk                       ssd_chunk_cumsum
//   layout         B, C -> [b, c, g, Q, n], zero-padded past the end          ssd_pad_bc
//   X = x·Δ        Xh [b, c, h, Q, p]; Xd = X decayed to the chunk end         ssd_scale_x
//   1. diagonal    M = (C Bᵀ) ⊙ exp(segsum), lower triangle only              ssd_diag_mask
//   3. passing     S_in[c+1] = exp(acs_c[-1]) · S_in[c] + S_c                 ssd_state_passing
//   4. output      y = Y_diag + exp(acs) · Y_off                              ssd_combine
//
// Shape legend: b batch, L the full length, a segment of len steps from t0 is cut into c chunks of
// Q (the last one padded), h heads, p headdim, g groups (head i reads group i / (h/g)), n state.
// Inputs are x [b, L, h, p], Δ [b, L, h], A [h], B and C [b, L, g, n], all float32 or all float64.
// With seq_idx [b, L] (packed sequences, int64 ids) the masks of portable_ssm.ssd._boundaries apply:
// padded steps take the segment's last id, and the state entering chunk 0 has the id at t0 - 1
// (or the row's first id at t0 = 0).
#include "common.cuh"

// The id of padded step t of the segment.
__device__ __forceinline__ long long seq_at(const long long* seq, long long row, long long L, long long t0,
                                            long long len, long long t) {
    return seq[row * L + t0 + (t < len ? t : len - 1)];
}

// The id of the state entering chunk ci: that of the step just before the chunk.
__device__ __forceinline__ long long entering_id(const long long* seq, long long row, long long L, long long t0,
                                                 long long ci, long long Q) {
    const long long t = t0 + ci * Q - 1;
    return seq[row * L + (t >= 0 ? t : 0)];
}

// acs [b, c, h, Q]. Grid: 1-D grid-stride over (b, c, h), h fastest (neighbouring threads read
// neighbouring Δ); each thread runs the Q-step sum of its chunk and head. Padded steps add 0.
template <typename F>
__device__ void ssd_chunk_cumsum(const F* __restrict__ dt, const F* __restrict__ A, F* __restrict__ acs,
                                 long long b, long long L, long long t0, long long len, long long c,
                                 long long Q, long long h) {
    GRID_STRIDE_LOOP(i, b * c * h) {
        const long long hi = i % h;
        const long long ci = (i / h) % c;
        const long long row = i / (h * c);
        F* out = acs + ((row * c + ci) * h + hi) * Q;
        F run = 0;
        for (long long q = 0; q < Q; ++q) {
            const long long t = ci * Q + q;
            if (t < len) {
                run += dt[(row * L + t0 + t) * h + hi] * A[hi];
            }
            out[q] = run;
        }
    }
}

// Bg, Cg [b, c, g, Q, n] from B, C [b, L, g, n]. Grid: 1-D grid-stride over the outputs, n fastest.
template <typename F>
__device__ void ssd_pad_bc(const F* __restrict__ B, const F* __restrict__ C, F* __restrict__ Bg,
                           F* __restrict__ Cg, long long b, long long L, long long t0, long long len,
                           long long c, long long Q, long long g, long long n) {
    GRID_STRIDE_LOOP(i, b * c * g * Q * n) {
        const long long ni = i % n;
        const long long q = (i / n) % Q;
        const long long gi = (i / (n * Q)) % g;
        const long long ci = (i / (n * Q * g)) % c;
        const long long row = i / (n * Q * g * c);
        const long long t = ci * Q + q;
        F bv = 0;
        F cv = 0;
        if (t < len) {
            const long long src = ((row * L + t0 + t) * g + gi) * n + ni;
            bv = B[src];
            cv = C[src];
        }
        Bg[i] = bv;
        Cg[i] = cv;
    }
}

// X = x·Δ into Xh [b, c, h, Q, p] (for Y_diag = M X) and, decayed to the chunk end and kept only
// for the chunk's last sequence, into Xd [b, c, g, Q, (h/g)·p] (for S = Xdᵀ B per group).
// Grid: 1-D grid-stride over (b, c, Q, h, p), p fastest, as x is stored.
template <typename F>
__device__ void ssd_scale_x(const F* __restrict__ x, const F* __restrict__ dt, const F* __restrict__ acs,
                            const long long* __restrict__ seq, F* __restrict__ Xh, F* __restrict__ Xd,
                            long long b, long long L, long long t0, long long len, long long c, long long Q,
                            long long h, long long p, long long g, int has_seq) {
    GRID_STRIDE_LOOP(i, b * c * Q * h * p) {
        const long long pi = i % p;
        const long long hi = (i / p) % h;
        const long long q = (i / (p * h)) % Q;
        const long long ci = (i / (p * h * Q)) % c;
        const long long row = i / (p * h * Q * c);
        const long long t = ci * Q + q;
        const long long r = h / g;
        F X = 0;
        if (t < len) {
            const long long step = (row * L + t0 + t) * h + hi;
            X = x[step * p + pi] * dt[step];
        }
        const F* a = acs + ((row * c + ci) * h + hi) * Q;
        F to_end = acc_exp(acc_min(a[Q - 1] - a[q], (F)0));
        if (has_seq && seq_at(seq, row, L, t0, len, t) != seq_at(seq, row, L, t0, len, ci * Q + Q - 1)) {
            to_end = 0;
        }
        Xh[(((row * c + ci) * h + hi) * Q + q) * p + pi] = X;
        Xd[(((row * c + ci) * g + hi / r) * Q + q) * (r * p) + (hi % r) * p + pi] = X * to_end;
    }
}

// 1. M [b, c, h, Q, Q] = CB [b, c, g, Q, Q] ⊙ exp(acs[i] - acs[j]) for j <= i (and i, j in one
// sequence), else 0. Grid: 1-D grid-stride over M, j fastest.
template <typename F>
__device__ void ssd_diag_mask(const F* __restrict__ CB, const F* __restrict__ acs,
                              const long long* __restrict__ seq, F* __restrict__ M, long long b, long long L,
                              long long t0, long long len, long long c, long long Q, long long h, long long g,
                              int has_seq) {
    GRID_STRIDE_LOOP(i, b * c * h * Q * Q) {
        const long long j = i % Q;
        const long long qi = (i / Q) % Q;
        const long long hi = (i / (Q * Q)) % h;
        const long long ci = (i / (Q * Q * h)) % c;
        const long long row = i / (Q * Q * h * c);
        F m = 0;
        const bool same = !has_seq || seq_at(seq, row, L, t0, len, ci * Q + qi) ==
                                          seq_at(seq, row, L, t0, len, ci * Q + j);
        if (j <= qi && same) {
            const F* a = acs + ((row * c + ci) * h + hi) * Q;
            const long long gi = hi / (h / g);
            m = CB[(((row * c + ci) * g + gi) * Q + qi) * Q + j] * acc_exp(acc_min(a[qi] - a[j], (F)0));
        }
        M[i] = m;
    }
}

// 3. S_in [b, c, h, p, n] (the state entering each chunk) and final [b, h, p, n] from the chunk states
// S [b, c, h, p, n]; the carried state is dropped when the sequence that entered a chunk has ended
// by the chunk's end. Grid: 1-D grid-stride over the (b, h, p, n) state entries, n fastest; each
// thread walks the c chunks in order (a sequential recurrence, deterministic).
template <typename F>
__device__ void ssd_state_passing(const F* __restrict__ S, const F* __restrict__ acs, const F* __restrict__ init,
                                  const long long* __restrict__ seq, F* __restrict__ S_in, F* __restrict__ final_state,
                                  long long b, long long L, long long t0, long long len, long long c,
                                  long long Q, long long h, long long pn, int has_init, int has_seq) {
    GRID_STRIDE_LOOP(i, b * h * pn) {
        const long long e = i % (h * pn);
        const long long hi = e / pn;
        const long long row = i / (h * pn);
        F st = has_init ? init[i] : (F)0;
        for (long long ci = 0; ci < c; ++ci) {
            const long long chunk = row * c + ci;
            S_in[chunk * h * pn + e] = st;
            F decay = acc_exp(acs[(chunk * h + hi) * Q + Q - 1]);
            if (has_seq && seq_at(seq, row, L, t0, len, ci * Q + Q - 1) != entering_id(seq, row, L, t0, ci, Q)) {
                decay = 0;
            }
            st = decay * st + S[chunk * h * pn + e];
        }
        final_state[i] = st;
    }
}

// 4. y[b, t0 + t, h, p] = Y_diag [b, c, h, Q, p] + exp(acs) · Y_off [b, c, g, Q, (h/g)·p], the
// entering state reaching only the steps of the sequence it belongs to. Grid: 1-D grid-stride over
// the segment's (b, len, h, p) outputs, p fastest, as y is stored.
template <typename F>
__device__ void ssd_combine(const F* __restrict__ Y_diag, const F* __restrict__ Y_off, const F* __restrict__ acs,
                            const long long* __restrict__ seq, F* __restrict__ y, long long b, long long L,
                            long long t0, long long len, long long c, long long Q, long long h, long long p,
                            long long g, int has_seq) {
    GRID_STRIDE_LOOP(i, b * len * h * p) {
        const long long pi = i % p;
        const long long hi = (i / p) % h;
        const long long t = (i / (p * h)) % len;
        const long long row = i / (p * h * len);
        const long long ci = t / Q;
        const long long q = t % Q;
        const long long r = h / g;
        const long long chunk = row * c + ci;
        F decay = acc_exp(acs[(chunk * h + hi) * Q + q]);
        if (has_seq && seq_at(seq, row, L, t0, len, t) != entering_id(seq, row, L, t0, ci, Q)) {
            decay = 0;
        }
        const F off = Y_off[((chunk * g + hi / r) * Q + q) * (r * p) + (hi % r) * p + pi] * decay;
        y[((row * L + t0 + t) * h + hi) * p + pi] = Y_diag[((chunk * h + hi) * Q + q) * p + pi] + off;
    }
}

#define SSD_KERNELS(SUFFIX, F)                                                                          \
    extern "C" __global__ void ssd_chunk_cumsum_##SUFFIX(const F* dt, const F* A, F* acs, long long b,  \
                                                         long long L, long long t0, long long len,      \
                                                         long long c, long long Q, long long h) {       \
        ssd_chunk_cumsum<F>(dt, A, acs, b, L, t0, len, c, Q, h);                                        \
    }                                                                                                   \
    extern "C" __global__ void ssd_pad_bc_##SUFFIX(const F* B, const F* C, F* Bg, F* Cg, long long b,    \
                                                   long long L, long long t0, long long len, long long c, \
                                                   long long Q, long long g, long long n) {              \
        ssd_pad_bc<F>(B, C, Bg, Cg, b, L, t0, len, c, Q, g, n);                                         \
    }                                                                                                   \
    extern "C" __global__ void ssd_scale_x_##SUFFIX(                                                    \
        const F* x, const F* dt, const F* acs, const long long* seq, F* Xh, F* Xd, long long b,          \
        long long L, long long t0, long long len, long long c, long long Q, long long h, long long p,     \
        long long g, int has_seq) {                                                                     \
        ssd_scale_x<F>(x, dt, acs, seq, Xh, Xd, b, L, t0, len, c, Q, h, p, g, has_seq);                 \
    }                                                                                                   \
    extern "C" __global__ void ssd_diag_mask_##SUFFIX(                                                  \
        const F* CB, const F* acs, const long long* seq, F* M, long long b, long long L, long long t0,   \
        long long len, long long c, long long Q, long long h, long long g, int has_seq) {                \
        ssd_diag_mask<F>(CB, acs, seq, M, b, L, t0, len, c, Q, h, g, has_seq);                          \
    }                                                                                                   \
    extern "C" __global__ void ssd_state_passing_##SUFFIX(                                              \
        const F* S, const F* acs, const F* init, const long long* seq, F* S_in, F* final_state,          \
        long long b, long long L, long long t0, long long len, long long c, long long Q, long long h,    \
        long long pn, int has_init, int has_seq) {                                                      \
        ssd_state_passing<F>(S, acs, init, seq, S_in, final_state, b, L, t0, len, c, Q, h, pn, has_init, \
                             has_seq);                                                                  \
    }                                                                                                   \
    extern "C" __global__ void ssd_combine_##SUFFIX(                                                    \
        const F* Y_diag, const F* Y_off, const F* acs, const long long* seq, F* y, long long b,          \
        long long L, long long t0, long long len, long long c, long long Q, long long h, long long p,     \
        long long g, int has_seq) {                                                                     \
        ssd_combine<F>(Y_diag, Y_off, acs, seq, y, b, L, t0, len, c, Q, h, p, g, has_seq);              \
    }

SSD_KERNELS(f32, float)
SSD_KERNELS(f64, double)
