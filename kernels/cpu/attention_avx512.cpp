// Prefill attention over a paged KV cache (AVX-512 builds), float32, registered as
// torch.ops.unified_cpu.paged_prefill_. Reference: unified/kernels/paged_attention.py (paged_attention's
// prefill chunks, torch's SDPA over the gathered context).
//
// Each multi-token chunk's queries attend causally (optionally within a sliding window) to its sequence's
// context, whose K/V rows are read in place through the block table. One task is one KV head and a tile of
// kRows query rows: the tile's positions times the query heads that share the KV head, so each K/V row is
// read once for the whole group. Per task the tile's queries are packed transposed ([dk, rows], scaled), and
// the keys stream by in steps of kKeys positions:
//   S^T [keys, rows] = K Q^T  (a key element broadcast against a vector of 16 query rows),
//   online softmax down each column (a running max and sum per query row),
//   O [rows, dv] += P V       (a probability broadcast against a vector of 16 value channels).
// Neither the keys nor the values are copied or transposed. Tasks are taken longest first and handed out
// dynamically: under causal attention the last tiles of a chunk read the most keys.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#include <omp.h>

namespace {

constexpr int64_t kRows = 64;  // query rows per task, four vectors of 16
constexpr int64_t kKeys = 64;  // key positions per step of the online softmax
constexpr int kLanes = 16;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

inline __m512 exp16(__m512 x) { return __m512(at::vec::Vectorized<float>(x).exp_u20()); }

// st[p][0:64] = sum_d keys[p][d] * qt[d][0:64] for P key positions (P x 4 accumulators).
template <int P>
inline void score_tile(const float* const* keys, const float* qt, int64_t dk, float* st) {
  __m512 acc[P][4];
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[p][c] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dk; ++d) {
    const float* q = qt + d * kRows;
    const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16), q2 = _mm512_loadu_ps(q + 32),
                 q3 = _mm512_loadu_ps(q + 48);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      const __m512 k = _mm512_set1_ps(keys[p][d]);
      acc[p][0] = _mm512_fmadd_ps(k, q0, acc[p][0]);
      acc[p][1] = _mm512_fmadd_ps(k, q1, acc[p][1]);
      acc[p][2] = _mm512_fmadd_ps(k, q2, acc[p][2]);
      acc[p][3] = _mm512_fmadd_ps(k, q3, acc[p][3]);
    }
  }
#pragma GCC unroll 8
  for (int p = 0; p < P; ++p)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(st + p * kRows + c * kLanes, acc[p][c]);
}

using ScoreTile = void (*)(const float* const*, const float*, int64_t, float*);
constexpr int kScorePositions = 6;
constexpr ScoreTile kScoreTiles[kScorePositions + 1] = {nullptr, score_tile<1>, score_tile<2>, score_tile<3>,
                                                         score_tile<4>, score_tile<5>, score_tile<6>};

// out[r][0:16V] (+)= sum_j w[r * w_row + j * w_key] * values[j][offset:offset + 16V] for R rows of weights
// (R x V sums in registers), added to what out holds when `accumulate`. Both attention kernels' P V.
template <int R, int V>
inline void weighted_rows(const float* w, int64_t w_row, int64_t w_key, const float* const* values, int64_t offset,
                          int64_t n, float* out, int64_t ldo, bool accumulate) {
  __m512 acc[R][V];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < V; ++c) acc[r][c] = accumulate ? _mm512_loadu_ps(out + r * ldo + c * kLanes) : _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 x[V];
