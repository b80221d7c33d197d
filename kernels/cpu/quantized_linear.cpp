// Weight-only quantized linears for a few rows of x (decode): out [..., N] = x [..., K] @ w.T (+ bias [N]), the
// weights dequantized in registers as they stream in. Reference: unified/kernels/linear.py,
// quantized_linear_reference over int16_rounded_input(x, input_block).
//
// - int8_linear: w = q [N, K] int8 * scale [N, G], one float32 scale per output feature and group of K / G
//   inputs (G = 1: per output feature); a quarter of float32's bytes.
// - int4_linear: w[j][i] = (u[j][i] - 8) * scale[j][i / group], packed two to a byte as compressed-tensors'
//   pack-quantized format stores them (an int32 of eight values, lowest bits first, is on a little-endian
//   machine the same bytes): q4 [N, K / 2] uint8, input 2c in byte c's low nibble and 2c + 1 in its high one;
//   an eighth of float32's bytes.
//
// Decode is bound by reading the weights, and a core reads memory fastest in one sequential stream: each
// thread walks its share of weight rows in order, one row at a time (four rows read side by side, the first
// layout, got well under half the bandwidth on small matrices). Converting every weight to float32 then bounds
// a core below its memory's speed, so with `input_block` > 0 x is rounded to int16, one scale per block of
// that many inputs of a row (a weight group when there are several, since a block's integer sums take one
// weight scale), and 32 weights at a time are widened to int16 and multiplied into int32 sums (vpmaddwd); each
// block's sums are scaled into float ones at its end. Inputs past the last whole block, and every input with
// `input_block` = 0, take the float path: 16 weights at a time converted to float32 and scaled in registers.
// Up to four rows of x share each weight row's conversion. With one row of x (batch-1 decode) a core is bound by
// loading x again for every weight row (two bytes of x for each weight byte) and by ending each row (its vector's
// lanes summed), well under its memory's speed: there x's first 768 inputs stay in registers for the whole call,
// and the rows' vectors are summed sixteen at a time, in the order each alone would be (a row's output is the
// same in any batch).
//
// `input_scale` [K] (optional): x is multiplied by it, input by input, before anything else. An activation-aware
// copy (unified/model/calibration.py) quantizes w * s column by column and takes input_scale = 1 / s.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kInputRows = 4, kMaxInputBlock = 4096;  // int32 sums of a 4096-input block cannot overflow
constexpr int kLeastExponent = -100;

// The two formats: the bytes of one row, the value stored for each weight (the weight is (value - kOffset) *
// scale), as a float for the portable loop and, on AVX-512, for the 16 weights from input i on (float path)
// and the 32 from input i on widened to int16.
struct Int8Weights {
  using Byte = int8_t;
  static constexpr int64_t kPerByte = 1;
  static constexpr float kOffset = 0.0f;
  static int32_t value(const Byte* row, int64_t i) { return row[i]; }
#if defined(CPU_CAPABILITY_AVX512)
  static __m512 sixteen(const Byte* row, int64_t i) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
  static __m512i thirty_two(const Byte* row, int64_t i) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
  }
#endif
};

struct Int4Weights {
  using Byte = uint8_t;
  static constexpr int64_t kPerByte = 2;
  static constexpr float kOffset = 8.0f;
  static int32_t value(const Byte* row, int64_t i) {
    const uint8_t byte = row[i / 2];
    return (i % 2) ? byte >> 4 : byte & 0x0F;
  }
#if defined(CPU_CAPABILITY_AVX512)
  static __m128i low_nibbles(__m128i packed) { return _mm_and_si128(packed, _mm_set1_epi8(0x0F)); }
  static __m128i high_nibbles(__m128i packed) { return _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F)); }
  static __m512 sixteen(const Byte* row, int64_t i) {
    const __m128i packed = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i values = _mm_unpacklo_epi8(low_nibbles(packed), high_nibbles(packed));  // inputs in order
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(values));
  }
  static __m512i thirty_two(const Byte* row, int64_t i) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i low = low_nibbles(packed), high = high_nibbles(packed);
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(low, high), _mm_unpacklo_epi8(low, high)));
  }
#endif
};

