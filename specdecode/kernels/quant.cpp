// Matrix products with block-quantized weights, for decoding on CPUs (the weights stay quantized in memory).
//
// Weight formats are GGUF's (FORMATS below: a row is in_features / values blocks). Every format is read as 32-value
// blocks w = dA * v (dB * v for the second 16 values of a Q6_K block) + m, with v small integers (block_weights:
// the scalar reference of each format's unpacking, which also serves embedding lookups):
//   Q8_0  fp16 d, int8 q[32]                            v = q          Q4_0  fp16 d, nibbles q[16]    v = q - 8
//   Q4_1  fp16 d, fp16 m, nibbles q[16]                  v = q, + m     Q5_0  d, qh[4], q[16]          v = q - 16
//   Q5_1  d, m, qh[4], q[16] (5-bit: nibble + qh bit)    v = q, + m
//   Q4_K  256 values: fp16 d, dmin, 12 bytes of 6-bit scales sc_j and mins m_j, q[128]: block j = d*sc_j * q - dmin*m_j
//   Q5_K  Q4_K plus qh[32] (bit j of byte e = the fifth bit of value e of block j)
//   Q6_K  256 values: ql[128], qh[64], int8 scales[16] (one per 16 values), fp16 d: v = q - 32, scale d * sc
// In a 4-bit 32-block, byte j holds element j in its low nibble and element j + 16 in its high nibble.
//
// A matrix is packed once at load (`pack`, see Super): groups of 8 weight rows whose values interleave so that
// int32 lane r of every vector belongs to row r. Activations are rounded per row and per block of 32 to int8
// (d = max|x| / 127, as llama.cpp does), so one vpdpbusd (VNNI; AVX2: vpmaddubsw + vpmaddwd) multiplies 32
// weights - 4 of each of 8 rows - by 4 activations broadcast, 8 of them leave a block's 8 exact row sums in one
// vector, and a convert and two fused multiply-adds apply the block's scales and min. Nothing is summed across
// lanes: a group ends as 8 outputs. The unpacked weights serve a tile of up to 8 activation rows (4 without
// AVX-512VL's 32 registers), so a pass over 5-9 tokens reads every weight once and adds only multiply-adds.
// Measured (2-core AMD EPYC Zen 4, one thread, random Q4_K blocks of the 1.5B's shapes, against the former
// int16 kernels with their own orders for one row and several): one row 1.3-1.8x faster, 5 rows 1.6-2.2x.
// Why int8 (llama.cpp's choice) and not int16 (ours before): half the multiply-adds a weight for wide passes;
// the cost in perplexity is measured by `specdecode bench perplexity` (docs/bench).
//
// Batch invariance: the number for (row m, output n) is computed by the same sequence of operations whatever
// the number of rows M and however rows are tiled or threads split the groups: each (m, n) is one lane of its
// own accumulator, the integer block sums are exact however they are formed, and blocks are applied in order
// (the file is compiled with -ffp-contract=off). So a token's logits do not depend on what else shares its pass,
// and the SIMD and scalar paths (group_scalar, also the kernel where AVX2 is absent) agree bit for bit.
#include "quant.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>

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