#pragma GCC unroll 4
    for (int c = 0; c < V; ++c) x[c] = _mm512_loadu_ps(values[j] + offset + c * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 p = _mm512_set1_ps(w[r * w_row + j * w_key]);
#pragma GCC unroll 4
      for (int c = 0; c < V; ++c) acc[r][c] = _mm512_fmadd_ps(p, x[c], acc[r][c]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(out + r * ldo + c * kLanes, acc[r][c]);
}

using WeightedRows = void (*)(const float*, int64_t, int64_t, const float* const*, int64_t, int64_t, float*, int64_t,
                              bool);
constexpr int kValueRows = 6;
// kWeightedRows[V - 1][R]: R rows (1-6) x V vectors (1-4) of 16 channels.
#define UNIFIED_WEIGHTED_ROWS(V)                                                                             \
  {nullptr, weighted_rows<1, V>, weighted_rows<2, V>, weighted_rows<3, V>, weighted_rows<4, V>, weighted_rows<5, V>, \
   weighted_rows<6, V>}
constexpr WeightedRows kWeightedRows[4][kValueRows + 1] = {UNIFIED_WEIGHTED_ROWS(1), UNIFIED_WEIGHTED_ROWS(2),
                                                           UNIFIED_WEIGHTED_ROWS(3), UNIFIED_WEIGHTED_ROWS(4)};
#undef UNIFIED_WEIGHTED_ROWS

// The rows values are read from, and their length: the value cache's, or without one (MLA's latent cache) the
// keys', whose first dv channels are the values.
std::pair<const float*, int64_t> value_rows(const at::Tensor& k_cache, const std::optional<at::Tensor>& v_cache,
                                            int64_t dv, const char* op) {
  if (!v_cache.has_value()) {
    TORCH_CHECK(dv <= k_cache.size(3), op, ": dv exceeds the key rows");
    return {k_cache.data_ptr<float>(), k_cache.size(3)};
  }
  TORCH_CHECK(v_cache->scalar_type() == at::kFloat && v_cache->is_contiguous() &&
                  v_cache->sizes().slice(0, 3) == k_cache.sizes().slice(0, 3) && dv <= v_cache->size(3),
              op, ": the value cache does not match the key cache, or has fewer than dv channels");
  return {v_cache->data_ptr<float>(), v_cache->size(3)};
}

struct Task {
  int64_t chunk, kv_head, first_row;  // first_row: the tile's first row in the chunk's [position, group] order
  int64_t keys;                       // how many key positions it reads, for ordering
};

struct Chunk {
  int64_t seq, q_start, q_len, ctx_len;
};

// A paged KV cache as the kernels read it: rows of slot * kv_heads + head, through per-sequence block tables.
struct PagedCache {
  const float* keys;
  const float* values;  // the keys themselves for MLA's latent cache
  int64_t value_row, block_size, kv_heads;
  const int64_t* tables;
  int64_t width;
};

// The attention of `chunks` (see paged_prefill) once checked: out and lse (or null) by query row and head.
void attend_chunks(float* op, float* lse_p, const float* qp, int64_t q_heads, int64_t dk, int64_t dv,
                   const PagedCache& cache, const std::vector<Chunk>& chunks, float softmax_scale,
                   int64_t sliding_window, bool causal) {
  const float *kp = cache.keys, *vp = cache.values;
  const int64_t v_row = cache.value_row, block_size = cache.block_size, kv_heads = cache.kv_heads;
  const int64_t* tables = cache.tables;
  const int64_t width = cache.width, group = q_heads / kv_heads;
  const int64_t tile_rows = std::min(kRows, std::max<int64_t>(1, kRows / group) * group);  // < kRows: no divisor
  std::vector<Task> tasks;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const Chunk& ch = chunks[c];
    const int64_t rows = ch.q_len * group;
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t r = 0; r < rows; r += tile_rows)
        tasks.push_back({c, h, r, causal ? ch.ctx_len - ch.q_len + std::min(rows, r + tile_rows) / group : ch.ctx_len});
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.keys > b.keys; });

  const int64_t task_count = static_cast<int64_t>(tasks.size());

