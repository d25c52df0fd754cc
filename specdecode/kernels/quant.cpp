// Matrix products with block-quantized weights, for decoding on CPUs (the weights stay quantized in memory, used
// in place from the GGUF file's memory map).
//
// Weight formats are GGUF's, byte for byte, one matrix row after the other (FORMATS below: a row is in_features /
// values blocks). Every format is read as 32-value blocks w = dA * v (dB * v for the second 16 values of a Q6_K
// block) + m, with v small integers (block_weights: the scalar reference of each format's unpacking):
//   Q8_0  fp16 d, int8 q[32]                            v = q          Q4_0  fp16 d, nibbles q[16]    v = q - 8
//   Q4_1  fp16 d, fp16 m, nibbles q[16]                  v = q, + m     Q5_0  d, qh[4], q[16]          v = q - 16
//   Q5_1  d, m, qh[4], q[16] (5-bit: nibble + qh bit)    v = q, + m
//   Q4_K  256 values: fp16 d, dmin, 12 bytes of 6-bit scales sc_j and mins m_j, q[128]: block j = d*sc_j * q - dmin*m_j
//   Q5_K  Q4_K plus qh[32] (bit j of byte e = the fifth bit of value e of block j)
//   Q6_K  256 values: ql[128], qh[64], int8 scales[16] (one per 16 values), fp16 d: v = q - 32, scale d * sc
// In a 4-bit 32-block, byte j holds element j in its low nibble and element j + 16 in its high nibble.
//
// Activations are quantized per row and per block of 32 to int16 with a float scale (d = max|x| / 32767) and the
// block's sum (for the min terms); a block's dot product is then an exact integer one, scaled once.
// llama.cpp rounds activations to int8 instead (d = max|x| / 127, one vpmaddubsw): 256 times coarser, which on
// SmolLM2 moved logits by up to 6% of the largest and changed greedy answers against the dequantised model (its
// answer to "What is the capital of France?" is not Paris); with int16 SmolLM2's logits stay within 0.01 (of 37.6)
// of the dequantised float32 model's, for ~1/3 more arithmetic per row and the same weight bytes.
//
// The kernels take 256 values at a time (a group: 8 blocks of 32, or one K-quant super-block): the group's
// weights are turned around so that int32 lane i only ever sums products of block i (the activations are stored
// in the matching order), so 16 multiply-adds (vpdpwssd with VNNI, else vpmaddwd + vpaddd) leave the group's 8
// exact block sums in one vector (two for Q6_K: its 16-value halves have their own scales), scaled by one convert
// and one fused multiply-add with the 8 scales dw * dx, instead of a convert, a broadcast and a multiply-add per
// block. Tiles of WR weight rows x R activation rows share the unpacked weights and the loaded activations.
// Two unpackings: Q4_0/Q4_1 turn their nibbles around in place (the "nibble" order); every other format first
// expands each 32-block to 32 bytes in the natural order (`expand`, the only per-format SIMD code) and then turns
// the 8 x 32 bytes around once (the "byte" order). Adding a format is a block layout, a row of FORMATS, its
// block_weights and its expand.
//
// One activation row (a decode step, M = 1) takes another road to the same numbers: its activations are stored
// block by block as even then odd elements (EVEN_ODD), so a block's weights need only a mask and a shift to become
// two int16 vectors whatever the format, and the 8 blocks' partial sums meet in one hadd tree per group. The weights
// are prefetched 8 KB ahead into L2 (PREFETCH_BYTES): the hardware alone left one core far below its bandwidth.
//
// Speed (2-core AMD EPYC Zen 4, AVX-512 VNNI, ~26 GB/s read by one core; random blocks of the 1.5B's shapes, best
// of 5; `python benchmarks/quant_kernels.py` on a model's own matrices):
//   M = 1, 1 thread: Q4_K 65536 x 1536 (from memory) 21 GMAC/s (11.8 GB/s), 1536 x 8960 (in cache) 27 GMAC/s;
//   Q6_K 32768 x 1536 13 GMAC/s. Qwen2.5-Coder-1.5B Q4_K_M one-token forward 77-84 ms (1 thread), llama.cpp
//   ~49 ms a token (20.6 tok/s; docs/bench/speed_gguf_2026-12-04).
// The rest of the step is ours to win: per group of 256 weights a Q4_K row costs ~110 instructions (unpacking ~28,
// 16 multiply-adds, the hadd tree ~21, the 6-bit scales ~30), llama.cpp's ~70 with int8 activations (vpdpbusd: 32
// products an instruction) and its sub-block scales applied in integers. Weights turned around once at load (a
// converted file ~1.03x the GGUF: no hadd tree, no scale decoding) or int8 activations are the next steps.
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
enum Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, Q5_0 = 3, Q5_1 = 4, Q4_K = 5, Q5_K = 6, Q6_K = 7 };
constexpr int64_t NUM_FORMATS = 8;

struct BlockQ8_0 { uint16_t d; int8_t q[32]; };
struct BlockQ4_0 { uint16_t d; uint8_t q[16]; };
struct BlockQ4_1 { uint16_t d; uint16_t m; uint8_t q[16]; };
struct BlockQ5_0 { uint16_t d; uint8_t qh[4]; uint8_t q[16]; };
struct BlockQ5_1 { uint16_t d; uint16_t m; uint8_t qh[4]; uint8_t q[16]; };
struct BlockQ4_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t q[128]; };
struct BlockQ5_K { uint16_t d; uint16_t dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t q[128]; };
struct BlockQ6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; uint16_t d; };
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20, "32-blocks");
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24, "5-bit 32-blocks");
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210, "K-quant blocks");

// The table of formats: values and bytes per block, and how a block's values are read.
struct FormatInfo {
  int64_t values, bytes;
  bool nibble_order;  // activations in the Q4_0/Q4_1 kernels' order (else the byte order)
  bool has_min;       // w = d * v + m: the block's activation sum enters with m
  bool split;         // two scales per 32 values (Q6_K)
};
constexpr FormatInfo FORMATS[NUM_FORMATS] = {
    {32, 34, false, false, false},  {32, 18, true, false, false},   {32, 20, true, true, false},
    {32, 22, false, false, false},  {32, 24, false, true, false},   {256, 144, false, true, false},
    {256, 176, false, true, false}, {256, 210, false, false, true},
};

