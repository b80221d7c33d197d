// C++ CPU kernels, float32, registered as torch.ops.unified_cpu.*; tests compare each with its reference:
// - paged_decode: decode attention over a paged KV cache, one query token per sequence, reading each
//   sequence's K/V rows in place through its block table (no gathered copy of the context).
//   Reference: unified/kernels/paged_attention.py (_decode_batch).
// - skinny_linear: x @ w.T for a few rows of x, streaming the weight. Reference: F.linear (linear.py).
// - pack_panels, panel_linear (AVX2 and AVX-512 builds): x @ w.T through a copy of w packed in panels of 16
//   output features, for any number of rows. Reference: F.linear (linear.py).
// - rms_norm, silu_and_mul: one pass each. References: unified/kernels/rms_norm.py, activation.py.
// - norm_rope_, write_kv_rows_: qk-norm and RoPE in place, the KV-cache write. References:
//   unified/kernels/rotary.py, paged_attention.py (write_kv).
//
// Built at first use by unified/kernels/cpu_ops.py with CPU_CAPABILITY set to what ATen dispatches to on
// this machine (AVX2 or AVX512), so at::vec::Vectorized<float> is that width.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#if defined(CPU_CAPABILITY_AVX512)
namespace unified_avx512 {  // attention_avx512.cpp
void paged_decode(float* out, const float* q, const float* k_cache, const float* v_cache, int64_t v_row,
                  const int64_t* tables, int64_t width, const int64_t* lens, int64_t seqs, int64_t q_heads,
                  int64_t kv_heads, int64_t block_size, int64_t dk, int64_t dv, float scale, int64_t sliding_window,
                  const int64_t* skips, float* lse);
void panel_linear(const float* x, int64_t m, int64_t k, const float* panels, int64_t n, const float* bias,
                  float* out);  // panel_avx512.cpp
}
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

// Four independent accumulators: one FMA chain would wait on the FMA latency at every step.
inline float dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t w = Vec::size();
  Vec acc0(0.f), acc1(0.f), acc2(0.f), acc3(0.f);
  int64_t d = 0;
  for (; d + 4 * w <= n; d += 4 * w) {
    acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + d + w), Vec::loadu(b + d + w), acc1);
    acc2 = at::vec::fmadd(Vec::loadu(a + d + 2 * w), Vec::loadu(b + d + 2 * w), acc2);
    acc3 = at::vec::fmadd(Vec::loadu(a + d + 3 * w), Vec::loadu(b + d + 3 * w), acc3);
  }
  for (; d + w <= n; d += w) acc0 = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc0);
  Vec acc = (acc0 + acc1) + (acc2 + acc3);
  float out = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < n; ++d) out += a[d] * b[d];
  return out;
}

// out[j] = the sum of acc[j]'s lanes, for eight accumulators (on AVX2 by a tree of horizontal adds, ~10
// instructions for all eight instead of a full reduction each).
inline void reduce8(Vec* acc, float* out) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#if defined(CPU_CAPABILITY_AVX512)
  __m256 half[8];  // each accumulator's two 256-bit halves added, then the AVX2 tree
  for (int j = 0; j < 8; ++j)
    half[j] = _mm256_add_ps(_mm512_castps512_ps256(acc[j]), _mm512_extractf32x8_ps(__m512(acc[j]), 1));
#else
  const __m256* half = reinterpret_cast<const __m256*>(acc);
#endif
  const __m256 t0 = _mm256_hadd_ps(half[0], half[1]), t1 = _mm256_hadd_ps(half[2], half[3]);
  const __m256 t2 = _mm256_hadd_ps(half[4], half[5]), t3 = _mm256_hadd_ps(half[6], half[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 holds rows 0-3 in each 128-bit half, u1 rows 4-7: add the halves.
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
#else
  for (int j = 0; j < 8; ++j) out[j] = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc[j]);
#endif
}