#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> qt(dk * kRows), st(kKeys * kRows), o(kRows * dv);
    alignas(64) float running_max[kRows], running_sum[kRows];
    int64_t row_position[kRows];
    const float* keys[kKeys];
    const float* values[kKeys];
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < task_count; ++t) {
      const Task& task = tasks[t];
      const Chunk& ch = chunks[task.chunk];
      const int64_t h = task.kv_head, rows = std::min(tile_rows, ch.q_len * group - task.first_row);
      const int64_t offset = ch.ctx_len - ch.q_len;  // the chunk's first query position
      // Pack Q^T (scaled); rows past `rows` are zero and repeat the last row's position.
      std::fill(qt.begin(), qt.end(), 0.f);
      for (int64_t r = 0; r < kRows; ++r) {
        const int64_t row = task.first_row + std::min(r, rows - 1), position = row / group, head = h * group + row % group;
        row_position[r] = causal ? offset + position : ch.ctx_len - 1;
        if (r >= rows) continue;
        const float* src = qp + ((ch.q_start + position) * q_heads + head) * dk;
        for (int64_t d = 0; d < dk; ++d) qt[d * kRows + r] = src[d] * softmax_scale;
      }
      const int64_t lowest = row_position[0], highest = row_position[rows - 1];
      const int64_t key_begin = sliding_window > 0 ? std::max<int64_t>(0, lowest - sliding_window + 1) : 0;
      const int64_t key_end = highest + 1;
      std::fill(running_max, running_max + kRows, kMinusInf);
      std::fill(running_sum, running_sum + kRows, 0.f);
      std::fill(o.begin(), o.end(), 0.f);
      const int64_t* table = tables + ch.seq * width;
      for (int64_t k0 = key_begin; k0 < key_end; k0 += kKeys) {
        const int64_t n = std::min(kKeys, key_end - k0);
        for (int64_t j = 0; j < n; ++j) {
          const int64_t pos = k0 + j, slot = table[pos / block_size] * block_size + pos % block_size;
          keys[j] = kp + (slot * kv_heads + h) * dk;
          values[j] = vp + (slot * kv_heads + h) * v_row;
        }
        for (int64_t j = 0; j < n; j += kScorePositions)
          kScoreTiles[std::min<int64_t>(kScorePositions, n - j)](keys + j, qt.data(), dk, st.data() + j * kRows);
        // Mask the keys a row may not see: past its position, or (windowed) before its window.
        const bool causal_edge = k0 + n - 1 > lowest;
        const bool window_edge = sliding_window > 0 && k0 <= highest - sliding_window;
        if (causal_edge || window_edge)
          for (int64_t j = 0; j < n; ++j)
            for (int64_t r = 0; r < kRows; ++r) {
              const int64_t pos = k0 + j;
              if (pos > row_position[r] || (sliding_window > 0 && pos <= row_position[r] - sliding_window))
                st[j * kRows + r] = kMinusInf;
            }
        // Online softmax down each column, 16 query rows at a time.
        alignas(64) float rescale[kRows];
        for (int64_t c = 0; c < kRows; c += kLanes) {
          __m512 column_max = _mm512_set1_ps(kMinusInf);
          for (int64_t j = 0; j < n; ++j) column_max = _mm512_max_ps(column_max, _mm512_loadu_ps(&st[j * kRows + c]));
          const __m512 old_max = _mm512_load_ps(running_max + c);
          const __m512 new_max = _mm512_max_ps(old_max, column_max);
          // A row that has seen no visible key yet keeps max -inf; subtract 0 there so exp gives 0, not NaN.
          const __mmask16 none = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(kMinusInf), _CMP_EQ_OQ);
          const __m512 shift = _mm512_mask_blend_ps(none, new_max, _mm512_setzero_ps());
          __m512 sum = _mm512_setzero_ps();
          for (int64_t j = 0; j < n; ++j) {
            const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(&st[j * kRows + c]), shift));
            _mm512_storeu_ps(&st[j * kRows + c], p);
            sum = _mm512_add_ps(sum, p);
          }
          const __m512 alpha = exp16(_mm512_sub_ps(old_max, shift));
          _mm512_store_ps(rescale + c, alpha);
          _mm512_store_ps(running_sum + c, _mm512_fmadd_ps(_mm512_load_ps(running_sum + c), alpha, sum));
          _mm512_store_ps(running_max + c, new_max);
        }
        if (k0 != key_begin)
          for (int64_t r = 0; r < rows; ++r) {
            const __m512 a = _mm512_set1_ps(rescale[r]);
            float* row = o.data() + r * dv;
            for (int64_t d = 0; d < dv; d += kLanes) _mm512_storeu_ps(row + d, _mm512_mul_ps(a, _mm512_loadu_ps(row + d)));
          }
        for (int64_t d = 0; d < dv; d += 4 * kLanes) {
          const int64_t vectors = std::min<int64_t>(4, (dv - d) / kLanes);
          for (int64_t r = 0; r < rows; r += kValueRows)
            kWeightedRows[vectors - 1][std::min<int64_t>(kValueRows, rows - r)](st.data() + r, 1, kRows, values, d, n,
                                                                                 o.data() + r * dv + d, dv, true);
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = task.first_row + r, position = row / group, head = h * group + row % group;
        float* dst = op + ((ch.q_start + position) * q_heads + head) * dv;
        if (lse_p) lse_p[(ch.q_start + position) * q_heads + head] = running_max[r] + std::log(running_sum[r]);
        const __m512 inv = _mm512_set1_ps(1.f / running_sum[r]);
        for (int64_t d = 0; d < dv; d += kLanes)
          _mm512_storeu_ps(dst + d, _mm512_mul_ps(inv, _mm512_loadu_ps(o.data() + r * dv + d)));
      }
    }
  }
}

