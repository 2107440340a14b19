// Causal self-attention on the CPU, forward and backward, as XLA FFI handlers
// (cpu_flash.py builds this file and calls it).
//
// q [B, L, H, D], k and v [B, L, G, D] in the model's own layouts (no transposes around the
// call), float32, H a multiple of G (grouped queries). Token i attends to tokens 0..i: the mask
// is the token index, which equals the position mask when positions increase along the
// sequence (train.py, eval.py), the assumption the dense kernel's causal blocks make too.
//
// Forward, one unit per (batch, query head, block of T query rows): the scores of the block
// over the keys up to its last row are computed transposed, s^T = k q^T [keys, T], in chunks
// of KEY_CHUNK keys that stay in a per-thread buffer (128 KiB at T = 64, in L2); the softmax
// runs down each chunk's columns, vectorised along the queries, rescaling the sums of earlier
// chunks to the new maximum (at L <= KEY_CHUNK one chunk: no rescale), and o = p v / l. The
// log-sum-exp of each row is kept for the backward pass.
// Backward, one unit per (batch, key-value head), so that dk and dv accumulate in one thread:
// for each query head of the group and each query block, p is recomputed from the scores and
// the log-sum-exp, then
//   dp = do v^T,  ds = p (dp - rowsum(do o)),  dq = ds k,  dk += ds^T q,  dv += p^T do
// with the 1 / sqrt(D) of the logits on dq and dk.
//
// Every product is one register-blocked kernel: C [M, N] (+)= A [M, Kd] B [Kd, N], A read
// through strides (so A^T costs nothing), B rows contiguous, 6 (with AVX-512) or 4 rows by 64
// columns of C held in vector registers of 16 floats. The backward pass first copies its
// operands out of the model's power-of-two token strides (see PAD). Work units go to XLA's
// intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));  // unaligned access

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }

inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

// C[R, 16 NV] (+)= A[R, Kd] B[Kd, 16 NV]; A(r, p) = A[r rsa + p csa], B(p, c) = B[p ldb + c].
template <int R, int NV>
inline void tile(int64_t Kd, const float* A, int64_t rsa, int64_t csa, const float* B,
                 int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  v16 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = accumulate ? load(C + r * ldc + 16 * v) : v16{};
  for (int64_t p = 0; p < Kd; ++p) {
    const float* b = B + p * ldb;
    v16 bv[NV];
    for (int v = 0; v < NV; ++v) bv[v] = load(b + 16 * v);
    const float* a = A + p * csa;
    for (int r = 0; r < R; ++r) {
      const float ar = a[r * rsa];
      for (int v = 0; v < NV; ++v) acc[r][v] += ar * bv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) store(C + r * ldc + 16 * v, acc[r][v]);
}

// The rows [r0, r1) of C (+)= A B in tiles of R rows, 16 NV columns from column c.
template <int R, int NV>
void rows(int64_t r0, int64_t r1, int64_t c, int64_t Kd, const float* A, int64_t rsa,
          int64_t csa, const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  for (int64_t r = r0; r < r1; r += R)
    tile<R, NV>(Kd, A + r * rsa, rsa, csa, B + c, ldb, C + r * ldc + c, ldc, accumulate);
}

// C[M, N] (+)= A[M, Kd] B[Kd, N] with M % 4 == 0 and N % 16 == 0. With AVX-512, tiles of 6
// rows (24 accumulators and 4 B vectors: 29 of the 32 zmm registers, 10 loads per 24 FMAs
// against 8 per 16 at 4 rows) and the rest in tiles of 4: M = 6 a + 4 b with b < 3. Without
// it (16 ymm registers, two per vector of 16 floats) tiles of 4 rows only.
#ifdef __AVX512F__
constexpr bool SIX_ROWS = true;
#else
constexpr bool SIX_ROWS = false;
#endif

void gemm(int64_t M, int64_t N, int64_t Kd, const float* A, int64_t rsa, int64_t csa,
          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t fours = SIX_ROWS ? (M / 4) % 3 : M / 4, six_end = M - 4 * fours;
  for (int64_t c = 0; c < N; c += 64) {
    const int64_t nv = std::min<int64_t>(64, N - c) / 16;
#define ROFORMER_ROWS(NV)                                                             \
  rows<6, NV>(0, six_end, c, Kd, A, rsa, csa, B, ldb, C, ldc, accumulate);           \
  rows<4, NV>(six_end, M, c, Kd, A, rsa, csa, B, ldb, C, ldc, accumulate);           \
  break;
    switch (nv) {
      case 4: ROFORMER_ROWS(4)
      case 3: ROFORMER_ROWS(3)
      case 2: ROFORMER_ROWS(2)
      default: ROFORMER_ROWS(1)
    }
#undef ROFORMER_ROWS
  }
}

// exp(x) for x <= 0 to about 1 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so n ln2
// is exact), e^r by its Taylor polynomial to degree 7, 2^n into the exponent bits. A plain loop
// over this vectorises. Below -87 the result is flushed to 0.
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -88.0f);  // keeps the integer conversions below defined
  const float t = xc * 1.44269504088896341f;
  const float n = std::nearbyint(t);
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &e, sizeof(two_n));
  return x < -87.0f ? 0.0f : p * two_n;
}