// out[j] = x . rows[j] for eight rows of length n: one vector accumulator per row.
inline void dot8(const float* x, const float* const* rows, int64_t n, float* out) {
  constexpr int64_t w = Vec::size();
  Vec acc[8] = {Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f), Vec(0.f)};
  int64_t d = 0;
  for (; d + w <= n; d += w) {
    const Vec xv = Vec::loadu(x + d);
    for (int j = 0; j < 8; ++j) acc[j] = at::vec::fmadd(xv, Vec::loadu(rows[j] + d), acc[j]);
  }
  float sums[8];
  reduce8(acc, sums);
  for (; d < n; ++d)
    for (int j = 0; j < 8; ++j) sums[j] += x[d] * rows[j][d];
  for (int j = 0; j < 8; ++j) out[j] = sums[j];
}

// out[0:n] = sum_i weights[i] * rows[i][0:n], keeping four vectors of the sum in registers across the rows.
inline void weighted_sum(const float* weights, const std::vector<const float*>& rows, float* out, int64_t n) {
  constexpr int64_t w = Vec::size();
  const int64_t count = static_cast<int64_t>(rows.size());
  int64_t d = 0;
  for (; d + 4 * w <= n; d += 4 * w) {
    Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
    for (int64_t i = 0; i < count; ++i) {
      const Vec p(weights[i]);
      const float* x = rows[i] + d;
      a0 = at::vec::fmadd(p, Vec::loadu(x), a0);
      a1 = at::vec::fmadd(p, Vec::loadu(x + w), a1);
      a2 = at::vec::fmadd(p, Vec::loadu(x + 2 * w), a2);
      a3 = at::vec::fmadd(p, Vec::loadu(x + 3 * w), a3);
    }
    a0.store(out + d);
    a1.store(out + d + w);
    a2.store(out + d + 2 * w);
    a3.store(out + d + 3 * w);
  }
  for (; d < n; ++d) {
    float sum = 0.f;
    for (int64_t i = 0; i < count; ++i) sum += weights[i] * rows[i][d];
    out[d] = sum;
  }
}

// out[g][0:n] = sum_i weights[g * count + i] * rows[i][0:n] for `queries` weight rows, one pass over the rows
// (each row read once for all queries): four queries times 64 channels of sums stay in registers.
inline void weighted_sums(const float* weights, int64_t count, int64_t queries, const std::vector<const float*>& rows,
                          float* out, int64_t n) {
  constexpr int64_t w = Vec::size();
  for (int64_t g0 = 0; g0 < queries; g0 += 4) {
    const int64_t gs = std::min<int64_t>(4, queries - g0);
    if (gs < 4 || n % (4 * w) != 0) {  // an odd group or width: one query at a time
      for (int64_t g = g0; g < g0 + gs; ++g) weighted_sum(weights + g * count, rows, out + g * n, n);
      continue;
    }
    const float* w0 = weights + g0 * count;
    for (int64_t d = 0; d < n; d += 4 * w) {
      Vec acc[4][4];
      for (int g = 0; g < 4; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = Vec(0.f);
      for (int64_t i = 0; i < count; ++i) {
        const float* x = rows[i] + d;
        const Vec x0 = Vec::loadu(x), x1 = Vec::loadu(x + w), x2 = Vec::loadu(x + 2 * w), x3 = Vec::loadu(x + 3 * w);
        for (int g = 0; g < 4; ++g) {
          const Vec p(w0[g * count + i]);
          acc[g][0] = at::vec::fmadd(p, x0, acc[g][0]);
          acc[g][1] = at::vec::fmadd(p, x1, acc[g][1]);
          acc[g][2] = at::vec::fmadd(p, x2, acc[g][2]);
          acc[g][3] = at::vec::fmadd(p, x3, acc[g][3]);
        }
      }
      for (int g = 0; g < 4; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c].store(out + (g0 + g) * n + d + c * w);
    }
  }
}

// Asks for a row's cache lines ahead of its use: rows of a head are strided through the cache (the other heads'
// rows lie between them), a pattern the hardware prefetchers barely follow, so loads would wait on memory one
// row at a time. kRowsAhead rows ahead covers the memory latency at the rate the dot products consume them.
constexpr int64_t kRowsAhead = 64;

template <int Locality>
inline void prefetch_row(const float* row, int64_t n) {
  for (int64_t d = 0; d < n; d += 16) __builtin_prefetch(row + d, 0, Locality);
}

inline void softmax_inplace(float* row, int64_t n) {
  const float top = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row, n);
  at::vec::map([top](Vec x) { return (x - Vec(top)).exp(); }, row, row, n);
  const float inv = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, row, n);
  at::vec::map([inv](Vec x) { return x * Vec(inv); }, row, row, n);
}