// out [T, Hq, dv] rows of the chunks; q [T, Hq, dk]; caches [blocks, block_size, Hkv, D] (v_cache none: the
// values are the first dv channels of the keys); block_tables [S, W]; chunks: seq [C], q_start [C], q_len [C]
// (>= 1, the last q_len of the sequence's ctx_len tokens), ctx_len [C]; sliding_window <= 0: none.
// causal=false: every query row of a chunk sees all ctx_len keys (a prefix that sequences share, with one
// query row per sequence: cascade decoding). lse [T, Hq], when given, receives each row's log-sum-exp of its
// scaled scores, for merging with attention over other keys.
void paged_prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                   const std::optional<at::Tensor>& v_cache, const at::Tensor& block_tables,
                   const at::Tensor& chunk_seqs, const at::Tensor& chunk_starts, const at::Tensor& chunk_lens,
                   const at::Tensor& context_lens, double scale, int64_t sliding_window,
                   const std::optional<at::Tensor>& lse, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && out.dim() == 3, "paged_prefill: q, out [T, H, D], a 4-d cache");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "paged_prefill: float32 only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && out.is_contiguous(), "paged_prefill: contiguous tensors");
  for (const at::Tensor* t : {&block_tables, &chunk_seqs, &chunk_starts, &chunk_lens, &context_lens})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "paged_prefill: int64 tables and lengths");
  const int64_t q_heads = q.size(1), dk = q.size(2), dv = out.size(2);
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), width = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dk && q_heads % kv_heads == 0 && out.size(0) == q.size(0) && out.size(1) == q_heads,
              "paged_prefill: q, out and the key cache do not match");
  TORCH_CHECK(dv % kLanes == 0, "paged_prefill: dv must be a multiple of 16");
  const auto [vp, v_row] = value_rows(k_cache, v_cache, dv, "paged_prefill");
  TORCH_CHECK(causal || sliding_window <= 0, "paged_prefill: a shared prefix takes no sliding window");
  float* lse_p = nullptr;
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->is_contiguous() && lse->numel() == q.size(0) * q_heads,
                "paged_prefill: lse [T, Hq] float32 expected");
    lse_p = lse->data_ptr<float>();
  }
  TORCH_CHECK(q_heads / kv_heads <= kRows, "paged_prefill: at most 64 query heads per KV head");

  std::vector<Chunk> chunks;
  const int64_t* seq_p = chunk_seqs.data_ptr<int64_t>();
  for (int64_t c = 0; c < chunk_seqs.numel(); ++c)
    chunks.push_back({seq_p[c], chunk_starts.data_ptr<int64_t>()[c], chunk_lens.data_ptr<int64_t>()[c],
                      context_lens.data_ptr<int64_t>()[c]});
  for (const Chunk& ch : chunks)
    TORCH_CHECK(ch.q_len >= 1 && (ch.q_len <= ch.ctx_len || !causal) && ch.ctx_len >= 1 &&
                    ch.ctx_len <= width * block_size && ch.seq >= 0 && ch.seq < block_tables.size(0) &&
                    ch.q_start >= 0 && ch.q_start + ch.q_len <= q.size(0),
                "paged_prefill: a chunk does not fit its tables");
  const PagedCache cache{k_cache.data_ptr<float>(), vp, v_row, block_size, kv_heads, block_tables.data_ptr<int64_t>(),
                         width};
  attend_chunks(out.data_ptr<float>(), lse_p, q.data_ptr<float>(), q_heads, dk, dv, cache, chunks,
                static_cast<float>(scale), sliding_window, causal);
}

// ---- decode: one query token per sequence ----

// The positions a decode task reads per step, every KV head at once: about 64 KiB of key rows (fewer positions
// per step read slower here, for small heads most of all; more read no faster and crowd the caches), at least
// one 16-position block.
constexpr int64_t kDecodeStepBytes = 64 * 1024;
// When there are too few sequences to keep every thread busy, each sequence's positions are split into parts
// of at least this many, attended apart and merged by their log-sum-exps.
constexpr int64_t kMinPartPositions = 32;

