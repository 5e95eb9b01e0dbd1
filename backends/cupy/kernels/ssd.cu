// The chunked SSD scan's non-matmul parts (MAMBA2_SPEC.md, "Chunked SSD"); the three matmuls
// (C Bᵀ, M X and the chunk/entering-state products) run in cuBLAS through cupy.matmul. Together they
// equal portable_ssm.ssd.ssd_chunked_ref, step for step, with its numerics:
//
//   exponents      a = A·Δ, acs = its running sum, to_end = a[q+1] + ... + a[Q-1]   ssd_chunk_exponents
//   layout         B, C -> [b, c, g, Q, n], zero-padded past the end                ssd_pad_bc
//   X = x·Δ        Xh [b, c, h, Q, p] (non-finite -> 0); Xd = X decayed to the end   ssd_scale_x
//   packed rows    Bg of steps outside the chunk's last sequence -> 0 (after C Bᵀ)  ssd_mask_b
//   1. diagonal    M = (C Bᵀ) ⊙ exp(a[j+1] + ... + a[i]), lower triangle only        ssd_diag_mask
//   3. passing     S_in[c+1] = exp(acs_c[-1]) · S_in[c] + S_c                       ssd_state_passing
//   4. output      y = Y_diag + poison + exp(acs) · Y_off                           ssd_combine
//
// Every in-chunk exponent is a sum of the step exponents between the two steps (the "stable
// segsum"), never a difference of running sums, which would lose the digits of one huge |A·Δ| for
// every later pair. Each decay factor below exp(floor) (floor = portable_ssm.ssd.decay_floor) is
// flushed to 0, a NaN exponent too. Non-finite input stays causal: non-finite X enter M X as 0 and
// come back as NaN from their step on ("poison", the running sum of X - X over the chunk), M is 0
// above the diagonal whatever C Bᵀ holds, and later chunks see them through the states. In packed
// rows a term of another sequence is selected out, never multiplied by a 0 (0·nan is nan): the
// chunk state's X and B (ssd_scale_x, ssd_mask_b), the dropped entering state (ssd_state_passing),
// its read outside its sequence and the poison of earlier sequences (ssd_combine).
//
// Shape legend: b batch, L the full length, a segment of len steps from t0 is cut into c chunks of
// Q (the last one padded), h heads, p headdim, g groups (head i reads group i / (h/g)), n state.
// Inputs are x [b, L, h, p], Δ [b, L, h], A [h], B and C [b, L, g, n], all float32 or all float64.
// With seq_idx [b, L] (packed sequences, int64 ids) the masks of portable_ssm.ssd._boundaries apply:
// padded steps take the segment's last id, and the state entering chunk 0 has the id at t0 - 1
// (or the row's first id at t0 = 0).
#include "common.cuh"

// Where a segment lies, and the index arithmetic every kernel shares.
struct Segment {
    long long b, L, t0, len, c, Q;

    // Flat index of step t (of the segment) of batch row `row` in an array [b, L, ...], in units of
    // the trailing axes' size.
    __device__ __forceinline__ long long step(long long row, long long t) const { return row * L + t0 + t; }
    // Flat index of chunk ci of batch row `row` in an array [b, c, ...], in the same units.
    __device__ __forceinline__ long long chunk(long long row, long long ci) const { return row * c + ci; }
    // Start of head hi's Q steps of chunk `chunk` in an array [b, c, h, Q].
    __device__ __forceinline__ long long head_steps(long long chunk, long long h, long long hi) const {
        return (chunk * h + hi) * Q;
    }
    // Element (q, head hi, pi) of chunk `chunk` in the grouped layout [b, c, g, Q, (h/g)·p] of Xd and Y_off.
    __device__ __forceinline__ long long grouped(long long chunk, long long q, long long hi, long long pi,
                                                 long long h, long long p, long long g) const {
        const long long r = h / g;
        return ((chunk * g + hi / r) * Q + q) * (r * p) + (hi % r) * p + pi;
    }
    // The id of padded step t of the segment.
    __device__ __forceinline__ long long seq_at(const long long* seq, long long row, long long t) const {
        return seq[step(row, t < len ? t : len - 1)];
    }
    // The id of the state entering chunk ci: that of the step just before the chunk.
    __device__ __forceinline__ long long entering_id(const long long* seq, long long row, long long ci) const {
        const long long t = t0 + ci * Q - 1;
        return seq[row * L + (t >= 0 ? t : 0)];
    }
};