// q [S, Hq, Dk]; k_cache [num_blocks, block_size, Hkv, Dk]; v_cache [num_blocks, block_size, Hkv, Dv], or
// none: the values are the first dv channels of the keys (MLA's latent cache); block_tables [S, W] int64;
// context_lens [S] int64, each >= 1; sliding_window <= 0: none. Returns [S, Hq, dv].
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const std::optional<at::Tensor>& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                        int64_t sliding_window, int64_t dv) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q [S, Hq, D] and a 4-d key cache expected");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat, "paged_decode: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous(), "paged_decode: contiguous q and key cache expected");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong &&
              block_tables.is_contiguous() && context_lens.is_contiguous(), "paged_decode: int64 tables and lengths");
  const int64_t seqs = q.size(0), q_heads = q.size(1), dk = q.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dk && q_heads % kv_heads == 0, "paged_decode: q and key cache do not match");
  const float* vp = k_cache.data_ptr<float>();
  int64_t v_row = dk;
  if (v_cache.has_value()) {
    TORCH_CHECK(v_cache->scalar_type() == at::kFloat && v_cache->is_contiguous() &&
                v_cache->sizes().slice(0, 3) == k_cache.sizes().slice(0, 3), "paged_decode: value cache mismatch");
    vp = v_cache->data_ptr<float>();
    v_row = v_cache->size(3);
  }
  TORCH_CHECK(dv <= v_row, "paged_decode: dv exceeds the value rows");
  const int64_t group = q_heads / kv_heads;
  at::Tensor out = at::empty({seqs, q_heads, dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float softmax_scale = static_cast<float>(scale);
#if defined(CPU_CAPABILITY_AVX512)
  if (dv % 16 == 0) {
    unified_avx512::paged_decode(op, qp, kp, vp, v_row, tables, width, lens, seqs, q_heads, kv_heads, block_size, dk,
                                 dv, softmax_scale, sliding_window, nullptr, nullptr);
    return out;
  }
#endif

  // One task per (sequence, KV head): its K/V rows are read once for the whole group of query heads.
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries(group * dk);
    std::vector<const float*> keys, values;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads, len = lens[s];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t n = len - first;
      const int64_t* table = tables + s * width;
      keys.clear();
      values.clear();
      for (int64_t block = first / block_size, pos = first; pos < len; ++block) {
        const int64_t row0 = table[block] * block_size * kv_heads + h;  // (slot * kv_heads + h) at the block's start
        for (int64_t offset = pos % block_size; offset < block_size && pos < len; ++offset, ++pos) {
          keys.push_back(kp + (row0 + offset * kv_heads) * dk);
          values.push_back(vp + (row0 + offset * kv_heads) * v_row);
        }
      }
      const float* qs = qp + (s * q_heads + h * group) * dk;
      for (int64_t i = 0; i < group * dk; ++i) queries[i] = qs[i] * softmax_scale;
      scores.resize(group * n);
      // One pass over the keys for the whole group: eight rows at a time, dotted with each query while in L1.
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        for (int64_t j = i + kRowsAhead; j < std::min(n, i + kRowsAhead + 8); ++j) {
          prefetch_row<3>(keys[j], dk);
          prefetch_row<2>(values[j], dv);  // for the value pass, which starts when the keys are done
        }
        for (int64_t g = 0; g < group; ++g) dot8(queries.data() + g * dk, keys.data() + i, dk, scores.data() + g * n + i);
      }
      for (; i < n; ++i)
        for (int64_t g = 0; g < group; ++g) scores[g * n + i] = dot(queries.data() + g * dk, keys[i], dk);
      for (int64_t g = 0; g < group; ++g) softmax_inplace(scores.data() + g * n, n);
      weighted_sums(scores.data(), n, group, values, op + (s * q_heads + h * group) * dv, dv);
    }
  });
  return out;
}