// x rounded to int16 over the whole blocks of each row: a block's step is the power of two 2^(e - 15) for its
// largest magnitude under 2^e, so that scaling is exact and every implementation rounds alike (the largest
// value clamps at 32767); a block under 2^kLeastExponent reads as zeros. Also each block's sum of values (the
// int4 offset's share).
struct Int16Input {
  std::vector<int16_t> values;  // [rows, blocks * block]
  std::vector<float> scales;    // [rows, blocks]
  std::vector<int32_t> sums;    // [rows, blocks]
  int64_t block, blocks;

  Int16Input(const float* x, int64_t rows, int64_t k, int64_t block)
      : values(rows * (k / block) * block), scales(rows * (k / block)), sums(rows * (k / block)), block(block),
        blocks(k / block) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* in = x + r * k + b * block;
        float largest = 0.0f;
        bool finite = true;
        for (int64_t i = 0; i < block; ++i) {
          largest = std::max(largest, std::abs(in[i]));
          finite = finite && std::isfinite(in[i]);
        }
        int exponent = 0;
        std::frexp(largest, &exponent);  // largest < 2^exponent
        const bool zeros = !finite || exponent < kLeastExponent;
        const float inverse = zeros ? 0.0f : std::ldexp(1.0f, 15 - exponent);
        int16_t* out = values.data() + (r * blocks + b) * block;
        int32_t sum = 0;
        for (int64_t i = 0; i < block; ++i) {
          const float value = zeros ? 0.0f : std::clamp(std::nearbyint(in[i] * inverse), -32767.0f, 32767.0f);
          out[i] = static_cast<int16_t>(value);
          sum += out[i];
        }
        // A NaN or infinity makes its block's scale NaN, so that it shows in the row's outputs as in float32
        scales[r * blocks + b] = !finite ? std::numeric_limits<float>::quiet_NaN()
                                         : zeros ? 0.0f : std::ldexp(1.0f, exponent - 15);
        sums[r * blocks + b] = sum;
      }
  }
};

// sums[r] += x[r][i] * (value(i) - kOffset) * scale(i) over inputs [from, k), in float32 (r < Rows, a constant, so
// the accumulators stay in registers). Grouped: a scale per `group` inputs, applied to the weights; else the
// row's one scale is left to the caller.
template <typename W, int Rows, bool Grouped>
void float_dot(const float* x, int64_t from, int64_t k, const typename W::Byte* q, const float* scale, int64_t group,
               float* sums) {
  int64_t i = from;
#if defined(CPU_CAPABILITY_AVX512)
  if (!Grouped || group % 16 == 0) {
    constexpr int kSplit = Rows == 1 ? 4 : Rows == 2 ? 2 : 1;  // partial sums per row of x, so adds overlap
    __m512 acc[Rows][kSplit];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    const __m512 offset = _mm512_set1_ps(-W::kOffset);
    for (; i + 16 * kSplit <= k; i += 16 * kSplit)
      for (int s = 0; s < kSplit; ++s) {
        const int64_t at = i + 16 * s;
        __m512 w = W::sixteen(q, at);
        if (Grouped) {
          const float g = scale[at / group];
          w = W::kOffset != 0.0f ? _mm512_fmadd_ps(w, _mm512_set1_ps(g), _mm512_set1_ps(-W::kOffset * g))
                                 : _mm512_mul_ps(w, _mm512_set1_ps(g));
        } else if (W::kOffset != 0.0f) {
          w = _mm512_add_ps(w, offset);
        }
        for (int r = 0; r < Rows; ++r) acc[r][s] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + at), w, acc[r][s]);
      }
    for (int r = 0; r < Rows; ++r) {
      __m512 total = acc[r][0];
      for (int s = 1; s < kSplit; ++s) total = _mm512_add_ps(total, acc[r][s]);
      sums[r] += _mm512_reduce_add_ps(total);
    }
  }