// The table of formats: values and bytes per block, and whether a 32-block has two scales (Q6_K's 16-value halves).
struct FormatInfo {
  int64_t values, bytes;
  bool split;
};
constexpr FormatInfo FORMATS[NUM_FORMATS] = {
    {32, 34, false},  {32, 18, false},  {32, 20, false},   {32, 22, false},
    {32, 24, false},  {256, 144, false}, {256, 176, false}, {256, 210, true},
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

#define UNROLL _Pragma("GCC unroll 16")  // constant-bound loops over tiles: their accumulators stay in registers

// ---- the packed layout: 8 weight rows interleaved, one row per int32 lane ----
//
// `pack` turns a matrix around once at load: rows in groups of 8 (the last group padded with zero rows), each
// group a run of super-blocks (SUPER[F].values inputs: 256 for K-quants, 32 otherwise) holding, for its 8 rows,
// their scales then their quantized values. Within a 32-block the values are 8 vectors u = 0..7 of 32 bytes:
// byte 4r + i of vector u is row r's value 4u + i, so one vpdpbusd of vector u with the activations' bytes
// 4u..4u+3 broadcast adds 4 products to each row's lane, and 8 of them leave the block's 8 exact row sums in one
// vector: no horizontal sums, and a vector of 8 outputs at the end. Values are stored as unsigned codes
// (Q4_0's q, Q5_0's q, Q6_K's q without their - 8, - 16, - 32, Q8_0's q + 128; the offset enters with the
// activation sum like a min), 4-bit planes (vectors 2t and 2t + 1 are the low and high nibbles of 32 bytes) plus a
// plane of their fifth bits (Q5_0, Q5_1, Q5_K) or fifth and sixth (Q6_K); Q8_0 keeps whole bytes. The packed matrix is as
// large as the file's (Q4_K: 1184 bytes a super-block of 8 rows against 8 x 144: its 6-bit scales decoded).
struct Super {
  int64_t values, bytes;                    // inputs a super-block covers; its bytes for 8 rows
  int64_t d, m, sc, mn, q, hi;              // offsets (-1: absent): fp16 d[8], fp16 m or dmin[8], scales, mins
  int hi_bits;                              // 0, 1 (Q5_*) or 2 (Q6_K) extra bits a value
};
constexpr Super SUPER[NUM_FORMATS] = {
    {32, 272, 0, -1, -1, -1, 16, -1, 0},    {32, 144, 0, -1, -1, -1, 16, -1, 0},
    {32, 160, 0, 16, -1, -1, 32, -1, 0},    {32, 176, 0, -1, -1, -1, 16, 144, 1},
    {32, 192, 0, 16, -1, -1, 32, 160, 1},   {256, 1184, 0, 16, 32, 96, 160, -1, 0},
    {256, 1440, 0, 16, 32, 96, 160, 1184, 1}, {256, 1680, 0, -1, 16, -1, 144, 1168, 2},
};
constexpr int64_t LANES = 8;            // weight rows a group
constexpr int64_t HEADER = 64;          // a packed matrix's header: magic, format, rows, inputs, groups
constexpr int64_t MAGIC = 0x4b43505344;  // "DSPCK"
// The offset each format's codes carry (w = scale * (code - OFFSET)): entered as c = -OFFSET * scale.
constexpr int OFFSET[NUM_FORMATS] = {128, 8, 0, 16, 0, 0, 0, 32};

struct Packed {
  const uint8_t* groups;
  int64_t format, rows, inputs, count, super_blocks;
};

Packed view_packed(const torch::Tensor& packed, int64_t format, int64_t in_features) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dtype() == torch::kUInt8 && packed.dim() == 1 &&
              packed.is_contiguous() && packed.numel() >= HEADER, "a packed matrix is a 1-d uint8 CPU tensor (pack())");
  const auto* head = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>());
  TORCH_CHECK(head[0] == MAGIC, "not a packed matrix (pack() makes them)");
  TORCH_CHECK(head[1] == format, "packed matrix of format ", head[1], " used as format ", format);
  TORCH_CHECK(head[3] == in_features, "packed matrix of ", head[3], " inputs used with ", in_features);
  const Super& s = SUPER[format];
  const int64_t nsb = in_features / s.values;
  TORCH_CHECK(packed.numel() == HEADER + head[4] * nsb * s.bytes, "packed matrix of the wrong size");
  return {packed.data_ptr<uint8_t>() + HEADER, format, head[2], in_features, head[4], nsb};
}

// Values 4u..4u+3 of row r of a 32-block's vector u sit at byte 32u + 4r + i (i = 0..3) of the unpacked block.
inline int64_t code_at(int r, int e) { return 32 * (e / 4) + 4 * r + e % 4; }

}  // namespace

namespace {
// A zeroed byte tensor in memory the kernel may back with 2 MB pages (transparent huge pages on request, where
// the system allows them): a step streams ~1 GB of weights, 4 KB pages cost a TLB miss every 4 KB. Measured on the
// 1.5B, one thread, both in one process: a one-token forward 49.3 ms with 4 KB pages, 45.6 ms with 2 MB ones
// (SPECDECODE_SMALL_PAGES=1 keeps ordinary pages, for such comparisons).
torch::Tensor huge_zeros(int64_t bytes) {
  constexpr int64_t HUGE = 2 << 20;
  if (bytes < HUGE || std::getenv("SPECDECODE_SMALL_PAGES") != nullptr) return torch::zeros({bytes}, torch::kUInt8);
  const size_t length = static_cast<size_t>(bytes + HUGE);
  void* base = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return torch::zeros({bytes}, torch::kUInt8);
  auto* aligned = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(base) + HUGE - 1) & ~uintptr_t(HUGE - 1));
  madvise(aligned, static_cast<size_t>(bytes), MADV_HUGEPAGE);
  return torch::from_blob(aligned, {bytes}, [base, length](void*) { munmap(base, length); },
                          torch::TensorOptions().dtype(torch::kUInt8));
}
}  // namespace

