// Matrix products with block-quantized weights, for decoding on CPUs (the weights stay quantized in memory).
//
// Weight formats are GGUF's, byte for byte, one matrix row after the other (a row = in_features / 32 blocks):
//   Q8_0: fp16 d, int8 q[32]                       w = d * q
//   Q4_0: fp16 d, uint8 q[16] (two 4-bit values)   w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, uint8 q[16]              w = d * q + m
// In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high nibble.
//
// Activations are quantized per row and per block of 32 to int16 with a float scale (d = max|x| / 32767) and the
// block's sum (for Q4_1's offset); a block's dot product is then an integer one (AVX2: two vpmaddwd) scaled once.
// llama.cpp rounds activations to int8 instead (d = max|x| / 127, one vpmaddubsw): 256 times coarser, which on
// SmolLM2 moved logits by up to 6% of the largest and changed greedy answers against the dequantised model (its
// answer to "What is the capital of France?" is not Paris); with int16 SmolLM2's logits stay within 0.01 (of 37.6)
// of the dequantised float32 model's, for ~1/3 more arithmetic per row and the same weight bytes (measured end to
// end on SmolLM2, AVX2: int8 activations decoded -2% to +14% faster; not worth the changed answers).
//
// Batch invariance: the number for (row m, output n) is computed by the same sequence of operations whatever
// the number of rows M and however rows are tiled or threads split the outputs (each (m, n) has its own
// accumulator, blocks are summed in order, the horizontal sum is fixed; the file is compiled with
// -ffp-contract=off). So a token's logits do not depend on what else shares its pass.
#include "quant.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t QK = 32;
enum Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2 };

struct BlockQ8_0 { uint16_t d; int8_t q[32]; };
struct BlockQ4_0 { uint16_t d; uint8_t q[16]; };
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t q[16]; };
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block");
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block");
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block");

int64_t block_bytes(int64_t format) {
  switch (format) {
    case Q8_0: return sizeof(BlockQ8_0);
    case Q4_0: return sizeof(BlockQ4_0);
    case Q4_1: return sizeof(BlockQ4_1);
  }
  TORCH_CHECK(false, "unknown weight format ", format);
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// Rows of activations, quantized: q [M, K] int16, d [M, K/32] scales, s [M, K/32] = d * sum(q of the
// block).
struct QuantRows {
  torch::Tensor q, d, s;
  int64_t rows, blocks;
};

QuantRows quantize_rows(const torch::Tensor& x) {
  constexpr float LEVELS = 32767.f;
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), nb = K / QK;
  QuantRows out{torch::empty({M, K}, torch::kInt16),
                torch::empty({M, nb}, torch::kFloat32), torch::empty({M, nb}, torch::kFloat32), M, nb};
  const float* src = xf.data_ptr<float>();
  int16_t* q = out.q.data_ptr<int16_t>();
  float* d = out.d.data_ptr<float>();
  float* s = out.s.data_ptr<float>();
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = src + i * QK;  // rows are contiguous: block i of the flattened matrix
      float amax = 0.f;
      for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float scale = amax / LEVELS;
      const float inv = scale > 0.f ? 1.f / scale : 0.f;
      int sum = 0;
      for (int j = 0; j < QK; ++j) {
        const int value = static_cast<int>(std::nearbyint(v[j] * inv));
        q[i * QK + j] = static_cast<int16_t>(value);
        sum += value;
      }
      d[i] = scale;
      s[i] = scale * static_cast<float>(sum);
    }
  });
  return out;
}

// ---- the reference: one (row, output) dot product in plain C++ (also the kernel where AVX2 is absent) ----

float dot_scalar(int64_t format, const uint8_t* w, const int16_t* xq, const float* xd, const float* xs, int64_t nb) {
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int16_t* x = xq + b * QK;
    int sum = 0;
    float block;
    if (format == Q8_0) {
      const auto* blk = reinterpret_cast<const BlockQ8_0*>(w) + b;
      for (int j = 0; j < QK; ++j) sum += blk->q[j] * x[j];
      block = half_to_float(blk->d) * xd[b] * static_cast<float>(sum);
    } else if (format == Q4_0) {
      const auto* blk = reinterpret_cast<const BlockQ4_0*>(w) + b;
      int xsum = 0;
      for (int j = 0; j < 16; ++j) {
        sum += (blk->q[j] & 0x0F) * x[j] + (blk->q[j] >> 4) * x[j + 16];
        xsum += x[j] + x[j + 16];
      }
      block = half_to_float(blk->d) * xd[b] * static_cast<float>(sum - 8 * xsum);
    } else {
      const auto* blk = reinterpret_cast<const BlockQ4_1*>(w) + b;
      for (int j = 0; j < 16; ++j) sum += (blk->q[j] & 0x0F) * x[j] + (blk->q[j] >> 4) * x[j + 16];
      block = half_to_float(blk->d) * xd[b] * static_cast<float>(sum) + half_to_float(blk->m) * xs[b];
    }
    total += block;
  }
  return total;
}

