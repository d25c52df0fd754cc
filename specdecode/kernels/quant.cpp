// Matrix products with block-quantized weights, for decoding on CPUs (the weights stay quantized in memory).
//
// Weight formats are GGUF's, byte for byte, one matrix row after the other (a row = in_features / 32 blocks):
//   Q8_0: fp16 d, int8 q[32]                       w = d * q
//   Q4_0: fp16 d, uint8 q[16] (two 4-bit values)   w = d * (q - 8)
//   Q4_1: fp16 d, fp16 m, uint8 q[16]              w = d * q + m
// In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high nibble.
//
// Activations are quantized per row and per block of 32 to int16 with a float scale (d = max|x| / 32767) and the
// block's sum (for Q4_1's offset); a block's dot product is then an exact integer one, scaled once.
// llama.cpp rounds activations to int8 instead (d = max|x| / 127, one vpmaddubsw): 256 times coarser, which on
// SmolLM2 moved logits by up to 6% of the largest and changed greedy answers against the dequantised model (its
// answer to "What is the capital of France?" is not Paris); with int16 SmolLM2's logits stay within 0.01 (of 37.6)
// of the dequantised float32 model's, for ~1/3 more arithmetic per row and the same weight bytes (measured end to
// end on SmolLM2, AVX2: int8 activations decoded -2% to +14% faster; not worth the changed answers).
//
// The kernels take blocks eight at a time (a group, see GROUP below): the 8 blocks' weights are turned around so
// that int32 lane i only ever sums products of block i (the activations are stored in the matching order), so 16
// multiply-adds (vpdpwssd with VNNI, else vpmaddwd + vpaddd) leave the group's 8 exact block sums in one vector,
// scaled by one convert and one fused multiply-add with the 8 scales dw * dx, instead of a convert, a broadcast
// and a multiply-add per block. Tiles of WR weight rows x R activation rows share the unpacked weights and the
// loaded activations.
//
// Speed (SmolLM2-135M Q4_1, all 121 products: 134.5 M MACs, 96.4 MB; 2-core AMD EPYC Zen 4, 1 thread, CPU clock,
// fastest of 7 rounds alternating with the previous per-block kernels in one process; docs/bench/speed_kernels.md):
//   M rows               1      4      8     16     32    256
//   per-block, GMAC/s  11.0   21.9   25.6   28.2   26.7   25.4
//   groups, GMAC/s     11.7   33.8   40.2   40.0   41.1   36.6
// A cached forward after 300 tokens: 1 token 12.7 -> 11.8 ms, 4: 27.2 -> 19.9, 8: 48.3 -> 34.0, 16: 94.4 -> 68.3.
// One row is 1.1x (Q8_0) to 1.8x (Q4_1) faster per matrix with the weights in cache, but the whole model at
// M = 1 is held by streaming 96 MB from memory with one core (8.4 GB/s). Tried and slower here: 512-bit vectors,
// unpacking a chunk of weights once for all row tiles, split integer accumulators, scalar loads in place of the
// scales' gather (equal). Measured with `python benchmarks/quant_kernels.py --model FILE.gguf --against OLD.so`.
//
// Batch invariance: the number for (row m, output n) is computed by the same sequence of operations whatever
// the number of rows M and however rows are tiled or threads split the outputs (each (m, n) has its own
// accumulators; the integer block sums are exact however they are formed; block b's scaled sum goes to lane b % 8
// of 8 float accumulators, groups in order, and the lanes are summed in a fixed order, by every path including
// the scalar reference; the file is compiled with -ffp-contract=off). So a token's logits do not depend on what
// else shares its pass, and the SIMD and scalar paths agree bit for bit.
#include "quant.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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

// Blocks are taken eight at a time (a group): the kernels turn a group's 8 x 32 weights around so that lane i of
// an int32 vector only ever sums products of block i, and the activations are stored in the matching order; after
// 16 integer multiply-adds the vector holds the group's 8 exact block sums, which are scaled with one convert and
// one fused multiply-add (scales dw * dx as a vector of 8). A row's last, partial group (K = 576: 2 blocks after
// 2 groups) keeps the natural order: its block sums are added up lane by lane and then scaled in the same way,
// as a group whose missing blocks are zero.
constexpr int64_t GROUP = 8;
constexpr int64_t GROUP_VALUES = GROUP * QK;
constexpr int64_t VECTORS = 16;  // int16 vectors of 16 values per group