// rows [N, row_bytes] of format (GGUF blocks) -> the packed matrix (see Super above).
torch::Tensor pack(const torch::Tensor& weight, int64_t format, int64_t in_features) {
  check_weight(weight, format, in_features);
  const Super& s = SUPER[format];
  const int64_t N = weight.size(0), row_bytes = weight.size(1), nsb = in_features / s.values;
  const int64_t groups = (N + LANES - 1) / LANES, blocks_per = s.values / QK;
  auto out = huge_zeros(HEADER + groups * nsb * s.bytes);
  auto* head = reinterpret_cast<int64_t*>(out.data_ptr<uint8_t>());
  head[0] = MAGIC, head[1] = format, head[2] = N, head[3] = in_features, head[4] = groups;
  const uint8_t* w = weight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>() + HEADER;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    int v[QK];
    uint8_t u[QK];
    for (int64_t g = g0; g < g1; ++g) {
      for (int64_t p = 0; p < nsb; ++p) {
        uint8_t* sb = dst + (g * nsb + p) * s.bytes;
        for (int r = 0; r < LANES; ++r) {
          const int64_t n = g * LANES + r;
          if (n >= N) continue;  // padding rows stay zero
          const uint8_t* row = w + n * row_bytes;
          const uint8_t* blk = row + p * FORMATS[format].bytes;  // the block (or super-block) p
          if (format == Q6_K) {
            std::memcpy(sb + s.d + 2 * r, blk + 208, 2);
            for (int h = 0; h < 16; ++h) sb[s.sc + h * LANES + r] = blk[192 + h];  // int8 scale of values 16h..
          } else {
            std::memcpy(sb + s.d + 2 * r, blk, 2);
            if (s.m >= 0) std::memcpy(sb + s.m + 2 * r, blk + 2, 2);
          }
          for (int64_t j = 0; j < blocks_per; ++j) {
            float dA, dB, m;
            block_weights(format, row, p * blocks_per + j, v, dA, dB, m);
            for (int e = 0; e < QK; ++e) u[e] = static_cast<uint8_t>(v[e] + OFFSET[format]);
            if (s.sc >= 0 && format != Q6_K) {
              int scale, min;
              k_scale_min(blk + 4, static_cast<int>(j), scale, min);
              sb[s.sc + j * LANES + r] = static_cast<uint8_t>(scale);
              sb[s.mn + j * LANES + r] = static_cast<uint8_t>(min);
            }
            if (format == Q8_0) {  // whole bytes: vector a (values 4a..4a+3), byte 4r + i
              for (int e = 0; e < QK; ++e) sb[s.q + code_at(r, e)] = u[e];
              continue;
            }
            uint8_t* q = sb + s.q + j * 128;  // vector t: low nibbles values 8t..8t+3, high nibbles 8t+4..8t+7
            for (int t4 = 0; t4 < 4; ++t4)
              for (int i = 0; i < 4; ++i)
                q[32 * t4 + 4 * r + i] = (u[8 * t4 + i] & 0x0F) | ((u[8 * t4 + 4 + i] & 0x0F) << 4);
            if (s.hi_bits == 1) {  // bit a of byte 4r + i: the fifth bit of value 4a + i
              uint8_t* hi = sb + s.hi + j * 32;
              for (int i = 0; i < 4; ++i) {
                uint8_t bits = 0;
                for (int a = 0; a < 8; ++a) bits |= ((u[4 * a + i] >> 4) & 1) << a;
                hi[4 * r + i] = bits;
              }
            } else if (s.hi_bits == 2) {  // vector half, bits 2a, 2a + 1 of byte 4r + i: value 4 (4 half + a) + i
              uint8_t* hi = sb + s.hi + j * 64;
              for (int half = 0; half < 2; ++half)
                for (int i = 0; i < 4; ++i) {
                  uint8_t bits = 0;
                  for (int a = 0; a < 4; ++a) bits |= ((u[4 * (4 * half + a) + i] >> 4) & 3) << (2 * a);
                  hi[32 * half + 4 * r + i] = bits;
                }
            }
          }
        }
      }
    }
  });
  return out;
}