const FormatInfo& info(int64_t format) {
  TORCH_CHECK(format >= 0 && format < NUM_FORMATS, "unknown weight format ", format);
  return FORMATS[format];
}

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

inline uint16_t load16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Scale and min of block j (0..7) of a Q4_K/Q5_K super-block, from its 12 bytes of 6-bit fields.
inline void k_scale_min(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// The reference unpacking: 32-block b of a row (format `format`): its integer values v[32] and w = dA * v (dB * v
// for values 16..31 where the format splits) + m.
void block_weights(int64_t format, const uint8_t* row, int64_t b, int* v, float& dA, float& dB, float& m) {
  m = 0.f;
  switch (format) {
    case Q8_0: {
      const auto* blk = reinterpret_cast<const BlockQ8_0*>(row + b * 34);
      for (int j = 0; j < QK; ++j) v[j] = blk->q[j];
      dA = half_to_float(load16(row + b * 34));
      break;
    }
    case Q4_0:
    case Q4_1: {
      const int64_t bytes = format == Q4_0 ? 18 : 20;
      const uint8_t* blk = row + b * bytes;
      const uint8_t* q = blk + (format == Q4_0 ? 2 : 4);
      const int offset = format == Q4_0 ? 8 : 0;
      for (int j = 0; j < 16; ++j) {
        v[j] = (q[j] & 0x0F) - offset;
        v[j + 16] = (q[j] >> 4) - offset;
      }
      dA = half_to_float(load16(blk));
      if (format == Q4_1) m = half_to_float(load16(blk + 2));
      break;
    }
    case Q5_0:
    case Q5_1: {
      const int64_t bytes = format == Q5_0 ? 22 : 24;
      const uint8_t* blk = row + b * bytes;
      const int head = format == Q5_0 ? 2 : 4;
      const uint32_t qh = load32(blk + head);
      const uint8_t* q = blk + head + 4;
      const int offset = format == Q5_0 ? 16 : 0;
      for (int j = 0; j < 16; ++j) {
        v[j] = ((q[j] & 0x0F) | (((qh >> j) & 1) << 4)) - offset;
        v[j + 16] = ((q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - offset;
      }
      dA = half_to_float(load16(blk));
      if (format == Q5_1) m = half_to_float(load16(blk + 2));
      break;
    }
    case Q4_K:
    case Q5_K: {
      const int64_t bytes = format == Q4_K ? 144 : 176;
      const uint8_t* blk = row + (b / 8) * bytes;
      const int j = static_cast<int>(b % 8);
      const uint8_t* qh = blk + 16;
      const uint8_t* q = blk + (format == Q4_K ? 16 : 48) + 32 * (j / 2);
      for (int e = 0; e < QK; ++e) {
        v[e] = (q[e] >> (4 * (j % 2))) & 0x0F;
        if (format == Q5_K) v[e] |= ((qh[e] >> j) & 1) << 4;
      }
      int scale, min;
      k_scale_min(blk + 4, j, scale, min);
      dA = half_to_float(load16(blk)) * static_cast<float>(scale);
      m = -(half_to_float(load16(blk + 2)) * static_cast<float>(min));
      break;
    }
    case Q6_K: {
      const auto* blk = reinterpret_cast<const BlockQ6_K*>(row + (b / 8) * 210);
      const int j = static_cast<int>(b % 8), half = j / 4, quarter = j % 4;
      const uint8_t* ql = blk->ql + 64 * half + 32 * (quarter % 2);
      const uint8_t* qh = blk->qh + 32 * half;
      for (int e = 0; e < QK; ++e)
        v[e] = (((ql[e] >> (4 * (quarter / 2))) & 0x0F) | (((qh[e] >> (2 * quarter)) & 3) << 4)) - 32;
      const float d = half_to_float(load16(reinterpret_cast<const uint8_t*>(&blk->d)));
      dA = d * static_cast<float>(blk->scales[8 * half + 2 * quarter]);
      dB = d * static_cast<float>(blk->scales[8 * half + 2 * quarter + 1]);
      break;
    }
    default:
      TORCH_CHECK(false, "unknown weight format ", format);
  }
  if (!FORMATS[format].split) dB = dA;
}

// Blocks are taken eight at a time (a group, 256 values); see the top of the file. A row's last, partial group
// (K = 576: 2 blocks after 2 groups; only 32-block formats have one) keeps the natural order: its block sums are
// added up lane by lane and then scaled in the same way, as a group whose missing blocks are zero.
constexpr int64_t GROUP = 8;
constexpr int64_t GROUP_VALUES = GROUP * QK;
constexpr int64_t VECTORS = 16;  // int16 vectors of 16 values per group

// Where the kernels' layouts put the values of a group: vector k, lane l holds element index_in_group(k, l)
// (block * 32 + element). The turned-around orders (several activation rows a pass) follow from how the weights
// are turned around below: a vector of 8 dwords, dword i = bytes 4t..4t+3 of block i (its q bytes, or its expanded
// bytes), read as 16-bit lanes (lane 2i + c = bytes 4t + 2c and 4t + 2c + 1; 2 lanes per block, block l / 2).
//   NIBBLES_TURNED: vector 4t + s: s = 0 low nibble of the lane's first byte (element 4t + 2c), 1 its high nibble
//          (+16), 2 the second byte's low nibble (+1), 3 its high nibble (+17);
//   BYTES_TURNED: vector 2t + s: s = 0 the first byte (element 4t + 2c), 1 the second (4t + 2c + 1).
// One activation row (a decode step) takes its weights a block at a time, as two vectors of 16-bit lanes: the
// block's even elements, then its odd ones (EVEN_ODD: vector 2b + s, lane l = element 2l + s of block b), which
// is what reading 32 bytes (or 16 nibble pairs) as 16-bit lanes gives with a mask and a shift.
enum Order : int { BYTES_TURNED = 0, NIBBLES_TURNED = 1, EVEN_ODD = 2 };

inline int index_in_group(Order order, int k, int lane) {
  if (order == EVEN_ODD) return (k / 2) * QK + 2 * lane + k % 2;
  const int block = lane / 2, c = lane % 2;
  int element;
  if (order == BYTES_TURNED) {
    element = 4 * (k / 2) + 2 * c + k % 2;
  } else {
    static constexpr int shift[4] = {0, 16, 1, 17};
    element = 4 * (k / 4) + 2 * c + shift[k % 4];
  }
  return block * QK + element;
}

// Rows of activations, quantized per block of 32: q [M, groups * 256] int16, d [M, groups * 8] scales,
// s = d * (sum of the block's q), sum [M, groups * 8] int32 (the same sum); padding blocks are zero throughout.
// For the kernels (`interleaved`), whole groups hold their values in the kernels' order and all four are stored
// group-major, [groups, M, ...]: a tile of rows then reads one group of all its rows at fixed offsets from one
// pointer.
struct QuantRows {
  torch::Tensor q, d, s, sum, sum_hi;  // sum_hi: the sum of the block's last 16 values (Q6_K's second half)
  int64_t rows, blocks, groups;
};

QuantRows quantize_rows(const torch::Tensor& x, Order order, bool interleaved) {
  constexpr float LEVELS = 32767.f;
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), nb = K / QK, ng = (nb + GROUP - 1) / GROUP;
  QuantRows out{torch::empty({M, ng * GROUP_VALUES}, torch::kInt16), torch::empty({M, ng * GROUP}, torch::kFloat32),
                torch::empty({M, ng * GROUP}, torch::kFloat32), torch::empty({M, ng * GROUP}, torch::kInt32),
                torch::empty({M, ng * GROUP}, torch::kInt32), M, nb, ng};
  int position[GROUP_VALUES];  // position in the stored group -> element of the natural group
  for (int k = 0; k < VECTORS; ++k)
    for (int lane = 0; lane < 16; ++lane) position[k * 16 + lane] = index_in_group(order, k, lane);
  const float* src = xf.data_ptr<float>();
  int16_t* q = out.q.data_ptr<int16_t>();
  float* d = out.d.data_ptr<float>();
  float* s = out.s.data_ptr<float>();
  int32_t* sums = out.sum.data_ptr<int32_t>();
  int32_t* sums_hi = out.sum_hi.data_ptr<int32_t>();
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
          sums[at] = sums_hi[at] = 0;
          continue;
        }
        const float* v = src + m * K + b * QK;
        float amax = 0.f;
        for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
        const float scale = amax / LEVELS;
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        int sum = 0, sum_hi = 0;
        for (int j = 0; j < QK; ++j) {
          const int value = static_cast<int>(std::nearbyint(v[j] * inv));
          values[j] = static_cast<int16_t>(value);
          sum += value;
          if (j >= QK / 2) sum_hi += value;
        }
        d[at] = scale;
        s[at] = scale * static_cast<float>(sum);
        sums[at] = sum;
        sums_hi[at] = sum_hi;
      }
      int16_t* dst = q + (interleaved ? g * M + m : i) * GROUP_VALUES;
      if (interleaved && (order == EVEN_ODD || (g + 1) * GROUP <= nb)) {  // (turned orders: whole groups only)
        for (int p = 0; p < GROUP_VALUES; ++p) dst[p] = natural[position[p]];
      } else {
        std::memcpy(dst, natural, sizeof(natural));
      }
    }
  });
  return out;
}