// Where the kernels' layout puts the values of a group: vector k, lane l (2 lanes per block, block l / 2) holds
// element index_in_group(k, l) (block * 32 + element). This follows from how the weights are unpacked below: a
// vector of 8 dwords, dword i = bytes 4t..4t+3 of block i, read as 16-bit lanes (lane 2i + c = bytes 4t + 2c and
// 4t + 2c + 1).
//   4-bit: vector 4t + s: s = 0 low nibble of the lane's first byte (element 4t + 2c), 1 its high nibble (+16),
//          2 the second byte's low nibble (+1), 3 its high nibble (+17);
//   8-bit: vector 2t + s: s = 0 the first byte (element 4t + 2c), 1 the second (4t + 2c + 1).
inline int index_in_group(int64_t format, int k, int lane) {
  const int block = lane / 2, c = lane % 2;
  int element;
  if (format == Q8_0) {
    element = 4 * (k / 2) + 2 * c + k % 2;
  } else {
    static constexpr int shift[4] = {0, 16, 1, 17};
    element = 4 * (k / 4) + 2 * c + shift[k % 4];
  }
  return block * QK + element;
}

// Rows of activations, quantized per block of 32: q [M, groups * 256] int16, d [M, groups * 8] scales,
// s = d * (sum of the block's q), sum [M, groups * 8] int32 (the same sum, for Q4_0's offset); padding blocks are
// zero throughout. For the kernels (`interleaved`), whole groups hold their values in the kernels' order and all
// four are stored group-major, [groups, M, ...]: a tile of rows then reads one group of all its rows at fixed
// offsets from one pointer.
struct QuantRows {
  torch::Tensor q, d, s, sum;
  int64_t rows, blocks, groups;
};

QuantRows quantize_rows(const torch::Tensor& x, int64_t format, bool interleaved) {
  constexpr float LEVELS = 32767.f;
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), nb = K / QK, ng = (nb + GROUP - 1) / GROUP;
  QuantRows out{torch::empty({M, ng * GROUP_VALUES}, torch::kInt16), torch::empty({M, ng * GROUP}, torch::kFloat32),
                torch::empty({M, ng * GROUP}, torch::kFloat32), torch::empty({M, ng * GROUP}, torch::kInt32), M, nb,
                ng};
  int order[GROUP_VALUES];  // position in the stored group -> element of the natural group
  for (int k = 0; k < VECTORS; ++k)
    for (int lane = 0; lane < 16; ++lane) order[k * 16 + lane] = index_in_group(format, k, lane);
  const float* src = xf.data_ptr<float>();
  int16_t* q = out.q.data_ptr<int16_t>();
  float* d = out.d.data_ptr<float>();
  float* s = out.s.data_ptr<float>();
  int32_t* sums = out.sum.data_ptr<int32_t>();
  at::parallel_for(0, M * ng, 32, [&](int64_t begin, int64_t end) {
    int16_t natural[GROUP_VALUES];
    for (int64_t i = begin; i < end; ++i) {  // group g of row m
      const int64_t m = i / ng, g = i % ng;
      for (int64_t blk = 0; blk < GROUP; ++blk) {
        const int64_t b = g * GROUP + blk, at = (interleaved ? g * M + m : m * ng + g) * GROUP + blk;
        int16_t* values = natural + blk * QK;
        if (b >= nb) {
          std::memset(values, 0, QK * sizeof(int16_t));
          d[at] = s[at] = 0.f;
          sums[at] = 0;
          continue;
        }
        const float* v = src + m * K + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float scale = amax / LEVELS;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        int sum = 0;
        for (int j = 0; j < QK; ++j) {
          const int value = static_cast<int>(std::nearbyint(v[j] * inv));
          values[j] = static_cast<int16_t>(value);
          sum += value;
        }
        d[at] = scale;
        s[at] = scale * static_cast<float>(sum);
        sums[at] = sum;
      }
      int16_t* dst = q + (interleaved ? g * M + m : i) * GROUP_VALUES;
      if (interleaved && (g + 1) * GROUP <= nb) {
        for (int p = 0; p < GROUP_VALUES; ++p) dst[p] = natural[order[p]];
      } else {
        std::memcpy(dst, natural, sizeof(natural));
      }
    }
  });
  return out;
}

