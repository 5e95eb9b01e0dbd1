// torch's hand-written CPU kernels, registered as ops of the portable_ssm_cpu namespace: batch-1
// decode's one-row products, the decode step and the whole-model step, the conv with SiLU, the gated
// RMSNorm and the chunked scan with their backwards. Built on first use by
// backends/torch_kernels.py (torch.utils.cpp_extension.load), which documents them.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <omp.h>
#include <string>
#include <tuple>
#include <utility>
#include <vector>
#include <type_traits>

#include "decode_model.h"
#include "shared.h"

namespace {

inline RowWeight row_weight(const at::Tensor& weight, const c10::optional<at::Tensor>& scale, int64_t in,
                            const char* op, const std::string& name) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == in && weight.is_contiguous(), op, ": ", name,
              " must be a contiguous [out, ", in, "], got ", weight.sizes());
  const at::ScalarType type = weight.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kChar || type == at::kBFloat16, op, ": ", name,
              " must be float32, int8 or bfloat16, got ", type);
  const int64_t out = weight.size(0);
  const float* s = nullptr;
  if (scale.has_value()) {
    TORCH_CHECK(scale->dim() == 1 && scale->size(0) == out && scale->scalar_type() == at::kFloat &&
                scale->is_contiguous(), op, ": ", name, "'s scale must be a contiguous float32 [", out, "]");
    s = scale->data_ptr<float>();
  }
  const int64_t kind = type == at::kFloat ? kWeightF32 : type == at::kChar ? kWeightI8 : kWeightBF16;
  return {weight.data_ptr(), kind, s, out, in};
}

at::Tensor row_gemv(const at::Tensor& row, const at::Tensor& weight, const c10::optional<at::Tensor>& scale) {
  TORCH_CHECK(row.dim() == 2 && row.size(0) == 1 && row.scalar_type() == at::kFloat && row.is_contiguous(),
              "row_gemv: row must be a contiguous float32 [1, in], got ", row.sizes(), " ", row.scalar_type());
  const RowWeight w = row_weight(weight, scale, row.size(1), "row_gemv", "weight");
  at::Tensor y = at::empty({1, w.out}, row.options());
  const float* x = row.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, w.out, 64, [&](int64_t begin, int64_t end) { row_share(w, x, yp, begin, end); });
  return y;
}

// A tensor whose last two axes are packed (rows of size(-2)·size(-1) contiguous floats), its
// leading axes at any stride: a slice of in_proj's output, read in place.
inline bool packed_rows(const at::Tensor& t) {
  return t.numel() == 0 || (t.stride(-1) == 1 && (t.size(-2) == 1 || t.stride(-2) == t.size(-1)));
}


inline void check_f32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == at::kFloat && t.is_contiguous(), "decode_step: ", name,
              " must be a contiguous float32 tensor of rank ", dim, ", got ", t.sizes(), " ", t.scalar_type());
}


// One token of one layer after in_proj (portable_ssm.mixer.decode_step_ref): the conv step and SiLU,
// Δ = clamp(softplus(dt + dt_bias)), H' = exp(Δ·A)·H + Δ·outer(x, B), y = (H' @ C + D·x)·silu(z).
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_step(
    const at::Tensor& xBC, const at::Tensor& dt, const at::Tensor& z, const at::Tensor& conv_state,
    const at::Tensor& ssm_state, const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias,
    const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, double low, double high,
    int64_t ngroups, int64_t headdim) {
  check_f32(xBC, "xBC", 2); check_f32(dt, "dt", 2); check_f32(z, "z", 2); check_f32(conv_state, "conv_state", 3);
  check_f32(ssm_state, "ssm_state", 4); check_f32(conv_weight, "conv_weight", 2); check_f32(dt_bias, "dt_bias", 1);
  check_f32(A, "A", 1); check_f32(D, "D", D.dim());
  const int64_t b = xBC.size(0), conv_dim = xBC.size(1), k = conv_state.size(2), h = dt.size(1);
  const int64_t p = headdim, n = ssm_state.size(3), g = ngroups, d_inner = h * p;
  TORCH_CHECK(g > 0 && h % g == 0 && conv_dim == d_inner + 2 * g * n && k > 0, "decode_step: inconsistent sizes");
  TORCH_CHECK(dt.size(0) == b && z.size(0) == b && z.size(1) == d_inner && conv_state.size(0) == b &&
              conv_state.size(1) == conv_dim && conv_weight.size(0) == conv_dim && conv_weight.size(1) == k &&
              ssm_state.size(0) == b && ssm_state.size(1) == h && ssm_state.size(2) == p &&
              dt_bias.size(0) == h && A.size(0) == h && D.size(0) == h && (D.dim() == 1 || D.size(1) == p),
              "decode_step: shapes do not match xBC ", xBC.sizes(), " and ssm_state ", ssm_state.sizes());
  const float* bias = nullptr;
  if (conv_bias.has_value()) {
    check_f32(*conv_bias, "conv_bias", 1);
    TORCH_CHECK(conv_bias->size(0) == conv_dim, "decode_step: conv_bias must be [", conv_dim, "]");
    bias = conv_bias->data_ptr<float>();
  }
  at::Tensor act = at::empty({b, conv_dim}, xBC.options());
  at::Tensor new_conv = at::empty_like(conv_state), new_ssm = at::empty_like(ssm_state);
  at::Tensor y = at::empty({b, d_inner}, xBC.options());
  const float *xin = xBC.data_ptr<float>(), *cs = conv_state.data_ptr<float>(), *w = conv_weight.data_ptr<float>();
  float *ap = act.data_ptr<float>(), *ncs = new_conv.data_ptr<float>();
  for (int64_t row = 0; row < b; ++row) {
    conv_step(cs + row * conv_dim * k, xin + row * conv_dim, w, bias, ncs + row * conv_dim * k, ap + row * conv_dim, k,
              conv_dim);
  }
  const float *dtp = dt.data_ptr<float>(), *zp = z.data_ptr<float>(), *H = ssm_state.data_ptr<float>();
  const float *dbp = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Dp = D.data_ptr<float>();
  const bool d_per_channel = D.dim() == 2;
  float *Hn = new_ssm.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float lo = static_cast<float>(low), hi = static_cast<float>(high);
  const bool stream = streams(Hn, n);
  at::parallel_for(0, b * h, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {  // one head of one row
      const int64_t row = bh / h, head = bh % h, group = head / (h / g);
      const float* a = ap + row * conv_dim;
      head_step(dtp[bh], dbp[head], Ap[head], lo, hi, a + head * p, a + d_inner + group * n,
                a + d_inner + g * n + group * n, H + bh * p * n, Hn + bh * p * n, stream,
                d_per_channel ? Dp + head * p : nullptr, Dp[head], zp + row * d_inner + head * p,
                yp + row * d_inner + head * p, p, n);
    }
    _mm_sfence();  // the streamed rows are visible before the step returns
  });
  return {y, new_conv, new_ssm};
}