// The float steps, shared by every path: block b of a row adds dA * dx * (its integer sum) (split formats: the
// sums of its two halves, dA then dB), then m * s, to lane b % 8 of 8 float accumulators, groups in order, and the
// lanes are summed as `sum_lanes` does. With the integer sums exact, this fixes every rounding of a (row, output)
// whatever path, tile or thread computes it.
inline float sum_lanes(const float* lane) {  // the order of hsum() below
  const float a0 = lane[0] + lane[4], a1 = lane[1] + lane[5], a2 = lane[2] + lane[6], a3 = lane[3] + lane[7];
  return (a0 + a2) + (a1 + a3);
}

// ---- the reference: one (row, output) dot product in plain C++ (also the kernel where AVX2 is absent) ----

float dot_scalar(int64_t format, const uint8_t* w, const int16_t* xq, const float* xd, const float* xs,
                 int64_t nb, int64_t ng) {
  const FormatInfo& f = FORMATS[format];
  float lane[GROUP] = {};
  int v[QK];
  for (int64_t b = 0; b < ng * GROUP; ++b) {
    const int16_t* x = xq + b * QK;
    int sum = 0, sum_b = 0;
    float dA = 0.f, dB = 0.f, mw = 0.f;
    if (b < nb) {
      block_weights(format, w, b, v, dA, dB, mw);
      if (f.split) {
        for (int j = 0; j < 16; ++j) sum += v[j] * x[j];
        for (int j = 16; j < QK; ++j) sum_b += v[j] * x[j];
      } else {
        for (int j = 0; j < QK; ++j) sum += v[j] * x[j];
      }
    }
    float& acc = lane[b % GROUP];
    acc = std::fma(dA * xd[b], static_cast<float>(sum), acc);
    if (f.split) acc = std::fma(dB * xd[b], static_cast<float>(sum_b), acc);
    if (f.has_min) acc = std::fma(mw, xs[b], acc);
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

// How far ahead of a weight row the kernels ask for its bytes, into L2: a step streams every weight once from
// memory, and the hardware's own prefetching alone left one core at ~5-7 GB/s of its ~26. Measured on Zen 4, one
// thread, M = 1, matrices of 57, 41 and 41 MB (Q4_K, Q6_K, Q4_K): none 5.5 / 4.7 / 6.8 GB/s; into L1 1-8 KB ahead
// 8.1-8.7 / 7.0-8.2 / 8.3-10.3; into L2 2 KB 7.3 / 8.7 / 7.9, 4 KB 12.3 / 13.4 / 8.1, 8 KB 14.0 / 14.1 / 14.0,
// 16 KB 13.1 / 14.5 / 14.4 (the rows follow one another, so this reaches into the next rows).
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
#define PREFETCH(p) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1)

template <int F> constexpr FormatInfo TRAITS = FORMATS[F];
template <int F> constexpr int64_t GROUP_BYTES = TRAITS<F>.bytes * (GROUP_VALUES / TRAITS<F>.values);

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline __m256i load2(const uint8_t* lo, const uint8_t* hi) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo))),
                                 _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi)), 1);
}