#endif
  for (; i < k; ++i) {
    const float value = static_cast<float>(W::value(q, i)) - W::kOffset;
    const float w = Grouped ? value * scale[i / group] : value;
    for (int r = 0; r < Rows; ++r) sums[r] += x[r * k + i] * w;
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The sum of v's lanes: halves, then quarters, pairs and single lanes added, the order reduce16 adds each of its
// vectors in (spelled out, since _mm512_reduce_add_ps leaves the order to the compiler).
inline float lane_sum(__m512 v) {
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 quarters = _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
  const __m128 pairs = _mm_add_ps(quarters, _mm_movehl_ps(quarters, quarters));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}
#endif

// sums[r] += the whole blocks' share over int16 x (rows r0 .. r0 + Rows - 1 of `xq`), with the same scale
// convention as float_dot: a block's integer sum times its x scale, times its weight group's scale if Grouped.
template <typename W, int Rows, bool Grouped>
void int16_dot(const Int16Input& xq, int64_t r0, const typename W::Byte* q, const float* scale, int64_t group,
               float* sums) {
  const int64_t block = xq.block, blocks = xq.blocks;
  float offset_share[Rows] = {};
#if defined(CPU_CAPABILITY_AVX512)
  __m512 acc[Rows];
  for (auto& a : acc) a = _mm512_setzero_ps();
#else
  float acc[Rows] = {};
#endif
  for (int64_t b = 0; b < blocks; ++b) {
    const int16_t* xs[Rows];
    for (int r = 0; r < Rows; ++r) xs[r] = xq.values.data() + ((r0 + r) * blocks + b) * block;
    const float weight_scale = Grouped ? scale[b * block / group] : 1.0f;
#if defined(CPU_CAPABILITY_AVX512)
    __m512i dots[Rows];
    for (auto& d : dots) d = _mm512_setzero_si512();
    for (int64_t i = 0; i < block; i += 32) {
      const __m512i w = W::thirty_two(q, b * block + i);
      for (int r = 0; r < Rows; ++r)
        dots[r] = _mm512_add_epi32(dots[r], _mm512_madd_epi16(w, _mm512_loadu_si512(xs[r] + i)));
    }
#else
    int32_t dots[Rows] = {};
    for (int64_t i = 0; i < block; ++i)
      for (int r = 0; r < Rows; ++r) dots[r] += W::value(q, b * block + i) * xs[r][i];
#endif
    for (int r = 0; r < Rows; ++r) {
      const float s = weight_scale * xq.scales[(r0 + r) * blocks + b];
#if defined(CPU_CAPABILITY_AVX512)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), _mm512_set1_ps(s), acc[r]);
#else
      acc[r] += static_cast<float>(dots[r]) * s;
#endif
      if (W::kOffset != 0.0f) offset_share[r] += s * static_cast<float>(xq.sums[(r0 + r) * blocks + b]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
#if defined(CPU_CAPABILITY_AVX512)
    sums[r] += lane_sum(acc[r]) - W::kOffset * offset_share[r];
#else
    sums[r] += acc[r] - W::kOffset * offset_share[r];
#endif
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The lane sums of 16 vectors at once: halves, then quarters, then pairs and single lanes of the vectors are added
// together in a tree, about three instructions per vector where reducing each alone takes ten in a dependent
// chain. Lane l of the result holds vector kReducedVector[l]'s sum.
__m512 reduce16(const __m512* v) {
  __m512 halves[8], quarters[4], pairs[2];
  for (int i = 0; i < 8; ++i)
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44), _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[i], halves[i + 4], 0x88),
                                _mm512_shuffle_f32x4(halves[i], halves[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[i], quarters[i + 2], 0x44),
                             _mm512_shuffle_ps(quarters[i], quarters[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88), _mm512_shuffle_ps(pairs[0], pairs[1], 0xDD));
}

// Which vector's sum each lane of reduce16's result holds: reduce16 of vectors filled with their own index.
const std::array<int, 16> kReducedVector = [] {
  __m512 v[16];
  for (int i = 0; i < 16; ++i) v[i] = _mm512_set1_ps(static_cast<float>(i));
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, reduce16(v));
  std::array<int, 16> order{};
  for (int l = 0; l < 16; ++l) order[l] = static_cast<int>(lanes[l] / 16.0f);
  return order;
}();
#endif

#if defined(CPU_CAPABILITY_AVX512)
// x's first 32 * kHeld int16 inputs held in registers (all of them for widths of 512 to 768; narrower x is read
// from memory as before: each width held is a compiled copy of the loop).
constexpr int kHeld = 24;

// One weight row's int16_dot<W, 1, Grouped> before its lanes are summed (the same operations in the same order, so
// the same result), with x's first Held vectors of 32 inputs in `held`.
template <typename W, bool Grouped, int Held>
inline __m512 held_row_lanes(const Int16Input& xq, const __m512i* held, int64_t vectors, const typename W::Byte* row,
                             const float* row_scale, float* offset_share) {
  const int64_t per_block = xq.block / 32;
  __m512 acc = _mm512_setzero_ps();
  __m512i dots = _mm512_setzero_si512();
  float offset = 0.0f;
  int64_t left = per_block, b = 0;
  const auto block_done = [&] {
    const float s = (Grouped ? row_scale[b] : 1.0f) * xq.scales[b];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(s), acc);
    if (W::kOffset != 0.0f) offset += s * static_cast<float>(xq.sums[b]);
    dots = _mm512_setzero_si512();
    left = per_block;
    ++b;
  };
#pragma GCC unroll 32
  for (int v = 0; v < Held; ++v) {
    dots = _mm512_add_epi32(dots, _mm512_madd_epi16(W::thirty_two(row, 32 * v), held[v]));
    if (--left == 0) block_done();
  }
  for (int64_t v = Held; v < vectors; ++v) {
    dots = _mm512_add_epi32(dots, _mm512_madd_epi16(W::thirty_two(row, 32 * v),
                                                    _mm512_loadu_si512(xq.values.data() + 32 * v)));
    if (--left == 0) block_done();
  }
  *offset_share = offset;
  return acc;
}

// Weight rows [begin, end) for one row of x read whole as int16 (decode at batch 1), sixteen at a time: each row's
// integer sums end as a vector, the sixteen vectors are reduced together (reduce16, in the order each alone
// would be), and the rows are still read one after another, in one stream. Returns the first row left undone.
template <typename W, bool Grouped, int Held>
int64_t held_rows(const Int16Input& xq, int64_t k, const typename W::Byte* q, const float* scale, int64_t groups,
                  const float* bias, float* out, int64_t begin, int64_t end) {
  __m512i held[Held > 0 ? Held : 1];
  for (int v = 0; v < Held; ++v) held[v] = _mm512_loadu_si512(xq.values.data() + 32 * v);
  const int64_t row_bytes = k / W::kPerByte, vectors = k / 32;
  int64_t j = begin;
  for (; j + 16 <= end; j += 16) {
    __m512 acc[16];
    float offset_share[16];
    for (int t = 0; t < 16; ++t)
      acc[t] = held_row_lanes<W, Grouped, Held>(xq, held, vectors, q + (j + t) * row_bytes, scale + (j + t) * groups,
                                                offset_share + t);
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, reduce16(acc));
    for (int l = 0; l < 16; ++l) {
      const int t = kReducedVector[l];
      const float sum = lanes[l] - W::kOffset * offset_share[t];
      out[j + t] = (Grouped ? sum : sum * scale[(j + t) * groups]) + (bias ? bias[j + t] : 0.0f);
    }
  }
  return j;
}

template <typename W, bool Grouped>
int64_t one_row_of_x(const Int16Input& xq, int64_t k, const typename W::Byte* q, const float* scale, int64_t groups,
                     const float* bias, float* out, int64_t begin, int64_t end) {
  const auto run = [&](auto held) {
    return held_rows<W, Grouped, decltype(held)::value>(xq, k, q, scale, groups, bias, out, begin, end);
  };
  switch (std::min<int64_t>(k / 32, kHeld)) {
    case 16: return run(std::integral_constant<int, 16>{});
    case 17: return run(std::integral_constant<int, 17>{});
    case 18: return run(std::integral_constant<int, 18>{});
    case 19: return run(std::integral_constant<int, 19>{});
    case 20: return run(std::integral_constant<int, 20>{});
    case 21: return run(std::integral_constant<int, 21>{});
    case 22: return run(std::integral_constant<int, 22>{});
    case 23: return run(std::integral_constant<int, 23>{});
    case 24: return run(std::integral_constant<int, kHeld>{});
    default: return run(std::integral_constant<int, 0>{});  // under 512 inputs
  }
}
#endif

// Calls f with std::integral_constant<int, rows> for rows in 1..kInputRows.
template <typename F>
void with_rows(int64_t rows, F&& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{});
  }
}

