// int8_linear: out [M, N] = (x [M, K] @ q [N, K].T) * scale [N] (+ bias [N]) for weight-only int8 weights with
// one float32 scale per output feature, for a few rows of x (decode). Reference: x @ (q * scale[:, None]).T
// (unified/kernels/linear.py, int8_linear_reference).
//
// Decode is bound by reading the weights: int8 reads a quarter of float32's bytes. Each task streams eight
// weight rows once from memory, converting 16 int8 values at a time to float32 in registers and multiplying
// them into every row of x while they sit in L1; the scale is applied once per output.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 8;  // weight rows per task, sharing each load of x

// out[j] = sum_i x[i] * w[j][i] for the kRows rows w[0..7] (int8) and one row of x.
inline void dot_rows_int8(const float* x, const int8_t* const* w, int64_t k, float* out) {
  int64_t i = 0;
  float sums[kRows] = {0, 0, 0, 0, 0, 0, 0, 0};
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc[kRows];
  for (int j = 0; j < kRows; ++j) acc[j] = _mm512_setzero_ps();
  for (; i + 16 <= k; i += 16) {
    const __m512 xv = _mm512_loadu_ps(x + i);
    for (int j = 0; j < kRows; ++j) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[j] + i));
      acc[j] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), acc[j]);
    }
  }
  for (int j = 0; j < kRows; ++j) sums[j] = _mm512_reduce_add_ps(acc[j]);
#endif
  for (; i < k; ++i)
    for (int j = 0; j < kRows; ++j) sums[j] += x[i] * static_cast<float>(w[j][i]);
  for (int j = 0; j < kRows; ++j) out[j] = sums[j];
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1), "int8_linear: x [M, K] and q [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && q.scalar_type() == at::kChar && q.is_contiguous(),
              "int8_linear: contiguous float32 x and int8 q expected");
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == n,
              "int8_linear: float32 scale [N] expected");
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
  at::parallel_for(0, (n + kRows - 1) / kRows, 16, [&](int64_t begin, int64_t end) {
    float sums[kRows];
    const int8_t* weights[kRows];
    for (int64_t group = begin; group < end; ++group) {
      const int64_t j0 = group * kRows, count = std::min(kRows, n - j0);
      for (int64_t j = 0; j < kRows; ++j) weights[j] = qp + (j0 + std::min(j, count - 1)) * k;  // tail: repeat
      for (int64_t i = 0; i < rows; ++i) {
        dot_rows_int8(xp + i * k, weights, k, sums);
        for (int64_t j = 0; j < count; ++j) op[i * n + j0 + j] = sums[j] * sp[j0 + j] + (bp ? bp[j0 + j] : 0.0f);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias) -> Tensor", &int8_linear);
}
