// Few-row float32 matrix products for XLA's CPU backend, called through the JAX FFI.
//
//   jspec_matmul_nn: y[R, N] = x[R, K] @ w[K, N]      (a `Linear` weight, [in, out])
//   jspec_matmul_nt: y[R, N] = x[R, K] @ w[N, K]^T    (a tied LM head: the embedding)
//
// XLA's CPU dot sends every product of more than one row to a general GEMM that first
// copies (packs) the whole weight, so verifying 5 tokens costs 2-3 times a one-token step
// although both are bound by reading the weights. These loops read each weight once for up
// to ROWS rows, straight from its natural layout.
//
// Every output element is computed by the same operation sequence whatever R is and
// wherever the element lies: acc = 0, then acc = fma(x[r, k], w[k, n], acc) for k = 0..K-1
// (nn), or 8-lane partial sums over k followed by a fixed reduction (nt). A row's result
// therefore does not depend, to the last bit, on the rows beside it.
//
// Built by jspec/kernels/cpu/matmul.py with -march=native; requires AVX2 and FMA.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

#if !defined(__AVX2__) || !defined(__FMA__)
#error "jspec's CPU products need AVX2 and FMA"
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int ROWS = 6;   // rows a pass keeps in registers: 2 x ROWS accumulators of 8 lanes
constexpr int64_t KB = 8;  // nn: weight rows a pass over the strips reads (8 sequential streams)
constexpr int64_t PREFETCH = 16;  // nn: weight rows ahead that a strip prefetches
constexpr int64_t MIN_COLS = 64;  // fewest output columns worth a thread

// Lanes [0, n) of 8 set: masked loads read zeros and masked stores write nothing there.
inline __m256i lane_mask(int64_t n) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes);
}

// nn, one strip of V vectors of 8 columns starting at column n (the last vector masked to
// `tail` lanes when tail < 8), for weight rows [k0, k1): accumulators start at zero when
// k0 == 0, else from y.
template <int M, int V>
inline void nn_strip(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t k0,
                     int64_t k1, int64_t n, int64_t tail) {
  const __m256i mask = lane_mask(tail);
  __m256 acc[M][V];
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) {
      float* yp = y + m * N + n + 8 * v;
      bool last = v == V - 1 && tail < 8;
      acc[m][v] = k0 == 0 ? _mm256_setzero_ps() : last ? _mm256_maskload_ps(yp, mask) : _mm256_loadu_ps(yp);
    }
  const float* wr = w + k0 * N + n;
  for (int64_t k = k0; k < k1; ++k, wr += N) {
    if (k + PREFETCH < K) _mm_prefetch(reinterpret_cast<const char*>(wr + PREFETCH * N), _MM_HINT_T0);
    __m256 wv[V];
    for (int v = 0; v < V; ++v)
      wv[v] = (v == V - 1 && tail < 8) ? _mm256_maskload_ps(wr + 8 * v, mask) : _mm256_loadu_ps(wr + 8 * v);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_broadcast_ss(x + m * K + k);
      for (int v = 0; v < V; ++v) acc[m][v] = _mm256_fmadd_ps(xv, wv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int v = 0; v < V; ++v) {
      float* yp = y + m * N + n + 8 * v;
      if (v == V - 1 && tail < 8)
        _mm256_maskstore_ps(yp, mask, acc[m][v]);
      else
        _mm256_storeu_ps(yp, acc[m][v]);
    }
}

// nn for M (<= ROWS) rows and output columns [n0, n1): weight rows in blocks of KB,
// columns in strips of 16, then 8, then a masked remainder.
template <int M>
void nn_rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t k0 = 0; k0 < K; k0 += KB) {
    const int64_t k1 = k0 + KB < K ? k0 + KB : K;
    int64_t n = n0;
    for (; n + 16 <= n1; n += 16) nn_strip<M, 2>(x, w, y, K, N, k0, k1, n, 8);
    if (n + 8 <= n1) {
      nn_strip<M, 1>(x, w, y, K, N, k0, k1, n, 8);
      n += 8;
    }
    if (n < n1) nn_strip<M, 1>(x, w, y, K, N, k0, k1, n, n1 - n);
  }
}