#if defined(__AVX2__)

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

#define UNROLL _Pragma("GCC unroll 16")  // constant-bound loops over tiles: their accumulators stay in registers

// 32 weights as int16 (lo: elements 0..15, hi: 16..31), from 32 bytes (signed or unsigned values).
struct Wide { __m256i lo, hi; };

inline Wide widen_signed(__m256i bytes) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes)),
          _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1))};
}

inline __m256i unpack_nibbles(const uint8_t* q) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m256i both = _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed);  // high half: elements 16..31
  return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

// One weight block's 32 values as int16.
template <int F>
inline Wide unpack(const uint8_t* row, int64_t b) {
  if constexpr (F == Q8_0) {
    const auto* blk = reinterpret_cast<const BlockQ8_0*>(row) + b;
    return widen_signed(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk->q)));
  } else if constexpr (F == Q4_0) {
    const auto* blk = reinterpret_cast<const BlockQ4_0*>(row) + b;
    return widen_signed(_mm256_sub_epi8(unpack_nibbles(blk->q), _mm256_set1_epi8(8)));
  } else {
    const auto* blk = reinterpret_cast<const BlockQ4_1*>(row) + b;
    return widen_signed(unpack_nibbles(blk->q));  // 0..15: a signed widening is the same
  }
}

// The float scales (d) and offsets (m, Q4_1) of `rows` weight rows, row after row: nb values each.
template <int F>
void row_scales(const uint8_t* weight, int64_t row_bytes, int64_t rows, int64_t nb, float* d, float* m) {
  for (int64_t j = 0; j < rows; ++j) {
    const uint8_t* row = weight + j * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      if constexpr (F == Q8_0) {
        d[j * nb + b] = half_to_float((reinterpret_cast<const BlockQ8_0*>(row) + b)->d);
      } else if constexpr (F == Q4_0) {
        d[j * nb + b] = half_to_float((reinterpret_cast<const BlockQ4_0*>(row) + b)->d);
      } else {
        const auto* blk = reinterpret_cast<const BlockQ4_1*>(row) + b;
        d[j * nb + b] = half_to_float(blk->d);
        m[j * nb + b] = half_to_float(blk->m);
      }
    }
  }
}

// Q4_1's offset term of one output, sum over blocks of m * (dx * sum of the block's activations): 8 blocks at a
// time, then the tail (the same order for every output).
inline float offset_dot(const float* m, const float* s, int64_t nb) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(m + b), _mm256_loadu_ps(s + b), acc);
  float total = hsum(acc);
  for (; b < nb; ++b) total = std::fma(m[b], s[b], total);
  return total;
}

// Integer dot product of a weight block with 32 int16 activations -> 8 int32 lanes (exact: |w| <= 127).
inline __m256i block_dot(const Wide& w, const int16_t* x) {
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, x0), _mm256_madd_epi16(w.hi, x1));
}

// The outputs of WR weight rows (w, w + row_bytes, ...; their scales dw, offsets mw, nb each) for R activation
// rows: out[r * out_stride + j]. Every (row, output) pair has its own accumulator and sees the same operations in
// the same order whatever WR and R are: the tiles only decide what is loaded once and reused, never how a number
// is summed.
template <int F, int WR, int R>
void tile_avx2(const uint8_t* w, int64_t row_bytes, const float* dw, const float* mw, const int16_t* xq,
               const float* xd, const float* xs, int64_t nb, int64_t K, float* out, int64_t out_stride) {
  __m256 acc[WR][R];
  UNROLL for (int j = 0; j < WR; ++j)
    UNROLL for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    Wide blocks[WR];
    UNROLL for (int j = 0; j < WR; ++j) blocks[j] = unpack<F>(w + j * row_bytes, b);
    UNROLL for (int r = 0; r < R; ++r) {
      const int16_t* x = xq + r * K + b * QK;
      const float dx = xd[r * nb + b];
      UNROLL for (int j = 0; j < WR; ++j) {
        const __m256i p = block_dot(blocks[j], x);
        acc[j][r] = _mm256_fmadd_ps(_mm256_set1_ps(dw[j * nb + b] * dx), _mm256_cvtepi32_ps(p), acc[j][r]);
      }
    }
  }
  UNROLL for (int j = 0; j < WR; ++j)
    UNROLL for (int r = 0; r < R; ++r) {
      float value = hsum(acc[j][r]);
      if constexpr (F == Q4_1) value += offset_dot(mw + j * nb, xs + r * nb, nb);
      out[r * out_stride + j] = value;
    }
}

