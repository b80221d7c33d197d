// int4_linear: out [M, N] = x [M, K] @ w.T (+ bias [N]) for weight-only int4 weights with group scales,
// w[j][i] = (u[j][i] - 8) * scale[j][i / group], for a few rows of x (decode). The weights stay packed two to a
// byte as compressed-tensors' pack-quantized format stores them (an int32 of eight values, lowest bits first,
// is on a little-endian machine the same bytes): q4 [N, K / 2] uint8, input 2c in byte c's low nibble and 2c + 1
// in its high one, each offset by 8. Reference: unified/kernels/linear.py, int4_linear_reference.
//
// As int8_linear.cpp: each task streams four weight rows once; 16 values at a time are unpacked, dequantized
// with one fused multiply-add and multiplied into a block of up to four rows of x.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kWeightRows = 4, kInputRows = 4, kPrefetchRows = 8;

inline float int4_at(const uint8_t* row, int64_t i) {
  const uint8_t byte = row[i / 2];
  return static_cast<float>(((i % 2) ? byte >> 4 : byte & 0x0F)) - 8.0f;
}

// out[r * ldo + j] = sum_i x[r][i] * w[j][i] for r < Rows, j < 4.
template <int Rows>
void block_int4(const float* x, int64_t k, const uint8_t* const* q, const float* const* scale, int64_t group,
                float* out, int64_t ldo) {
  float sums[kInputRows][kWeightRows] = {};
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if (group % 16 == 0) {
    __m512 acc[Rows][kWeightRows];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    __m512 scales[kWeightRows], offsets[kWeightRows];
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    for (; i + 16 <= k; i += 16) {
      if (i % group == 0)
        for (int j = 0; j < kWeightRows; ++j) {
          scales[j] = _mm512_set1_ps(scale[j][i / group]);
          offsets[j] = _mm512_set1_ps(-8.0f * scale[j][i / group]);
        }
      if (i % 128 == 0)  // the next task's rows, as in int8_linear.cpp
        for (int j = 0; j < kWeightRows; ++j)
          _mm_prefetch(reinterpret_cast<const char*>(q[j] + (kPrefetchRows * k + i) / 2), _MM_HINT_T0);
      __m512 xs[Rows];
      for (int r = 0; r < Rows; ++r) xs[r] = _mm512_loadu_ps(x + r * k + i);
      for (int j = 0; j < kWeightRows; ++j) {
        const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q[j] + i / 2));
        const __m128i low = _mm_and_si128(bytes, low_nibbles);
        const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
        const __m128i values = _mm_unpacklo_epi8(low, high);  // inputs i .. i + 15 in order
        const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(values)), scales[j], offsets[j]);
        for (int r = 0; r < Rows; ++r) acc[r][j] = _mm512_fmadd_ps(xs[r], w, acc[r][j]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < kWeightRows; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  }
#endif
  for (; i < k; ++i)
    for (int j = 0; j < kWeightRows; ++j) {
      const float w = int4_at(q[j], i) * scale[j][i / group];
      for (int r = 0; r < Rows; ++r) sums[r][j] += x[r * k + i] * w;
    }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < kWeightRows; ++j) out[r * ldo + j] = sums[r][j];
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == 2 * q.size(1),
              "int4_linear: x [M, K] and q [N, K / 2] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && q.scalar_type() == at::kByte && q.is_contiguous(),
              "int4_linear: contiguous float32 x and uint8 q expected");
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) > 0 && k % scale.size(1) == 0,
              "int4_linear: float32 scale [N, G] with G dividing K expected");
  const int64_t groups = scale.size(1), group = k / groups;
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "int4_linear: float32 bias [N] expected");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (n + kWeightRows - 1) / kWeightRows, 32, [&](int64_t begin, int64_t end) {
    float block[kInputRows * kWeightRows];
    const uint8_t* weights[kWeightRows];
    const float* scales[kWeightRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kWeightRows, count = std::min(kWeightRows, n - j0);
      for (int64_t j = 0; j < kWeightRows; ++j) {  // a tail task repeats its last row
        weights[j] = qp + (j0 + std::min(j, count - 1)) * (k / 2);
        scales[j] = sp + (j0 + std::min(j, count - 1)) * groups;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kInputRows) {
        const int64_t block_rows = std::min(kInputRows, rows - r0);
        const float* xs = xp + r0 * k;
        switch (block_rows) {
          case 1: block_int4<1>(xs, k, weights, scales, group, block, kWeightRows); break;
          case 2: block_int4<2>(xs, k, weights, scales, group, block, kWeightRows); break;
          case 3: block_int4<3>(xs, k, weights, scales, group, block, kWeightRows); break;
          default: block_int4<4>(xs, k, weights, scales, group, block, kWeightRows);
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
  m.def("int4_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor", &int4_linear);
}
