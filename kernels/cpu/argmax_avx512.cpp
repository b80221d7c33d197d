// Greedy choice over logits (AVX-512 builds), registered as torch.ops.unified_cpu.argmax_rows, argmax_merge_ and
// topk_merge_. Reference: unified/kernels/argmax.py (torch's max(-1), a stable sort).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>

namespace {

constexpr int kLanes = 16;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// The first maximum of row[0:n] and its position; false where the row holds a NaN.
inline bool row_max(const float* row, int64_t n, float& top, int64_t& position) {
  __m512 best = _mm512_set1_ps(kMinusInf);
  __m512i best_index = _mm512_setzero_si512(), index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                          14, 15);
  const __m512i step = _mm512_set1_epi32(kLanes);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += kLanes) {
    const __mmask16 valid = j + kLanes <= n ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(kMinusInf), valid, row + j);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    best_index = _mm512_mask_mov_epi32(best_index, greater, index);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    index = _mm512_add_epi32(index, step);
  }
  top = _mm512_reduce_max_ps(best);
  const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
  position = _mm512_mask_reduce_min_epi32(at_top, best_index);
  return nan == 0;
}

void check_rows(const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) > 0 &&
                  x.size(1) < (int64_t(1) << 31), op, ": a contiguous float32 [rows, V] tensor expected");
}

// Each row's first maximum, or -1 for a row holding a NaN (whose caller decides what that means). Greedy
// sampling over a 150k-token vocabulary: one pass at memory speed, where torch's max(-1) also tracks values.
at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x, "argmax_rows");
  const int64_t rows = x.size(0), vocab = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float top;
      int64_t position;
      op[r] = row_max(xp + r * vocab, vocab, top, position) ? position : -1;
    }
  });
  return out;
}

// One vocabulary chunk of a greedy choice: x [R, C] holds the logits of tokens offset .. offset + C - 1, and
// best [R] / index [R] (float32 / int64) the maxima of the chunks before it and their tokens. Each row takes
// its chunk's first maximum where that exceeds best, so that chunks taken in vocabulary order end with each
// row's first maximum; a NaN wins, as in torch's argmax: the first one, after which best stays NaN.
void argmax_merge_(const at::Tensor& x, int64_t offset, at::Tensor& best, at::Tensor& index) {
  check_rows(x, "argmax_merge_");
  const int64_t rows = x.size(0), width = x.size(1);
  TORCH_CHECK(best.scalar_type() == at::kFloat && index.scalar_type() == at::kLong && best.is_contiguous() &&
                  index.is_contiguous() && best.numel() == rows && index.numel() == rows,
              "argmax_merge_: best float32 [rows] and index int64 [rows] expected");
  const float* xp = x.data_ptr<float>();
  float* bp = best.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * width;
      float top;
      int64_t position;
      if (row_max(row, width, top, position)) {
        if (top > bp[r]) bp[r] = top, ip[r] = offset + position;
      } else if (!std::isnan(bp[r])) {
        position = 0;
        while (!std::isnan(row[position])) ++position;
        bp[r] = row[position], ip[r] = offset + position;
      }
    }
  });
}

// One vocabulary chunk of each row's k largest logits: x [R, C] holds the logits of tokens offset .. offset + C - 1,
// values [R, K] (float32, largest first) and tokens [R, K] (int64) the k largest of the chunks before it (-inf
// before the first). A logit enters where it exceeds the smallest kept, after the kept ones it equals, so that
// chunks taken in vocabulary order keep, among equal logits, the first tokens. One pass compares 16 logits at a
// time with the smallest kept: past the first few hundred logits of a row, hardly any enter. NaNs never do.
void topk_merge_(const at::Tensor& x, int64_t offset, at::Tensor& values, at::Tensor& tokens) {
  check_rows(x, "topk_merge_");
  const int64_t rows = x.size(0), width = x.size(1), k = values.dim() == 2 ? values.size(1) : 0;
  TORCH_CHECK(values.scalar_type() == at::kFloat && tokens.scalar_type() == at::kLong && values.is_contiguous() &&
                  tokens.is_contiguous() && k > 0 && values.size(0) == rows && tokens.sizes() == values.sizes(),
              "topk_merge_: values float32 [rows, k] and tokens int64 [rows, k] expected");
  const float* xp = x.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  int64_t* tp = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * width;
      float* kept = vp + r * k;
      int64_t* kept_tokens = tp + r * k;
      for (int64_t j = 0; j < width; j += kLanes) {
        const __mmask16 valid = j + kLanes <= width ? static_cast<__mmask16>(0xFFFF)
                                                    : static_cast<__mmask16>((1u << (width - j)) - 1);
        const __m512 v = _mm512_maskz_loadu_ps(valid, row + j);
        unsigned entering = _mm512_mask_cmp_ps_mask(valid, v, _mm512_set1_ps(kept[k - 1]), _CMP_GT_OQ);
        while (entering != 0) {
          const int lane = __builtin_ctz(entering);
          entering &= entering - 1;
          const float value = row[j + lane];
          if (!(value > kept[k - 1])) continue;  // an earlier lane raised the bar
          int64_t p = k - 1;
          for (; p > 0 && kept[p - 1] < value; --p) kept[p] = kept[p - 1], kept_tokens[p] = kept_tokens[p - 1];
          kept[p] = value, kept_tokens[p] = offset + j + lane;
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
  m.def("argmax_merge_(Tensor x, int offset, Tensor(a!) best, Tensor(b!) index) -> ()", &argmax_merge_);
  m.def("topk_merge_(Tensor x, int offset, Tensor(a!) values, Tensor(b!) tokens) -> ()", &topk_merge_);
}
#endif