// One head's diagonal block of one chunk of the chunked scan's backward (step 1 of
// portable_ssm.backends.torch_scan's loop), in one pass over its [q, q] block: with seg_ij = pre_i -
// pre_j (float64 prefix sums of A·Δ, the difference rounded to float32), L_ij = exp(max(seg_ij,
// floor)) for j <= i and 0 above, G = C Bᵀ [q, q] and dW = dy xᵀ [q, q],
//   w_ij = W_ij = L_ij G_ij Δ_j (the block's weights, 0 above the diagonal),
//   dG_ij += dW_ij L_ij Δ_j (this head's share of dG),  dd_j = Σ_i dW_ij L_ij G_ij (dΔ through the block),
//   dacs_i = Σ_j dW_ij W_ij - Σ_j dW_ji W_ji (the gradient of the cumulative sums; seg_ij = acs_i - acs_j).
// seg and down: scratch of q floats.
inline void diagonal_block_head(const double* pre, const float* d, const float* G, const float* dW, int64_t q,
                                float lowest, float* w, float* dG, float* dd, float* dacs, float* seg, float* down) {
  std::fill(dd, dd + q, 0.f);
  std::fill(down, down + q, 0.f);  // Σ_i over the rows so far, per column
  for (int64_t i = 0; i < q; ++i) {
    const float *e = dW + i * q, *g = G + i * q;
    float *wi = w + i * q, *dg = dG + i * q;
    for (int64_t j = 0; j <= i; ++j) seg[j] = std::max(static_cast<float>(pre[i] - pre[j]), lowest);
    __m256 across = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= i + 1; j += 8) {
      const __m256 L = exp8(_mm256_loadu_ps(seg + j)), dj = _mm256_loadu_ps(d + j);
      const __m256 gj = _mm256_loadu_ps(g + j), eL = _mm256_mul_ps(_mm256_loadu_ps(e + j), L);
      _mm256_storeu_ps(wi + j, _mm256_mul_ps(_mm256_mul_ps(L, gj), dj));
      _mm256_storeu_ps(dg + j, _mm256_fmadd_ps(eL, dj, _mm256_loadu_ps(dg + j)));
      const __m256 t = _mm256_mul_ps(eL, gj), u = _mm256_mul_ps(t, dj);
      _mm256_storeu_ps(dd + j, _mm256_add_ps(_mm256_loadu_ps(dd + j), t));
      _mm256_storeu_ps(down + j, _mm256_add_ps(_mm256_loadu_ps(down + j), u));
      across = _mm256_add_ps(across, u);
    }
    float row_sum = horizontal_sum(across);
    for (; j <= i; ++j) {
      const float L = std::exp(seg[j]), eL = e[j] * L, t = eL * g[j], u = t * d[j];
      wi[j] = L * g[j] * d[j];
      dg[j] += eL * d[j];
      dd[j] += t;
      down[j] += u;
      row_sum += u;
    }
    std::fill(wi + i + 1, wi + q, 0.f);
    dacs[i] = row_sum;
  }
  for (int64_t i = 0; i < q; ++i) dacs[i] -= down[i];
}

// The scan's products through ATen (scan_forward_item's gemm): C_i = op(A_i) op(B_i) + beta C_i for
// i < count, row-major, views of the buffers (mm or addmm for one, bmm or baddbmm for several).
inline void torch_gemm(int64_t count, bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda,
                       int64_t sa, const float* B, int64_t ldb, int64_t sb, float beta, float* C, int64_t ldc,
                       int64_t sc) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor a = ta ? at::from_blob(const_cast<float*>(A), {count, k, m}, {sa, lda, 1}, f32).transpose(1, 2)
                          : at::from_blob(const_cast<float*>(A), {count, m, k}, {sa, lda, 1}, f32);
  const at::Tensor bt = tb ? at::from_blob(const_cast<float*>(B), {count, n, k}, {sb, ldb, 1}, f32).transpose(1, 2)
                           : at::from_blob(const_cast<float*>(B), {count, k, n}, {sb, ldb, 1}, f32);
  at::Tensor c = at::from_blob(C, {count, m, n}, {sc, ldc, 1}, f32);
  if (count == 1) {
    at::Tensor c0 = c[0];
    if (beta == 0.f) at::mm_out(c0, a[0], bt[0]); else c0.addmm_(a[0], bt[0], beta);
  } else if (beta == 0.f) {
    at::bmm_out(c, a, bt);
  } else {
    c.baddbmm_(a, bt, beta);
  }
}

// The scan's sizes and optional inputs, once its tensors are checked (`name`: the kernel, for messages).
struct ScanSizes {
  int64_t b, l, h, p, g, n, r;
  const float* D;  // nullptr: no skip
  bool d_per_channel;  // D is [h, p], else [h]
  const float* initial;  // nullptr: no initial state
};

// The scan's inputs as ssd_chunked_ref takes them (no seq_idx): x [b, l, h, p], B and C [b, l, g, n]
// float32 with packed rows at any row and step stride (slices of the conv's output), dt [b, l, h] and
// A [h] contiguous float32, D [h] or [h, p] and initial [b, h, p, n] contiguous float32 or absent.
ScanSizes check_scan(const char* name, const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A,
                     const at::Tensor& B, const at::Tensor& C, const c10::optional<at::Tensor>& D,
                     const c10::optional<at::Tensor>& initial) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat && packed_rows(x),
              name, ": x must be a float32 [b, l, h, p] with contiguous [h, p] rows, got ", x.sizes(), " ",
              x.strides(), " ", x.scalar_type());
  const int64_t b = x.size(0), l = x.size(1), h = x.size(2), p = x.size(3);
  TORCH_CHECK(B.dim() == 4 && B.sizes() == C.sizes() && B.size(0) == b && B.size(1) == l && B.size(2) > 0 &&
                  h % B.size(2) == 0,
              name, ": B and C must be [b, l, g, n] with g dividing h = ", h, ", got ", B.sizes(), " and ",
              C.sizes());
  const int64_t g = B.size(2), n = B.size(3), r = h / g;
  TORCH_CHECK(B.scalar_type() == at::kFloat && C.scalar_type() == at::kFloat && packed_rows(B) && packed_rows(C),
              name, ": B and C must be float32 with contiguous [g, n] rows, got strides ", B.strides(), " and ",
              C.strides());
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.is_contiguous() && A.scalar_type() == at::kFloat &&
                  A.is_contiguous(), name, ": dt and A must be contiguous float32");
  TORCH_CHECK(dt.dim() == 3 && dt.size(0) == b && dt.size(1) == l && dt.size(2) == h && A.dim() == 1 &&
                  A.size(0) == h, name, ": dt must be [b, l, h] and A [h] for x ", x.sizes(), ", got ",
              dt.sizes(), " and ", A.sizes());
  const float* Dp = nullptr;
  bool d_per_channel = false;
  if (D.has_value()) {
    TORCH_CHECK(D->scalar_type() == at::kFloat && D->is_contiguous() &&
                ((D->dim() == 1 && D->size(0) == h) || (D->dim() == 2 && D->size(0) == h && D->size(1) == p)),
                name, ": D must be a contiguous float32 [h] or [h, p], got ", D->sizes());
    Dp = D->data_ptr<float>();
    d_per_channel = D->dim() == 2;
  }
  const float* Ip = nullptr;
  if (initial.has_value()) {
    TORCH_CHECK(initial->scalar_type() == at::kFloat && initial->is_contiguous() && initial->dim() == 4 &&
                initial->size(0) == b && initial->size(1) == h && initial->size(2) == p && initial->size(3) == n,
                name, ": initial_states must be a contiguous float32 [b, h, p, n], got ", initial->sizes());
    Ip = initial->data_ptr<float>();
  }
  return {b, l, h, p, g, n, r, Dp, d_per_channel, Ip};
}