// The float steps, shared by every path: block b of a row adds dw * dx * (its integer sum) (then, Q4_1, m * s) to
// lane b % 8 of 8 float accumulators, groups in order, and the lanes are summed as `sum_lanes` does. With the
// integer sums exact, this fixes every rounding of a (row, output) whatever path, tile or thread computes it.
inline float sum_lanes(const float* lane) {  // the order of hsum() below
  const float a0 = lane[0] + lane[4], a1 = lane[1] + lane[5], a2 = lane[2] + lane[6], a3 = lane[3] + lane[7];
  return (a0 + a2) + (a1 + a3);
}

// ---- the reference: one (row, output) dot product in plain C++ (also the kernel where AVX2 is absent) ----

float dot_scalar(int64_t format, const uint8_t* w, const int16_t* xq, const float* xd, const float* xs,
                 const int32_t* xsum, int64_t nb, int64_t ng) {
  float lane[GROUP] = {};
  for (int64_t b = 0; b < ng * GROUP; ++b) {
    const int16_t* x = xq + b * QK;
    int sum = 0;
    float dw = 0.f, mw = 0.f;
    if (b < nb) {
      if (format == Q8_0) {
        const auto* blk = reinterpret_cast<const BlockQ8_0*>(w) + b;
        for (int j = 0; j < QK; ++j) sum += blk->q[j] * x[j];
        dw = half_to_float(blk->d);
      } else if (format == Q4_0) {
        const auto* blk = reinterpret_cast<const BlockQ4_0*>(w) + b;
        for (int j = 0; j < 16; ++j) sum += (blk->q[j] & 0x0F) * x[j] + (blk->q[j] >> 4) * x[j + 16];
        sum -= 8 * xsum[b];
        dw = half_to_float(blk->d);
      } else {
        const auto* blk = reinterpret_cast<const BlockQ4_1*>(w) + b;
        for (int j = 0; j < 16; ++j) sum += (blk->q[j] & 0x0F) * x[j] + (blk->q[j] >> 4) * x[j + 16];
        dw = half_to_float(blk->d);
        mw = half_to_float(blk->m);
      }
    }
    float& acc = lane[b % GROUP];
    acc = std::fma(dw * xd[b], static_cast<float>(sum), acc);
    if (format == Q4_1) acc = std::fma(mw, xs[b], acc);
  }
  return sum_lanes(lane);
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

template <int F> constexpr int64_t BYTES = F == Q8_0 ? sizeof(BlockQ8_0) : F == Q4_0 ? sizeof(BlockQ4_0)
                                                                                    : sizeof(BlockQ4_1);
template <int F> constexpr int64_t Q_OFFSET = F == Q4_1 ? 4 : 2;  // where q starts in a block
template <int F> constexpr int DWORDS = F == Q8_0 ? 8 : 4;         // dwords of q per block

inline __m256i load2(const uint8_t* lo, const uint8_t* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}

// A group of 8 weight blocks turned around: t[k] dword i = dword k of block i's q.
template <int F>
inline void transpose(const uint8_t* q, __m256i* t) {
  constexpr int64_t B = BYTES<F>;
  if constexpr (F != Q8_0) {
    __m256i y[4];  // [block k | block k + 4]
    UNROLL for (int k = 0; k < 4; ++k) y[k] = load2(q + k * B, q + (k + 4) * B);
    const __m256i a = _mm256_unpacklo_epi32(y[0], y[1]), b = _mm256_unpackhi_epi32(y[0], y[1]);
    const __m256i c = _mm256_unpacklo_epi32(y[2], y[3]), e = _mm256_unpackhi_epi32(y[2], y[3]);
    t[0] = _mm256_unpacklo_epi64(a, c);
    t[1] = _mm256_unpackhi_epi64(a, c);
    t[2] = _mm256_unpacklo_epi64(b, e);
    t[3] = _mm256_unpackhi_epi64(b, e);
  } else {
    __m256i y[8], a[8], b[8];
    UNROLL for (int k = 0; k < 8; ++k) y[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k * B));
    UNROLL for (int k = 0; k < 4; ++k) {
      a[2 * k] = _mm256_unpacklo_epi32(y[2 * k], y[2 * k + 1]);      // dwords 0, 1 | 4, 5 of blocks 2k, 2k + 1
      a[2 * k + 1] = _mm256_unpackhi_epi32(y[2 * k], y[2 * k + 1]);  // dwords 2, 3 | 6, 7
    }
    UNROLL for (int h = 0; h < 2; ++h) {  // blocks 0..3, then 4..7: dword 0 | 4, 1 | 5, 2 | 6, 3 | 7
      b[4 * h + 0] = _mm256_unpacklo_epi64(a[4 * h], a[4 * h + 2]);
      b[4 * h + 1] = _mm256_unpackhi_epi64(a[4 * h], a[4 * h + 2]);
      b[4 * h + 2] = _mm256_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
      b[4 * h + 3] = _mm256_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
    }
    UNROLL for (int k = 0; k < 4; ++k) {
      t[k] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x20);
      t[k + 4] = _mm256_permute2x128_si256(b[k], b[4 + k], 0x31);
    }
  }
}