template <typename W, bool Grouped>
void linear_rows(const float* x, const Int16Input* xq, int64_t rows, int64_t k, int64_t n, const typename W::Byte* q,
                 const float* scale, int64_t groups, const float* bias, float* out, int64_t begin, int64_t end) {
  const int64_t row_bytes = k / W::kPerByte, group = k / groups;
  const int64_t float_from = xq ? xq->blocks * xq->block : 0;
  int64_t j = begin;
#if defined(CPU_CAPABILITY_AVX512)
  if (rows == 1 && xq && float_from == k) j = one_row_of_x<W, Grouped>(*xq, k, q, scale, groups, bias, out, begin, end);
#endif
  for (; j < end; ++j) {
    const auto* wq = q + j * row_bytes;
    const float* ws = scale + j * groups;
    for (int64_t r0 = 0; r0 < rows; r0 += kInputRows)
      with_rows(std::min(kInputRows, rows - r0), [&](auto rows_constant) {
        constexpr int R = decltype(rows_constant)::value;
        float sums[R] = {};
        if (xq) int16_dot<W, R, Grouped>(*xq, r0, wq, ws, group, sums);
        if (float_from < k) float_dot<W, R, Grouped>(x + r0 * k, float_from, k, wq, ws, group, sums);
        for (int r = 0; r < R; ++r)
          out[(r0 + r) * n + j] = (Grouped ? sums[r] : sums[r] * ws[0]) + (bias ? bias[j] : 0.0f);
      });
  }
}

