// Weight-only quantized linears for a few rows of x (decode): out [M, N] = x [M, K] @ w.T (+ bias [N]), the
// weights dequantized in registers as they stream in. Reference: unified/kernels/linear.py,
// quantized_linear_reference.
//
// - int8_linear: w = q [N, K] int8 * scale [N, G], one float32 scale per output feature and group of K / G
//   inputs (G = 1: per output feature); a quarter of float32's bytes.
// - int4_linear: w[j][i] = (u[j][i] - 8) * scale[j][i / group], packed two to a byte as compressed-tensors'
//   pack-quantized format stores them (an int32 of eight values, lowest bits first, is on a little-endian
//   machine the same bytes): q4 [N, K / 2] uint8, input 2c in byte c's low nibble and 2c + 1 in its high one;
//   an eighth of float32's bytes.
//
// Decode is bound by reading the weights. Each task streams four weight rows once from memory; 16 values at a
// time are converted to float32 and scaled in registers, then multiplied into a block of up to four rows of x
// (16 accumulators), so the conversion is shared by the block and the weight rows are re-read from L1 by the
// next block.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kWeightRows = 4, kInputRows = 4, kPrefetchRows = 8;

// The two formats: the bytes of one row, the value stored for each weight (the weight is (value - kOffset) *
// scale), as a float for the portable loop and, on AVX-512, for the 16 weights from input i on.
struct Int8Weights {
  using Byte = int8_t;
  static constexpr int64_t kPerByte = 1;
  static constexpr float kOffset = 0.0f;
  static float at(const Byte* row, int64_t i) { return static_cast<float>(row[i]); }
#if defined(CPU_CAPABILITY_AVX512)
  static __m512 sixteen(const Byte* row, int64_t i) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
#endif
};

struct Int4Weights {
  using Byte = uint8_t;
  static constexpr int64_t kPerByte = 2;
  static constexpr float kOffset = 8.0f;
  static float at(const Byte* row, int64_t i) {
    const uint8_t byte = row[i / 2];
    return static_cast<float>((i % 2) ? byte >> 4 : byte & 0x0F);
  }
#if defined(CPU_CAPABILITY_AVX512)
  static __m512 sixteen(const Byte* row, int64_t i) {
    const __m128i low_nibbles = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i low = _mm_and_si128(bytes, low_nibbles);
    const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
    const __m128i values = _mm_unpacklo_epi8(low, high);  // inputs i .. i + 15 in order
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(values));
  }
#endif
};

// out[r * ldo + j] = sum_i x[r][i] * w[j][i] for r < Rows, j < 4 (Rows a constant, so the accumulators stay in
// registers). Grouped: a scale per `group` inputs, applied to the weights (with the offset, in one fused
// multiply-add); else one per row, at the end.
template <typename W, int Rows, bool Grouped>
void block(const float* x, int64_t k, const typename W::Byte* const* q, const float* const* scale, int64_t group,
           float* out, int64_t ldo) {
  float sums[kInputRows][kWeightRows] = {};
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if (!Grouped || group % 16 == 0) {
    __m512 acc[Rows][kWeightRows];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    __m512 scales[kWeightRows], offsets[kWeightRows];
    const __m512 offset = _mm512_set1_ps(-W::kOffset);
    for (; i + 16 <= k; i += 16) {
      if (Grouped && i % group == 0)
        for (int j = 0; j < kWeightRows; ++j) {
          scales[j] = _mm512_set1_ps(scale[j][i / group]);
          offsets[j] = _mm512_set1_ps(-W::kOffset * scale[j][i / group]);
        }
      if (i % (64 * W::kPerByte) == 0)  // the next task's rows (the following kWeightRows rows): DRAM latency,
        for (int j = 0; j < kWeightRows; ++j)  // not bandwidth, limits short rows otherwise
          _mm_prefetch(reinterpret_cast<const char*>(q[j] + (kPrefetchRows * k + i) / W::kPerByte), _MM_HINT_T0);
      __m512 xs[Rows];
      for (int r = 0; r < Rows; ++r) xs[r] = _mm512_loadu_ps(x + r * k + i);
      for (int j = 0; j < kWeightRows; ++j) {
        __m512 w = W::sixteen(q[j], i);
        if (Grouped)
          w = W::kOffset != 0.0f ? _mm512_fmadd_ps(w, scales[j], offsets[j]) : _mm512_mul_ps(w, scales[j]);
        else if (W::kOffset != 0.0f)
          w = _mm512_add_ps(w, offset);
        for (int r = 0; r < Rows; ++r) acc[r][j] = _mm512_fmadd_ps(xs[r], w, acc[r][j]);
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int j = 0; j < kWeightRows; ++j) sums[r][j] = _mm512_reduce_add_ps(acc[r][j]);
  }
#endif
  for (; i < k; ++i)
    for (int j = 0; j < kWeightRows; ++j) {
      const float value = W::at(q[j], i) - W::kOffset;
      const float w = Grouped ? value * scale[j][i / group] : value;
      for (int r = 0; r < Rows; ++r) sums[r][j] += x[r * k + i] * w;
    }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < kWeightRows; ++j) out[r * ldo + j] = Grouped ? sums[r][j] : sums[r][j] * scale[j][0];
}