// Runs fn(u) for u in [0, n) on the calling thread and XLA's intra-op pool. Units are claimed
// from a counter, so the caller never waits for a task to start (a pool busy with other work
// cannot deadlock it), only for claimed units to finish.
template <typename F>
void parallel_units(ffi::ThreadPool& pool, int64_t n, F fn) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, fn]() {
    for (int64_t u; (u = state->next.fetch_add(1)) < n;) {
      fn(u);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// Keys per chunk of the forward pass's scores: [512, T] floats (128 KiB at T = 64) stay in L2
// at any length.
constexpr int64_t KEY_CHUNK = 512;

struct Shape {
  int64_t B, L, H, G, D;
  int64_t R() const { return H / G; }
};

ffi::Error check(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k,
                 const ffi::Buffer<ffi::F32>& v, int64_t block, Shape* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("cpu_flash: q, k and v must be [B, L, heads, D]");
  *s = Shape{qd[0], qd[1], qd[2], kd[2], qd[3]};
  for (int i : {0, 1, 3})
    if (kd[i] != qd[i] || vd[i] != qd[i])
      return ffi::Error::InvalidArgument("cpu_flash: q, k and v differ in B, L or D");
  if (vd[2] != s->G || s->H % s->G != 0)
    return ffi::Error::InvalidArgument("cpu_flash: query heads must be a multiple of k/v heads");
  if (s->D % 16 != 0 || block % 16 != 0 || block <= 0 || s->L % block != 0)
    return ffi::Error::InvalidArgument("cpu_flash: D and the block must be multiples of 16, L of the block");
  return ffi::Error::Success();
}

thread_local std::vector<float> tls_a, tls_b, tls_c, tls_d, tls_e;

float* scratch(std::vector<float>& buf, size_t n) {
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// The backward pass copies its operands into buffers of its own before the products: the
// model's layouts put a token's row of one head H D (q, do) or G D (k, v) floats after the last
// (1 KiB at 4 heads of 64), a power of two, and a row of k^T or v^T over all L keys would be L
// floats long, so that the rows a product walks down share a few cache sets and evict each
// other. Packed rows are D floats apart; k^T and v^T have a row stride of L + PAD, and the
// [T, n] blocks p and ds one of n + PAD. (The forward pass reads k and v in place: copying them
// measured no faster.)
constexpr int64_t PAD = 16;

// kT [D, ld] (columns 0..n-1) from the rows 0..n-1 of x (row stride `stride`).
void pack_transposed(const float* x, int64_t n, int64_t stride, int64_t D, float* kT,
                     int64_t ld) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t d = 0; d < D; ++d) kT[d * ld + t] = x[t * stride + d];
}

// out [n, D] from the rows 0..n-1 of x (row stride `stride`).
void pack_rows(const float* x, int64_t n, int64_t stride, int64_t D, float* out) {
  for (int64_t t = 0; t < n; ++t) std::memcpy(out + t * D, x + t * stride, D * sizeof(float));
}

ffi::Error FwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> o,
                   ffi::ResultBuffer<ffi::F32> lse, float scale, int64_t block) {
  Shape s;
  if (auto err = check(q, k, v, block, &s); err.failure()) return err;
  const int64_t T = block, NQ = s.L / T, R = s.R();
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = o->typed_data(), *lp = lse->typed_data();
  const int64_t qs = s.H * s.D, ks = s.G * s.D;  // token strides
  // Units by decreasing work (the last query blocks attend to the most keys), for balance.
  parallel_units(pool, s.B * s.H * NQ, [=](int64_t u) {
    const int64_t i = NQ - 1 - u / (s.B * s.H), bh = u % (s.B * s.H), b = bh / s.H, h = bh % s.H;
    const int64_t g = h / R, q0 = i * T, n = q0 + T;
    const float* qi = qp + (b * s.L + q0) * qs + h * s.D;
    const float* kb = kp + b * s.L * ks + g * s.D;
    const float* vb = vp + b * s.L * ks + g * s.D;
    float* qT = scratch(tls_a, s.D * T);
    float* sT = scratch(tls_b, std::min(n, KEY_CHUNK) * T);  // scores transposed: [keys, queries]
    float* acc = scratch(tls_c, 4 * T);
    float *m = acc, *l = acc + T, *m_new = acc + 2 * T, *alpha = acc + 3 * T;
    float* oi = op + (b * s.L + q0) * qs + h * s.D;
    float* li = lp + (b * s.H + h) * s.L + q0;
    pack_transposed(qi, T, qs, s.D, qT, T);
    std::fill(m, m + T, -INFINITY);
    std::fill(l, l + T, 0.0f);
    for (int64_t c0 = 0; c0 < n; c0 += KEY_CHUNK) {
      const int64_t nc = std::min(KEY_CHUNK, n - c0);
      gemm(nc, T, s.D, kb + c0 * ks, ks, 1, qT, T, sT, T, false);
      // Key c is masked for query r when c > q0 + r: only in the diagonal block (keys q0 on).
      for (int64_t c = std::max(c0, q0); c < c0 + nc; ++c)
        for (int64_t r = 0; r < c - q0; ++r) sT[(c - c0) * T + r] = -INFINITY;
      // The softmax runs down the columns (one per query), vectorised along the queries; over
      // the keys in chunks, each rescaling the sums so far to its new maximum (no query has
      // all keys of a chunk masked: every chunk starts at or before the diagonal block).
      for (int64_t r = 0; r < T; ++r) m_new[r] = sT[r];
      for (int64_t c = 1; c < nc; ++c)
        for (int64_t r = 0; r < T; ++r) m_new[r] = std::max(m_new[r], sT[c * T + r]);
      for (int64_t r = 0; r < T; ++r) {
        m_new[r] = std::max(m[r], m_new[r] * scale);
        alpha[r] = exp_nonpositive(m[r] - m_new[r]);  // 0 before the first chunk
        l[r] *= alpha[r];
        m[r] = m_new[r];
      }
      for (int64_t c = 0; c < nc; ++c) {
        float* row = sT + c * T;
        for (int64_t r = 0; r < T; ++r) {
          row[r] = exp_nonpositive(row[r] * scale - m[r]);  // exp(-inf) is 0
          l[r] += row[r];
        }
      }
      if (c0 > 0)
        for (int64_t r = 0; r < T; ++r)
          for (int64_t d = 0; d < s.D; ++d) oi[r * qs + d] *= alpha[r];
      gemm(T, s.D, nc, sT, 1, T, vb + c0 * ks, ks, oi, qs, c0 > 0);  // o += (sT)^T v
    }
    for (int64_t r = 0; r < T; ++r) {
      li[r] = m[r] + std::log(l[r]);
      const float inv_l = 1.0f / l[r];
      for (int64_t d = 0; d < s.D; ++d) oi[r * qs + d] *= inv_l;
    }
  });
  return ffi::Error::Success();
}