template <typename W>
at::Tensor quantized_linear(const char* name, at::ScalarType stored, const at::Tensor& x_in, const at::Tensor& q,
                            const at::Tensor& scale, const std::optional<at::Tensor>& bias, int64_t input_block,
                            const std::optional<at::Tensor>& input_scale) {
  TORCH_CHECK(x_in.dim() >= 1 && q.dim() == 2 && x_in.size(-1) == W::kPerByte * q.size(1), name,
              ": x [..., K] and q [N, K / values per byte] expected");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && q.scalar_type() == stored && q.is_contiguous(), name,
              ": float32 x and contiguous ", stored, " q expected");
  const at::Tensor x = x_in.contiguous();
  const int64_t k = x.size(-1), rows = k > 0 ? x.numel() / k : 0, n = q.size(0);
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == n &&
                  scale.size(1) > 0 && k % scale.size(1) == 0,
              name, ": float32 scale [N, G] with G dividing K expected");
  const int64_t groups = scale.size(1);
  TORCH_CHECK(input_block == 0 || (input_block % 32 == 0 && input_block <= kMaxInputBlock && input_block <= k &&
                                   (groups == 1 || input_block == k / groups)),
              name, ": input_block must be 0, or a multiple of 32 up to ", kMaxInputBlock,
              " and no larger than K, equal to the weight group when there are several; got ", input_block);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, name,
                ": float32 bias [N] expected");
    bp = bias->data_ptr<float>();
  }
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor out = at::empty(out_sizes, x.options());
  const float* xp = x.data_ptr<float>();
  std::vector<float> scaled_x;
  if (input_scale.has_value()) {
    TORCH_CHECK(input_scale->scalar_type() == at::kFloat && input_scale->is_contiguous() && input_scale->numel() == k,
                name, ": float32 input_scale [K] expected");
    const float* m = input_scale->data_ptr<float>();
    scaled_x.resize(rows * k);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t i = 0; i < k; ++i) scaled_x[r * k + i] = xp[r * k + i] * m[i];
    xp = scaled_x.data();
  }
  const std::optional<Int16Input> xq =
      input_block > 0 ? std::optional<Int16Input>(std::in_place, xp, rows, k, input_block) : std::nullopt;
  const auto* qp = static_cast<const typename W::Byte*>(q.data_ptr());
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    if (groups > 1)
      linear_rows<W, true>(xp, xq ? &*xq : nullptr, rows, k, n, qp, sp, groups, bp, op, begin, end);
    else
      linear_rows<W, false>(xp, xq ? &*xq : nullptr, rows, k, n, qp, sp, groups, bp, op, begin, end);
  });
  return out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t input_block,
                       const std::optional<at::Tensor>& input_scale) {
  return quantized_linear<Int8Weights>("int8_linear", at::kChar, x, q, scale, bias, input_block, input_scale);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t input_block,
                       const std::optional<at::Tensor>& input_scale) {
  return quantized_linear<Int4Weights>("int4_linear", at::kByte, x, q, scale, bias, input_block, input_scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(unified_cpu, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias, int input_block, Tensor? input_scale=None) -> "
        "Tensor",
        &int8_linear);
  m.def("int4_linear(Tensor x, Tensor q, Tensor scale, Tensor? bias, int input_block, Tensor? input_scale=None) -> "
        "Tensor",
        &int4_linear);
}
