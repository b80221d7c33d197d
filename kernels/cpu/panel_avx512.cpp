// x @ w.T over a weight packed in panels of 16 output features (AVX-512 builds): the body of
// unified_cpu::panel_linear (cpu_kernels.cpp, which packs the panels and checks the arguments).
// Reference: F.linear (unified/kernels/linear.py).
//
// Panel p holds output features [16p, 16p + 16) as k rows of 16 floats: one zmm vector per input feature,
// read as one contiguous stream. A register tile is up to kTileRows rows of x by two adjacent panels' 32
// features (two accumulators per row), so each weight vector loaded feeds that many FMAs and each x entry,
// broadcast once, two. Few rows (decode steps) read each panel once from memory; more rows go through the
// same panel tile by tile while it sits in L2, and those tiles fetch the next panels meanwhile. Threads take
// contiguous ranges of panels.
#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>
#include <vector>

namespace unified_avx512 {
namespace {

constexpr int64_t kPanel = 16;
constexpr int kTileRows = 12;  // rows x 2 panels of accumulators, with 2 weight vectors, within the 32 zmm registers
// Rows of x each pass over the panels takes: the block of x a panel meets stays in L2 beside the panel.
constexpr int64_t kRowBlockBytes = 512 * 1024;
// Row blocks of at least this many tiles fetch each thread's next panels while the tiles after the first compute
// on the current ones (bench/RESULTS.md): with fewer, one tile would have to fetch a whole pair of panels.
constexpr int64_t kMinTilesToFetch = 3;

// c[R, 16 P] = init + a[R, k] @ P panels [k, 16] (P adjacent panels, k * 16 floats apart), where a holds the R
// rows interleaved (a[d * R + r] is row r's input d) and rows of c are `ldc` apart; the last panel writes the
// lanes of `lanes` only. Meanwhile it prefetches `fetch_lines` cache lines from `fetch` on, spread over its k loop.
template <int R, int P>
void panel_tile(const float* a, const float* panel, int64_t k, float* c, int64_t ldc, const __m512* init,
                __mmask16 lanes, const char* fetch, int64_t fetch_lines) {
  const int64_t every = fetch_lines > 0 ? std::max<int64_t>(1, k / fetch_lines) : k + 1;
  int64_t countdown = every;
  __m512 acc[P][R];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) acc[q][r] = init[q];
  for (int64_t d = 0; d < k; ++d, a += R) {
    if (--countdown == 0 && fetch_lines > 0) {
      _mm_prefetch(fetch, _MM_HINT_T0);
      fetch += 64;
      --fetch_lines;
      countdown = every;
    }
    __m512 w[P];
#pragma GCC unroll 2
    for (int q = 0; q < P; ++q) w[q] = _mm512_loadu_ps(panel + q * k * kPanel + d * kPanel);
#pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      const __m512 xr = _mm512_set1_ps(a[r]);
#pragma GCC unroll 2
      for (int q = 0; q < P; ++q) acc[q][r] = _mm512_fmadd_ps(xr, w[q], acc[q][r]);
    }
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 2
    for (int q = 0; q < P - 1; ++q) _mm512_storeu_ps(c + r * ldc + q * kPanel, acc[q][r]);
    _mm512_mask_storeu_ps(c + r * ldc + (P - 1) * kPanel, lanes, acc[P - 1][r]);
  }
  for (; fetch_lines > 0; --fetch_lines, fetch += 64) _mm_prefetch(fetch, _MM_HINT_T0);
}

using Tile = void (*)(const float*, const float*, int64_t, float*, int64_t, const __m512*, __mmask16, const char*,
                      int64_t);

template <int P, int... R>
constexpr auto make_tiles(std::integer_sequence<int, R...>) {
  return std::array<Tile, sizeof...(R)>{panel_tile<R + 1, P>...};
}
// [panels - 1][rows - 1]
constexpr std::array<std::array<Tile, kTileRows>, 2> kTiles = {
    make_tiles<1>(std::make_integer_sequence<int, kTileRows>{}),
    make_tiles<2>(std::make_integer_sequence<int, kTileRows>{})};

}  // namespace

void panel_linear(const float* x, int64_t m, int64_t k, const float* panels, int64_t n, const float* bias,
                  float* out) {
  if (m == 0) return;
  // Row tiles of equal height (13 rows are two tiles of 6 and 7, not 12 and 1), each copied with its rows
  // interleaved, so that a tile's FMAs read x as one stream: rows a power of two of floats apart would meet in
  // the same few L1 sets.
  const int64_t tiles = (m + kTileRows - 1) / kTileRows;
  std::vector<int64_t> first(tiles + 1);
  for (int64_t t = 0; t <= tiles; ++t) first[t] = m * t / tiles;
  // From the CPU allocator (the engine's caching one): a fresh block per call would be page-faulted in anew.
  const at::Tensor interleaved_buffer = at::empty({m * k}, at::kFloat);
  float* const interleaved = interleaved_buffer.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t rows = first[t + 1] - first[t];
      float* dst = interleaved + first[t] * k;
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = x + (first[t] + r) * k;
        for (int64_t d = 0; d < k; ++d) dst[d * rows + r] = row[d];
      }
    }
  });
  const int64_t block_tiles =
      std::max<int64_t>(1, kRowBlockBytes / (4 * std::max<int64_t>(k, 1) * kTileRows));  // tiles per pass
  const int64_t panel_count = (n + kPanel - 1) / kPanel, pairs = (panel_count + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = 0; block < tiles; block += block_tiles) {
      const int64_t block_end = std::min(tiles, block + block_tiles);
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t p = 2 * pair, count = std::min<int64_t>(2, panel_count - p);
        const int64_t j0 = p * kPanel, last_features = std::min(kPanel, n - (p + count - 1) * kPanel);
        const __mmask16 lanes = static_cast<__mmask16>((1u << last_features) - 1);
        __m512 init[2];
        for (int64_t q = 0; q < count; ++q) {
          const __mmask16 valid = q == count - 1 ? lanes : static_cast<__mmask16>(0xFFFF);
          init[q] = bias ? _mm512_maskz_loadu_ps(valid, bias + j0 + q * kPanel) : _mm512_setzero_ps();
        }
        const float* panel = panels + p * k * kPanel;
        // The tiles after the first fetch the thread's next pair of panels, an equal share each, while they
        // compute from the caches: the next pair's first tile would otherwise wait on memory.
        const int64_t fetchers = block_end - block >= kMinTilesToFetch ? block_end - block - 1 : 0;
        const int64_t next_lines = pair + 1 < end ? std::min<int64_t>(2, panel_count - p - 2) * k * kPanel / 16 : 0;
        const char* next = reinterpret_cast<const char*>(panel + count * k * kPanel);
        for (int64_t t = block; t < block_end; ++t) {
          const int64_t i = t - block - 1;
          const int64_t from = fetchers > 0 && i >= 0 ? next_lines * i / fetchers : 0;
          const int64_t to = fetchers > 0 && i >= 0 ? next_lines * (i + 1) / fetchers : 0;
          kTiles[count - 1][first[t + 1] - first[t] - 1](interleaved + first[t] * k, panel, k,
                                                          out + first[t] * n + j0, n, init, lanes, next + from * 64,
                                                          to - from);
        }
      }
    }
  });
}

}  // namespace unified_avx512
#endif