// a = A·Δ (0 on padded steps), acs = a[0] + ... + a[q] and to_end = a[q+1] + ... + a[Q-1], each
// [b, c, h, Q]: to_end is summed from the chunk's end, step by step. Grid: 1-D grid-stride over
// (b, c, h), h fastest (neighbouring threads read neighbouring Δ); one thread per chunk and head.
template <typename F>
__device__ void ssd_chunk_exponents(const F* __restrict__ dt, const F* __restrict__ A, F* __restrict__ a,
                                    F* __restrict__ acs, F* __restrict__ to_end, const Segment s, long long h) {
    GRID_STRIDE_LOOP(i, s.b * s.c * h) {
        long long rest = i;
        const long long hi = peel(rest, h);
        const long long ci = peel(rest, s.c);
        const long long row = rest;
        const long long at = s.head_steps(s.chunk(row, ci), h, hi);
        F run = 0;
        for (long long q = 0; q < s.Q; ++q) {
            const long long t = ci * s.Q + q;
            const F step = t < s.len ? dt[s.step(row, t) * h + hi] * A[hi] : (F)0;
            a[at + q] = step;
            run += step;
            acs[at + q] = run;
        }
        F suffix = 0;
        for (long long q = s.Q - 1; q >= 0; --q) {
            to_end[at + q] = suffix;
            suffix += a[at + q];
        }
    }
}

// Bg, Cg [b, c, g, Q, n] from B, C [b, L, g, n]. Grid: 1-D grid-stride over the outputs, n fastest.
template <typename F>
__device__ void ssd_pad_bc(const F* __restrict__ B, const F* __restrict__ C, F* __restrict__ Bg,
                           F* __restrict__ Cg, const Segment s, long long g, long long n) {
    GRID_STRIDE_LOOP(i, s.b * s.c * g * s.Q * n) {
        long long rest = i;
        const long long ni = peel(rest, n);
        const long long q = peel(rest, s.Q);
        const long long gi = peel(rest, g);
        const long long ci = peel(rest, s.c);
        const long long row = rest;
        const long long t = ci * s.Q + q;
        F bv = 0;
        F cv = 0;
        if (t < s.len) {
            const long long src = (s.step(row, t) * g + gi) * n + ni;
            bv = B[src];
            cv = C[src];
        }
        Bg[i] = bv;
        Cg[i] = cv;
    }
}

// X = x·Δ into Xh [b, c, h, Q, p] (for Y_diag = M Xh), non-finite values as 0, and, decayed to the
// chunk end and kept only for the chunk's last sequence, into Xd [b, c, g, Q, (h/g)·p] (for
// S = Xdᵀ B per group; non-finite values kept). Grid: 1-D grid-stride over (b, c, Q, h, p), p fastest.
template <typename F>
__device__ void ssd_scale_x(const F* __restrict__ x, const F* __restrict__ dt, const F* __restrict__ to_end,
                            const long long* __restrict__ seq, F* __restrict__ Xh, F* __restrict__ Xd,
                            const Segment s, long long h, long long p, long long g, F floor, int has_seq) {
    GRID_STRIDE_LOOP(i, s.b * s.c * s.Q * h * p) {
        long long rest = i;
        const long long pi = peel(rest, p);
        const long long hi = peel(rest, h);
        const long long q = peel(rest, s.Q);
        const long long ci = peel(rest, s.c);
        const long long row = rest;
        const long long t = ci * s.Q + q;
        const long long chunk = s.chunk(row, ci);
        F X = 0;
        if (t < s.len) {
            const long long step = s.step(row, t) * h + hi;
            X = x[step * p + pi] * dt[step];
        }
        const F decay = decay_factor(to_end[s.head_steps(chunk, h, hi) + q], floor);
        const bool fed = !has_seq || s.seq_at(seq, row, t) == s.seq_at(seq, row, ci * s.Q + s.Q - 1);
        Xh[(s.head_steps(chunk, h, hi) + q) * p + pi] = is_finite(X) ? X : (F)0;
        Xd[s.grouped(chunk, q, hi, pi, h, p, g)] = fed ? X * decay : (F)0;
    }
}