// Reads n rows of `span` floats, a cache line at a time, in order. A core here fetches memory at full speed
// only for one ascending stream of lines: the kernels' own order (one head's slice of each row, four rows side
// by side) and software prefetches (held to the L1 miss buffers) reach about half of it (bench/RESULTS.md).
// So each step's rows are first read through once, in order, and then computed on from the caches.
inline void touch_rows(const float* const* rows, int64_t n, int64_t span) {
  int32_t seen = 0;
  for (int64_t j = 0; j < n; ++j) {
    const auto* row = reinterpret_cast<const int32_t*>(rows[j]);
    for (int64_t d = 0; d < span; d += kLanes) seen |= row[d];
  }
  asm volatile("" : : "r"(seen));
}

// The lane sums of a, b, c, d, in that order.
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
  // 128-bit lane i now holds four partial sums of a, b, c, d for i = 0..3.
  __m512 x = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
  x = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0x4E));
  x = _mm512_add_ps(x, _mm512_shuffle_ps(x, x, 0xB1));
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), x));
}

// scores[g * ld + j] = queries[g] . key_rows[j][offset:offset + dk] for G queries and n keys, four keys at a time.
template <int G>
inline void decode_scores(const float* queries, int64_t dk, const float* const* key_rows, int64_t offset, int64_t n,
                          float* scores, int64_t ld) {
  const int64_t vectors = dk / kLanes;
  const __mmask16 tail = static_cast<__mmask16>((1u << (dk % kLanes)) - 1);
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    __m512 acc[4][G];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) acc[i][g] = _mm512_setzero_ps();
    for (int64_t v = 0; v <= vectors; ++v) {
      if (v == vectors && tail == 0) break;
      const __mmask16 mask = v < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
      __m512 k[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) k[i] = _mm512_maskz_loadu_ps(mask, key_rows[j + i] + offset + v * kLanes);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) {
        const __m512 q = _mm512_maskz_loadu_ps(mask, queries + g * dk + v * kLanes);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[i][g] = _mm512_fmadd_ps(k[i], q, acc[i][g]);
      }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) _mm_storeu_ps(scores + g * ld + j, sum4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]));
  }
  for (; j < n; ++j)
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t v = 0; v * kLanes < dk; ++v) {
        const __mmask16 mask = v < vectors ? static_cast<__mmask16>(0xFFFF) : tail;
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, key_rows[j] + offset + v * kLanes),
                              _mm512_maskz_loadu_ps(mask, queries + g * dk + v * kLanes), acc);
      }
      scores[g * ld + j] = _mm512_reduce_add_ps(acc);
    }
}

using DecodeScores = void (*)(const float*, int64_t, const float* const*, int64_t, int64_t, float*, int64_t);
constexpr DecodeScores kDecodeScores[5] = {nullptr, decode_scores<1>, decode_scores<2>, decode_scores<3>,
                                           decode_scores<4>};

// Softmax of a row in place (its exponentials normalised to sum 1); returns the row's log-sum-exp.
inline float softmax_row(float* row, int64_t n) {
  __m512 top = _mm512_set1_ps(kMinusInf);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) top = _mm512_max_ps(top, _mm512_loadu_ps(row + j));
  float m = _mm512_reduce_max_ps(top);
  for (; j < n; ++j) m = std::max(m, row[j]);
  const __m512 shift = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j < n; j += kLanes) {
    const __mmask16 mask = j + kLanes <= n ? static_cast<__mmask16>(0xFFFF)
                                           : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 p = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, row + j), shift));
    _mm512_mask_storeu_ps(row + j, mask, p);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mask, p));
  }
  const float total = _mm512_reduce_add_ps(sum);
  const __m512 inv = _mm512_set1_ps(1.f / total);
  for (j = 0; j + kLanes <= n; j += kLanes) _mm512_storeu_ps(row + j, _mm512_mul_ps(inv, _mm512_loadu_ps(row + j)));
  for (; j < n; ++j) row[j] *= _mm512_cvtss_f32(inv);
  return m + std::log(total);
}

}  // namespace

