// Greedy choice over logits (AVX-512 builds), registered as torch.ops.unified_cpu.argmax_rows. Reference:
// unified/kernels/argmax.py (torch's max(-1).indices).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <limits>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) { m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows); }
#endif