// out [M, N] = x [M, K] @ w [N, K].T (+ bias [N]) for a few rows M (batch-1 decode): a stream over the
// weight, each row read from memory once for all rows of x; threads take contiguous row ranges. Up to
// kOneStreamRows rows of x, a thread walks its weight rows one at a time: a core here reads memory fastest
// as one sequential stream, faster than eight rows side by side (bench/RESULTS.md). With more rows of x,
// eight weight rows at a time, so that each load of x serves eight multiply-adds.
constexpr int64_t kOneStreamRows = 4;

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.is_contiguous() && w.is_contiguous(),
              "skinny_linear: contiguous float32 x and w expected");
  const int64_t rows = x.size(0), k = x.size(1), n = w.size(0);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "skinny_linear: float32 bias [N] expected");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (rows <= kOneStreamRows) {
    at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j)
        for (int64_t i = 0; i < rows; ++i) op[i * n + j] = dot(xp + i * k, wp + j * k, k) + (bp ? bp[j] : 0.f);
    });
    return out;
  }
  at::parallel_for(0, (n + 7) / 8, 16, [&](int64_t begin, int64_t end) {
    for (int64_t group = begin; group < end; ++group) {
      const int64_t j0 = group * 8;
      if (j0 + 8 <= n) {
        const float* weights[8];
        for (int j = 0; j < 8; ++j) weights[j] = wp + (j0 + j) * k;
        for (int64_t i = 0; i < rows; ++i) dot8(xp + i * k, weights, k, op + i * n + j0);
      } else {
        for (int64_t j = j0; j < n; ++j)
          for (int64_t i = 0; i < rows; ++i) op[i * n + j] = dot(xp + i * k, wp + j * k, k);
      }
      if (bp)
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = j0; j < std::min(j0 + 8, n); ++j) op[i * n + j] += bp[j];
    }
  });
  return out;
}

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// x @ w.T with w packed once in panels: panel p holds output features [16p, 16p + 16) as k rows of 16
// floats, so a register tile of rows x 16 features reads one contiguous stream of weights. Threads take
// contiguous panel ranges; rows go in blocks so the block of x a panel meets stays in L2. No split of k: a
// panel (k x 64 bytes) is read from L2 at a rate the FMAs keep up with. The AVX-512 tiles are in
// panel_avx512.cpp.
constexpr int64_t kPanel = 16;

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "pack_panels: a float32 CPU weight [N, K] expected");
  const at::Tensor wc = w.contiguous();
  const int64_t n = wc.size(0), k = wc.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor out = at::zeros({panels, k, kPanel}, wc.options());  // features past N stay zero
  const float* src = wc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < n; ++j) {
        const float* row = src + (p * kPanel + j) * k;
        float* column = dst + p * k * kPanel + j;
        for (int64_t d = 0; d < k; ++d) column[d * kPanel] = row[d];
      }
  });
  return out;
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// AVX2 tiles: 6 rows x 16 features (12 accumulators, 2 weight vectors, 1 broadcast of the 16 registers). On
// a 2-core Zen 3 EPYC, over SmolLM2's weights (bench/matmul.py): 142-192 GFLOP/s for 64 and 2048 rows
// against oneDNN's 129-162 on its own packing; 1-8 rows are bound by reading the weight, 1.01-1.45x over
// oneDNN there.
constexpr int64_t kPanelRows = 6, kPanelRowBlock = 264;