namespace unified_avx512 {

// paged_decode's AVX-512 body (cpu_kernels.cpp checks the arguments and allocates out [S, Hq, dv]). One task is
// a sequence's positions, or a part of them when there are too few sequences to keep every thread busy, and all
// of its KV heads: a step's K (then V) rows are read whole, in order, once for every query head. Parts are
// merged by their log-sum-exps at the end.
// skips [S] (or null): the positions each sequence leaves out at its start (a prefix attended apart); lse [S, Hq]
// (or null) receives each row's log-sum-exp of its scaled scores.
void paged_decode(float* out, const float* q, const float* k_cache, const float* v_cache, int64_t v_row,
                  const int64_t* tables, int64_t width, const int64_t* lens, int64_t seqs, int64_t q_heads,
                  int64_t kv_heads, int64_t block_size, int64_t dk, int64_t dv, float scale, int64_t sliding_window,
                  const int64_t* skips, float* lse) {
  if (seqs == 0) return;
  const int64_t group = q_heads / kv_heads;
  const int64_t k_span = kv_heads * dk, v_span = (kv_heads - 1) * v_row + dv;
  const int64_t step = std::clamp<int64_t>(kDecodeStepBytes / (4 * k_span), 16, 256) / 4 * 4;
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());  // tasks for an even share per thread
  const int64_t parts_wanted = (wanted + seqs - 1) / seqs;
  struct Part {
    int64_t seq, begin, end;
    int64_t partial;  // its row in the partial results, or -1: it writes out and lse directly
  };
  struct Split {
    int64_t seq, first_partial, count;  // a sequence in more than one part, and its rows in the partial results
  };
  std::vector<Part> parts;
  std::vector<Split> splits;
  int64_t partials = 0;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t first = std::max<int64_t>(sliding_window > 0 ? lens[s] - sliding_window : 0, skips ? skips[s] : 0);
    const int64_t n = lens[s] - first;
    const int64_t count = std::clamp<int64_t>(n / kMinPartPositions, 1, parts_wanted);
    if (count > 1) splits.push_back({s, partials, count});
    for (int64_t i = 0; i < count; ++i)
      parts.push_back({s, first + n * i / count, first + n * (i + 1) / count, count > 1 ? partials++ : -1});
  }
  std::vector<float> partial_out(partials * q_heads * dv), partial_lse(partials * q_heads);
  std::stable_sort(parts.begin(), parts.end(),
                   [](const Part& a, const Part& b) { return a.end - a.begin > b.end - b.begin; });  // longest first
  const int64_t task_count = static_cast<int64_t>(parts.size());