namespace {

// Rows of activations, quantized per block of 32 to int8 (d = max|x| / 127, round to nearest even), with the
// block's sum scaled by d (s, for the min and offset terms) and the sums of its two halves (Q6_K's scales are
// per 16): q [M, K] int8, d, s, s_lo, s_hi [M, K / 32] float32.
struct RowsFrom {  // pointers at row m of each array of Activations
  const int8_t* q;
  const float *d, *s, *s_lo, *s_hi;
  const int32_t* sum;
};
struct Activations {
  torch::Tensor q, d, s, s_lo, s_hi, sum;  // sum: the block's integer sum (Q8_0 without VNNI)
  int64_t rows, inputs, blocks;
  RowsFrom base;  // the arrays' data (read once: data_ptr<T>() checks the type on every call)
  RowsFrom from(int64_t m) const {
    return {base.q + m * inputs, base.d + m * blocks, base.s + m * blocks, base.s_lo + m * blocks,
            base.s_hi + m * blocks, base.sum + m * blocks};
  }
};

inline void quantize_block(const float* v, int8_t* q, float& d, float& s, float& s_lo, float& s_hi, int32_t& sum) {
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(v[j]));
  d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
#if defined(__AVX2__)
  const __m256 scale = _mm256_set1_ps(inv);
  const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v), scale));
  const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8), scale));
  const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16), scale));
  const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 24), scale));
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  alignas(32) int32_t lo[8], hi[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lo), _mm256_add_epi32(i0, i1));
  _mm256_store_si256(reinterpret_cast<__m256i*>(hi), _mm256_add_epi32(i2, i3));
  int sum_lo = 0, sum_hi = 0;
  for (int j = 0; j < 8; ++j) sum_lo += lo[j], sum_hi += hi[j];
#else
  int sum_lo = 0, sum_hi = 0;
  for (int j = 0; j < QK; ++j) {
    const int value = static_cast<int>(std::nearbyint(v[j] * inv));
    q[j] = static_cast<int8_t>(value);
    (j < QK / 2 ? sum_lo : sum_hi) += value;
  }
#endif
  sum = sum_lo + sum_hi;
  s = d * static_cast<float>(sum);
  s_lo = d * static_cast<float>(sum_lo);
  s_hi = d * static_cast<float>(sum_hi);
}

Activations quantize_activations(const torch::Tensor& x) {
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1), nb = K / QK;
  Activations a{torch::empty({M, K}, torch::kInt8), torch::empty({M, nb}), torch::empty({M, nb}),
                torch::empty({M, nb}), torch::empty({M, nb}), torch::empty({M, nb}, torch::kInt32), M, K, nb, {}};
  const float* src = xf.data_ptr<float>();
  int8_t* q = a.q.data_ptr<int8_t>();
  float *d = a.d.data_ptr<float>(), *s = a.s.data_ptr<float>();
  float *s_lo = a.s_lo.data_ptr<float>(), *s_hi = a.s_hi.data_ptr<float>();
  int32_t* sum = a.sum.data_ptr<int32_t>();
  a.base = {q, d, s, s_lo, s_hi, sum};
  at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      quantize_block(src + i * QK, q + i * QK, d[i], s[i], s_lo[i], s_hi[i], sum[i]);
  });
  return a;
}

// ---- the reference: one group of 8 rows against one activation row, in plain C++ (also the kernel where AVX2
// is absent). Every path applies, per 32-block b and lane (row): acc = fma(float(integer sum), scale * d_b, acc)
// (Q6_K: its two halves, each with its scale), then acc = fma(c, s_b, acc) with c the block's min (- dmin * m,
// m, or - offset * scale; Q6_K per half with s_lo, s_hi). Integer sums are exact however they are formed, so
// with -ffp-contract=off every path, tile and thread gives the same bits. ----

// Row r's codes of 32-block j of super-block sb and its float scales: scale (scale_hi for Q6_K's second half)
// and c (c_hi).
void packed_block(int64_t format, const uint8_t* sb, int64_t j, int r, int* u, float& scale, float& scale_hi,
                  float& c, float& c_hi) {
  const Super& s = SUPER[format];
  const float d = half_to_float(load16(sb + s.d + 2 * r));
  if (format == Q8_0) {
    for (int e = 0; e < QK; ++e) u[e] = sb[s.q + code_at(r, e)];
  } else {
    const uint8_t* q = sb + s.q + j * 128;
    for (int e = 0; e < QK; ++e) {
      const int vec = e / 4, i = e % 4, t = vec / 2;
      const uint8_t byte = q[32 * t + 4 * r + i];
      u[e] = vec % 2 ? byte >> 4 : byte & 0x0F;
      if (s.hi_bits == 1) u[e] |= ((sb[s.hi + j * 32 + 4 * r + i] >> vec) & 1) << 4;
      if (s.hi_bits == 2) u[e] |= ((sb[s.hi + j * 64 + 32 * (vec / 4) + 4 * r + i] >> (2 * (vec % 4))) & 3) << 4;
    }
  }
  if (format == Q6_K) {
    scale = d * static_cast<float>(static_cast<int8_t>(sb[s.sc + (2 * j) * LANES + r]));
    scale_hi = d * static_cast<float>(static_cast<int8_t>(sb[s.sc + (2 * j + 1) * LANES + r]));
    c = scale * -32.f;
    c_hi = scale_hi * -32.f;
  } else if (s.sc >= 0) {  // Q4_K, Q5_K
    scale = d * static_cast<float>(sb[s.sc + j * LANES + r]);
    c = -(half_to_float(load16(sb + s.m + 2 * r)) * static_cast<float>(sb[s.mn + j * LANES + r]));
  } else {
    scale = d;
    c = s.m >= 0 ? half_to_float(load16(sb + s.m + 2 * r)) : scale * static_cast<float>(-OFFSET[format]);
  }
}