// c[R, 16] = init[16] + a[R, k] @ panel[k, 16], with R <= 6 rows of a `lda` apart and of c `ldc` apart.
// Named registers, not an array of vectors: GCC kept such an array in memory, storing every
// accumulator at every step (half the speed).
template <int R>
inline void panel_tile(const float* a, int64_t lda, const float* panel, int64_t k, float* c, int64_t ldc,
                       const float* init) {
  __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda, *a4 = a + 4 * lda, *a5 = a + 5 * lda;
#define UNIFIED_TILE_INIT(r) \
  if (R > r) { c##r##0 = _mm256_loadu_ps(init); c##r##1 = _mm256_loadu_ps(init + 8); }
#define UNIFIED_TILE_FMA(r)                                                                          \
  if (R > r) {                                                                                       \
    const __m256 x = _mm256_broadcast_ss(a##r + d);                                                  \
    c##r##0 = _mm256_fmadd_ps(x, w0, c##r##0);                                                       \
    c##r##1 = _mm256_fmadd_ps(x, w1, c##r##1);                                                       \
  }
#define UNIFIED_TILE_STORE(r) \
  if (R > r) { _mm256_storeu_ps(c + r * ldc, c##r##0); _mm256_storeu_ps(c + r * ldc + 8, c##r##1); }
  UNIFIED_TILE_INIT(0) UNIFIED_TILE_INIT(1) UNIFIED_TILE_INIT(2) UNIFIED_TILE_INIT(3) UNIFIED_TILE_INIT(4)
  UNIFIED_TILE_INIT(5)
  for (int64_t d = 0; d < k; ++d) {
    const __m256 w0 = _mm256_loadu_ps(panel + d * kPanel), w1 = _mm256_loadu_ps(panel + d * kPanel + 8);
    UNIFIED_TILE_FMA(0) UNIFIED_TILE_FMA(1) UNIFIED_TILE_FMA(2) UNIFIED_TILE_FMA(3) UNIFIED_TILE_FMA(4)
    UNIFIED_TILE_FMA(5)
  }
  UNIFIED_TILE_STORE(0) UNIFIED_TILE_STORE(1) UNIFIED_TILE_STORE(2) UNIFIED_TILE_STORE(3) UNIFIED_TILE_STORE(4)
  UNIFIED_TILE_STORE(5)
#undef UNIFIED_TILE_INIT
#undef UNIFIED_TILE_FMA
#undef UNIFIED_TILE_STORE
}

using PanelTile = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, const float*);
constexpr PanelTile kPanelTiles[kPanelRows + 1] = {nullptr,        panel_tile<1>, panel_tile<2>, panel_tile<3>,
                                                   panel_tile<4>, panel_tile<5>, panel_tile<6>};

void panel_matmul(const float* xp, int64_t m, int64_t k, const float* wp, int64_t n, const float* bp, float* op) {
  at::parallel_for(0, (n + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
    alignas(32) float init[kPanel];
    alignas(32) float edge[kPanelRows * kPanel];  // the last panel's tile when N is no multiple of 16
    for (int64_t block = 0; block < m; block += kPanelRowBlock) {
      const int64_t block_end = std::min(m, block + kPanelRowBlock);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t j0 = p * kPanel, features = std::min(kPanel, n - j0);
        for (int64_t j = 0; j < kPanel; ++j) init[j] = bp && j < features ? bp[j0 + j] : 0.f;
        const float* panel = wp + p * k * kPanel;
        for (int64_t i = block; i < block_end; i += kPanelRows) {
          const int64_t rows = std::min(kPanelRows, block_end - i);
          if (features == kPanel) {
            kPanelTiles[rows](xp + i * k, k, panel, k, op + i * n + j0, n, init);
          } else {
            kPanelTiles[rows](xp + i * k, k, panel, k, edge, kPanel, init);
            for (int64_t r = 0; r < rows; ++r)
              std::copy(edge + r * kPanel, edge + r * kPanel + features, op + (i + r) * n + j0);
          }
        }
      }
    }
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
// out [M, N] = x [M, K] @ w [N, K].T (+ bias [N]), w given as pack_panels(w).
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t n, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "panel_linear: contiguous float32 x [M, K] expected");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(2) == kPanel && panels.size(1) == x.size(1) && n > (panels.size(0) - 1) * kPanel &&
                  n <= panels.size(0) * kPanel,
              "panel_linear: panels = pack_panels(w) of a weight [n, K] expected");
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "panel_linear: float32 bias [N] expected");
    bp = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
#if defined(CPU_CAPABILITY_AVX512)
  unified_avx512::panel_linear(x.data_ptr<float>(), m, k, panels.data_ptr<float>(), n, bp, out.data_ptr<float>());
#else
  panel_matmul(x.data_ptr<float>(), m, k, panels.data_ptr<float>(), n, bp, out.data_ptr<float>());
#endif
  return out;
}
#endif

// y = weight * (x / sqrt(mean(x^2) + eps)) over the last dimension, one pass per row.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.is_contiguous() &&
              weight.is_contiguous() && x.dim() >= 1 && weight.numel() == x.size(-1),
              "rms_norm: contiguous float32 x [..., n] and weight [n] expected");
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * n;
      const float squares = at::vec::map_reduce_all<float>(
          [](Vec v) { return v * v; }, [](Vec a, Vec b) { return a + b; }, xr, n);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + static_cast<float>(eps));
      at::vec::map2([inv](Vec v, Vec w) { return w * (v * Vec(inv)); }, op + r * n, xr, wp, n);
    }
  });
  return out;
}