// Weight rows [0, rows) (their scales dw, offsets mw) against activation rows [m0, m0 + R): tiles of WR weight
// rows, then one at a time.
template <int F, int WR, int R>
void rows_avx2(const uint8_t* weight, int64_t row_bytes, const float* dw, const float* mw, int64_t rows,
               const int16_t* q, const float* d, const float* s, int64_t nb, int64_t K, float* out, int64_t N) {
  int64_t n = 0;
  for (; n + WR <= rows; n += WR)
    tile_avx2<F, WR, R>(weight + n * row_bytes, row_bytes, dw + n * nb, mw + n * nb, q, d, s, nb, K, out + n, N);
  for (; n < rows; ++n)
    tile_avx2<F, 1, R>(weight + n * row_bytes, row_bytes, dw + n * nb, mw + n * nb, q, d, s, nb, K, out + n, N);
}

#ifndef R1_WR
#define R1_WR 2
#endif

template <int F>
void range_avx2(const uint8_t* weight, int64_t row_bytes, const float* dw, const float* mw, int64_t n_rows,
                const int16_t* q, const float* d, const float* s, int64_t nb, int64_t K, int64_t rows, float* out,
                int64_t N) {
#define SPECDECODE_ROWS(WR, R) rows_avx2<F, WR, R>(weight, row_bytes, dw, mw, n_rows, q, d, s, nb, K, out, N)
  switch (rows) {  // weight rows per tile: as many as keep every accumulator in a register
    case 8: SPECDECODE_ROWS(1, 8); break;
    case 7: SPECDECODE_ROWS(1, 7); break;
    case 6: SPECDECODE_ROWS(1, 6); break;
    case 5: SPECDECODE_ROWS(1, 5); break;
    case 4: SPECDECODE_ROWS(2, 4); break;
    case 3: SPECDECODE_ROWS(2, 3); break;
    case 2: SPECDECODE_ROWS(2, 2); break;
    default: SPECDECODE_ROWS(R1_WR, 1); break;
  }
#undef SPECDECODE_ROWS
}

#endif  // __AVX2__

constexpr int64_t ROW_TILE = 8;     // activation rows per pass over a weight row (their accumulators in registers)
constexpr int64_t WEIGHT_TILE = 16;  // weight rows kept hot while every tile of activation rows passes over them

void matmul_range(int64_t format, const uint8_t* weight, int64_t row_bytes, const QuantRows& x, int64_t K,
                  float* out, int64_t N, int64_t n_begin, int64_t n_end, bool use_simd) {
  const int16_t* xq = x.q.data_ptr<int16_t>();
  const float* xd = x.d.data_ptr<float>();
  const float* xs = x.s.data_ptr<float>();
  const int64_t M = x.rows, nb = x.blocks;
  std::vector<float> dw(WEIGHT_TILE * nb), mw(WEIGHT_TILE * nb);  // the chunk's scales, converted once
  for (int64_t n0 = n_begin; n0 < n_end; n0 += WEIGHT_TILE) {
    const int64_t n1 = std::min(n_end, n0 + WEIGHT_TILE);
    const uint8_t* chunk = weight + n0 * row_bytes;
#if defined(__AVX2__)
    if (use_simd) {
      if (format == Q8_0) row_scales<Q8_0>(chunk, row_bytes, n1 - n0, nb, dw.data(), mw.data());
      else if (format == Q4_0) row_scales<Q4_0>(chunk, row_bytes, n1 - n0, nb, dw.data(), mw.data());
      else row_scales<Q4_1>(chunk, row_bytes, n1 - n0, nb, dw.data(), mw.data());
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
      const int64_t rows = std::min(ROW_TILE, M - m0);
      const int16_t* q = xq + m0 * K;
      const float* d = xd + m0 * nb;
      const float* s = xs + m0 * nb;
#if defined(__AVX2__)
      if (use_simd) {
        float* o = out + m0 * N + n0;
        const float *dp = dw.data(), *mp = mw.data();
        if (format == Q8_0) range_avx2<Q8_0>(chunk, row_bytes, dp, mp, n1 - n0, q, d, s, nb, K, rows, o, N);
        else if (format == Q4_0) range_avx2<Q4_0>(chunk, row_bytes, dp, mp, n1 - n0, q, d, s, nb, K, rows, o, N);
        else range_avx2<Q4_1>(chunk, row_bytes, dp, mp, n1 - n0, q, d, s, nb, K, rows, o, N);
        continue;
      }
#endif
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = weight + n * row_bytes;
        float* o = out + m0 * N + n;
        for (int64_t r = 0; r < rows; ++r)
          o[r * N] = dot_scalar(format, w, q + r * K, d + r * nb, s + r * nb, nb);
      }
    }
  }
}