// ---- nibble order (Q4_0, Q4_1): the q bytes of a group of 8 blocks turned around in place ----

// t[k] dword i = dword k of block i's q.
template <int F>
inline void transpose_nibbles(const uint8_t* q, __m256i* t) {
  constexpr int64_t B = TRAITS<F>.bytes;
  __m256i y[4];  // [block k | block k + 4]
  UNROLL for (int k = 0; k < 4; ++k) y[k] = load2(q + k * B, q + (k + 4) * B);
  const __m256i a = _mm256_unpacklo_epi32(y[0], y[1]), b = _mm256_unpackhi_epi32(y[0], y[1]);
  const __m256i c = _mm256_unpacklo_epi32(y[2], y[3]), e = _mm256_unpackhi_epi32(y[2], y[3]);
  t[0] = _mm256_unpacklo_epi64(a, c);
  t[1] = _mm256_unpackhi_epi64(a, c);
  t[2] = _mm256_unpacklo_epi64(b, e);
  t[3] = _mm256_unpackhi_epi64(b, e);
}

// Vector k of the group's weights as int16 (the nibble order of index_in_group).
inline __m256i unpack_nibbles(const __m256i* t, int k) {
  const __m256i v = t[k / 4], low4 = _mm256_set1_epi16(0x000F);
  switch (k % 4) {
    case 0: return _mm256_and_si256(v, low4);
    case 1: return _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    case 2: return _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
    default: return _mm256_srli_epi16(v, 12);
  }
}

// ---- byte order (every other format): 32-blocks expanded to bytes, then the 8 x 32 bytes turned around ----

// The values of blocks 0..count-1 of a group as bytes in the natural order (y[i] byte e = value e of block i; the
// format's offsets applied, so that they are signed for Q8_0, Q5_0 and Q6_K).
template <int F>
inline void expand(const uint8_t* group, __m256i* y, int64_t count) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (F == Q8_0) {
    for (int64_t i = 0; i < count; ++i) y[i] = load256(group + i * 34 + 2);
  } else if constexpr (F == Q5_0 || F == Q5_1) {
    constexpr int64_t B = TRAITS<F>.bytes, HEAD = F == Q5_0 ? 2 : 4;
    // byte e takes bit e of the 32 high bits: broadcast byte e / 8 of them to byte e, test bit e % 8
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
    for (int64_t i = 0; i < count; ++i) {
      const uint8_t* blk = group + i * B;
      const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + HEAD + 4));
      const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
      const __m256i high = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(load32(blk + HEAD))), spread);
      const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(high, bit), bit),
                                             _mm256_set1_epi8(0x10));
      y[i] = _mm256_or_si256(_mm256_and_si256(both, low4), fifth);
      if constexpr (F == Q5_0) y[i] = _mm256_sub_epi8(y[i], _mm256_set1_epi8(16));
    }
  } else if constexpr (F == Q4_K || F == Q5_K) {
    const uint8_t* q = group + (F == Q4_K ? 16 : 48);
    __m256i high;
    if constexpr (F == Q5_K) high = load256(group + 16);
    UNROLL for (int c = 0; c < 4; ++c) {  // 32 bytes: block 2c in the low nibbles, block 2c + 1 in the high ones
      const __m256i packed = load256(q + 32 * c);
      y[2 * c] = _mm256_and_si256(packed, low4);
      y[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      if constexpr (F == Q5_K) {  // bit j of each qh byte -> bit 4 of block j's byte
        const __m256i fifth = _mm256_set1_epi8(0x10);
        UNROLL for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
          const __m256i moved = j <= 4 ? _mm256_slli_epi16(high, 4 - j) : _mm256_srli_epi16(high, j - 4);
          y[j] = _mm256_or_si256(y[j], _mm256_and_si256(moved, fifth));
        }
      }
    }
  } else {  // Q6_K: per half of 128 values, ql[64] and qh[32] hold 4 blocks (see block_weights)
    const __m256i two = _mm256_set1_epi8(0x30), offset = _mm256_set1_epi8(32);
    UNROLL for (int h = 0; h < 2; ++h) {
      const __m256i l0 = load256(group + 64 * h), l1 = load256(group + 64 * h + 32);
      const __m256i qh = load256(group + 128 + 32 * h);
      const __m256i v0 = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), two));
      const __m256i v1 = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), two));
      const __m256i v2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(qh, two));
      const __m256i v3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                         _mm256_and_si256(_mm256_srli_epi16(qh, 2), two));
      y[4 * h + 0] = _mm256_sub_epi8(v0, offset);
      y[4 * h + 1] = _mm256_sub_epi8(v1, offset);
      y[4 * h + 2] = _mm256_sub_epi8(v2, offset);
      y[4 * h + 3] = _mm256_sub_epi8(v3, offset);
    }
  }
}