// [..., 2i] -> [..., i]: silu(gate) * up for x = [gate | up], the gated MLP's activation in one pass.
at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "silu_and_mul: contiguous float32 [..., 2i] expected");
  const int64_t half = x.size(-1) / 2, rows = half ? x.numel() / (2 * half) : 0;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = half;
  at::Tensor out = at::empty(shape, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* gate = xp + r * 2 * half;
      at::vec::map2([](Vec g, Vec u) { return g / (Vec(1.f) + g.neg().exp()) * u; }, op + r * half, gate,
                    gate + half, half);
    }
  });
  return out;
}

// In place over the q and k heads of a fused projection, x [T, H, D] or [1, T, H, D] (heads D apart, tokens any
// stride): each head optionally RMS-normalised (q_weight for the first q_heads heads, k_weight for the rest;
// Qwen3's qk-norm), then rotated by RoPE with cos, sin [T, D/2] (any shape of that many values, such as
// [1, T, D/2]; the halves convention: x1 = x[:D/2], x2 = x[D/2:]). The same operations in the same order as
// RMSNorm followed by apply_rotary, in one pass instead of about ten ops.
void norm_rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& q_weight,
                const std::optional<at::Tensor>& k_weight, int64_t q_heads, double eps) {
  TORCH_CHECK((x.dim() == 3 || (x.dim() == 4 && x.size(0) == 1)) && x.scalar_type() == at::kFloat &&
                  x.stride(-1) == 1 && x.stride(-2) == x.size(-1) && x.size(-1) % 2 == 0,
              "norm_rope_: float32 x [T, H, D] or [1, T, H, D] with contiguous heads expected");
  const int64_t tokens = x.size(-3), heads = x.size(-2), dim = x.size(-1), half = dim / 2;
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.numel() == tokens * half && sin.numel() == tokens * half,
              "norm_rope_: float32 cos, sin [T, D/2] expected");
  TORCH_CHECK(q_weight.has_value() == k_weight.has_value(), "norm_rope_: both norm weights or neither");
  const float *qw = nullptr, *kw = nullptr;
  if (q_weight.has_value()) {
    TORCH_CHECK(q_weight->scalar_type() == at::kFloat && k_weight->scalar_type() == at::kFloat &&
                    q_weight->is_contiguous() && k_weight->is_contiguous() && q_weight->numel() == dim &&
                    k_weight->numel() == dim, "norm_rope_: float32 norm weights [D] expected");
    qw = q_weight->data_ptr<float>();
    kw = k_weight->data_ptr<float>();
  }
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t token_stride = x.stride(-3);
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / heads, h = task % heads;
      float* row = xp + t * token_stride + h * dim;
      if (qw) {
        const float squares = at::vec::map_reduce_all<float>([](Vec v) { return v * v; },
                                                             [](Vec a, Vec b) { return a + b; }, row, dim);
        const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + epsilon);
        at::vec::map2([inv](Vec v, Vec w) { return w * (v * Vec(inv)); }, row, row, h < q_heads ? qw : kw, dim);
      }
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      float* x1 = row;
      float* x2 = row + half;
      constexpr int64_t w = Vec::size();
      int64_t i = 0;
      for (; i + w <= half; i += w) {
        const Vec a = Vec::loadu(x1 + i), b = Vec::loadu(x2 + i), cv = Vec::loadu(c + i), sv = Vec::loadu(s + i);
        (a * cv - b * sv).store(x1 + i);
        (b * cv + a * sv).store(x2 + i);
      }
      for (; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        x1[i] = a * c[i] - b * s[i];
        x2[i] = b * c[i] + a * s[i];
      }
    }
  });
}