#pragma omp parallel num_threads(std::min<int64_t>(at::get_num_threads(), task_count))
  {
    std::vector<float> scores, queries(q_heads * dk);
    std::vector<const float*> keys, values;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < task_count; ++t) {
      const Part part = parts[t];
      const int64_t s = part.seq, n = part.end - part.begin;
      const int64_t* table = tables + s * width;
      keys.resize(n);
      values.resize(n);
      for (int64_t pos = part.begin; pos < part.end; ++pos) {
        const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
        keys[pos - part.begin] = k_cache + slot * kv_heads * dk;
        values[pos - part.begin] = v_cache + slot * kv_heads * v_row;
      }
      const float* qs = q + s * q_heads * dk;
      for (int64_t i = 0; i < q_heads * dk; ++i) queries[i] = qs[i] * scale;
      scores.resize(q_heads * n);
      touch_rows(keys.data(), std::min(n, step), k_span);
      for (int64_t j = 0; j < n; j += step) {
        const int64_t count = std::min(step, n - j);
        touch_rows(keys.data() + j + count, std::min(step, n - j - count), k_span);
        for (int64_t h = 0; h < kv_heads; ++h)
          for (int64_t g = 0; g < group; g += 4)
            kDecodeScores[std::min<int64_t>(4, group - g)](queries.data() + (h * group + g) * dk, dk, keys.data() + j,
                                                           h * dk, count, scores.data() + (h * group + g) * n + j, n);
      }
      float* part_out = part.partial < 0 ? out + s * q_heads * dv : partial_out.data() + part.partial * q_heads * dv;
      float* part_lse = part.partial < 0 ? (lse ? lse + s * q_heads : nullptr) : partial_lse.data() + part.partial * q_heads;
      for (int64_t r = 0; r < q_heads; ++r) {
        const float row_lse = softmax_row(scores.data() + r * n, n);
        if (part_lse) part_lse[r] = row_lse;
      }
      touch_rows(values.data(), std::min(n, step), v_span);
      for (int64_t j = 0; j < n; j += step) {
        const int64_t count = std::min(step, n - j);
        touch_rows(values.data() + j + count, std::min(step, n - j - count), v_span);
        for (int64_t h = 0; h < kv_heads; ++h)
          for (int64_t g = 0; g < group; g += 4) {
            const int64_t r = h * group + g, many = std::min<int64_t>(4, group - g);
            for (int64_t d = 0; d < dv; d += 4 * kLanes)
              kWeightedRows[std::min<int64_t>(4, (dv - d) / kLanes) - 1][many](
                  scores.data() + r * n + j, n, 1, values.data() + j, h * v_row + d, count, part_out + r * dv + d, dv,
                  j > 0);
          }
      }
    }
  }
  // Parts of a sequence: out = sum_i w_i out_i with w_i = exp(lse_i - lse), lse = log sum_i exp(lse_i).
  const int64_t split_count = static_cast<int64_t>(splits.size());
  at::parallel_for(0, split_count * q_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> weights;
    for (int64_t row = begin; row < end; ++row) {
      const Split& split = splits[row / q_heads];
      const int64_t r = row % q_heads;
      const auto partial = [&](int64_t i) { return (split.first_partial + i) * q_heads + r; };
      float top = kMinusInf;
      for (int64_t i = 0; i < split.count; ++i) top = std::max(top, partial_lse[partial(i)]);
      weights.resize(split.count);
      float total = 0.f;
      for (int64_t i = 0; i < split.count; ++i) total += weights[i] = std::exp(partial_lse[partial(i)] - top);
      for (float& w : weights) w /= total;
      float* dst = out + (split.seq * q_heads + r) * dv;
      for (int64_t d = 0; d < dv; d += kLanes) {
        __m512 acc = _mm512_setzero_ps();
        for (int64_t i = 0; i < split.count; ++i)
          acc = _mm512_fmadd_ps(_mm512_set1_ps(weights[i]), _mm512_loadu_ps(partial_out.data() + partial(i) * dv + d),
                                acc);
        _mm512_storeu_ps(dst + d, acc);
      }
      if (lse) lse[split.seq * q_heads + r] = top + std::log(total);
    }
  });
}

}  // namespace unified_avx512