// Eight vectors turned around: t[k] dword i = dword k of y[i].
inline void transpose8(const __m256i* y, __m256i* t) {
  __m256i a[8], b[8];
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

// Vector k of the group's weights as int16 (the byte order of index_in_group), from the turned-around bytes.
inline __m256i unpack_bytes(const __m256i* t, int k) {
  const __m256i v = t[k / 2];
  return k % 2 == 0 ? _mm256_srai_epi16(_mm256_slli_epi16(v, 8), 8) : _mm256_srai_epi16(v, 8);
}

// ---- scales ----

// The scales d (and offsets m, Q4_1/Q5_1) of `count` 32-blocks as floats (0 past them): a block starts with fp16
// d (then fp16 m).
template <int F>
inline void gather_scales(const uint8_t* blocks, __m256& d, __m256& m, int64_t count) {
  constexpr int B = static_cast<int>(TRAITS<F>.bytes);
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

// A group's per-block scales as the reference computes them (dA, dB and m of block_weights), 8 lanes each.
template <int F>
inline void group_scales(const uint8_t* group, __m256& dA, __m256& dB, __m256& m, int64_t count) {
  if constexpr (F == Q4_K || F == Q5_K) {  // the 12 bytes of 6-bit fields -> 8 scale bytes, then 8 min bytes
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));  // d, dmin, s[0..11]
    // bytes: scale j < 4: s[j] & 63; j >= 4: s[j + 4] & 15 | (s[j - 4] >> 6) << 4; min j < 4: s[j + 4] & 63;
    // j >= 4: s[j + 4] >> 4 | (s[j] >> 6) << 4  (s[k] is byte 4 + k)
    const __m128i a = _mm_shuffle_epi8(v, _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m128i b = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11));
    const __m128i low = _mm_and_si128(a, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 0, 0, 0, 0));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                         15, 15, 15, 15));
    const __m128i top = _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30));
    const __m128i fields = _mm_or_si128(_mm_or_si128(low, high), top);  // [scales 0..7 | mins 0..7]
    const __m256 scale = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(fields));
    const __m256 min = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(fields, 8)));
    const __m128 dd = _mm_cvtph_ps(v);  // [d, dmin, ...]
    dA = _mm256_mul_ps(_mm256_broadcastss_ps(dd), scale);
    m = _mm256_xor_ps(_mm256_mul_ps(_mm256_broadcastss_ps(_mm_movehdup_ps(dd)), min), _mm256_set1_ps(-0.f));
    dB = dA;
  } else if constexpr (F == Q6_K) {
    const __m256 d = _mm256_set1_ps(half_to_float(load16(group + 208)));
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 192)));
    const __m256i even = _mm256_srai_epi32(_mm256_slli_epi32(sc, 16), 16), odd = _mm256_srai_epi32(sc, 16);
    dA = _mm256_mul_ps(d, _mm256_cvtepi32_ps(even));  // scales 2j: the first 16 values of block j
    dB = _mm256_mul_ps(d, _mm256_cvtepi32_ps(odd));
    m = _mm256_setzero_ps();
  } else {
    gather_scales<F>(group, dA, m, count);
    dB = dA;
  }
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
  const int32_t *sum, *sum_hi;
  int64_t q_group, group;  // from one group to the next: values of q, of d/s/sum (rows are 256 and 8 apart)
};

// The float step of group g for activation row r, 8 blocks at once: acc + dA * dx * sums (+ dB * dx * sums_b for
// split formats) (+ m * s).
template <int F>
inline __m256 scale_group(__m256 acc, __m256i sums, __m256i sums_b, __m256 dA, __m256 dB, __m256 mw,
                          const RowsView& x, int r, int64_t g) {
  const int64_t at = g * x.group + r * GROUP;
  if constexpr (F == Q4_0)  // the weights are q - 8
    sums = _mm256_sub_epi32(sums, _mm256_slli_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum + at)), 3));
  const __m256 dx = _mm256_loadu_ps(x.d + at);
  acc = _mm256_fmadd_ps(_mm256_mul_ps(dA, dx), _mm256_cvtepi32_ps(sums), acc);
  if constexpr (TRAITS<F>.split) acc = _mm256_fmadd_ps(_mm256_mul_ps(dB, dx), _mm256_cvtepi32_ps(sums_b), acc);
  if constexpr (TRAITS<F>.has_min) acc = _mm256_fmadd_ps(mw, _mm256_loadu_ps(x.s + at), acc);
  return acc;
}

// Eight vectors of 8 int32 lanes -> the vector of their 8 sums (exact).
inline __m256i sum8(const __m256i* p) {
  const __m256i a = _mm256_hadd_epi32(p[0], p[1]), b = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i c = _mm256_hadd_epi32(p[4], p[5]), e = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i lo = _mm256_hadd_epi32(a, b), hi = _mm256_hadd_epi32(c, e);  // [0..3 of each | 4..7 of each]
  return _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
}

// Block b's 32 values as int16 in the natural order (lo: elements 0..15, hi: 16..31; Q4_0's without its offset,
// which scale_group applies).
template <int F>
inline void unpack_natural(const uint8_t* group, int64_t b, __m256i& lo, __m256i& hi) {
  if constexpr (TRAITS<F>.nibble_order) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + b * TRAITS<F>.bytes +
                                                                            (F == Q4_1 ? 4 : 2)));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    lo = _mm256_cvtepu8_epi16(_mm_and_si128(packed, low4));
    hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low4));
  } else {
    static_assert(TRAITS<F>.values == QK || F == Q4_K || F == Q5_K || F == Q6_K, "");
    __m256i y[GROUP];
    expand<F>(group + b * TRAITS<F>.bytes, y, 1);  // (only 32-block formats have partial groups)
    lo = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(y[0]));
    hi = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(y[0], 1));
  }
}