void group_scalar(const Packed& w, const uint8_t* group, const Activations& a, int64_t m, float* out) {
  const Super& s = SUPER[w.format];
  const int64_t per = s.values / QK;
  const RowsFrom row = a.from(m);
  const int8_t* xq = row.q;
  const float *xd = row.d, *xs = row.s, *lo = row.s_lo, *hi = row.s_hi;
  int u[QK];
  for (int r = 0; r < LANES; ++r) {
    float acc = 0.f;
    for (int64_t p = 0; p < w.super_blocks; ++p) {
      const uint8_t* sb = group + p * s.bytes;
      for (int64_t j = 0; j < per; ++j) {
        const int64_t b = p * per + j;
        float scale, scale_hi = 0.f, c = 0.f, c_hi = 0.f;
        packed_block(w.format, sb, j, r, u, scale, scale_hi, c, c_hi);
        const int8_t* x = xq + b * QK;
        if (w.format == Q6_K) {
          int sum_lo = 0, sum_hi = 0;
          for (int e = 0; e < 16; ++e) sum_lo += u[e] * x[e];
          for (int e = 16; e < QK; ++e) sum_hi += u[e] * x[e];
          acc = std::fma(static_cast<float>(sum_lo), scale * xd[b], acc);
          acc = std::fma(static_cast<float>(sum_hi), scale_hi * xd[b], acc);
          acc = std::fma(c, lo[b], acc);
          acc = std::fma(c_hi, hi[b], acc);
        } else {
          int sum = 0;
          for (int e = 0; e < QK; ++e) sum += u[e] * x[e];
          acc = std::fma(static_cast<float>(sum), scale * xd[b], acc);
          acc = std::fma(c, xs[b], acc);
        }
      }
    }
    out[r] = acc;
  }
}

#if defined(__AVX2__)

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define VNNI 1
// acc + the 4-product sums of unsigned w and signed x bytes, per int32 lane (exact: no saturation)
inline __m256i dot4(__m256i acc, __m256i w, __m256i x) { return _mm256_dpbusd_epi32(acc, w, x); }
#else
#define VNNI 0
inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
  // pairs of products as int16 (|w| <= 128 and |x| <= 127 keep them below 2^15: exact), then pairs of pairs
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
#endif

#if defined(__AVX512VL__)
constexpr int64_t ROW_TILE = 8;  // activation rows a pass over a group (32 vector registers)
#else
constexpr int64_t ROW_TILE = 4;  // (16 registers: 8 unpacked vectors, the accumulators, the scales)
#endif

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256 load_halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load_bytes(const uint8_t* p, bool is_signed) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + w's products with the 4 activation bytes at x, broadcast to every lane.
inline __m256i dot4_at(__m256i acc, __m256i w, const int8_t* x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // the broadcast folded into the multiply-add's memory operand (EVEX {1to8}): GCC does not fold set1 into
  // vpdpbusd itself, and a separate vpbroadcastd per 32 products took a third of the instructions of wide passes
  asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
#else
  return dot4(acc, w, broadcast4(x));
#endif
}

// How far ahead the kernels ask for weights, into L2: a step streams every weight once from memory, and the
// hardware's own prefetching alone left one core at ~5-7 GB/s of its ~26 (Zen 4; 8 KB ahead reached ~14).
constexpr int64_t PREFETCH_BYTES = 8192;