void check_weight(const torch::Tensor& weight, int64_t format, int64_t in_features) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dtype() == torch::kUInt8 && weight.dim() == 2 &&
              weight.is_contiguous(), "quantized weight must be a contiguous 2-d uint8 CPU tensor");
  TORCH_CHECK(in_features % QK == 0, "in_features must be a multiple of 32, got ", in_features);
  TORCH_CHECK(weight.size(1) == in_features / QK * block_bytes(format),
              "quantized weight rows hold ", weight.size(1), " bytes; format ", format, " with ", in_features,
              " inputs needs ", in_features / QK * block_bytes(format));
}

}  // namespace

// x [M, K] (any float dtype) @ dequantized(weight [N, K]).T -> [M, N] float32.
torch::Tensor qmatmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t format, bool use_simd) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-d CPU tensor");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  check_weight(weight, format, K);
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  const QuantRows quantized = quantize_rows(x);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t row_bytes = weight.size(1);
  at::parallel_for(0, N, WEIGHT_TILE * 4, [&](int64_t begin, int64_t end) {
    matmul_range(format, w, row_bytes, quantized, K, o, N, begin, end, use_simd);
  });
  return out;
}

// The rows `index` [T] (int64) of a quantized matrix, dequantized -> [T, K] float32 (an embedding lookup).
torch::Tensor dequantize_rows(const torch::Tensor& weight, int64_t format, int64_t in_features,
                              const torch::Tensor& index) {
  check_weight(weight, format, in_features);
  auto idx = index.to(torch::kInt64).contiguous();
  const int64_t T = idx.numel(), nb = in_features / QK, row_bytes = weight.size(1), N = weight.size(0);
  auto out = torch::empty({T, in_features}, torch::kFloat32);
  const int64_t* ids = idx.data_ptr<int64_t>();
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(ids[t] >= 0 && ids[t] < N, "row index ", ids[t], " out of range for ", N, " rows");
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row = w + ids[t] * row_bytes;
      float* dst = o + t * in_features;
      for (int64_t b = 0; b < nb; ++b) {
        float* v = dst + b * QK;
        if (format == Q8_0) {
          const auto* blk = reinterpret_cast<const BlockQ8_0*>(row) + b;
          const float d = half_to_float(blk->d);
          for (int j = 0; j < QK; ++j) v[j] = d * blk->q[j];
        } else if (format == Q4_0) {
          const auto* blk = reinterpret_cast<const BlockQ4_0*>(row) + b;
          const float d = half_to_float(blk->d);
          for (int j = 0; j < 16; ++j) {
            v[j] = d * ((blk->q[j] & 0x0F) - 8);
            v[j + 16] = d * ((blk->q[j] >> 4) - 8);
          }
        } else {
          const auto* blk = reinterpret_cast<const BlockQ4_1*>(row) + b;
          const float d = half_to_float(blk->d), m = half_to_float(blk->m);
          for (int j = 0; j < 16; ++j) {
            v[j] = d * (blk->q[j] & 0x0F) + m;
            v[j + 16] = d * (blk->q[j] >> 4) + m;
          }
        }
      }
    }
  });
  return out;
}

bool has_simd() {
#if defined(__AVX2__)
  return true;
#else
  return false;
#endif
}

std::string instruction_set() {
#if defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "x [M, K] @ dequantized(weight [N, K]).T -> [M, N] float32");
  m.def("dequantize_rows", &dequantize_rows, "rows of a quantized matrix as float32");
  m.def("layer_step", &layer_step, "one decoder layer over a cached forward's new tokens, in place");
  m.def("race_argmax", &race_argmax, "a seeded sample per row by the exponential race (Gumbel-max)");
  m.def("has_simd", &has_simd);
  m.def("instruction_set", &instruction_set);
}