// The outputs of WR weight rows (w, w + row_bytes, ...) for R activation rows: out[r * out_stride + j]. Every
// (row, output) pair has its own accumulators and sees the same operations in the same order whatever WR and R
// are: the tiles only decide what is loaded once and reused, never how a number is summed.
template <int F, int WR, int R>
void tile_avx2(const uint8_t* w, int64_t row_bytes, const RowsView& x, int64_t nb, float* out, int64_t out_stride) {
  constexpr bool NIBBLES = TRAITS<F>.nibble_order, SPLIT = TRAITS<F>.split;
  constexpr int TURNED = NIBBLES ? 4 : 8;  // vectors of turned-around bytes per group
  __m256 acc[WR][R];
  UNROLL for (int j = 0; j < WR; ++j)
    UNROLL for (int r = 0; r < R; ++r) acc[j][r] = _mm256_setzero_ps();
  const int64_t full = nb / GROUP, rest = nb % GROUP;
  // Few activation rows: a second chain of integer sums (odd vectors), so that a row's 16 multiply-adds are not one
  // dependent chain (the sums are exact, so how they are split changes no number).
  constexpr bool CHAINS = !SPLIT && R <= 2;
  for (int64_t g = 0; g < full; ++g) {
    __m256i t[WR][TURNED];
    __m256 dA[WR], dB[WR], mw[WR];
    UNROLL for (int j = 0; j < WR; ++j) {
      const uint8_t* group = w + j * row_bytes + g * GROUP_BYTES<F>;
      for (int64_t line = 0; line < GROUP_BYTES<F>; line += 64)  // (as in gemv_avx2)
        PREFETCH(group + PREFETCH_BYTES + line);
      if constexpr (NIBBLES) {
        transpose_nibbles<F>(group + (F == Q4_1 ? 4 : 2), t[j]);
      } else {
        __m256i y[GROUP];
        expand<F>(group, y, GROUP);
        transpose8(y, t[j]);
      }
      group_scales<F>(group, dA[j], dB[j], mw[j], GROUP);
    }
    __m256i sums[WR][R], sums_b[WR][R];
    const int16_t* xq = x.q + g * x.q_group;
    UNROLL for (int j = 0; j < WR; ++j)
      UNROLL for (int r = 0; r < R; ++r) {
        sums[j][r] = _mm256_setzero_si256();
        if constexpr (SPLIT || CHAINS) sums_b[j][r] = _mm256_setzero_si256();
      }
    UNROLL for (int k = 0; k < VECTORS; ++k) {
      UNROLL for (int j = 0; j < WR; ++j) {
        const __m256i v = NIBBLES ? unpack_nibbles(t[j], k) : unpack_bytes(t[j], k);
        UNROLL for (int r = 0; r < R; ++r) {
          if ((SPLIT && k >= VECTORS / 2) || (CHAINS && k % 2 == 1))  // (split: vectors 8..15 hold values 16..31)
            sums_b[j][r] = dot_add(sums_b[j][r], v, xq + r * GROUP_VALUES + k * 16);
          else
            sums[j][r] = dot_add(sums[j][r], v, xq + r * GROUP_VALUES + k * 16);
        }
      }
    }
    UNROLL for (int r = 0; r < R; ++r)
      UNROLL for (int j = 0; j < WR; ++j) {
        if constexpr (CHAINS) sums[j][r] = _mm256_add_epi32(sums[j][r], sums_b[j][r]);
        acc[j][r] = scale_group<F>(acc[j][r], sums[j][r], SPLIT ? sums_b[j][r] : sums[j][r], dA[j], dB[j], mw[j], x,
                                   r, g);
      }
  }
  if (rest > 0) {  // the partial group, in the natural order
    const int64_t g = full;
    UNROLL for (int j = 0; j < WR; ++j) {
      const uint8_t* group = w + j * row_bytes + g * GROUP_BYTES<F>;
      __m256 dA, dB, mw;
      group_scales<F>(group, dA, dB, mw, rest);
      __m256i lo[GROUP - 1], hi[GROUP - 1];
      for (int64_t b = 0; b < rest; ++b) unpack_natural<F>(group, b, lo[b], hi[b]);
      UNROLL for (int r = 0; r < R; ++r) {
        const int16_t* xq = x.q + g * x.q_group + r * GROUP_VALUES;
        __m256i lanes[GROUP];
        UNROLL for (int b = 0; b < GROUP; ++b)
          lanes[b] = b < rest ? dot_add(dot_add(_mm256_setzero_si256(), lo[b], xq + b * QK), hi[b], xq + b * QK + 16)
                              : _mm256_setzero_si256();
        acc[j][r] = scale_group<F>(acc[j][r], sum8(lanes), _mm256_setzero_si256(), dA, dB, mw, x, r, g);
      }
    }
  }
  UNROLL for (int j = 0; j < WR; ++j)
    UNROLL for (int r = 0; r < R; ++r) out[r * out_stride + j] = hsum(acc[j][r]);
}

// ---- one activation row (EVEN_ODD order): a block at a time, no turning around ----

// Block b of a group as int16: E its even elements, O its odd ones (lane l: element 2l, 2l + 1); Q4_0's without
// its offset (scale_group applies it).
template <int F>
inline void unpack_even_odd(const uint8_t* group, int b, __m256i& E, __m256i& O) {
  const __m256i low4 = _mm256_set1_epi16(0x000F);
  if constexpr (F == Q4_0 || F == Q4_1) {  // byte j: element j (low nibble), j + 16 (high)
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + b * TRAITS<F>.bytes +
                                                                            (F == Q4_1 ? 4 : 2)));
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
    E = _mm256_and_si256(v, low4);
    O = _mm256_and_si256(_mm256_srli_epi16(v, 8), low4);
  } else if constexpr (F == Q4_K || F == Q5_K) {  // 32 bytes: block 2c in the low nibbles, 2c + 1 in the high
    const __m256i v = load256(group + (F == Q4_K ? 16 : 48) + 32 * (b / 2));
    const __m256i nibbles = b % 2 == 0 ? v : _mm256_srli_epi16(v, 4);
    E = _mm256_and_si256(nibbles, low4);
    O = _mm256_and_si256(_mm256_srli_epi16(nibbles, 8), low4);
    if constexpr (F == Q5_K) {  // bit b of each qh byte: of the lane's low byte for E, its high byte for O
      const __m256i high = load256(group + 16), fifth = _mm256_set1_epi16(0x0010);
      const __m256i even = b <= 4 ? _mm256_slli_epi16(high, 4 - b) : _mm256_srli_epi16(high, b - 4);
      E = _mm256_or_si256(E, _mm256_and_si256(even, fifth));
      O = _mm256_or_si256(O, _mm256_and_si256(_mm256_srli_epi16(high, 4 + b), fifth));
    }
  } else if constexpr (F == Q6_K) {
    const int half = b / 4, quarter = b % 4;
    const __m256i l = load256(group + 64 * half + 32 * (quarter % 2));
    const __m256i qh = load256(group + 128 + 32 * half);
    const __m256i two = _mm256_set1_epi16(0x0030);
    const int shift = 4 * (quarter / 2), bits = 2 * quarter;  // the nibble, and the 2 high bits in qh
    const __m256i even = bits <= 4 ? _mm256_slli_epi16(qh, 4 - bits) : _mm256_srli_epi16(qh, bits - 4);
    E = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, shift), low4), _mm256_and_si256(even, two));
    O = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 8 + shift), low4),
                        _mm256_and_si256(_mm256_srli_epi16(qh, 4 + bits), two));  // q, 0..63: the -32 is in
    // gemv_avx2 (32 x the activations' half sums, subtracted from the integer sums: exact, so the same numbers)
  } else {  // Q8_0, Q5_0, Q5_1: the block's 32 values as (signed) bytes
    __m256i y[GROUP];
    expand<F>(group + b * TRAITS<F>.bytes, y, 1);
    E = _mm256_srai_epi16(_mm256_slli_epi16(y[0], 8), 8);
    O = _mm256_srai_epi16(y[0], 8);
  }
}