// Block j of a super-block, unpacked to the 8 vectors of codes (see Super).
template <int F>
inline void unpack(const uint8_t* sb, int64_t j, __m256i* w) {
  constexpr Super s = SUPER[F];
  if constexpr (F == Q8_0) {
    for (int u = 0; u < 8; ++u) w[u] = load256(sb + s.q + 32 * u);
    return;
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m256i v = load256(sb + s.q + 128 * j + 32 * t);
      w[2 * t] = _mm256_and_si256(v, low);
      w[2 * t + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    if constexpr (s.hi_bits == 1) {
      const __m256i h = load256(sb + s.hi + 32 * j), bit = _mm256_set1_epi8(0x10);
      w[0] = _mm256_or_si256(w[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), bit));
      w[1] = _mm256_or_si256(w[1], _mm256_and_si256(_mm256_slli_epi16(h, 3), bit));
      w[2] = _mm256_or_si256(w[2], _mm256_and_si256(_mm256_slli_epi16(h, 2), bit));
      w[3] = _mm256_or_si256(w[3], _mm256_and_si256(_mm256_slli_epi16(h, 1), bit));
      w[4] = _mm256_or_si256(w[4], _mm256_and_si256(h, bit));
      w[5] = _mm256_or_si256(w[5], _mm256_and_si256(_mm256_srli_epi16(h, 1), bit));
      w[6] = _mm256_or_si256(w[6], _mm256_and_si256(_mm256_srli_epi16(h, 2), bit));
      w[7] = _mm256_or_si256(w[7], _mm256_and_si256(_mm256_srli_epi16(h, 3), bit));
    } else if constexpr (s.hi_bits == 2) {
      const __m256i bits = _mm256_set1_epi8(0x30);
      for (int half = 0; half < 2; ++half) {
        const __m256i h = load256(sb + s.hi + 64 * j + 32 * half);
        __m256i* v = w + 4 * half;
        v[0] = _mm256_or_si256(v[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), bits));
        v[1] = _mm256_or_si256(v[1], _mm256_and_si256(_mm256_slli_epi16(h, 2), bits));
        v[2] = _mm256_or_si256(v[2], _mm256_and_si256(h, bits));
        v[3] = _mm256_or_si256(v[3], _mm256_and_si256(_mm256_srli_epi16(h, 2), bits));
      }
    }
  }
}

