// Small-M dense layer for CPUs (x86-64 AVX2 + FMA), an XLA FFI custom call: y[M, O] = x[M, I] · W[O, I]ᵀ, fp32.
//
// Must equal (to fp32 rounding) the pure-JAX reference `jnp.einsum("...i,oi->...o", x, w)`, which
// `hyspec_jax.cpu_kernels.dense` falls back to everywhere this kernel does not apply.
//
// Why: a speculative verify (and a draft block) multiplies a handful of rows (M = 2..32 tree nodes) by every
// weight matrix. XLA:CPU runs M = 1 as a streaming matrix-vector product, but M ≥ 2 as a packed GEMM whose
// per-call packing of W costs about a second pass over the weights, so a verify of 2..8 nodes cost 2.1-2.4x
// a decode step on a 2-core host. Here W (HF layout [out, in], rows contiguous) is streamed once: for each
// output row o, a block of up to 8 rows of x (L1-resident) is multiplied with W[o, :] in 8-lane fp32 FMA
// accumulators, then each accumulator is summed horizontally. The arithmetic of y[m, o] (8 lane sums over
// i ≡ lane mod 8, in order, then a fixed reduction tree, then the scalar tail) does not depend on M, on
// the row block or on the thread that computes it: results are deterministic.
//
// Threads: output rows are split into chunks claimed from an atomic counter by the caller and by helper tasks
// on XLA's intra-op pool. The caller never waits for a chunk nobody has started (it claims the rest itself),
// so a busy or single-thread pool cannot deadlock it; late helpers find no work and exit.
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kPrefetch = 256;    // floats ahead in the current W row (1 KiB)
constexpr int64_t kChunkRows = 64;    // output rows per claimed chunk (at least)
constexpr int64_t kMaxThreads = 8;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Rows x[0..MB) (stride I) times W rows [o0, o1) -> y[m, o] (stride O).
template <int MB>
void block(const float* x, const float* w, float* y, int64_t I, int64_t O, int64_t o0, int64_t o1) {
  for (int64_t o = o0; o < o1; ++o) {
    const float* wr = w + o * I;
    __m256 acc[MB];
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= I; i += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(wr + i + kPrefetch), _MM_HINT_T0);
      const __m256 wv = _mm256_loadu_ps(wr + i);
      for (int m = 0; m < MB; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * I + i), acc[m]);
    }
    for (int m = 0; m < MB; ++m) {
      float s = hsum(acc[m]);
      for (int64_t j = i; j < I; ++j) s += wr[j] * x[m * I + j];
      y[m * O + o] = s;
    }
  }
}

void rows(const float* x, const float* w, float* y, int64_t M, int64_t I, int64_t O, int64_t o0, int64_t o1) {
  int64_t m = 0;
  for (; m + 8 <= M; m += 8) block<8>(x + m * I, w, y + m * O, I, O, o0, o1);
  const float* xr = x + m * I;
  float* yr = y + m * O;
  switch (M - m) {
    case 7: block<7>(xr, w, yr, I, O, o0, o1); break;
    case 6: block<6>(xr, w, yr, I, O, o0, o1); break;
    case 5: block<5>(xr, w, yr, I, O, o0, o1); break;
    case 4: block<4>(xr, w, yr, I, O, o0, o1); break;
    case 3: block<3>(xr, w, yr, I, O, o0, o1); break;
    case 2: block<2>(xr, w, yr, I, O, o0, o1); break;
    case 1: block<1>(xr, w, yr, I, O, o0, o1); break;
    default: break;
  }
}

struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t M, I, O, chunk, n_chunks;
  std::atomic<int64_t> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int64_t done = 0;  // chunks finished (under mu)

  // Claim and compute chunks until none is left; returns the number computed.
  int64_t drain() {
    int64_t k, n = 0;
    while ((k = next.fetch_add(1, std::memory_order_relaxed)) < n_chunks) {
      const int64_t o0 = k * chunk;
      rows(x, w, y, M, I, O, o0, std::min(O, o0 + chunk));
      ++n;
    }
    return n;
  }
  void finish(int64_t n) {
    if (n == 0) return;
    std::lock_guard<std::mutex> lock(mu);
    done += n;
    if (done == n_chunks) cv.notify_all();
  }
};

ffi::Error Dense(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                 ffi::ResultBuffer<ffi::F32> y) {
  const auto wd = w.dimensions();
  if (wd.size() != 2) return ffi::Error::InvalidArgument("hyspec_dense_f32: w must be [out, in]");
  const int64_t O = wd[0], I = wd[1];
  const int64_t M = I ? static_cast<int64_t>(x.element_count()) / I : 0;
  if (M * I != static_cast<int64_t>(x.element_count()) || static_cast<int64_t>(y->element_count()) != M * O)
    return ffi::Error::InvalidArgument("hyspec_dense_f32: shapes do not match x[..., in] · w[out, in]ᵀ");
  if (M == 0 || O == 0) return ffi::Error::Success();
  const int64_t threads = std::min<int64_t>({pool.num_threads(), kMaxThreads, (O + kChunkRows - 1) / kChunkRows});
  if (threads < 2) {
    rows(x.typed_data(), w.typed_data(), y->typed_data(), M, I, O, 0, O);
    return ffi::Error::Success();
  }
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->M = M;
  work->I = I;
  work->O = O;
  work->chunk = std::max<int64_t>(kChunkRows, (O + 4 * threads - 1) / (4 * threads));
  work->n_chunks = (O + work->chunk - 1) / work->chunk;
  for (int64_t t = 1; t < threads; ++t) {
    pool.Schedule([work] { work->finish(work->drain()); });
  }
  work->finish(work->drain());
  std::unique_lock<std::mutex> lock(work->mu);
  work->cv.wait(lock, [&] { return work->done == work->n_chunks; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(hyspec_dense_f32, Dense,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