// Eight blocks' int32 partial sums p[b] (dwords 0-3: the block's first 16 values, 4-7: its last 16) -> A = the
// sums of the first halves, B = of the second halves, block b in lane b (exact).
inline void halves8(const __m256i* p, __m256i& A, __m256i& B) {
  const __m256i h01 = _mm256_hadd_epi32(p[0], p[1]), h23 = _mm256_hadd_epi32(p[2], p[3]);
  const __m256i h45 = _mm256_hadd_epi32(p[4], p[5]), h67 = _mm256_hadd_epi32(p[6], p[7]);
  const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);  // [A0..A3 | B0..B3], 4..7
  A = _mm256_permute2x128_si256(lo, hi, 0x20);
  B = _mm256_permute2x128_si256(lo, hi, 0x31);
}

// WR weight rows against the one activation row: out[j].
template <int F, int WR>
void gemv_avx2(const uint8_t* w, int64_t row_bytes, const RowsView& x, int64_t nb, float* out) {
  __m256 acc[WR];
  UNROLL for (int j = 0; j < WR; ++j) acc[j] = _mm256_setzero_ps();
  const int64_t groups = (nb + GROUP - 1) / GROUP;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t count = std::min<int64_t>(GROUP, nb - g * GROUP);  // (< 8: a 32-block format's last group)
    const int16_t* xq = x.q + g * x.q_group;
    UNROLL for (int j = 0; j < WR; ++j) {
      const uint8_t* group = w + j * row_bytes + g * GROUP_BYTES<F>;
      // one step streams every weight once: ask for what comes next early (the rows follow one another)
      for (int64_t line = 0; line < GROUP_BYTES<F>; line += 64)
        PREFETCH(group + PREFETCH_BYTES + line);
      __m256i p[GROUP];
      UNROLL for (int b = 0; b < GROUP; ++b) {
        if (b < count) {
          __m256i E, O;
          unpack_even_odd<F>(group, b, E, O);
          p[b] = dot_add(dot_add(_mm256_setzero_si256(), E, xq + b * QK), O, xq + b * QK + 16);
        } else {
          p[b] = _mm256_setzero_si256();
        }
      }
      __m256i A, B;
      halves8(p, A, B);
      if constexpr (F == Q6_K) {  // v = q - 32: the halves' sums less 32 x the activations' half sums
        const __m256i all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum + g * x.group));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum_hi + g * x.group));
        A = _mm256_sub_epi32(A, _mm256_slli_epi32(_mm256_sub_epi32(all, hi), 5));
        B = _mm256_sub_epi32(B, _mm256_slli_epi32(hi, 5));
      }
      __m256 dA, dB, mw;
      group_scales<F>(group, dA, dB, mw, count);
      acc[j] = scale_group<F>(acc[j], TRAITS<F>.split ? A : _mm256_add_epi32(A, B), B, dA, dB, mw, x, 0, g);
    }
  }
  UNROLL for (int j = 0; j < WR; ++j) out[j] = hsum(acc[j]);
}

template <int F>
void gemv_rows_avx2(const uint8_t* weight, int64_t row_bytes, int64_t rows, const RowsView& x, int64_t nb,
                    float* out) {
  constexpr int WR = 2;
  int64_t n = 0;
  for (; n + WR <= rows; n += WR) gemv_avx2<F, WR>(weight + n * row_bytes, row_bytes, x, nb, out + n);
  for (; n < rows; ++n) gemv_avx2<F, 1>(weight + n * row_bytes, row_bytes, x, nb, out + n);
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
  constexpr int WIDE = TRAITS<F>.nibble_order ? R1_WR : 2;  // (the byte order holds 8 turned vectors a row)
#define SPECDECODE_ROWS(WR, R) rows_avx2<F, WR, R>(weight, row_bytes, n_rows, x, nb, out, N)
  switch (rows) {  // weight rows per tile: as many as keep the accumulators in registers
    case 8: SPECDECODE_ROWS(1, 8); break;
    case 7: SPECDECODE_ROWS(1, 7); break;
    case 6: SPECDECODE_ROWS(1, 6); break;
    case 5: SPECDECODE_ROWS(1, 5); break;
    case 4: SPECDECODE_ROWS(2, 4); break;
    case 3: SPECDECODE_ROWS(2, 3); break;
    case 2: SPECDECODE_ROWS(2, 2); break;
    default: SPECDECODE_ROWS(WIDE, 1); break;
  }
#undef SPECDECODE_ROWS
}

#endif  // __AVX2__

constexpr int64_t ROW_TILE = 8;     // activation rows per pass over a weight row (their accumulators in registers)
constexpr int64_t WEIGHT_TILE = 16;  // weight rows kept hot while every tile of activation rows passes over them

#if defined(__AVX2__)
// Weight rows [0, n_rows) of a chunk against every activation row, tile after tile of ROW_TILE rows.
template <int F>
void chunk_avx2(const uint8_t* chunk, int64_t row_bytes, int64_t n_rows, const QuantRows& x, float* out,
                int64_t N) {
  const int64_t M = x.rows, nb = x.blocks;
  if (M == 1) {  // a decode step: the activations are in the EVEN_ODD order (qmatmul_parts)
    const RowsView view{x.q.data_ptr<int16_t>(), x.d.data_ptr<float>(), x.s.data_ptr<float>(),
                        x.sum.data_ptr<int32_t>(), x.sum_hi.data_ptr<int32_t>(), GROUP_VALUES, GROUP};
    gemv_rows_avx2<F>(chunk, row_bytes, n_rows, view, nb, out);
    return;
  }
  // Tiles of equal size (9 rows: 5 + 4, not 8 + 1, which would unpack every weight twice for one row's sake).
  const int64_t tiles = (M + ROW_TILE - 1) / ROW_TILE, tile = (M + tiles - 1) / tiles;
  for (int64_t m0 = 0; m0 < M; m0 += tile) {
    const RowsView view{x.q.data_ptr<int16_t>() + m0 * GROUP_VALUES, x.d.data_ptr<float>() + m0 * GROUP,
                        x.s.data_ptr<float>() + m0 * GROUP, x.sum.data_ptr<int32_t>() + m0 * GROUP,
                        x.sum_hi.data_ptr<int32_t>() + m0 * GROUP, M * GROUP_VALUES, M * GROUP};
    range_avx2<F>(chunk, row_bytes, n_rows, view, nb, std::min(tile, M - m0), out + m0 * N, N);
  }
}