// Rows m0 .. m0 + R - 1 against one group of 8 weight rows: out[m * ldo + lane].
template <int F, int R>
void group_avx2(const Packed& w, const uint8_t* group, const Activations& a, int64_t m0, float* out, int64_t ldo) {
  constexpr Super s = SUPER[F];
  constexpr int64_t per = s.values / QK;
  const RowsFrom rows = a.from(m0);
  const int8_t* xq = rows.q;
  const float *xd = rows.d, *xs = rows.s, *x_lo = rows.s_lo, *x_hi = rows.s_hi;
  const int64_t K = a.inputs, nb = a.blocks;
  __m256 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t p = 0; p < w.super_blocks; ++p) {
    const uint8_t* sb = group + p * s.bytes;
    for (int64_t line = 0; line < s.bytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(sb + PREFETCH_BYTES + line), _MM_HINT_T1);
    const __m256 d = load_halves(sb + s.d);
    __m256 second = _mm256_setzero_ps();  // fp16 m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
    if constexpr (s.m >= 0) second = load_halves(sb + s.m);
    for (int64_t j = 0; j < per; ++j) {
      const int64_t b = p * per + j;
      __m256 scale, scale_hi = _mm256_setzero_ps(), c = _mm256_setzero_ps(), c_hi = _mm256_setzero_ps();
      if constexpr (F == Q6_K) {
        scale = _mm256_mul_ps(d, load_bytes(sb + s.sc + (2 * j) * LANES, true));
        scale_hi = _mm256_mul_ps(d, load_bytes(sb + s.sc + (2 * j + 1) * LANES, true));
        c = _mm256_mul_ps(scale, _mm256_set1_ps(-32.f));
        c_hi = _mm256_mul_ps(scale_hi, _mm256_set1_ps(-32.f));
      } else if constexpr (s.sc >= 0) {
        scale = _mm256_mul_ps(d, load_bytes(sb + s.sc + j * LANES, false));
        c = _mm256_mul_ps(second, load_bytes(sb + s.mn + j * LANES, false));  // dmin * m, entered negated
      } else {
        scale = d;
        if constexpr (s.m >= 0) c = second;
        else c = _mm256_mul_ps(scale, _mm256_set1_ps(static_cast<float>(-OFFSET[F])));
      }
      __m256i v[8];
      unpack<F>(sb, j, v);
#if !VNNI
      if constexpr (F == Q8_0)  // without VNNI: the signed q (code - 128), multiplied as |q| times x with q's sign
        for (int u = 0; u < 8; ++u) v[u] = _mm256_xor_si256(v[u], _mm256_set1_epi8(static_cast<char>(0x80)));
#endif
      UNROLL for (int m = 0; m < R; ++m) {
        const int8_t* x = xq + m * K + b * QK;
        const __m256 dx = _mm256_set1_ps(xd[m * nb + b]);
        const __m256i zero = _mm256_setzero_si256();
        if constexpr (F == Q6_K) {
          const __m256i lo = dot4_at(dot4_at(dot4_at(dot4_at(zero, v[0], x), v[1], x + 4), v[2], x + 8), v[3], x + 12);
          const __m256i hi = dot4_at(dot4_at(dot4_at(dot4_at(zero, v[4], x + 16), v[5], x + 20), v[6], x + 24),
                                     v[7], x + 28);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(scale, dx), acc[m]);
          acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(scale_hi, dx), acc[m]);
          acc[m] = _mm256_fmadd_ps(c, _mm256_set1_ps(x_lo[m * nb + b]), acc[m]);
          acc[m] = _mm256_fmadd_ps(c_hi, _mm256_set1_ps(x_hi[m * nb + b]), acc[m]);
          continue;
        }
        __m256i sum;
#if !VNNI
        if constexpr (F == Q8_0) {  // vpmaddubsw would saturate on codes up to 255: sum q * x, then add 128 * sum(x)
          __m256i even = zero, odd = zero;
          for (int u = 0; u < 8; u += 2) {
            even = dot4(even, _mm256_abs_epi8(v[u]), _mm256_sign_epi8(broadcast4(x + 4 * u), v[u]));
            odd = dot4(odd, _mm256_abs_epi8(v[u + 1]), _mm256_sign_epi8(broadcast4(x + 4 * u + 4), v[u + 1]));
          }
          sum = _mm256_add_epi32(_mm256_add_epi32(even, odd), _mm256_set1_epi32(128 * rows.sum[m * nb + b]));
        } else
#endif
        {  // two chains (one a row was 5-10% slower at 4-9 rows: the multiply-adds' latency)
          __m256i even = dot4_at(zero, v[0], x), odd = dot4_at(zero, v[1], x + 4);
          even = dot4_at(dot4_at(dot4_at(even, v[2], x + 8), v[4], x + 16), v[6], x + 24);
          odd = dot4_at(dot4_at(dot4_at(odd, v[3], x + 12), v[5], x + 20), v[7], x + 28);
          sum = _mm256_add_epi32(even, odd);
        }
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(scale, dx), acc[m]);
        const __m256 block_sum = _mm256_set1_ps(xs[m * nb + b]);
        if constexpr (s.sc >= 0) acc[m] = _mm256_fnmadd_ps(c, block_sum, acc[m]);
        else acc[m] = _mm256_fmadd_ps(c, block_sum, acc[m]);
      }
    }
  }
  for (int m = 0; m < R; ++m) _mm256_storeu_ps(out + m * ldo, acc[m]);
}

// Activation rows [r0, r1) against groups [g0, g1) of one packed matrix.
template <int F>
void groups_avx2(const Packed& w, int64_t g0, int64_t g1, const Activations& a, int64_t r0, int64_t r1, float* out,
                 int64_t ldo) {
  const int64_t M = r1 - r0, tiles = (M + ROW_TILE - 1) / ROW_TILE, tile = (M + tiles - 1) / tiles;
  const int64_t group_bytes = w.super_blocks * SUPER[F].bytes;
  float spill[ROW_TILE * LANES];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = w.groups + g * group_bytes;
    const int64_t lanes = std::min(LANES, w.rows - g * LANES);
    for (int64_t m0 = r0; m0 < r1; m0 += tile) {  // tiles of equal size (9 rows: 5 + 4)
      const int64_t R = std::min(tile, r1 - m0);
      float* dst = lanes == LANES ? out + m0 * ldo + g * LANES : spill;
      const int64_t stride = lanes == LANES ? ldo : LANES;
      switch (R) {
#define SPECDECODE_TILE(n) case n: group_avx2<F, n>(w, group, a, m0, dst, stride); break;
        SPECDECODE_TILE(1) SPECDECODE_TILE(2) SPECDECODE_TILE(3) SPECDECODE_TILE(4)
#if defined(__AVX512VL__)
        SPECDECODE_TILE(5) SPECDECODE_TILE(6) SPECDECODE_TILE(7) SPECDECODE_TILE(8)
#endif
#undef SPECDECODE_TILE
        default: TORCH_CHECK(false, "row tile ", R);
      }
      if (lanes != LANES)
        for (int64_t m = 0; m < R; ++m)
          std::memcpy(out + (m0 + m) * ldo + g * LANES, spill + m * LANES, lanes * sizeof(float));
    }
  }
}