// The chunked scan's forward (portable_ssm.ssd.ssd_chunked_ref without seq_idx) for float32
// tensors: scan_forward_item's work items (blocks of `block` heads of one group and row) split over
// the threads, their products through ATen (torch_gemm). Returns (y, final state, the sum of every
// output and final entry in float64: non-finite wherever one of them is); `safe`: see
// scan_forward_item.
std::tuple<at::Tensor, at::Tensor, at::Tensor> scan_forward(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
    const c10::optional<at::Tensor>& D, const c10::optional<at::Tensor>& initial, int64_t chunk, double floor,
    int64_t block, bool safe) {
  const ScanSizes z = check_scan("scan_forward", x, dt, A, B, C, D, initial);
  TORCH_CHECK(chunk > 0 && block > 0, "scan_forward: chunk and block must be positive");
  const int64_t b = z.b, l = z.l, h = z.h, p = z.p, g = z.g, n = z.n, r = z.r;
  at::Tensor y = at::empty({b, l, h, p}, x.options()), final = at::empty({b, h, p, n}, x.options());
  const int64_t blocks = (r + block - 1) / block, items = b * g * blocks;
  // x, B and C may be slices of wider rows (the conv's output): their step and row strides
  const ScanView view{b, l, h, p, g, n, r, x.data_ptr<float>(), dt.data_ptr<float>(), A.data_ptr<float>(),
                      B.data_ptr<float>(), C.data_ptr<float>(), z.D, z.initial, z.d_per_channel,
                      x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
                      y.data_ptr<float>(), final.data_ptr<float>(), std::min(chunk, std::max<int64_t>(l, 1)), block,
                      blocks, static_cast<float>(floor), safe};
  std::vector<double> sums(items, 0.0);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) sums[item] = scan_forward_item(view, item, torch_gemm);
  });
  double check = 0.0;
  for (double s : sums) check += s;
  return {y, final, at::scalar_tensor(check, at::TensorOptions().dtype(at::kDouble))};
}

// Per head of a block of bw heads, one chunk's factors from its q steps of Δ (at d[j·h] for the block's
// first head, the heads one apart) and A (at Ah, as d): the steps Δ, the float64 prefix sums pre of
// a = A·Δ from the chunk's start, exp(acs_i) (from_start, acs the float32 cumulative sum), exp(acs_last
// - acs_j) Δ_j (fed: what x_j feeds the leaving state; its exp is to_end) and exp(acs_last) (chunk),
// each exp flushed to 0 below `lowest` (portable_ssm.ssd.decay). Per-head rows of the arrays are Q apart.
struct ChunkFactors {
  std::vector<float> delta, from_start, to_end, fed, chunk;
  std::vector<double> pre;
  int64_t Q;
  ChunkFactors(int64_t bw, int64_t Q)
      : delta(bw * Q), from_start(bw * Q), to_end(bw * Q), fed(bw * Q), chunk(bw), pre(bw * Q), Q(Q) {}
  void compute(const float* d, const float* Ah, int64_t h, int64_t bw, int64_t q, float lowest) {
    const auto decay = [lowest](float v) { return v >= lowest ? std::exp(v) : 0.f; };
    for (int64_t hh = 0; hh < bw; ++hh) {
      const float a_h = Ah[hh];
      float run = 0.f, suffix = 0.f;
      double prun = 0.0;
      for (int64_t j = 0; j < q; ++j) {
        const float step = d[j * h + hh], a = step * a_h;
        run += a;
        prun += static_cast<double>(a);
        delta[hh * Q + j] = step;
        pre[hh * Q + j] = prun;
        from_start[hh * Q + j] = decay(run);
      }
      chunk[hh] = decay(run);
      for (int64_t j = q - 1; j >= 0; --j) {  // suffix: Σ_{k>j} a_k, from the end
        to_end[hh * Q + j] = decay(suffix);
        fed[hh * Q + j] = to_end[hh * Q + j] * delta[hh * Q + j];
        suffix += delta[hh * Q + j] * a_h;
      }
    }
  }
};