// Packed rows: Bg [b, c, g, Q, n] set to 0 at the steps outside each chunk's last sequence, once C Bᵀ
// has read it, so that the chunk state Xdᵀ B takes no term (not even 0·nan) of an ended sequence.
// Grid: 1-D grid-stride over Bg, n fastest.
template <typename F>
__device__ void ssd_mask_b(F* __restrict__ Bg, const long long* __restrict__ seq, const Segment s, long long g,
                           long long n) {
    GRID_STRIDE_LOOP(i, s.b * s.c * g * s.Q * n) {
        long long rest = i / n;
        const long long q = peel(rest, s.Q);
        peel(rest, g);
        const long long ci = peel(rest, s.c);
        const long long row = rest;
        if (s.seq_at(seq, row, ci * s.Q + q) != s.seq_at(seq, row, ci * s.Q + s.Q - 1)) {
            Bg[i] = 0;
        }
    }
}

// 1. M [b, c, h, Q, Q] = CB [b, c, g, Q, Q] ⊙ exp(a[j+1] + ... + a[i]) for j <= i (and i, j in one
// sequence), else 0 (also where CB is not finite). Grid: 1-D grid-stride over M, j fastest; each
// thread sums its i - j exponents in step order, as portable_ssm.ssd.stable_segsum.
template <typename F>
__device__ void ssd_diag_mask(const F* __restrict__ CB, const F* __restrict__ a, const long long* __restrict__ seq,
                              F* __restrict__ M, const Segment s, long long h, long long g, F floor, int has_seq) {
    GRID_STRIDE_LOOP(i, s.b * s.c * h * s.Q * s.Q) {
        long long rest = i;
        const long long j = peel(rest, s.Q);
        const long long qi = peel(rest, s.Q);
        const long long hi = peel(rest, h);
        const long long ci = peel(rest, s.c);
        const long long row = rest;
        const long long chunk = s.chunk(row, ci);
        F m = 0;
        const bool same = !has_seq || s.seq_at(seq, row, ci * s.Q + qi) == s.seq_at(seq, row, ci * s.Q + j);
        if (j <= qi && same) {
            const F* steps = a + s.head_steps(chunk, h, hi);
            F segsum = 0;
            for (long long k = j + 1; k <= qi; ++k) {
                segsum += steps[k];
            }
            m = CB[((chunk * g + hi / (h / g)) * s.Q + qi) * s.Q + j] * decay_factor(segsum, floor);
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
                                  const Segment s, long long h, long long pn, F floor, int has_init, int has_seq) {
    GRID_STRIDE_LOOP(i, s.b * h * pn) {
        long long rest = i;
        const long long e = peel(rest, h * pn);
        const long long row = rest;
        const long long hi = e / pn;
        F st = has_init ? init[i] : (F)0;
        for (long long ci = 0; ci < s.c; ++ci) {
            const long long chunk = s.chunk(row, ci);
            S_in[chunk * h * pn + e] = st;
            const F decay = decay_factor(acs[s.head_steps(chunk, h, hi) + s.Q - 1], floor);
            const bool carried = !has_seq || s.seq_at(seq, row, ci * s.Q + s.Q - 1) == s.entering_id(seq, row, ci);
            st = (carried ? decay * st : (F)0) + S[chunk * h * pn + e];
        }
        final_state[i] = st;
    }
}

// 4. y[b, t0 + t, h, p] = Y_diag [b, c, h, Q, p] + poison + exp(acs) · Y_off [b, c, g, Q, (h/g)·p],
// the entering state reaching only the steps of the sequence it belongs to; poison is the running
// sum of X - X from the chunk's start (or t's sequence's first step in it) to t (0, or NaN from a
// non-finite X on, which Xh held as 0).
// Grid: 1-D grid-stride over the segment's (b, len, h, p) outputs, p fastest, as y is stored.
template <typename F>
__device__ void ssd_combine(const F* __restrict__ Y_diag, const F* __restrict__ Y_off, const F* __restrict__ acs,
                            const F* __restrict__ x, const F* __restrict__ dt, const long long* __restrict__ seq,
                            F* __restrict__ y, const Segment s, long long h, long long p, long long g, F floor,
                            int has_seq) {
    GRID_STRIDE_LOOP(i, s.b * s.len * h * p) {
        long long rest = i;
        const long long pi = peel(rest, p);
        const long long hi = peel(rest, h);
        const long long t = peel(rest, s.len);
        const long long row = rest;
        const long long ci = t / s.Q;
        const long long q = t % s.Q;
        const long long chunk = s.chunk(row, ci);
        const F decay = decay_factor(acs[s.head_steps(chunk, h, hi) + q], floor);
        const long long id = has_seq ? s.seq_at(seq, row, t) : 0;
        F poison = 0;
        for (long long k = ci * s.Q; k <= t; ++k) {
            if (has_seq && s.seq_at(seq, row, k) != id) {
                continue;  // an earlier sequence's step
            }
            const long long step = s.step(row, k) * h + hi;
            const F X = x[step * p + pi] * dt[step];
            poison += X - X;
        }
        const bool entered = !has_seq || id == s.entering_id(seq, row, ci);
        const F off = entered ? Y_off[s.grouped(chunk, q, hi, pi, h, p, g)] * decay : (F)0;
        y[(s.step(row, t) * h + hi) * p + pi] = Y_diag[(s.head_steps(chunk, h, hi) + q) * p + pi] + poison + off;
    }
}

// The kernels' segment arguments, and the Segment they make.
#define SSD_SEGMENT_PARAMS long long b, long long L, long long t0, long long len, long long c, long long Q
#define SSD_SEGMENT Segment{b, L, t0, len, c, Q}

#define SSD_KERNELS(SUFFIX, F)                                                                          \
    extern "C" __global__ void ssd_chunk_exponents_##SUFFIX(const F* dt, const F* A, F* a, F* acs,      \
                                                            F* to_end, SSD_SEGMENT_PARAMS, long long h) { \
        ssd_chunk_exponents<F>(dt, A, a, acs, to_end, SSD_SEGMENT, h);                                  \
    }                                                                                                   \
    extern "C" __global__ void ssd_pad_bc_##SUFFIX(const F* B, const F* C, F* Bg, F* Cg, SSD_SEGMENT_PARAMS, \
                                                   long long g, long long n) {                          \
        ssd_pad_bc<F>(B, C, Bg, Cg, SSD_SEGMENT, g, n);                                                 \
    }                                                                                                   \
    extern "C" __global__ void ssd_scale_x_##SUFFIX(const F* x, const F* dt, const F* to_end,            \
                                                    const long long* seq, F* Xh, F* Xd, SSD_SEGMENT_PARAMS, \
                                                    long long h, long long p, long long g, F floor,     \
                                                    int has_seq) {                                      \
        ssd_scale_x<F>(x, dt, to_end, seq, Xh, Xd, SSD_SEGMENT, h, p, g, floor, has_seq);               \
    }                                                                                                   \
    extern "C" __global__ void ssd_mask_b_##SUFFIX(F* Bg, const long long* seq, SSD_SEGMENT_PARAMS,       \
                                                   long long g, long long n) {                          \
        ssd_mask_b<F>(Bg, seq, SSD_SEGMENT, g, n);                                                      \
    }                                                                                                   \
    extern "C" __global__ void ssd_diag_mask_##SUFFIX(const F* CB, const F* a, const long long* seq, F* M, \
                                                      SSD_SEGMENT_PARAMS, long long h, long long g, F floor, \
                                                      int has_seq) {                                    \
        ssd_diag_mask<F>(CB, a, seq, M, SSD_SEGMENT, h, g, floor, has_seq);                             \
    }                                                                                                   \
    extern "C" __global__ void ssd_state_passing_##SUFFIX(                                              \
        const F* S, const F* acs, const F* init, const long long* seq, F* S_in, F* final_state,          \
        SSD_SEGMENT_PARAMS, long long h, long long pn, F floor, int has_init, int has_seq) {            \
        ssd_state_passing<F>(S, acs, init, seq, S_in, final_state, SSD_SEGMENT, h, pn, floor, has_init,  \
                             has_seq);                                                                  \
    }                                                                                                   \
    extern "C" __global__ void ssd_combine_##SUFFIX(                                                    \
        const F* Y_diag, const F* Y_off, const F* acs, const F* x, const F* dt, const long long* seq,    \
        F* y, SSD_SEGMENT_PARAMS, long long h, long long p, long long g, F floor, int has_seq) {        \
        ssd_combine<F>(Y_diag, Y_off, acs, x, dt, seq, y, SSD_SEGMENT, h, p, g, floor, has_seq);        \
    }

SSD_KERNELS(f32, float)
SSD_KERNELS(f64, double)