// Vector k of the group's weights as int16 (the layout of index_in_group).
template <int F>
inline __m256i unpack(const __m256i* t, int k) {
  if constexpr (F == Q8_0) {
    const __m256i v = t[k / 2];
    return k % 2 == 0 ? _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8) : _mm256_srai_epi16(v, 8);
  } else {
    const __m256i v = t[k / 4], low4 = _mm256_set1_epi16(0x000F);
    switch (k % 4) {
      case 0: return _mm256_and_si256(v, low4);
      case 1: return _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
      case 2: return _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
      default: return _mm256_srli_epi16(v, 12);
    }
  }
}

// The scales d (and offsets m, Q4_1) of `count` blocks as floats (0 past them): a block starts with fp16 d (then
// Q4_1's fp16 m).
template <int F>
inline void group_scales(const uint8_t* blocks, __m256& d, __m256& m, int64_t count) {
  constexpr int B = static_cast<int>(BYTES<F>);
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i starts = _mm256_mullo_epi32(index, _mm256_set1_epi32(B));
  __m256i dm;
  if (count == GROUP) {
    dm = _mm256_i32gather_epi32(reinterpret_cast<const int*>(blocks), starts, 1);
  } else {
    const __m256i present = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), index);
    dm = _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), reinterpret_cast<const int*>(blocks), starts, present,
                                     1);
  }
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  dm = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(dm, split), 0xD8);  // [d0..d7 | m0..m7]
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
  m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
}

// acc + the integer dot products of 16 int16 pairs (exact).
inline __m256i dot_add(__m256i acc, __m256i w, const int16_t* x) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, w, v);
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, v);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, v));
#endif
}

// Activation rows [m0, m0 + R) of the quantized input, as pointers to their first row.
struct RowsView {
  const int16_t* q;
  const float *d, *s;
  const int32_t* sum;
  int64_t q_group, group;  // from one group to the next: values of q, of d/s/sum (rows are 256 and 8 apart)
};

// The float step of group g for activation row r: acc + dw * dx * sums (+ m * s for Q4_1), 8 blocks at once.
template <int F>
inline __m256 scale_group(__m256 acc, __m256i sums, __m256 dw, __m256 mw, const RowsView& x, int r, int64_t g) {
  const int64_t at = g * x.group + r * GROUP;
  if constexpr (F == Q4_0)  // the weights are q - 8
    sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum + at)), 3));
  acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_loadu_ps(x.d + at)), _mm256_cvtepi32_ps(sums), acc);
  if constexpr (F == Q4_1) acc = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s + at), acc);
  return acc;
}

// Block b's 32 weights as int16 in the natural order (lo: elements 0..15, hi: 16..31; 4-bit values unsigned).
template <int F>
inline void unpack_natural(const uint8_t* block, __m256i& lo, __m256i& hi) {
  if constexpr (F == Q8_0) {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + Q_OFFSET<F>));
    lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(bytes));
    hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(bytes, 1));
  } else {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + Q_OFFSET<F>));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    lo = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low4));
    hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low4));
  }
}