// The chunked scan's backward for float32 tensors: the gradients of sum(dy·y) + sum(dfinal·final)
// for (y, final) = scan_forward(x, dt, A, B, C, D, initial) (what
// portable_ssm.backends.torch_scan.ssd_chunked_grad computes in torch ops and documents step by
// step), in chunks of `chunk`. One pass per block of `block` heads of a group (the blocks split over
// the threads): the states entering the chunks recomputed first (the block's [n, block·p] state, one
// Bᵀ X product per chunk), then the chunks from last to first, each product one matrix product for
// the block (C Bᵀ, dy xᵀ and Wᵀ dy per head, dy Sᵀ per head, Cᵀ dy, B dS, X dSᵀ) and the diagonal
// blocks one pass per head (diagonal_block_head). Returns (dx [b, l, h, p], dΔ [b, l, h], dA [h], dB
// and dC [b, l, g, n], dD as D (empty without), d initial [b, h, p, n] (empty without)); dA and dD
// sum over the steps in float64.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> scan_backward(
    const at::Tensor& x, const at::Tensor& dt, const at::Tensor& A, const at::Tensor& B, const at::Tensor& C,
    const c10::optional<at::Tensor>& D, const c10::optional<at::Tensor>& initial, const at::Tensor& dy,
    const at::Tensor& dfinal, int64_t chunk, double floor, int64_t block) {
  const ScanSizes z = check_scan("scan_backward", x, dt, A, B, C, D, initial);
  const int64_t b = z.b, l = z.l, h = z.h, p = z.p, g = z.g, n = z.n, r = z.r;
  TORCH_CHECK(dy.scalar_type() == at::kFloat && dy.is_contiguous() && dy.sizes() == x.sizes(),
              "scan_backward: dy must be a contiguous float32 ", x.sizes(), ", got ", dy.sizes(), " ",
              dy.scalar_type());
  TORCH_CHECK(dfinal.scalar_type() == at::kFloat && dfinal.is_contiguous() && dfinal.dim() == 4 &&
              dfinal.size(0) == b && dfinal.size(1) == h && dfinal.size(2) == p && dfinal.size(3) == n,
              "scan_backward: dfinal must be a contiguous float32 [b, h, p, n], got ", dfinal.sizes());
  TORCH_CHECK(chunk > 0 && block > 0, "scan_backward: chunk and block must be positive");
  const int64_t Q = std::min(chunk, std::max<int64_t>(l, 1)), chunks = (l + Q - 1) / Q;
  const int64_t blocks = (r + block - 1) / block, items = b * g * blocks;
  const auto f32 = x.options().dtype(at::kFloat), f64 = x.options().dtype(at::kDouble);
  at::Tensor dx = at::empty({b, l, h, p}, f32), ddt = at::empty({b, l, h}, f32);
  at::Tensor dB = at::empty({blocks, b, l, g, n}, f32), dC = at::empty({blocks, b, l, g, n}, f32);
  // dA and dD per row (the rows' items run at once), summed after
  at::Tensor dA = at::zeros({b, h}, f64), dD = at::zeros({b, h, p}, f64), dinit = at::empty({b, h, p, n}, f32);
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *dyp = dy.data_ptr<float>();
  const float* dfp = dfinal.data_ptr<float>();
  float *dxp = dx.data_ptr<float>(), *ddtp = ddt.data_ptr<float>(), *dBp = dB.data_ptr<float>();
  float *dCp = dC.data_ptr<float>(), *dip = dinit.data_ptr<float>();
  double *dAp = dA.data_ptr<double>(), *dDp = dD.data_ptr<double>();
  const int64_t xr = x.stride(0), xl = x.stride(1), br = B.stride(0), bl = B.stride(1);
  const int64_t cr = C.stride(0), cl = C.stride(1);
  const float lowest = static_cast<float>(floor);
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / (g * blocks), group = (item / blocks) % g, part = item % blocks;
      const int64_t first = part * block, bw = std::min(block, r - first), h0 = group * r + first, wide = bw * p;
      ChunkFactors f(bw, Q);
      // the entering states, [chunks][n, bw·p] (one [n, bw·p] without a step: the initial state's gradient
      // is then dfinal's), left uninitialised: each is written before it is read
      std::unique_ptr<float[]> states(new float[std::max<int64_t>(chunks, 1) * n * wide]);
      std::vector<float> dS(n * wide), dS_in(n * wide), fed(Q * wide), dyf(Q * wide);
      std::vector<float> BdS(Q * wide), G(Q * Q), dG(Q * Q), dW(bw * Q * Q), W(bw * Q * Q), dxc(bw * Q * p);
      std::vector<float> read(bw * Q * n), dBc(Q * n), dCc(Q * n), ddelta(bw * Q), dacs(bw * Q), seg(Q), down(Q);
      std::vector<float> dlast(bw);
      const auto Bc_at = [&](int64_t t0, int64_t q) {  // the chunk's rows of B and C, [q, n] (read in place)
        return at::from_blob(const_cast<float*>(Bp + row * br + t0 * bl + group * n), {q, n}, {bl, 1}, opts);
      };
      const auto Cc_at = [&](int64_t t0, int64_t q) {
        return at::from_blob(const_cast<float*>(Cp + row * cr + t0 * cl + group * n), {q, n}, {cl, 1}, opts);
      };
      const auto factors = [&](int64_t t0, int64_t q) {
        f.compute(dtp + (row * l + t0) * h + h0, Ap + h0, h, bw, q, lowest);
      };
      const auto fill_fed = [&](int64_t t0, int64_t q) {  // fed [q, bw·p]: x_j exp(acs_last - acs_j) Δ_j
        const float* xc = xp + row * xr + t0 * xl + h0 * p;
        for (int64_t j = 0; j < q; ++j)
          for (int64_t hh = 0; hh < bw; ++hh) {
            const float v = f.fed[hh * Q + j];
            for (int64_t c = 0; c < p; ++c) fed[j * wide + hh * p + c] = xc[j * xl + hh * p + c] * v;
          }
      };
      // 0. the states entering the chunks, [chunks][n, bw·p]: the initial state (or 0), then per chunk
      // S' = exp(acs_last) S + Bᵀ fed
      float* S0 = states.get();
      std::fill(S0, S0 + n * wide, 0.f);
      if (z.initial != nullptr) {
        for (int64_t hh = 0; hh < bw; ++hh)
          for (int64_t c = 0; c < p; ++c)
            for (int64_t k = 0; k < n; ++k) {
              S0[k * wide + hh * p + c] = z.initial[((row * h + h0 + hh) * p + c) * n + k];
            }
      }
      for (int64_t i = 0; i + 1 < chunks; ++i) {
        const int64_t t0 = i * Q;
        factors(t0, Q);
        const float* S = states.get() + i * n * wide;
        float* next = states.get() + (i + 1) * n * wide;
        for (int64_t k = 0; k < n; ++k)
          for (int64_t hh = 0; hh < bw; ++hh)
            for (int64_t c = 0; c < p; ++c) next[k * wide + hh * p + c] = f.chunk[hh] * S[k * wide + hh * p + c];
        fill_fed(t0, Q);
        at::from_blob(next, {n, wide}, opts).addmm_(Bc_at(t0, Q).t(), at::from_blob(fed.data(), {Q, wide}, opts));
      }
      for (int64_t hh = 0; hh < bw; ++hh)  // dS: the gradient of the state leaving the last chunk
        for (int64_t c = 0; c < p; ++c)
          for (int64_t k = 0; k < n; ++k) dS[k * wide + hh * p + c] = dfp[((row * h + h0 + hh) * p + c) * n + k];
      for (int64_t i = chunks - 1; i >= 0; --i) {
        const int64_t t0 = i * Q, q = std::min(Q, l - t0);
        factors(t0, q);
        const float* S = states.get() + i * n * wide;
        const float* xc = xp + row * xr + t0 * xl + h0 * p;  // x_j of head hh at xc + j·xl + hh·p
        const float* dyc = dyp + ((row * l + t0) * h + h0) * p;  // dy_j of head hh at dyc + j·h·p + hh·p
        const at::Tensor Bc = Bc_at(t0, q), Cc = Cc_at(t0, q);
        const at::Tensor xb = at::from_blob(const_cast<float*>(xc), {bw, q, p}, {p, xl, 1}, opts);
        const at::Tensor dyb = at::from_blob(const_cast<float*>(dyc), {bw, q, p}, {p, h * p, 1}, opts);
        const at::Tensor dSt = at::from_blob(dS.data(), {n, wide}, opts);
        at::Tensor Gt = at::from_blob(G.data(), {q, q}, opts), dGt = at::from_blob(dG.data(), {q, q}, opts);
        at::Tensor dBct = at::from_blob(dBc.data(), {q, n}, opts), dCct = at::from_blob(dCc.data(), {q, n}, opts);
        at::Tensor Wt = at::from_blob(W.data(), {bw, q, q}, opts), dWt = at::from_blob(dW.data(), {bw, q, q}, opts);
        at::Tensor dxct = at::from_blob(dxc.data(), {bw, q, p}, opts);
        at::Tensor readt = at::from_blob(read.data(), {bw, q, n}, opts);
        at::Tensor dS_int = at::from_blob(dS_in.data(), {n, wide}, opts);
        at::Tensor BdSt = at::from_blob(BdS.data(), {q, wide}, opts);

        // 1. the diagonal blocks: W = G ⊙ L ⊙ Δ_j per head; dx = Wᵀ dy, dG -> dC = dG B, dB = dGᵀ C
        at::mm_out(Gt, Cc, Bc.t());
        at::bmm_out(dWt, dyb, xb.transpose(1, 2));  // dy xᵀ
        std::fill(dG.begin(), dG.begin() + q * q, 0.f);
        for (int64_t hh = 0; hh < bw; ++hh) {
          diagonal_block_head(f.pre.data() + hh * Q, f.delta.data() + hh * Q, G.data(), dW.data() + hh * q * q, q,
                              lowest, W.data() + hh * q * q, dG.data(), ddelta.data() + hh * Q, dacs.data() + hh * Q,
                              seg.data(), down.data());
        }
        at::bmm_out(dxct, Wt.transpose(1, 2), dyb);
        at::mm_out(dCct, dGt, Bc);
        at::mm_out(dBct, dGt.t(), Cc);

        // 2. the entering state read by C and decayed to each step, exp(acs_i) C_i S: per head
        // read = exp(acs_i) dy S_hᵀ [q, n] into dC and d acs; dS_in = Cᵀ (dy ⊙ exp(acs_i))
        at::bmm_out(readt, dyb, at::from_blob(const_cast<float*>(S), {bw, p, n}, {p, 1, wide}, opts));
        for (int64_t hh = 0; hh < bw; ++hh)
          for (int64_t j = 0; j < q; ++j) {
            const float fs = f.from_start[hh * Q + j];
            const float* rj = read.data() + (hh * q + j) * n;
            const float* cj = Cp + row * cr + (t0 + j) * cl + group * n;
            float* dcj = dCc.data() + j * n;
            for (int64_t k = 0; k < n; ++k) dcj[k] += rj[k] * fs;
            dacs[hh * Q + j] += fs * inner(rj, cj, n);
            for (int64_t c = 0; c < p; ++c) dyf[j * wide + hh * p + c] = dyc[j * h * p + hh * p + c] * fs;
          }
        at::mm_out(dS_int, Cc.t(), at::from_blob(dyf.data(), {q, wide}, opts));

        // 3. the state's update, S_out = exp(acs_last) S + Σ_j exp(acs_last - acs_j) Δ_j B_jᵀ x_j
        std::fill(dlast.begin(), dlast.end(), 0.f);
        for (int64_t k = 0; k < n; ++k)
          for (int64_t hh = 0; hh < bw; ++hh) {
            const int64_t at_ = k * wide + hh * p;
            for (int64_t c = 0; c < p; ++c) dS_in[at_ + c] += f.chunk[hh] * dS[at_ + c];
            dlast[hh] += inner(dS.data() + at_, S + at_, p);
          }
        at::mm_out(BdSt, Bc, dSt);  // B dS, [q, bw·p]
        for (int64_t hh = 0; hh < bw; ++hh) {
          float to_end_sum = 0.f;
          const float Dh = z.D == nullptr || z.d_per_channel ? 0.f : z.D[h0 + hh];
          const float* Dc = z.D != nullptr && z.d_per_channel ? z.D + (h0 + hh) * p : nullptr;
          double* dDh = dDp + (row * h + h0 + hh) * p;
          for (int64_t j = 0; j < q; ++j) {
            const float v = f.fed[hh * Q + j];
            const float* bd = BdS.data() + j * wide + hh * p;
            const float* xj = xc + j * xl + hh * p;
            const float* dyj = dyc + j * h * p + hh * p;
            float* dxj = dxc.data() + (hh * q + j) * p;
            for (int64_t c = 0; c < p; ++c) dxj[c] += v * bd[c];
            const float dv = inner(bd, xj, p);
            if (z.D != nullptr) {  // 4. the skip D: dx += D dy, dD += dy x
              for (int64_t c = 0; c < p; ++c) {
                dxj[c] += (Dc == nullptr ? Dh : Dc[c]) * dyj[c];
                dDh[c] += static_cast<double>(dyj[c] * xj[c]);
              }
            }
            ddelta[hh * Q + j] += dv * f.to_end[hh * Q + j];
            const float d_to_end = dv * v;  // the gradient of the exponent acs_last - acs_j
            dacs[hh * Q + j] -= d_to_end;
            to_end_sum += d_to_end;
          }
          dacs[hh * Q + q - 1] += f.chunk[hh] * dlast[hh] + to_end_sum;
        }
        fill_fed(t0, q);
        dBct.addmm_(at::from_blob(fed.data(), {q, wide}, opts), dSt.t());  // dB += X dSᵀ

        // 5. acs back to a = A·Δ: da_k = Σ_{t >= k} dacs_t; dA += Σ da Δ, dΔ += da A; then the outputs
        for (int64_t hh = 0; hh < bw; ++hh) {
          const float a_h = Ap[h0 + hh];
          float run = 0.f;
          double dA_h = 0.0;
          for (int64_t j = q - 1; j >= 0; --j) {
            run += dacs[hh * Q + j];
            dA_h += static_cast<double>(run * f.delta[hh * Q + j]);
            ddtp[(row * l + t0 + j) * h + h0 + hh] = ddelta[hh * Q + j] + run * a_h;
          }
          dAp[row * h + h0 + hh] += dA_h;
          for (int64_t j = 0; j < q; ++j)
            std::memcpy(dxp + ((row * l + t0 + j) * h + h0 + hh) * p, dxc.data() + (hh * q + j) * p, p * sizeof(float));
        }
        for (int64_t j = 0; j < q; ++j) {
          const int64_t at_ = (((part * b + row) * l + t0 + j) * g + group) * n;
          std::memcpy(dBp + at_, dBc.data() + j * n, n * sizeof(float));
          std::memcpy(dCp + at_, dCc.data() + j * n, n * sizeof(float));
        }
        std::swap(dS, dS_in);
      }
      for (int64_t hh = 0; hh < bw; ++hh)  // the gradient of the initial state, [n, bw·p] -> [b, h, p, n]
        for (int64_t c = 0; c < p; ++c)
          for (int64_t k = 0; k < n; ++k) dip[((row * h + h0 + hh) * p + c) * n + k] = dS[k * wide + hh * p + c];
    }
  });
  at::Tensor dDout = z.D == nullptr ? at::empty({0}, f32)
                                    : (z.d_per_channel ? dD.sum(0) : dD.sum({0, 2})).to(at::kFloat);
  return {dx, ddt, dA.sum(0).to(at::kFloat), blocks == 1 ? dB[0] : dB.sum(0), blocks == 1 ? dC[0] : dC.sum(0), dDout,
          z.initial == nullptr ? at::empty({0}, f32) : dinit};
}