using GroupsKernel = void (*)(const Packed&, int64_t, int64_t, const Activations&, int64_t, int64_t, float*, int64_t);
constexpr GroupsKernel GROUP_KERNELS[NUM_FORMATS] = {groups_avx2<Q8_0>, groups_avx2<Q4_0>, groups_avx2<Q4_1>,
                                                     groups_avx2<Q5_0>, groups_avx2<Q5_1>, groups_avx2<Q4_K>,
                                                     groups_avx2<Q5_K>, groups_avx2<Q6_K>};
#endif  // __AVX2__

// Activation rows [r0, r1) against groups [g0, g1) of one packed matrix, into columns of out (row stride ldo; out
// points at the part's column 0).
void groups_range(const Packed& w, int64_t g0, int64_t g1, const Activations& a, int64_t r0, int64_t r1, float* out,
                  int64_t ldo, bool use_simd) {
#if defined(__AVX2__)
  if (use_simd) {
    GROUP_KERNELS[w.format](w, g0, g1, a, r0, r1, out, ldo);
    return;
  }
#endif
  const int64_t group_bytes = w.super_blocks * SUPER[w.format].bytes;
  float lanes_out[LANES];
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t lanes = std::min(LANES, w.rows - g * LANES);
    for (int64_t m = r0; m < r1; ++m) {
      group_scalar(w, w.groups + g * group_bytes, a, m, lanes_out);
      std::memcpy(out + m * ldo + g * LANES, lanes_out, lanes * sizeof(float));
    }
  }
}

}  // namespace

namespace {
constexpr int64_t CHUNK_BYTES = 256 << 10;  // activation bytes a pass over the weights takes at most
}  // namespace

// x [M, K] (any float dtype) @ [dequantized(part 0); dequantized(part 1); ...].T -> [M, sum of rows] float32,
// each part a packed matrix (pack()) of its own format.
torch::Tensor qmatmul_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& packed,
                            const std::vector<int64_t>& formats, bool use_simd) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "x must be a 2-d CPU tensor");
  TORCH_CHECK(!packed.empty() && packed.size() == formats.size(), "one format per weight part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0, "in_features must be a multiple of 32, got ", K);
  std::vector<Packed> parts;
  int64_t N = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    info(formats[i]);
    parts.push_back(view_packed(packed[i], formats[i], K));
    N += parts.back().rows;
  }
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  const Activations a = quantize_activations(x);
  float* o = out.data_ptr<float>();
  // Long prompts go through in chunks of rows whose int8 activations fit in L2 (every group of weights reads all of
  // a chunk's rows: 330 rows of 8,960 inputs were 3 MB re-read per group, and prefill ran at half speed).
  const int64_t chunk = std::max<int64_t>(8, (CHUNK_BYTES / K) / 8 * 8);
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t r1 = std::min(M, r0 + chunk);
    int64_t column = 0;
    for (const Packed& w : parts) {
      at::parallel_for(0, w.count, 4, [&](int64_t g0, int64_t g1) {
        groups_range(w, g0, g1, a, r0, r1, o + column, N, use_simd);
      });
      column += w.rows;
    }
  }
  return out;
}

// x [M, K] @ dequantized(weight [N, K] in GGUF blocks).T -> [M, N] float32 (packs the weight first: for tests
// and one-off products; a model packs its matrices once, model/quant.py).
torch::Tensor qmatmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t format, bool use_simd) {
  return qmatmul_parts(x, {pack(weight, format, x.size(1))}, {format}, use_simd);
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
  return "avx2+vnni";  // 256-bit vectors, vpdpbusd for the integer multiply-adds
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "x [M, K] @ dequantized(weight [N, K]).T -> [M, N] float32");
  m.def("pack", &pack, "rows of GGUF blocks -> the packed matrix the products read");
  m.def("qmatmul_parts", &qmatmul_parts, "x [M, K] @ the stacked dequantized parts .T -> [M, sum N] float32");
  m.def("dequantize_rows", &dequantize_rows, "rows of a quantized matrix as float32");
  m.def("layer_step", &layer_step, "one decoder layer over a cached forward's new tokens, in place");
  m.def("race_argmax", &race_argmax, "a seeded sample per row by the exponential race (Gumbel-max)");
  m.def("has_simd", &has_simd);
  m.def("instruction_set", &instruction_set);
}