template <typename W, bool Grouped>
void rows_block(int64_t rows, const float* x, int64_t k, const typename W::Byte* const* q, const float* const* scale,
                int64_t group, float* out) {
  switch (rows) {
    case 1: block<W, 1, Grouped>(x, k, q, scale, group, out, kWeightRows); break;
    case 2: block<W, 2, Grouped>(x, k, q, scale, group, out, kWeightRows); break;
    case 3: block<W, 3, Grouped>(x, k, q, scale, group, out, kWeightRows); break;
    default: block<W, 4, Grouped>(x, k, q, scale, group, out, kWeightRows);
  }
}

template <typename W>
at::Tensor quantized_linear(const char* name, at::ScalarType stored, const at::Tensor& x, const at::Tensor& q,
                            const at::Tensor& scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == W::kPerByte * q.size(1), name,
              ": x [M, K] and q [N, K / values per byte] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && q.scalar_type() == stored && q.is_contiguous(),
              name, ": contiguous float32 x and ", stored, " q expected");
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) > 0 && k % scale.size(1) == 0,
              name, ": float32 scale [N, G] with G dividing K expected");
  const int64_t groups = scale.size(1), group = k / groups;
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, name,
                ": float32 bias [N] expected");
    bp = bias->data_ptr<float>();
  }
  at::Tensor out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const auto* qp = static_cast<const typename W::Byte*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = k / W::kPerByte;
  at::parallel_for(0, (n + kWeightRows - 1) / kWeightRows, 32, [&](int64_t begin, int64_t end) {
    float sums[kInputRows * kWeightRows];
    const typename W::Byte* weights[kWeightRows];
    const float* scales[kWeightRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t j0 = task * kWeightRows, count = std::min(kWeightRows, n - j0);
      for (int64_t j = 0; j < kWeightRows; ++j) {  // a tail task repeats its last row
        weights[j] = qp + (j0 + std::min(j, count - 1)) * row_bytes;
        scales[j] = sp + (j0 + std::min(j, count - 1)) * groups;
      }
      for (int64_t r0 = 0; r0 < rows; r0 += kInputRows) {
        const int64_t block_rows = std::min(kInputRows, rows - r0);
        if (groups > 1)
          rows_block<W, true>(block_rows, xp + r0 * k, k, weights, scales, group, sums);
        else
          rows_block<W, false>(block_rows, xp + r0 * k, k, weights, scales, group, sums);
        for (int64_t r = 0; r < block_rows; ++r)
          for (int64_t j = 0; j < count; ++j)
            op[(r0 + r) * n + j0 + j] = sums[r * kWeightRows + j] + (bp ? bp[j0 + j] : 0.0f);
      }
    }
  });
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  return quantized_linear<Int8Weights>("int8_linear", at::kChar, x, q, scale, bias);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  return quantized_linear<Int4Weights>("int4_linear", at::kByte, x, q, scale, bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor", &int8_linear);
  m.def("int4_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor", &int4_linear);
}