ffi::Error BwdImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> o, ffi::Buffer<ffi::F32> lse,
                   ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                   ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale,
                   int64_t block) {
  Shape s;
  if (auto err = check(q, k, v, block, &s); err.failure()) return err;
  const int64_t T = block, NQ = s.L / T, R = s.R(), L = s.L, D = s.D;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const float *opp = o.typed_data(), *lp = lse.typed_data(), *dop = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  const int64_t qs = s.H * D, ks = s.G * D;
  parallel_units(pool, s.B * s.G, [=](int64_t u) {
    const int64_t b = u / s.G, g = u % s.G;
    const float* kb = kp + b * L * ks + g * D;
    const float* vb = vp + b * L * ks + g * D;
    const int64_t LP = L + PAD;
    float* kT = scratch(tls_a, D * LP);
    float* vT = scratch(tls_b, D * LP);
    float* p = scratch(tls_c, T * LP);
    float* ds = scratch(tls_d, T * LP);
    // dk rows, dv rows, k rows [L, D] each, then a block's q rows and do rows [T, D] each.
    float* packed = scratch(tls_e, 3 * L * D + 2 * T * D);
    float *dk_acc = packed, *dv_acc = packed + L * D, *kc = packed + 2 * L * D;
    float *qc = kc + L * D, *doc = qc + T * D;
    std::fill(packed, packed + 2 * L * D, 0.0f);
    pack_transposed(kb, L, ks, D, kT, LP);
    pack_transposed(vb, L, ks, D, vT, LP);
    pack_rows(kb, L, ks, D, kc);
    for (int64_t h = g * R; h < (g + 1) * R; ++h) {
      for (int64_t i = 0; i < NQ; ++i) {
        const int64_t q0 = i * T, n = q0 + T;
        const int64_t row0 = (b * L + q0) * qs + h * D;
        const float *qi = qp + row0, *oi = opp + row0, *doi = dop + row0;
        const float* li = lp + (b * s.H + h) * L + q0;
        const int64_t ld = n + PAD;  // of p and ds [T, n]
        pack_rows(qi, T, qs, D, qc);
        pack_rows(doi, T, qs, D, doc);
        // kT and vT hold all L keys: the first n columns used.
        gemm(T, n, D, qc, D, 1, kT, LP, p, ld, false);
        gemm(T, n, D, doc, D, 1, vT, LP, ds, ld, false);
        for (int64_t r = 0; r < T; ++r) {
          float delta = 0.0f;
          for (int64_t d = 0; d < D; ++d) delta += doi[r * qs + d] * oi[r * qs + d];
          float *pr = p + r * ld, *dsr = ds + r * ld;
          const int64_t valid = q0 + r + 1;
          for (int64_t c = 0; c < valid; ++c) {
            pr[c] = exp_nonpositive(pr[c] * scale - li[r]);
            dsr[c] = pr[c] * (dsr[c] - delta);
          }
          for (int64_t c = valid; c < n; ++c) pr[c] = dsr[c] = 0.0f;
        }
        float* dqi = dqp + row0;
        gemm(T, D, n, ds, ld, 1, kc, D, dqi, qs, false);
        for (int64_t r = 0; r < T; ++r)
          for (int64_t d = 0; d < D; ++d) dqi[r * qs + d] *= scale;
        gemm(n, D, T, ds, 1, ld, qc, D, dk_acc, D, true);  // ds^T q
        gemm(n, D, T, p, 1, ld, doc, D, dv_acc, D, true);  // p^T do
      }
    }
    for (int64_t t = 0; t < L; ++t)
      for (int64_t d = 0; d < D; ++d) {
        dkp[(b * L + t) * ks + g * D + d] = dk_acc[t * D + d] * scale;
        dvp[(b * L + t) * ks + g * D + d] = dv_acc[t * D + d];
      }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(RoformerCpuFlashFwd, FwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(RoformerCpuFlashBwd, BwdImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("block"));