// Channels [c0, c1) of the backward, one pass over the steps: g_t = dy_t·silu'(pre_t) (the last
// ones in the ring g [ring, kConvBlock], ring a power of two >= k, channel c at c - base), Σ_t g_t
// into db, Σ_t g_t xp_{t+j} into dtaps[j], and dxp_P = Σ_j w_j g_{P-j} into dhistory (P < k-1) or
// dx once g_P is known (the last k-1 positions after the loop).
template <typename V>
void conv_silu_backward_lanes(const ConvRow& r, const float* dy, float* g, int64_t ring, int64_t base, float* dx,
                              float* dhistory, float* dtaps, float* db, int64_t c0, int64_t c1) {
  constexpr int64_t width = sizeof(typename V::T) / sizeof(float);
  const typename V::T one = V::one();
  auto input_grad = [&](int64_t P, int64_t c) {  // dxp_P = Σ_j w_j g_{P-j} over the steps 0 <= P-j < l
    typename V::T acc = V::zero();
    for (int64_t j = std::max<int64_t>(0, P - r.l + 1); j <= std::min(r.k - 1, P); ++j) {
      acc = V::fma(V::load(r.taps + j * r.d + c), V::load(g + ((P - j) & (ring - 1)) * kConvBlock + c - base), acc);
    }
    V::store((P < r.k - 1 ? dhistory + P * r.d : dx + (P - r.k + 1) * r.d) + c, acc);
  };
  for (int64_t t = 0; t < r.l; ++t) {
    prefetch_step(r.x, t + kConvAhead, r.l, r.xs, c0, c1);
    prefetch_step(dy, t + kConvAhead, r.l, r.d, c0, c1);
    if (t + kConvAhead >= r.k - 1) prefetch_step(dx, t + kConvAhead - r.k + 1, r.l, r.d, c0, c1);
    for (int64_t c = c0; c < c1; c += width) {
      const typename V::T pre = conv_pre<V>(r, t, c), sig = V::sigmoid(pre);
      const typename V::T slope = V::mul(sig, V::add(one, V::mul(pre, V::sub(one, sig))));  // silu'(pre)
      const typename V::T gt = V::mul(V::load(dy + t * r.d + c), slope);
      V::store(g + (t & (ring - 1)) * kConvBlock + c - base, gt);
      V::store(db + c, V::add(V::load(db + c), gt));
      for (int64_t j = 0; j < r.k; ++j) {
        V::store(dtaps + j * r.d + c, V::fma(gt, V::load(r.row(t + j) + c), V::load(dtaps + j * r.d + c)));
      }
      input_grad(t, c);
    }
  }
  for (int64_t P = r.l; P < r.l + r.k - 1; ++P) {
    for (int64_t c = c0; c < c1; c += width) input_grad(P, c);
  }
}