// Eight vectors of 8 int32 lanes -> the vector of their 8 sums (exact).
inline __m256i sum8(const __m256i* p) {
  const __m256i a = _mm256_hadd_epi32(p[0], p[1]), b = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i c = _mm256_hadd_epi32(p[4], p[5]), e = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i lo = _mm256_hadd_epi32(a, b), hi = _mm256_hadd_epi32(c, e);  // [0..3 of each | 4..7 of each]
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

// The outputs of WR weight rows (w, w + row_bytes, ...) for R activation rows: out[r * out_stride + j]. Every
// (row, output) pair has its own accumulators and sees the same operations in the same order whatever WR and R
// are: the tiles only decide what is loaded once and reused, never how a number is summed.
template <int F, int WR, int R>
void tile_avx2(const uint8_t* w, int64_t row_bytes, const RowsView& x, int64_t nb, float* out, int64_t out_stride) {
  constexpr int64_t B = BYTES<F>;
  __m256 acc[WR][R];
  UNROLL for (int j = 0; j < WR; ++j)
    UNROLL for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  const int64_t full = nb / GROUP, rest = nb % GROUP;
  for (int64_t g = 0; g < full; ++g) {
    __m256i t[WR][DWORDS<F>];
    __m256 dw[WR], mw[WR];
    UNROLL for (int j = 0; j < WR; ++j) {
      const uint8_t* blocks = w + j * row_bytes + g * GROUP * B;
      transpose<F>(blocks + Q_OFFSET<F>, t[j]);
      group_scales<F>(blocks, dw[j], mw[j], GROUP);
    }
    __m256i sums[WR][R];
    const int16_t* xq = x.q + g * x.q_group;
    UNROLL for (int j = 0; j < WR; ++j)
      UNROLL for (int r = 0; r < R; ++r) sums[j][r] = _mm256_setzero_si256();
    UNROLL for (int k = 0; k < VECTORS; ++k) {
      UNROLL for (int j = 0; j < WR; ++j) {
        const __m256i v = unpack<F>(t[j], k);
        UNROLL for (int r = 0; r < R; ++r) sums[j][r] = dot_add(sums[j][r], v, xq + r * GROUP_VALUES + k * 16);
      }
    }
    UNROLL for (int r = 0; r < R; ++r)
      UNROLL for (int j = 0; j < WR; ++j) acc[j][r] = scale_group<F>(acc[j][r], sums[j][r], dw[j], mw[j], x, r, g);
  }
  if (rest > 0) {  // the partial group, in the natural order
    const int64_t g = full;
    UNROLL for (int j = 0; j < WR; ++j) {
      const uint8_t* blocks = w + j * row_bytes + g * GROUP * B;
      __m256 dw, mw;
      group_scales<F>(blocks, dw, mw, rest);
      __m256i lo[GROUP - 1], hi[GROUP - 1];
      for (int64_t b = 0; b < rest; ++b) unpack_natural<F>(blocks + b * B, lo[b], hi[b]);
      UNROLL for (int r = 0; r < R; ++r) {
        const int16_t* xq = x.q + g * x.q_group + r * GROUP_VALUES;
        __m256i lanes[GROUP];
        UNROLL for (int b = 0; b < GROUP; ++b)
          lanes[b] = b < rest ? dot_add(dot_add(_mm256_setzero_si256(), lo[b], xq + b * QK), hi[b], xq + b * QK + 16)
                              : _mm256_setzero_si256();
        acc[j][r] = scale_group<F>(acc[j][r], sum8(lanes), dw, mw, x, r, g);
      }
    }
  }
  UNROLL for (int j = 0; j < WR; ++j)
    UNROLL for (int r = 0; r < R; ++r) out[r * out_stride + j] = hsum(acc[j][r]);
}

// Weight rows [0, rows) against activation rows [m0, m0 + R): tiles of WR weight rows, then one at a time.
template <int F, int WR, int R>
void rows_avx2(const uint8_t* weight, int64_t row_bytes, int64_t rows, const RowsView& x, int64_t nb, float* out,
               int64_t N) {
  int64_t n = 0;
  for (; n + WR <= rows; n += WR) tile_avx2<F, WR, R>(weight + n * row_bytes, row_bytes, x, nb, out + n, N);
  for (; n < rows; ++n) tile_avx2<F, 1, R>(weight + n * row_bytes, row_bytes, x, nb, out + n, N);
}

#ifndef R1_WR
#define R1_WR 4
#endif

template <int F>
void range_avx2(const uint8_t* weight, int64_t row_bytes, int64_t n_rows, const RowsView& x, int64_t nb,
                int64_t rows, float* out, int64_t N) {
#define SPECDECODE_ROWS(WR, R) rows_avx2<F, WR, R>(weight, row_bytes, n_rows, x, nb, out, N)
  switch (rows) {  // weight rows per tile: as many as keep the accumulators in registers
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

#if defined(__AVX2__)
// Weight rows [0, n_rows) of a chunk against every activation row, tile after tile of ROW_TILE rows. (Unpacking
// a chunk's weights once for all tiles was tried: no faster, the loads cost what the unpacking saved.)
template <int F>
void chunk_avx2(const uint8_t* chunk, int64_t row_bytes, int64_t n_rows, const QuantRows& x, float* out,
                int64_t N) {
  const int64_t M = x.rows, nb = x.blocks;
  for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
    const RowsView view{x.q.data_ptr<int16_t>() + m0 * GROUP_VALUES, x.d.data_ptr<float>() + m0 * GROUP,
                        x.s.data_ptr<float>() + m0 * GROUP, x.sum.data_ptr<int32_t>() + m0 * GROUP,
                        M * GROUP_VALUES, M * GROUP};
    range_avx2<F>(chunk, row_bytes, n_rows, view, nb, std::min(ROW_TILE, M - m0), out + m0 * N, N);
  }
}
#endif

void matmul_range(int64_t format, const uint8_t* weight, int64_t row_bytes, const QuantRows& x, float* out,
                  int64_t N, int64_t n_begin, int64_t n_end, bool use_simd) {
  const int16_t* xq = x.q.data_ptr<int16_t>();
  const float* xd = x.d.data_ptr<float>();
  const float* xs = x.s.data_ptr<float>();
  const int32_t* xsum = x.sum.data_ptr<int32_t>();
  const int64_t M = x.rows, nb = x.blocks, ng = x.groups, q_stride = ng * GROUP_VALUES, stride = ng * GROUP;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += WEIGHT_TILE) {
    const int64_t n1 = std::min(n_end, n0 + WEIGHT_TILE);
    const uint8_t* chunk = weight + n0 * row_bytes;
#if defined(__AVX2__)
    if (use_simd) {
      if (format == Q8_0) chunk_avx2<Q8_0>(chunk, row_bytes, n1 - n0, x, out + n0, N);
      else if (format == Q4_0) chunk_avx2<Q4_0>(chunk, row_bytes, n1 - n0, x, out + n0, N);
      else chunk_avx2<Q4_1>(chunk, row_bytes, n1 - n0, x, out + n0, N);
      continue;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
      const int64_t rows = std::min(ROW_TILE, M - m0);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = weight + n * row_bytes;
        for (int64_t r = m0; r < m0 + rows; ++r)
          out[r * N + n] = dot_scalar(format, w, xq + r * q_stride, xd + r * stride, xs + r * stride,
                                      xsum + r * stride, nb, ng);
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
#if defined(__AVX2__)
  const bool interleaved = use_simd;
#else
  const bool interleaved = false;
#endif
  const QuantRows quantized = quantize_rows(x, format, interleaved);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  const int64_t row_bytes = weight.size(1);
  at::parallel_for(0, N, WEIGHT_TILE * 4, [&](int64_t begin, int64_t end) {
    matmul_range(format, w, row_bytes, quantized, o, N, begin, end, use_simd);
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
#if defined(__AVX2__) && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
  return "avx2+vnni";  // 256-bit vectors, vpdpwssd for the integer multiply-adds
#elif defined(__AVX2__)
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