// cache rows slots[t] (of a cache viewed as [slots, H, D]) = x[t] [H, D], for x [T, H, D] or [1, T, H, D] with
// contiguous rows at any token stride (the K or V heads of a fused projection): the KV-cache write, without
// index_copy_'s per-call set-up.
void write_kv_rows_(at::Tensor& cache, const at::Tensor& x, const at::Tensor& slots) {
  TORCH_CHECK(cache.scalar_type() == at::kFloat && x.scalar_type() == at::kFloat && cache.is_contiguous() &&
                  (x.dim() == 3 || (x.dim() == 4 && x.size(0) == 1)) && x.stride(-1) == 1 &&
                  x.stride(-2) == x.size(-1) && slots.scalar_type() == at::kLong && slots.is_contiguous() &&
                  slots.numel() == x.size(-3),
              "write_kv_rows_: float32 cache, x [T, H, D] or [1, T, H, D] with contiguous rows, int64 slots [T] "
              "expected");
  const int64_t tokens = x.size(-3), stride = x.stride(-3);
  const int64_t row = x.size(-2) * x.size(-1), capacity = cache.numel() / std::max<int64_t>(row, 1);
  TORCH_CHECK(cache.numel() % std::max<int64_t>(row, 1) == 0, "write_kv_rows_: cache rows do not match x");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < capacity, "write_kv_rows_: slot ", sp[t], " outside the cache");
  float* cp = cache.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) std::copy(xp + t * stride, xp + t * stride + row, cp + sp[t] * row);
  });
}

// x [..., in] @ weight [out, in].T (+ bias), the weight plain or packed by mkldnn::_reorder_linear_weight: oneDNN's
// linear, behind a schema that TorchScript's tracer can record (it cannot record the empty `Scalar?[]` that
// mkldnn::_linear_pointwise takes).
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY(unified_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor? v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale, int sliding_window, int dv) -> Tensor", &paged_decode);
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &skinny_linear);
  m.def("onednn_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor", &onednn_linear);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("norm_rope_(Tensor(a!) x, Tensor cos, Tensor sin, Tensor? q_weight, Tensor? k_weight, int q_heads, "
        "float eps) -> ()", &norm_rope_);
  m.def("write_kv_rows_(Tensor(a!) cache, Tensor x, Tensor slots) -> ()", &write_kv_rows_);
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  m.def("pack_panels(Tensor w) -> Tensor", &pack_panels);
  m.def("panel_linear(Tensor x, Tensor panels, int n, Tensor? bias) -> Tensor", &panel_linear);
#endif
}