inline void check_conv(const at::Tensor& x, const at::Tensor& taps, const c10::optional<at::Tensor>& bias,
                       const at::Tensor& history) {
  // x may be a view of wider rows (in_proj's output): its channels contiguous, its steps evenly apart
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.stride(1) >= x.size(2) &&
              x.stride(0) >= x.size(1) * x.stride(1), "conv_silu: x must be a float32 tensor of rank 3 with "
              "contiguous channels and rows apart, got ", x.sizes(), " strides ", x.strides(), " ", x.scalar_type());
  check_f32(taps, "taps", 2); check_f32(history, "history", 3);
  const int64_t b = x.size(0), d = x.size(2), k = taps.size(0);
  TORCH_CHECK(k > 0 && taps.size(1) == d && history.size(0) == b && history.size(1) == k - 1 && history.size(2) == d,
              "conv_silu: shapes do not match x ", x.sizes(), ": taps ", taps.sizes(), ", history ", history.sizes());
  if (bias.has_value()) {
    check_f32(*bias, "bias", 1);
    TORCH_CHECK(bias->size(0) == d, "conv_silu: bias must be [", d, "], got ", bias->sizes());
  }
}

inline ConvRow conv_row(const at::Tensor& x, const at::Tensor& taps, const c10::optional<at::Tensor>& bias,
                        const at::Tensor& history, int64_t row) {
  const int64_t l = x.size(1), d = x.size(2), k = taps.size(0);
  return {x.data_ptr<float>() + row * x.stride(0), history.data_ptr<float>() + row * (k - 1) * d,
          taps.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr, l, d, k, x.stride(1)};
}

// y [b, l, d] = silu(causal depthwise conv of x [b, l, d] with taps [k, d], bias [d], history [b, k-1, d]).
at::Tensor conv_silu(const at::Tensor& x, const at::Tensor& taps, const c10::optional<at::Tensor>& bias,
                     const at::Tensor& history) {
  check_conv(x, taps, bias, history);
  const int64_t b = x.size(0), l = x.size(1), d = x.size(2);
  at::Tensor y = at::empty({b, l, d}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, b * l, 16, [&](int64_t begin, int64_t end) {  // steps in order: each row read once
    for (int64_t row = begin / l; row * l < end; ++row) {
      conv_silu_steps(conv_row(x, taps, bias, history, row), yp + row * l * d, std::max(begin - row * l, int64_t{0}),
                      std::min(end - row * l, l));
    }
  });
  return y;
}

// The gradients (dx [b, l, d], dtaps [k, d], dbias [d], dhistory [b, k-1, d]) of sum(dy·y) for
// y = conv_silu(x, taps, bias, history); the pre-activations are recomputed.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> conv_silu_backward(
    const at::Tensor& dy, const at::Tensor& x, const at::Tensor& taps, const c10::optional<at::Tensor>& bias,
    const at::Tensor& history) {
  check_conv(x, taps, bias, history);
  check_f32(dy, "dy", 3);
  TORCH_CHECK(dy.sizes() == x.sizes(), "conv_silu_backward: dy must be shaped as x ", x.sizes(), ", got ", dy.sizes());
  const int64_t b = x.size(0), l = x.size(1), d = x.size(2), k = taps.size(0);
  at::Tensor dx = at::empty({b, l, d}, x.options()), dhistory = at::empty_like(history);
  at::Tensor dtaps = at::zeros_like(taps), dbias = at::zeros({d}, x.options());
  const float* dyp = dy.data_ptr<float>();
  float *dxp = dx.data_ptr<float>(), *dhp = dhistory.data_ptr<float>();
  float *dtp = dtaps.data_ptr<float>(), *dbp = dbias.data_ptr<float>();
  // the threads split the channels (every row's steps in each), so each sums its own dtaps and dbias
  at::parallel_for(0, (d + kConvBlock - 1) / kConvBlock, 1, [&](int64_t begin, int64_t end) {
    int64_t ring = 1;
    while (ring < k) ring *= 2;
    std::vector<float> g(ring * kConvBlock);  // the block's last g_t
    for (int64_t block = begin; block < end; ++block) {
      const int64_t c0 = block * kConvBlock, c1 = std::min(d, c0 + kConvBlock), split = c0 + (c1 - c0) / 8 * 8;
      for (int64_t row = 0; row < b; ++row) {
        const ConvRow r = conv_row(x, taps, bias, history, row);
        const float* dyr = dyp + row * l * d;
        float *dxr = dxp + row * l * d, *dhr = dhp + row * (k - 1) * d;
        conv_silu_backward_lanes<Lanes8>(r, dyr, g.data(), ring, c0, dxr, dhr, dtp, dbp, c0, split);
        conv_silu_backward_lanes<Lanes1>(r, dyr, g.data(), ring, c0, dxr, dhr, dtp, dbp, split, c1);
      }
    }
  });
  return {dx, dtaps, dbias, dhistory};
}

// The gated RMSNorm of training and prompt passes (portable_ssm.norm.gated_rms_norm_ref), one row of
// d channels at a time: v = y ⊙ silu(z) (v = y without z), each of `groups` slices of m = d/groups
// channels scaled by r = 1/sqrt(mean(v²) + eps), out = w ⊙ v·r. y, z and dout are [rows, d] with
// contiguous channels and their rows stride(0) floats apart (z: a slice of in_proj's output, read
// in place); the rows split over the threads.
inline void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t d) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.size(0) == rows && t.size(1) == d &&
              (d == 0 || t.stride(1) == 1) && (rows <= 1 || t.stride(0) >= d), "gated_rms_norm: ", name,
              " must be a float32 [", rows, ", ", d, "] with contiguous channels and rows apart, got ", t.sizes(),
              " strides ", t.strides(), " ", t.scalar_type());
}

inline void check_norm(const at::Tensor& y, const c10::optional<at::Tensor>& z, const at::Tensor& weight,
                       int64_t groups) {
  TORCH_CHECK(y.dim() == 2, "gated_rms_norm: y must be of rank 2 [rows, d], got ", y.sizes());
  check_rows(y, "y", y.size(0), y.size(1));
  if (z.has_value()) check_rows(*z, "z", y.size(0), y.size(1));
  check_f32(weight, "weight", 1);
  TORCH_CHECK(weight.size(0) == y.size(1) && groups > 0 && y.size(1) % groups == 0, "gated_rms_norm: weight must be [",
              y.size(1), "] and groups (", groups, ") must divide it, got weight ", weight.sizes());
}

// out [rows, d] = gated_rms_norm(y, z) ⊙ weight.
at::Tensor gated_rms_norm(const at::Tensor& y, const c10::optional<at::Tensor>& z, const at::Tensor& weight,
                          int64_t groups, double eps) {
  check_norm(y, z, weight, groups);
  const int64_t rows = y.size(0), d = y.size(1), m = d / groups, ys = y.stride(0);
  const int64_t zs = z.has_value() ? z->stride(0) : 0;
  at::Tensor out = at::empty({rows, d}, y.options());
  const float *yp = y.data_ptr<float>(), *zp = z.has_value() ? z->data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    norm_rows(yp, ys, zp, zs, w, op, d, m, eps, begin, end);
  });
  return out;
}

