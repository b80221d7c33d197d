// Greedy choice over logits (AVX-512 builds), registered as torch.ops.unified_cpu.argmax_rows (reference:
// unified/kernels/argmax.py, torch's max(-1).indices) and torch.ops.unified_cpu.screen_rows (reference:
// unified/kernels/greedy_head.py screen_chunk_reference).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

namespace {

constexpr int kLanes = 16;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Each row's first maximum, or -1 for a row holding a NaN (whose caller decides what that means). Greedy
// sampling over a 150k-token vocabulary: one pass at memory speed, where torch's max(-1) also tracks values.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0 &&
                  x.size(1) < (int64_t(1) << 31), "argmax_rows: a contiguous float32 [rows, V] tensor expected");
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * vocab;
      __m512 best = _mm512_set1_ps(kMinusInf);
      __m512i best_index = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,
                                                                              12, 13, 14, 15);
      const __m512i step = _mm512_set1_epi32(kLanes);
      __mmask16 nan = 0;
      for (int64_t j = 0; j < vocab; j += kLanes) {
        const __mmask16 valid = j + kLanes <= vocab ? static_cast<__mmask16>(0xFFFF)
                                                    : static_cast<__mmask16>((1u << (vocab - j)) - 1);
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(kMinusInf), valid, row + j);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
        best = _mm512_mask_mov_ps(best, greater, v);
        best_index = _mm512_mask_mov_epi32(best_index, greater, index);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        index = _mm512_add_epi32(index, step);
      }
      const float top = _mm512_reduce_max_ps(best);
      const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
      op[r] = nan ? -1 : _mm512_mask_reduce_min_epi32(at_top, best_index);
    }
  });
  return out;
}

// 16 bfloat16 values from p (the lanes of `valid`) as float32; other lanes read as `fill`.
inline __m512 load_bf16(const uint16_t* p, __mmask16 valid, __m512 fill) {
  const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(valid, p)), 16));
  return _mm512_mask_mov_ps(fill, valid, v);
}

// One vocabulary chunk of the greedy screen: approx [R, C] bfloat16 logits with an error bound error[r] per row.
// Raises best_lower[r] to the largest lower bound max_j approx[r, j] - error[r] and returns the entries that can
// still be the maximum (approx + error >= best_lower), as (rows, columns, approx + error). Two passes over each
// row while it is in cache, where torch's ops take five (convert, max, compare, nonzero, gather).
std::tuple<at::Tensor, at::Tensor, at::Tensor> screen_rows(const at::Tensor& approx, const at::Tensor& error,
                                                           at::Tensor best_lower) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kBFloat16 && approx.is_contiguous() &&
                  approx.size(1) < (int64_t(1) << 31), "screen_rows: a contiguous bfloat16 [rows, C] tensor expected");
  const int64_t rows = approx.size(0), columns = approx.size(1);
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.is_contiguous() && error.numel() == rows &&
                  best_lower.scalar_type() == at::kFloat && best_lower.is_contiguous() && best_lower.numel() == rows,
              "screen_rows: float32 error and best_lower of one value per row expected");
  const uint16_t* ap = reinterpret_cast<const uint16_t*>(approx.data_ptr<at::BFloat16>());
  const float* ep = error.data_ptr<float>();
  float* bp = best_lower.data_ptr<float>();
  std::vector<std::vector<int32_t>> kept(rows);
  std::vector<std::vector<float>> upper(rows);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float lanes[kLanes];
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* row = ap + r * columns;
      __m512 top = _mm512_set1_ps(kMinusInf);
      for (int64_t j = 0; j < columns; j += kLanes) {
        const __mmask16 valid = j + kLanes <= columns ? static_cast<__mmask16>(0xFFFF)
                                                      : static_cast<__mmask16>((1u << (columns - j)) - 1);
        top = _mm512_max_ps(top, load_bf16(row + j, valid, _mm512_set1_ps(kMinusInf)));
      }
      const float bound = ep[r];
      const float lower = std::max(bp[r], _mm512_reduce_max_ps(top) - bound);
      bp[r] = lower;
      const __m512 threshold = _mm512_set1_ps(lower - bound);
      for (int64_t j = 0; j < columns; j += kLanes) {
        const __mmask16 valid = j + kLanes <= columns ? static_cast<__mmask16>(0xFFFF)
                                                      : static_cast<__mmask16>((1u << (columns - j)) - 1);
        const __m512 v = load_bf16(row + j, valid, _mm512_set1_ps(kMinusInf));
        uint32_t hits = _mm512_mask_cmp_ps_mask(valid, v, threshold, _CMP_GE_OQ);
        if (!hits) continue;
        _mm512_store_ps(lanes, v);
        for (; hits; hits &= hits - 1) {
          const int lane = __builtin_ctz(hits);
          kept[r].push_back(static_cast<int32_t>(j + lane));
          upper[r].push_back(lanes[lane] + bound);
        }
      }
    }
  });
  int64_t total = 0;
  for (const auto& k : kept) total += static_cast<int64_t>(k.size());
  at::Tensor out_rows = at::empty({total}, approx.options().dtype(at::kLong));
  at::Tensor out_columns = at::empty({total}, approx.options().dtype(at::kLong));
  at::Tensor out_upper = at::empty({total}, approx.options().dtype(at::kFloat));
  int64_t* rp = out_rows.data_ptr<int64_t>();
  int64_t* cp = out_columns.data_ptr<int64_t>();
  float* up = out_upper.data_ptr<float>();
  for (int64_t r = 0, at = 0; r < rows; ++r) {
    for (size_t i = 0; i < kept[r].size(); ++i, ++at) {
      rp[at] = r;
      cp[at] = kept[r][i];
      up[at] = upper[r][i];
    }
  }
  return {out_rows, out_columns, out_upper};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  m.def("screen_rows(Tensor approx, Tensor error, Tensor(a!) best_lower) -> (Tensor, Tensor, Tensor)", &screen_rows);
}
#endif
