// int8_linear: out [M, N] = x [M, K] @ w.T (+ bias [N]) for weight-only int8 weights w = q [N, K] * scale [N, G],
// one float32 scale per output feature and group of K / G inputs (G = 1: per output feature), for a few rows
// of x (decode). Reference: unified/kernels/linear.py, int8_linear_reference.
//
// Decode is bound by reading the weights, and int8 reads a quarter of float32's bytes. Each task streams four
// weight rows once from memory; 16 int8 values at a time are converted to float32 and scaled in registers,
// then multiplied into a block of up to four rows of x (16 accumulators), so the conversion is shared by the
// block and the weight rows are re-read from L1 by the next block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kWeightRows = 4, kInputRows = 4, kPrefetchRows = 8;

// out[r * ldo + j] = sum_i x[r][i] * q[j][i] * scale[j][i / group] for r < Rows, j < 4 (Rows a constant,
// so the accumulators stay in registers).
template <int Rows, bool Grouped>
void block_int8(const float* x, int64_t k, const int8_t* const* q, const float* const* scale, int64_t group,
                float* out, int64_t ldo) {
  constexpr int rows = Rows;  // Grouped: a scale per `group` inputs, applied to the weights; else one per row, at the end
  float sums[kInputRows][kWeightRows] = {};
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if (!Grouped || group % 16 == 0) {
    __m512 acc[Rows][kWeightRows];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    __m512 scales[kWeightRows];
    for (; i + 16 <= k; i += 16) {
      if (Grouped && i % group == 0)
        for (int j = 0; j < kWeightRows; ++j) scales[j] = _mm512_set1_ps(scale[j][i / group]);
      if (i % 64 == 0)  // the next task's rows (the following kWeightRows * k bytes): DRAM latency, not bandwidth,
        for (int j = 0; j < kWeightRows; ++j)  // limits short rows otherwise
          _mm_prefetch(reinterpret_cast<const char*>(q[j] + kPrefetchRows * k + i), _MM_HINT_T0);
      __m512 xs[Rows];
      for (int r = 0; r < rows; ++r) xs[r] = _mm512_loadu_ps(x + r * k + i);
      for (int j = 0; j < kWeightRows; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[j] + i));
        __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
        if (Grouped) w = _mm512_mul_ps(w, scales[j]);
        for (int r = 0; r < rows; ++r) acc[r][j] = _mm512_fmadd_ps(xs[r], w, acc[r][j]);
      }
    }
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < kWeightRows; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  }
#endif
  for (; i < k; ++i)
    for (int j = 0; j < kWeightRows; ++j) {
      const float w = Grouped ? static_cast<float>(q[j][i]) * scale[j][i / group] : static_cast<float>(q[j][i]);
      for (int r = 0; r < rows; ++r) sums[r][j] += x[r * k + i] * w;
    }
  for (int r = 0; r < rows; ++r)
    for (int j = 0; j < kWeightRows; ++j) out[r * ldo + j] = Grouped ? sums[r][j] : sums[r][j] * scale[j][0];
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_linear: x [M, K] and q [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_linear: contiguous float32 x and int8 q expected");
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) > 0 && k % scale.size(1) == 0,
              "int8_linear: float32 scale [N, G] with G dividing K expected");
  const int64_t groups = scale.size(1), group = k / groups;
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "int8_linear: float32 bias [N] expected");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + kWeightRows - 1) / kWeightRows, 32, [&](int64_t begin, int64_t end) {
    float block[kInputRows * kWeightRows];
    const int8_t* weights[kWeightRows];
    const float* scales[kWeightRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kWeightRows, count = std::min(kWeightRows, n - j0);
      for (int64_t j = 0; j < kWeightRows; ++j) {  // a tail task repeats its last row
        weights[j] = qp + (j0 + std::min(j, count - 1)) * k;
        scales[j] = sp + (j0 + std::min(j, count - 1)) * groups;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kInputRows) {
        const int64_t block_rows = std::min(kInputRows, rows - r0);
        const float* xs = xp + r0 * k;
        if (groups == 1) {
          switch (block_rows) {
            case 1: block_int8<1, false>(xs, k, weights, scales, group, block, kWeightRows); break;
            case 2: block_int8<2, false>(xs, k, weights, scales, group, block, kWeightRows); break;
            case 3: block_int8<3, false>(xs, k, weights, scales, group, block, kWeightRows); break;
            default: block_int8<4, false>(xs, k, weights, scales, group, block, kWeightRows);
          }
        } else {
          switch (block_rows) {
            case 1: block_int8<1, true>(xs, k, weights, scales, group, block, kWeightRows); break;
            case 2: block_int8<2, true>(xs, k, weights, scales, group, block, kWeightRows); break;
            case 3: block_int8<3, true>(xs, k, weights, scales, group, block, kWeightRows); break;
            default: block_int8<4, true>(xs, k, weights, scales, group, block, kWeightRows);
          }
        }
        for (int64_t r = 0; r < block_rows; ++r)
          for (int64_t j = 0; j < count; ++j)
            op[(r0 + r) * n + j0 + j] = block[r * kWeightRows + j] + (bp ? bp[j0 + j] : 0.0f);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor", &int8_linear);
}