// Σ_c a[c]·b[c]·e[c] over n channels.
inline float dot3(const float* a, const float* b, const float* e, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = s0;
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    s0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a + c), _mm256_loadu_ps(b + c)), _mm256_loadu_ps(e + c), s0);
    s1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(a + c + 8), _mm256_loadu_ps(b + c + 8)),
                         _mm256_loadu_ps(e + c + 8), s1);
  }
  float total = horizontal_sum(_mm256_add_ps(s0, s1));
  for (; c < n; ++c) total += a[c] * b[c] * e[c];
  return total;
}

// One slice's gradients, channels [c0, c1): with u = dout ⊙ w, dv = r·u - coef·v (coef = r³·Σ u·v / m);
// dweight += dout ⊙ v·r; dy = dv ⊙ silu(z), dz = dv ⊙ y ⊙ silu'(z), silu'(z) = s·(1 + z·(1 - s))
// (without z: dy = dv).
template <typename V>
void norm_backward_lanes(const float* g, const float* w, const float* v, const float* y, const float* z,
                         const float* s, float r, float coef, float* dw, float* dy, float* dz, int64_t c0, int64_t c1) {
  const typename V::T rv = V::set(r), cv = V::set(coef), one = V::one();
  for (int64_t c = c0; c < c1; c += sizeof(typename V::T) / sizeof(float)) {
    const typename V::T gc = V::load(g + c), vc = V::load(v + c);
    const typename V::T dv = V::sub(V::mul(rv, V::mul(gc, V::load(w + c))), V::mul(cv, vc));
    V::store(dw + c, V::fma(gc, V::mul(vc, rv), V::load(dw + c)));
    if (z == nullptr) {
      V::store(dy + c, dv);
      continue;
    }
    const typename V::T zc = V::load(z + c), sc = V::load(s + c);
    V::store(dy + c, V::mul(dv, V::mul(zc, sc)));
    const typename V::T slope = V::mul(sc, V::add(one, V::mul(zc, V::sub(one, sc))));
    V::store(dz + c, V::mul(V::mul(dv, V::load(y + c)), slope));
  }
}

// The gradients (dy [rows, d], dz [rows, d] or empty without z, dweight [d]) of sum(dout · out) for
// out = gated_rms_norm(y, z, weight, groups, eps), the gate and the scales recomputed. The rows go in
// blocks, each summing its own share of dweight; the blocks' shares are added in order after.
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rms_norm_backward(
    const at::Tensor& dout, const at::Tensor& y, const c10::optional<at::Tensor>& z, const at::Tensor& weight,
    int64_t groups, double eps) {
  check_norm(y, z, weight, groups);
  const int64_t rows = y.size(0), d = y.size(1), m = d / groups, ys = y.stride(0);
  check_rows(dout, "dout", rows, d);
  const int64_t zs = z.has_value() ? z->stride(0) : 0, gs = dout.stride(0);
  const int64_t block = std::max<int64_t>(64, (rows + 255) / 256), blocks = (rows + block - 1) / block;
  at::Tensor dy = at::empty({rows, d}, y.options());
  at::Tensor dz = z.has_value() ? at::empty({rows, d}, y.options()) : at::empty({0}, y.options());
  at::Tensor shares = at::zeros({std::max<int64_t>(blocks, 1), d}, y.options());
  const float *yp = y.data_ptr<float>(), *zp = z.has_value() ? z->data_ptr<float>() : nullptr;
  const float *gp = dout.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *dyp = dy.data_ptr<float>(), *dzp = z.has_value() ? dz.data_ptr<float>() : nullptr;
  float* sp = shares.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> v(d), s(d);
    for (int64_t b = begin; b < end; ++b) {
      float* dw = sp + b * d;
      for (int64_t i = b * block; i < std::min(rows, (b + 1) * block); ++i) {
        const float *yi = yp + i * ys, *zi = zp == nullptr ? nullptr : zp + i * zs, *gi = gp + i * gs;
        gate_row(yi, zi, v.data(), s.data(), d);
        for (int64_t start = 0; start < d; start += m) {
          const float r = inverse_rms(v.data() + start, m, eps);
          const float coef = r * r * r * dot3(gi + start, w + start, v.data() + start, m) / static_cast<float>(m);
          const int64_t split = start + m / 8 * 8;
          float *dyi = dyp + i * d, *dzi = dzp == nullptr ? nullptr : dzp + i * d;
          norm_backward_lanes<Lanes8>(gi, w, v.data(), yi, zi, s.data(), r, coef, dw, dyi, dzi, start, split);
          norm_backward_lanes<Lanes1>(gi, w, v.data(), yi, zi, s.data(), r, coef, dw, dyi, dzi, split, start + m);
        }
      }
    }
  });
  return {dy, dz, shares.sum(0)};
}

inline void check_layers(at::TensorList list, int64_t layers, const char* name) {
  TORCH_CHECK(static_cast<int64_t>(list.size()) == layers, "decode_model: ", name, " must hold one tensor per layer (",
              layers, "), got ", list.size());
}

inline void check_vector(const at::Tensor& t, const std::string& name, int64_t size) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == size && t.scalar_type() == at::kFloat && t.is_contiguous(), "decode_model: ",
              name, " must be a contiguous float32 [", size, "], got ", t.sizes(), " ", t.scalar_type());
}