inline float sum8(__m256 v) {  // a fixed reduction order
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// nt, weight rows [n, n + C) against M rows of x: 8-lane partial sums over k.
template <int M, int C>
inline void nt_block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n) {
  __m256 acc[M][C];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + (n + c) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_fmadd_ps(xv, wv[c], acc[m][c]);
    }
  }
  if (k < K) {
    const __m256i mask = lane_mask(K - k);
    __m256 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm256_maskload_ps(w + (n + c) * K + k, mask);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_maskload_ps(x + m * K + k, mask);
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_fmadd_ps(xv, wv[c], acc[m][c]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < C; ++c) y[m * N + n + c] = sum8(acc[m][c]);
}

// nt for M (<= ROWS) rows and output columns (weight rows) [n0, n1).
template <int M>
void nt_rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) nt_block<M, 2>(x, w, y, K, N, n);
  if (n < n1) nt_block<M, 1>(x, w, y, K, N, n);
}

using RowsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr RowsFn NN[ROWS + 1] = {nullptr, nn_rows<1>, nn_rows<2>, nn_rows<3>, nn_rows<4>, nn_rows<5>, nn_rows<6>};
constexpr RowsFn NT[ROWS + 1] = {nullptr, nt_rows<1>, nt_rows<2>, nt_rows<3>, nt_rows<4>, nt_rows<5>, nt_rows<6>};

// One product split into column chunks that the caller and helper tasks on XLA's intra-op
// pool claim from a counter. The caller never waits for a task to start: it works through
// the chunks itself and then waits only for chunks that another thread has claimed and is
// running (a helper that starts late finds none left). XLA may run several of these
// products at once on the same pool, so waiting for a task to start could deadlock.
struct Product {
  const RowsFn* fns;
  const float* x;
  const float* w;
  float* y;
  int64_t R, K, N, cols;
  int64_t chunks;
  std::atomic<int64_t> next{0}, finished{0};

  void drain() {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      const int64_t n0 = c * cols, n1 = n0 + cols < N ? n0 + cols : N;
      for (int64_t r = 0; r < R; r += ROWS) {
        const int64_t m = R - r < ROWS ? R - r : ROWS;
        fns[m](x + r * K, w, y + r * N, K, N, n0, n1);
      }
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

// x [..., K] (R rows), w [K, N] (nn) or [N, K] (nt), y [..., N].
ffi::Error run(ffi::ThreadPool pool, const RowsFn* fns, bool nt, ffi::Buffer<ffi::F32> x,
               ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("the weight must have rank 2");
  const int64_t K = nt ? wd[1] : wd[0], N = nt ? wd[0] : wd[1];
  if (K == 0 || x.element_count() % K != 0 || y->element_count() != x.element_count() / K * N)
    return ffi::Error::InvalidArgument("operand shapes do not match");
  auto p = std::make_shared<Product>();
  p->fns = fns;
  p->x = x.typed_data();
  p->w = w.typed_data();
  p->y = y->typed_data();
  p->R = x.element_count() / K;
  p->K = K;
  p->N = N;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  p->cols = std::max<int64_t>((N + threads - 1) / threads + 15 & ~int64_t{15}, MIN_COLS);
  p->chunks = (N + p->cols - 1) / p->cols;
  const int64_t helpers = std::min<int64_t>(threads, p->chunks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([p] { p->drain(); });
  p->drain();
  while (p->finished.load(std::memory_order_acquire) < p->chunks) _mm_pause();
  return ffi::Error::Success();
}

ffi::Error MatmulNN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return run(pool, NN, false, x, w, y);
}

ffi::Error MatmulNT(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return run(pool, NT, true, x, w, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecMatmulNN, MatmulNN,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JspecMatmulNT, MatmulNT,
                              ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::Buffer<ffi::F32>>().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