using ChunkKernel = void (*)(const uint8_t*, int64_t, int64_t, const QuantRows&, float*, int64_t);
constexpr ChunkKernel CHUNK_KERNELS[NUM_FORMATS] = {chunk_avx2<Q8_0>, chunk_avx2<Q4_0>, chunk_avx2<Q4_1>,
                                                    chunk_avx2<Q5_0>, chunk_avx2<Q5_1>, chunk_avx2<Q4_K>,
                                                    chunk_avx2<Q5_K>, chunk_avx2<Q6_K>};
#endif

// Outputs [n_begin, n_end) of one weight matrix into columns [col + n_begin, ...) of out (row stride N).
void matmul_range(int64_t format, const uint8_t* weight, int64_t row_bytes, const QuantRows& x, float* out,
                  int64_t N, int64_t n_begin, int64_t n_end, bool use_simd) {
  const int16_t* xq = x.q.data_ptr<int16_t>();
  const float* xd = x.d.data_ptr<float>();
  const float* xs = x.s.data_ptr<float>();
  const int64_t M = x.rows, nb = x.blocks, ng = x.groups, q_stride = ng * GROUP_VALUES, stride = ng * GROUP;
  for (int64_t n0 = n_begin; n0 < n_end; n0 += WEIGHT_TILE) {
    const int64_t n1 = std::min(n_end, n0 + WEIGHT_TILE);
    const uint8_t* chunk = weight + n0 * row_bytes;
#if defined(__AVX2__)
    if (use_simd) {
      CHUNK_KERNELS[format](chunk, row_bytes, n1 - n0, x, out + n0, N);
      continue;
    }
#endif
    for (int64_t m0 = 0; m0 < M; m0 += ROW_TILE) {
      const int64_t rows = std::min(ROW_TILE, M - m0);
      for (int64_t n = n0; n < n1; ++n) {
        const uint8_t* w = weight + n * row_bytes;
        for (int64_t r = m0; r < m0 + rows; ++r)
          out[r * N + n] = dot_scalar(format, w, xq + r * q_stride, xd + r * stride, xs + r * stride, nb, ng);
      }
    }
  }
}

int64_t row_bytes_of(int64_t format, int64_t in_features) {
  const FormatInfo& f = info(format);
  TORCH_CHECK(in_features % f.values == 0, "in_features must be a multiple of ", f.values, " for format ", format,
              ", got ", in_features);
  return in_features / f.values * f.bytes;
}

void check_weight(const torch::Tensor& weight, int64_t format, int64_t in_features) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dtype() == torch::kUInt8 && weight.dim() == 2 &&
              weight.stride(1) == 1 && weight.stride(0) == weight.size(1),
              "quantized weight must be a contiguous 2-d uint8 CPU tensor");
  const int64_t bytes = row_bytes_of(format, in_features);
  TORCH_CHECK(weight.size(1) == bytes, "quantized weight rows hold ", weight.size(1), " bytes; format ", format,
              " with ", in_features, " inputs needs ", bytes);
}

}  // namespace

// x [M, K] (any float dtype) @ [dequantized(weights[0]); dequantized(weights[1]); ...].T -> [M, sum N_i] float32:
// the parts of a stacked matrix (q, k and v, say) may differ in format, and each is read where it lies.
torch::Tensor qmatmul_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                            const std::vector<int64_t>& formats, bool use_simd) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-d CPU tensor");
  TORCH_CHECK(!weights.empty() && weights.size() == formats.size(), "one format per weight part");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t N = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    check_weight(weights[i], formats[i], K);
    N += weights[i].size(0);
  }
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
#if defined(__AVX2__)
  const bool interleaved = use_simd;
#else
  const bool interleaved = false;
#endif
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32, got ", K);
  c10::optional<QuantRows> by_order[3];  // the activations quantized once per order the parts need
  float* o = out.data_ptr<float>();
  int64_t column = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int64_t format = formats[i], rows = weights[i].size(0), row_bytes = weights[i].size(1);
    const Order order = M == 1 ? EVEN_ODD : FORMATS[format].nibble_order ? NIBBLES_TURNED : BYTES_TURNED;
    auto& quantized = by_order[order];
    if (!quantized.has_value()) quantized = quantize_rows(x, order, interleaved);
    const uint8_t* w = weights[i].data_ptr<uint8_t>();
    float* part_out = o + column;
    const QuantRows& xq = *quantized;
    at::parallel_for(0, rows, WEIGHT_TILE * 4, [&](int64_t begin, int64_t end) {
      matmul_range(format, w, row_bytes, xq, part_out, N, begin, end, use_simd);
    });
    column += rows;
  }
  return out;
}

// x [M, K] (any float dtype) @ dequantized(weight [N, K]).T -> [M, N] float32.
torch::Tensor qmatmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t format, bool use_simd) {
  return qmatmul_parts(x, {weight}, {format}, use_simd);
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
    int v[QK];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* row = w + ids[t] * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        float dA, dB, m;
        block_weights(format, row, b, v, dA, dB, m);
        float* dst = o + t * in_features + b * QK;
        for (int j = 0; j < QK; ++j) dst[j] = (j < 16 ? dA : dB) * static_cast<float>(v[j]) + m;
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
  m.def("qmatmul_parts", &qmatmul_parts, "x [M, K] @ the stacked dequantized parts .T -> [M, sum N] float32");
  m.def("dequantize_rows", &dequantize_rows, "rows of a quantized matrix as float32");
  m.def("layer_step", &layer_step, "one decoder layer over a cached forward's new tokens, in place");
  m.def("race_argmax", &race_argmax, "a seeded sample per row by the exponential race (Gumbel-max)");
  m.def("has_simd", &has_simd);
  m.def("instruction_set", &instruction_set);
}