// One token through the whole language model at batch 1 (portable_ssm.lm.decode: the residual
// blocks with their mixers' steps, norm_f and the head), from the embedded token x [1, d_model].
// Layer i's in_proj output is [z, xBC, dt] (no gated MLP, no projection biases); its gated norm
// follows the gate (norm_before_gate=False). Weights are float32, int8 (with row scales) or
// bfloat16; every other tensor float32. Returns (logits [1, rows], new conv states, new ssm states).
//
// Every check and allocation comes first, then decode_model_run (decode_model.h) on ATen's thread count.
std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>> decode_model(
    const at::Tensor& x, at::TensorList conv_states, at::TensorList ssm_states, at::TensorList norms,
    at::TensorList in_weights, const c10::List<c10::optional<at::Tensor>>& in_scales, at::TensorList conv_weights,
    const c10::List<c10::optional<at::Tensor>>& conv_biases, at::TensorList dt_biases, at::TensorList A_logs,
    at::TensorList Ds, at::TensorList gate_norms, at::TensorList out_weights,
    const c10::List<c10::optional<at::Tensor>>& out_scales, const at::Tensor& norm_f, const at::Tensor& head,
    const c10::optional<at::Tensor>& head_scale, double eps, double low, double high, int64_t ngroups,
    int64_t headdim) {
  const int64_t layers = conv_states.size(), p = headdim, g = ngroups;
  check_f32(x, "x", 2);
  TORCH_CHECK(x.size(0) == 1, "decode_model: x must be one row [1, d_model], got ", x.sizes());
  for (auto [list, name] : {std::pair{ssm_states, "ssm_states"}, {norms, "norms"}, {in_weights, "in_weights"},
                            {conv_weights, "conv_weights"}, {dt_biases, "dt_biases"}, {A_logs, "A_logs"}, {Ds, "Ds"},
                            {gate_norms, "gate_norms"}, {out_weights, "out_weights"}}) {
    check_layers(list, layers, name);
  }
  TORCH_CHECK(static_cast<int64_t>(in_scales.size()) == layers && static_cast<int64_t>(conv_biases.size()) == layers &&
              static_cast<int64_t>(out_scales.size()) == layers,
              "decode_model: in_scales, conv_biases and out_scales must hold one entry per layer (", layers, ")");
  TORCH_CHECK(p > 0 && g > 0, "decode_model: headdim (", p, ") and ngroups (", g, ") must be positive");
  const int64_t d = x.size(1);
  std::vector<LayerView> views;
  std::vector<at::Tensor> convs, ssms;
  for (int64_t i = 0; i < layers; ++i) {
    const std::string at_ = "[" + std::to_string(i) + "]";
    LayerView v{};
    check_vector(norms[i], "norms" + at_, d);
    v.in = row_weight(in_weights[i], in_scales.get(i), d, "decode_model", "in_weights" + at_);
    TORCH_CHECK(dt_biases[i].dim() == 1, "decode_model: dt_biases", at_, " must be [nheads], got ",
                dt_biases[i].sizes());
    v.h = dt_biases[i].size(0);
    const int64_t d_inner = v.h * p;
    check_vector(dt_biases[i], "dt_biases" + at_, v.h);
    check_vector(A_logs[i], "A_logs" + at_, v.h);
    check_vector(gate_norms[i], "gate_norms" + at_, d_inner);
    check_f32(conv_states[i], "conv_states[i]", 3); check_f32(ssm_states[i], "ssm_states[i]", 4);
    v.conv_dim = conv_states[i].size(1), v.k = conv_states[i].size(2), v.n = ssm_states[i].size(3);
    TORCH_CHECK(v.h > 0 && v.h % g == 0 && v.k > 0 && v.conv_dim == d_inner + 2 * g * v.n &&
                conv_states[i].size(0) == 1 && ssm_states[i].size(0) == 1 && ssm_states[i].size(1) == v.h &&
                ssm_states[i].size(2) == p, "decode_model: layer ", i, "'s states (conv ", conv_states[i].sizes(),
                ", ssm ", ssm_states[i].sizes(), ") do not match its ", v.h, " heads of ", p, " channels in ", g,
                " groups");
    TORCH_CHECK(v.in.out == d_inner + v.conv_dim + v.h, "decode_model: layer ", i, "'s in_proj gives ", v.in.out,
                " outputs, not [z, xBC, dt] = ", d_inner + v.conv_dim + v.h);
    const at::Tensor& taps = conv_weights[i];
    TORCH_CHECK(taps.scalar_type() == at::kFloat && taps.is_contiguous() && taps.dim() >= 1 &&
                taps.size(0) == v.conv_dim && taps.numel() == v.conv_dim * v.k, "decode_model: conv_weights", at_,
                " must be a contiguous float32 [", v.conv_dim, ", 1, ", v.k, "], got ", taps.sizes());
    const at::Tensor& D = Ds[i];
    TORCH_CHECK(D.scalar_type() == at::kFloat && D.is_contiguous() && D.dim() >= 1 && D.dim() <= 2 &&
                D.size(0) == v.h && (D.dim() == 1 || D.size(1) == p), "decode_model: Ds", at_, " must be [", v.h,
                "] or [", v.h, ", ", p, "] float32, got ", D.sizes());
    const c10::optional<at::Tensor> bias = conv_biases.get(i);
    if (bias.has_value()) check_vector(*bias, "conv_biases" + at_, v.conv_dim);
    v.out = row_weight(out_weights[i], out_scales.get(i), d_inner, "decode_model", "out_weights" + at_);
    TORCH_CHECK(v.out.out == d, "decode_model: layer ", i, "'s out_proj gives ", v.out.out, " outputs, not d_model = ",
                d);
    convs.push_back(at::empty_like(conv_states[i]));
    ssms.push_back(at::empty_like(ssm_states[i]));
    v.norm = norms[i].data_ptr<float>(), v.conv_state = conv_states[i].data_ptr<float>();
    v.conv_w = taps.data_ptr<float>(), v.conv_b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
    v.dt_bias = dt_biases[i].data_ptr<float>(), v.A_log = A_logs[i].data_ptr<float>(), v.D = D.data_ptr<float>();
    v.gate_norm = gate_norms[i].data_ptr<float>(), v.H = ssm_states[i].data_ptr<float>();
    v.new_conv = convs.back().data_ptr<float>(), v.Hn = ssms.back().data_ptr<float>();
    v.d_per_channel = D.dim() == 2, v.stream = streams(v.Hn, v.n);
    views.push_back(v);
  }
  check_vector(norm_f, "norm_f", d);
  const RowWeight lm_head = row_weight(head, head_scale, d, "decode_model", "head");
  at::Tensor logits = at::empty({1, lm_head.out}, x.options());
  const int threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  decode_model_run(x.data_ptr<float>(), d, views.data(), layers, norm_f.data_ptr<float>(), lm_head,
                   logits.data_ptr<float>(), eps, static_cast<float>(low), static_cast<float>(high), g, p, threads);
  return {logits, convs, ssms};
}

}  // namespace

TORCH_LIBRARY(portable_ssm_cpu, m) {
  m.def("row_gemv(Tensor row, Tensor weight, Tensor? scale) -> Tensor");
  m.def("decode_step(Tensor xBC, Tensor dt, Tensor z, Tensor conv_state, Tensor ssm_state, Tensor conv_weight, "
        "Tensor? conv_bias, Tensor dt_bias, Tensor A, Tensor D, float low, float high, int ngroups, int headdim) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("decode_model(Tensor x, Tensor[] conv_states, Tensor[] ssm_states, Tensor[] norms, Tensor[] in_weights, "
        "Tensor?[] in_scales, Tensor[] conv_weights, Tensor?[] conv_biases, Tensor[] dt_biases, Tensor[] A_logs, "
        "Tensor[] Ds, Tensor[] gate_norms, Tensor[] out_weights, Tensor?[] out_scales, Tensor norm_f, Tensor head, "
        "Tensor? head_scale, float eps, float low, float high, int ngroups, int headdim) "
        "-> (Tensor, Tensor[], Tensor[])");
  m.def("scan_forward(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? initial_states, "
        "int chunk, float floor, int block, bool safe) -> (Tensor, Tensor, Tensor)");
  m.def("scan_backward(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? initial_states, "
        "Tensor dy, Tensor dfinal, int chunk, float floor, int block) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("conv_silu(Tensor x, Tensor taps, Tensor? bias, Tensor history) -> Tensor");
  m.def("conv_silu_backward(Tensor dy, Tensor x, Tensor taps, Tensor? bias, Tensor history) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("gated_rms_norm(Tensor y, Tensor? z, Tensor weight, int groups, float eps) -> Tensor");
  m.def("gated_rms_norm_backward(Tensor dout, Tensor y, Tensor? z, Tensor weight, int groups, float eps) "
        "-> (Tensor, Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(portable_ssm_cpu, CPU, m) {
  m.impl("row_gemv", &row_gemv);
  m.impl("decode_step", &decode_step);
  m.impl("decode_model", &decode_model);
  m.impl("scan_forward", &scan_forward);
  m.impl("scan_backward", &scan_backward);
  m.impl("conv_silu", &conv_silu);
  m.impl("conv_silu_backward", &conv_silu_backward);
  m.impl("gated_rms_norm", &gated_rms_norm);
  m.impl("gated_rms_norm_backward", &gated_rms_norm_backward);
}