namespace {

// Cascade decoding (unified/kernels/cascade.py): one query per sequence, q [S, Hq, dk]; caches as paged_decode's.
// Sequence s attends to its own keys from position skips[s] on; the sequences order[c_start : c_start + c_len]
// of each group c also attend together, every row to every key, to the c_ctx positions of the prefix they
// share (read through sequence c_seq's table); the two parts merge by their log-sum-exps. Returns [S, Hq, dv].
at::Tensor paged_decode_cascade(const at::Tensor& q, const at::Tensor& k_cache, const std::optional<at::Tensor>& v_cache,
                                const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& order,
                                const at::Tensor& chunk_seqs, const at::Tensor& chunk_starts,
                                const at::Tensor& chunk_lens, const at::Tensor& chunk_ctx, const at::Tensor& skips,
                                double scale, int64_t dv) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.scalar_type() == at::kFloat &&
                  k_cache.scalar_type() == at::kFloat && q.is_contiguous() && k_cache.is_contiguous(),
              "paged_decode_cascade: contiguous float32 q [S, Hq, D] and key cache expected");
  for (const at::Tensor* t : {&block_tables, &context_lens, &order, &chunk_seqs, &chunk_starts, &chunk_lens,
                              &chunk_ctx, &skips})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "paged_decode_cascade: int64 tables and lengths");
  const int64_t seqs = q.size(0), q_heads = q.size(1), dk = q.size(2), kv_heads = k_cache.size(2);
  const int64_t block_size = k_cache.size(1), width = block_tables.size(1);
  TORCH_CHECK(k_cache.size(3) == dk && q_heads % kv_heads == 0 && q_heads / kv_heads <= kRows &&
                  context_lens.numel() == seqs && skips.numel() == seqs && block_tables.size(0) == seqs &&
                  dv % kLanes == 0,
              "paged_decode_cascade: q, caches, tables and lengths do not match");
  const auto [vp, v_row] = value_rows(k_cache, v_cache, dv, "paged_decode_cascade");
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* skip = skips.data_ptr<int64_t>();
  const int64_t* grouped = order.data_ptr<int64_t>();
  const int64_t members = order.numel();
  for (int64_t i = 0; i < seqs; ++i)
    TORCH_CHECK(skip[i] >= 0 && skip[i] < lens[i] && lens[i] <= width * block_size,
                "paged_decode_cascade: each sequence must keep at least its last position");
  std::vector<Chunk> chunks;
  for (int64_t c = 0; c < chunk_seqs.numel(); ++c) {
    const Chunk ch{chunk_seqs.data_ptr<int64_t>()[c], chunk_starts.data_ptr<int64_t>()[c],
                   chunk_lens.data_ptr<int64_t>()[c], chunk_ctx.data_ptr<int64_t>()[c]};
    TORCH_CHECK(ch.seq >= 0 && ch.seq < seqs && ch.q_start >= 0 && ch.q_len >= 1 && ch.q_start + ch.q_len <= members &&
                    ch.ctx_len >= 1 && ch.ctx_len <= width * block_size,
                "paged_decode_cascade: a group does not fit the tables");
    for (int64_t i = ch.q_start; i < ch.q_start + ch.q_len; ++i)
      TORCH_CHECK(grouped[i] >= 0 && grouped[i] < seqs && skip[grouped[i]] == ch.ctx_len,
                  "paged_decode_cascade: a member's skip is not its group's shared length");
    chunks.push_back(ch);
  }
  const float softmax_scale = static_cast<float>(scale);
  at::Tensor out = at::empty({seqs, q_heads, dv}, q.options());
  at::Tensor own_lse = at::empty({seqs, q_heads}, q.options());
  unified_avx512::paged_decode(out.data_ptr<float>(), q.data_ptr<float>(), k_cache.data_ptr<float>(), vp, v_row,
                               block_tables.data_ptr<int64_t>(), width, lens, seqs, q_heads, kv_heads, block_size, dk,
                               dv, softmax_scale, 0, skip, own_lse.data_ptr<float>());
  if (members == 0) return out;
  const at::Tensor grouped_q = q.index_select(0, order);
  at::Tensor shared = at::empty({members, q_heads, dv}, q.options());
  at::Tensor shared_lse = at::empty({members, q_heads}, q.options());
  const PagedCache cache{k_cache.data_ptr<float>(), vp, v_row, block_size, kv_heads, block_tables.data_ptr<int64_t>(),
                         width};
  attend_chunks(shared.data_ptr<float>(), shared_lse.data_ptr<float>(), grouped_q.data_ptr<float>(), q_heads, dk, dv,
                cache, chunks, softmax_scale, 0, /*causal=*/false);
  float* op = out.data_ptr<float>();
  const float *sp = shared.data_ptr<float>(), *slp = shared_lse.data_ptr<float>(), *olp = own_lse.data_ptr<float>();
  at::parallel_for(0, members * q_heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row / q_heads, h = row % q_heads, target = grouped[i] * q_heads + h;
      const float a = slp[row], b = olp[target], top = std::max(a, b);
      const float wa = std::exp(a - top), wb = std::exp(b - top), inv = 1.f / (wa + wb);
      const __m512 va = _mm512_set1_ps(wa * inv), vb = _mm512_set1_ps(wb * inv);
      float* dst = op + target * dv;
      const float* src = sp + row * dv;
      for (int64_t d = 0; d < dv; d += kLanes)
        _mm512_storeu_ps(dst + d, _mm512_fmadd_ps(va, _mm512_loadu_ps(src + d), _mm512_mul_ps(vb, _mm512_loadu_ps(dst + d))));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("paged_prefill_(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor? v_cache, Tensor block_tables, "
        "Tensor chunk_seqs, Tensor chunk_starts, Tensor chunk_lens, Tensor context_lens, float scale, "
        "int sliding_window, Tensor(b!)? lse=None, bool causal=True) -> ()", &paged_prefill);
  m.def("paged_decode_cascade(Tensor q, Tensor k_cache, Tensor? v_cache, Tensor block_tables, Tensor context_lens, "
        "Tensor order, Tensor chunk_seqs, Tensor chunk_starts, Tensor chunk_lens, Tensor chunk_ctx, Tensor skips, "
        "float scale, int dv) -> Tensor", &paged_decode_cascade);
}
#endif
