// Matrix products with block-quantized weights, for decoding on CPUs (the weights stay quantized in memory).
//
// Weight formats are GGUF's (FORMATS below: a row is in_features / values blocks); block_weights is the scalar
// reference of each format's unpacking (it also serves embedding lookups). How each file format lays out its values:
//   Q8_0  fp16 d, int8 q[32]: value e = q[e]                                       w = d * q
//   Q4_0  fp16 d, q[16]: byte e holds value e (low nibble) and value e + 16 (high)  w = d * (q - 8)
//   Q4_1  fp16 d, fp16 m, q[16] as Q4_0                                             w = d * q + m
//   Q5_0  fp16 d, qh[4], q[16] as Q4_0; bit e of the 32-bit qh is value e's fifth bit   w = d * (q - 16)
//   Q5_1  fp16 d, fp16 m, qh[4], q[16] as Q5_0                                      w = d * q + m
//   Q4_K  256 values in 8 sub-blocks of 32: fp16 d, fp16 dmin, 12 bytes of 6-bit scales sc_j and mins m_j, q[128]:
//         byte e of chunk c (32 bytes) holds value 64c + e (sub-block 2c, low nibble) and 64c + 32 + e (sub-block
//         2c + 1, high nibble)                                                      w = d * sc_j * q - dmin * m_j
//   Q5_K  Q4_K plus qh[32]: bit j of byte e is the fifth bit of value 32j + e
//   Q6_K  256 values in 16 sub-blocks of 16: ql[128], qh[64], int8 scales[16], fp16 d. In half h (128 values),
//         byte e < 32 of ql[64h..] holds values 128h + e (low nibble) and 128h + 64 + e (high), byte 32 + e holds
//         128h + 32 + e and 128h + 96 + e; bits 2t, 2t + 1 of qh[32h + e] are the top two bits of value
//         128h + 32t + e                                                            w = d * sc_16 * (q - 32)
//
// A matrix is packed once at load (`pack`, see Super): groups of 16 weight rows whose values interleave so that
// int32 lane r of a vector belongs to row r (a 512-bit vector holds a group's 16 lanes; a 256-bit one half of
// them). Each 32 values of a row are 8 vectors of 4 values per lane, so one vpdpbusd (VNNI; AVX2: vpmaddubsw +
// vpmaddwd) of vector u with the activation bytes 4u..4u+3 broadcast adds 4 products to every row's lane, and 8 of
// them leave 32 values' exact row sums in one vector: no horizontal sums, a vector of outputs at the end. A weight
// vector is unpacked once per tile and multiplied into every activation row of the tile (up to 16).
//
// Activations are rounded to int8 per row, as llama.cpp does (d = max|x| / 127, round to nearest even), per block
// of 32 values (d and the block's sums): a convert and two multiply-adds per 32-block and row apply the weights'
// and the activations' scales and the min (Q6_K: per 16-value half). The K-quants can instead take activations per
// 256 (set_k_activation_block; llama.cpp's Q8_K): one float scale per super-block, the sub-blocks' 6-bit (Q6_K:
// 8-bit) scales multiplying the exact integer sub-block sums in int32 (vpmulld after vpdpbusd; without VNNI
// vpmaddwd by the scale in place of vpmaddwd by 1), the mins (and Q6_K's offset of 32) through the activation sums
// (vpmaddwd), one convert and one fused multiply-add per super-block and row; sums stay below 2^31 (Q6_K's worst:
// 16 x 16 x 63 x 127 x 128 < 2^28). It is not the default: on Qwen2.5-Coder-1.5B it costs +0.8% perplexity (a few
// huge activation channels flatten the rest of their 256-block) for no measured speed on 512-bit vectors.
// Measured (Intel Xeon VM, AVX-512 VNNI, one thread, the 1.5B's matrices): see docs/bench/wide_pass_2026-12-05.
//
// Batch invariance: the number for (row m, output n) is computed by the same sequence of operations whatever the
// number of rows M, however rows are tiled, whichever vector width runs, and however threads split the groups: each
// (m, n) is one lane of its own accumulator, integer sums are exact however they are formed, and the float steps are
// applied super-block by super-block in order (the file is compiled with -ffp-contract=off). So a token's logits do
// not depend on what else shares its pass, and the SIMD and scalar paths (group_scalar, also the kernel where AVX2
// is absent) agree bit for bit.
#include "quant.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include <sys/mman.h>
#include <time.h>

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


// ---- the packed layout: 16 weight rows interleaved, one row per int32 lane ----
//
// `pack` turns a matrix around once at load: rows in groups of LANES = 16 (the last group padded with zero rows),
// each group a run of super-blocks (SUPER[F].values inputs: 256 for K-quants, 32 otherwise) holding, for its 16
// rows, their scales then their quantized values. Every field is an array over the 16 lanes (so lanes 8..15 of any
// field start 8 units after lanes 0..7: a 256-bit kernel reads a group as two halves):
//   d, m      fp16 [16]: the block's scale and min (Q4_1, Q5_1) or the super-block's d and dmin (Q4_K, Q5_K)
//   sc        Q4_K, Q5_K: uint8 [8 sub-blocks][16]; Q6_K: int8 [8 sub-blocks of 32][16][2] (its two 16-scales)
//   mn        Q4_K, Q5_K: uint8 [4][16][2], the mins m_2k, m_2k+1 of each lane side by side (pairs for vpmaddwd)
//   q         per 32-block 4 vectors t of 64 bytes: byte 4r + i holds row r's values 8t + i (low nibble) and
//             8t + 4 + i (high nibble); Q8_0 8 vectors u of whole bytes, byte 4r + i = value 4u + i
//   hi        Q5_*: per 32-block 64 bytes, bit a of byte 4r + i = the fifth bit of value 4a + i; Q6_K: per 32-block
//             two 64-byte halves, bits 2a, 2a + 1 of byte 4r + i of half h = the top bits of value 4 (4h + a) + i
// Values are stored as unsigned codes (Q4_0's, Q5_0's and Q6_K's q without their - 8, - 16, - 32, Q8_0's q + 128;
// the offset enters with the activation sums like a min). The packed matrix is as large as the file's (Q4_K: 2368
// bytes a super-block of 16 rows against 16 x 144: its 6-bit scales decoded).
struct Super {
  int64_t values, bytes;                    // inputs a super-block covers; its bytes for 16 rows
  int64_t d, m, sc, mn, q, hi;              // offsets of the fields (-1: absent)
  int hi_bits;                              // 0, 1 (Q5_*) or 2 (Q6_K) extra bits a value
};
constexpr Super SUPER[NUM_FORMATS] = {
    {32, 544, 0, -1, -1, -1, 32, -1, 0},       {32, 288, 0, -1, -1, -1, 32, -1, 0},
    {32, 320, 0, 32, -1, -1, 64, -1, 0},       {32, 352, 0, -1, -1, -1, 32, 288, 1},
    {32, 384, 0, 32, -1, -1, 64, 320, 1},      {256, 2368, 0, 32, 64, 192, 320, -1, 0},
    {256, 2880, 0, 32, 64, 192, 320, 2368, 1}, {256, 3360, 0, -1, 32, -1, 288, 2336, 2},
};
constexpr int64_t LANES = 16;             // weight rows a group
constexpr int64_t HEADER = 64;            // a packed matrix's header: magic, format, rows, inputs, groups
constexpr int64_t MAGIC = 0x3631435053;   // "SPC16"
// The offset each format's codes carry (w = scale * (code - OFFSET)): entered as c = -OFFSET * scale.
constexpr int OFFSET[NUM_FORMATS] = {128, 8, 0, 16, 0, 0, 0, 32};

constexpr bool is_k(int64_t format) { return SUPER[format].values == 256; }

struct Packed {
  const uint8_t* groups;
  int64_t format, rows, inputs, count, super_blocks;
};

Packed view_packed(const torch::Tensor& packed, int64_t format, int64_t in_features) {
  TORCH_CHECK(packed.device().is_cpu() && packed.dtype() == torch::kUInt8 && packed.dim() == 1 &&
              packed.is_contiguous() && packed.numel() >= HEADER, "a packed matrix is a 1-d uint8 CPU tensor (pack())");
  const auto* head = reinterpret_cast<const int64_t*>(packed.data_ptr<uint8_t>());
  TORCH_CHECK(head[0] == MAGIC, "not a packed matrix of this build (pack() makes them)");
  TORCH_CHECK(head[1] == format, "packed matrix of format ", head[1], " used as format ", format);
  TORCH_CHECK(head[3] == in_features, "packed matrix of ", head[3], " inputs used with ", in_features);
  const Super& s = SUPER[format];
  const int64_t nsb = in_features / s.values;
  TORCH_CHECK(packed.numel() == HEADER + head[4] * nsb * s.bytes, "packed matrix of the wrong size");
  return {packed.data_ptr<uint8_t>() + HEADER, format, head[2], in_features, head[4], nsb};
}

// Row r's code of value e (0..31) of a 32-block within its 4-value vectors: vector e / 4, byte 4r + e % 4.
inline int64_t code_at(int r, int e) { return 64 * (e / 4) + 4 * r + e % 4; }

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
  // every core the machine has, whatever torch's thread count for decoding: packing happens once, at load, while
  // nothing else runs (the pair's 2 GB took 3 s on one core)
#pragma omp parallel for schedule(dynamic, 16) num_threads(omp_get_num_procs())
  for (int64_t g = 0; g < groups; ++g) {
    int v[QK];
    uint8_t u[QK];
    {
      for (int64_t p = 0; p < nsb; ++p) {
        uint8_t* sb = dst + (g * nsb + p) * s.bytes;
        for (int r = 0; r < LANES; ++r) {
          const int64_t n = g * LANES + r;
          if (n >= N) continue;  // padding rows stay zero
          const uint8_t* row = w + n * row_bytes;
          const uint8_t* blk = row + p * FORMATS[format].bytes;  // the block (or super-block) p
          if (format == Q6_K) {
            std::memcpy(sb + s.d + 2 * r, blk + 208, 2);
            for (int h = 0; h < 16; ++h) sb[s.sc + (h / 2) * 2 * LANES + 2 * r + h % 2] = blk[192 + h];
          } else {
            std::memcpy(sb + s.d + 2 * r, blk, 2);
            if (s.m >= 0) std::memcpy(sb + s.m + 2 * r, blk + 2, 2);
          }
          for (int64_t j = 0; j < blocks_per; ++j) {
            float dA, dB, m;
            block_weights(format, row, p * blocks_per + j, v, dA, dB, m);
            for (int e = 0; e < QK; ++e) u[e] = static_cast<uint8_t>(v[e] + OFFSET[format]);
            if (s.mn >= 0) {  // Q4_K, Q5_K
              int scale, min;
              k_scale_min(blk + 4, static_cast<int>(j), scale, min);
              sb[s.sc + j * LANES + r] = static_cast<uint8_t>(scale);
              sb[s.mn + (j / 2) * 2 * LANES + 2 * r + j % 2] = static_cast<uint8_t>(min);
            }
            if (format == Q8_0) {  // whole bytes: vector a (values 4a..4a+3), byte 4r + i
              for (int e = 0; e < QK; ++e) sb[s.q + code_at(r, e)] = u[e];
              continue;
            }
            uint8_t* q = sb + s.q + j * 256;  // vector t: low nibbles values 8t..8t+3, high nibbles 8t+4..8t+7
            for (int t = 0; t < 4; ++t)
              for (int i = 0; i < 4; ++i)
                q[64 * t + 4 * r + i] = (u[8 * t + i] & 0x0F) | ((u[8 * t + 4 + i] & 0x0F) << 4);
            if (s.hi_bits == 1) {  // bit a of byte 4r + i: the fifth bit of value 4a + i
              uint8_t* hi = sb + s.hi + j * 64;
              for (int i = 0; i < 4; ++i) {
                uint8_t bits = 0;
                for (int a = 0; a < 8; ++a) bits |= ((u[4 * a + i] >> 4) & 1) << a;
                hi[4 * r + i] = bits;
              }
            } else if (s.hi_bits == 2) {  // half h, bits 2a, 2a + 1 of byte 4r + i: value 4 (4h + a) + i
              uint8_t* hi = sb + s.hi + j * 128;
              for (int h = 0; h < 2; ++h)
                for (int i = 0; i < 4; ++i) {
                  uint8_t bits = 0;
                  for (int a = 0; a < 4; ++a) bits |= ((u[4 * (4 * h + a) + i] >> 4) & 3) << (2 * a);
                  hi[64 * h + 4 * r + i] = bits;
                }
            }
          }
        }
      }
    }
  }
  return out;
}

namespace {

// Activation rows rounded to int8 (see the top comment), in the one or two forms the products need:
// per 32 (every format, by default): q [M, K], d and s = d * (the block's integer sum) [M, K / 32] float32, the same
//   for the block's two halves s_lo, s_hi (Q6_K's scales are per 16), and the integer sum [M, K / 32] int32 (Q8_0
//   without VNNI);
// per 256 (the K-quants, where k_block says so): kq [M, K], kd [M, K / 256] float32, the integer sums of each 32
//   values kx32 [M, K / 32] and of each 16 kx16 [M, K / 16], int16.
struct Activations {
  int64_t rows = 0, inputs = 0;
  torch::Tensor storage[10];  // owns what the pointers below point into
  const int8_t* q = nullptr;
  const float *d = nullptr, *s = nullptr, *s_lo = nullptr, *s_hi = nullptr;
  const int32_t* sum = nullptr;
  const int8_t* kq = nullptr;
  const float* kd = nullptr;
  const int16_t *kx32 = nullptr, *kx16 = nullptr;
};

// Rounds n values (a multiple of 16) to int8 steps of d = max|v| / 127 (round to nearest even) into q, and writes
// the integer sum of each 16 into sums16. Returns d.
inline float round_to_int8(const float* v, int64_t n, int8_t* q, int32_t* sums16) {
  float amax = 0.f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(v[j]));
  const float d = amax / 127.f;
  const float inv = d > 0.f ? 1.f / d : 0.f;
  for (int64_t k = 0; k < n / 16; ++k) {
    int32_t values[16], sum = 0;
#if defined(__AVX2__)
    const __m256 scale = _mm256_set1_ps(inv);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values),
                        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * k), scale)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + 8),
                        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 16 * k + 8), scale)));
#else
    for (int e = 0; e < 16; ++e) values[e] = static_cast<int32_t>(std::nearbyint(v[16 * k + e] * inv));
#endif
    for (int e = 0; e < 16; ++e) {
      q[16 * k + e] = static_cast<int8_t>(values[e]);
      sum += values[e];
    }
    sums16[k] = sum;
  }
  return d;
}

Activations quantize_activations(const torch::Tensor& x, bool per_32, bool per_256) {
  auto xf = x.to(torch::kFloat32).contiguous();
  const int64_t M = xf.size(0), K = xf.size(1);
  Activations a;
  a.rows = M, a.inputs = K;
  a.storage[0] = xf;
  const float* src = xf.data_ptr<float>();
  if (per_32) {
    const int64_t nb = K / QK;
    a.storage[1] = torch::empty({M, K}, torch::kInt8);
    a.storage[2] = torch::empty({M, nb});
    a.storage[3] = torch::empty({M, nb});
    a.storage[4] = torch::empty({M, nb}, torch::kInt32);
    a.storage[8] = torch::empty({2, M, nb});
    int8_t* q = a.storage[1].data_ptr<int8_t>();
    float *d = a.storage[2].data_ptr<float>(), *s = a.storage[3].data_ptr<float>();
    float *s_lo = a.storage[8].data_ptr<float>(), *s_hi = s_lo + M * nb;
    int32_t* sum = a.storage[4].data_ptr<int32_t>();
    a.q = q, a.d = d, a.s = s, a.s_lo = s_lo, a.s_hi = s_hi, a.sum = sum;
    at::parallel_for(0, M * nb, 256, [&](int64_t begin, int64_t end) {
      int32_t halves[2];
      for (int64_t i = begin; i < end; ++i) {
        d[i] = round_to_int8(src + i * QK, QK, q + i * QK, halves);
        sum[i] = halves[0] + halves[1];
        s[i] = d[i] * static_cast<float>(sum[i]);
        s_lo[i] = d[i] * static_cast<float>(halves[0]);
        s_hi[i] = d[i] * static_cast<float>(halves[1]);
      }
    });
  }
  if (per_256) {
    TORCH_CHECK(K % 256 == 0, "K-quant products need inputs in multiples of 256, got ", K);
    const int64_t nsb = K / 256;
    a.storage[5] = torch::empty({M, K}, torch::kInt8);
    a.storage[6] = torch::empty({M, nsb});
    a.storage[7] = torch::empty({M, K / QK + K / 16}, torch::kInt16);
    int8_t* q = a.storage[5].data_ptr<int8_t>();
    float* d = a.storage[6].data_ptr<float>();
    int16_t* x32 = a.storage[7].data_ptr<int16_t>();
    int16_t* x16 = x32 + M * (K / QK);
    a.kq = q, a.kd = d, a.kx32 = x32, a.kx16 = x16;
    at::parallel_for(0, M * nsb, 32, [&](int64_t begin, int64_t end) {
      int32_t sums[16];
      for (int64_t i = begin; i < end; ++i) {
        d[i] = round_to_int8(src + i * 256, 256, q + i * 256, sums);
        for (int k = 0; k < 16; ++k) x16[i * 16 + k] = static_cast<int16_t>(sums[k]);
        for (int k = 0; k < 8; ++k) x32[i * 8 + k] = static_cast<int16_t>(sums[2 * k] + sums[2 * k + 1]);
      }
    });
  }
  return a;
}

// ---- the reference: one group of 16 rows against one activation row, in plain C++ (also the kernel where AVX2
// is absent). Per row (lane) and super-block, every path computes
//   K-quants: T = sum_j sc_j * (integer sum of sub-block j), U = sum_j m_j * (activation sum of sub-block j)
//             (Q6_K: over its 16-value halves, U with their scales, T - 32 U in place of T and no U term), then
//             acc = fma(float(T), d * dx, acc), acc = fma(float(U), -(dmin * dx), acc);
//   32-value formats: acc = fma(float(integer sum), d * dx, acc), acc = fma(c, s, acc) with c the block's min m or
//             - offset * d and s = dx * (activation sum).
// Integer sums are exact however they are formed, so with -ffp-contract=off every path, tile and thread gives the
// same bits. ----

// Row r's unsigned codes u[32] of 32-block j of super-block sb (see Super).
void packed_codes(int64_t format, const uint8_t* sb, int64_t j, int r, int* u) {
  const Super& s = SUPER[format];
  if (format == Q8_0) {
    for (int e = 0; e < QK; ++e) u[e] = sb[s.q + code_at(r, e)];
    return;
  }
  const uint8_t* q = sb + s.q + j * 256;
  for (int e = 0; e < QK; ++e) {
    const int vec = e / 4, i = e % 4, t = vec / 2;
    const uint8_t byte = q[64 * t + 4 * r + i];
    u[e] = vec % 2 ? byte >> 4 : byte & 0x0F;
    if (s.hi_bits == 1) u[e] |= ((sb[s.hi + j * 64 + 4 * r + i] >> vec) & 1) << 4;
    if (s.hi_bits == 2) u[e] |= ((sb[s.hi + j * 128 + 64 * (vec / 4) + 4 * r + i] >> (2 * (vec % 4))) & 3) << 4;
  }
}

void group_scalar(const Packed& w, const uint8_t* group, const Activations& a, int64_t m, float* out) {
  const Super& s = SUPER[w.format];
  const int64_t K = a.inputs;
  int u[QK];
  for (int r = 0; r < LANES; ++r) {
    float acc = 0.f;
    for (int64_t p = 0; p < w.super_blocks; ++p) {
      const uint8_t* sb = group + p * s.bytes;
      const float d = half_to_float(load16(sb + s.d + 2 * r));
      if (is_k(w.format) && a.kq != nullptr) {
        const int8_t* x = a.kq + m * K + p * 256;
        const int16_t *x32 = a.kx32 + m * (K / QK) + p * 8, *x16 = a.kx16 + m * (K / 16) + p * 16;
        const float dx = a.kd[m * (K / 256) + p];
        int32_t T = 0, U = 0;
        for (int j = 0; j < 8; ++j) {
          packed_codes(w.format, sb, j, r, u);
          const int8_t* xj = x + QK * j;
          if (w.format == Q6_K) {
            int32_t lo = 0, hi = 0;
            for (int e = 0; e < 16; ++e) lo += u[e] * xj[e];
            for (int e = 16; e < QK; ++e) hi += u[e] * xj[e];
            const int sc_lo = static_cast<int8_t>(sb[s.sc + j * 2 * LANES + 2 * r]);
            const int sc_hi = static_cast<int8_t>(sb[s.sc + j * 2 * LANES + 2 * r + 1]);
            T += sc_lo * lo + sc_hi * hi;
            U += sc_lo * x16[2 * j] + sc_hi * x16[2 * j + 1];
          } else {
            int32_t sum = 0;
            for (int e = 0; e < QK; ++e) sum += u[e] * xj[e];
            T += sb[s.sc + j * LANES + r] * sum;
            U += sb[s.mn + (j / 2) * 2 * LANES + 2 * r + j % 2] * x32[j];
          }
        }
        if (w.format == Q6_K) {
          acc = std::fma(static_cast<float>(T - 32 * U), d * dx, acc);
        } else {
          const float dmin = half_to_float(load16(sb + s.m + 2 * r));
          acc = std::fma(static_cast<float>(T), d * dx, acc);
          acc = std::fma(static_cast<float>(U), -(dmin * dx), acc);
        }
      } else {  // activations per 32: a float step a 32-block (Q6_K: a 16-value half)
        const int64_t per = s.values / QK;
        for (int64_t j = 0; j < per; ++j) {
          const int8_t* x = a.q + m * K + (p * per + j) * QK;
          const int64_t b = m * (K / QK) + p * per + j;
          packed_codes(w.format, sb, j, r, u);
          if (w.format == Q6_K) {
            int32_t lo = 0, hi = 0;
            for (int e = 0; e < 16; ++e) lo += u[e] * x[e];
            for (int e = 16; e < QK; ++e) hi += u[e] * x[e];
            const float scale = d * static_cast<float>(static_cast<int8_t>(sb[s.sc + j * 2 * LANES + 2 * r]));
            const float scale_hi = d * static_cast<float>(static_cast<int8_t>(sb[s.sc + j * 2 * LANES + 2 * r + 1]));
            acc = std::fma(static_cast<float>(lo), scale * a.d[b], acc);
            acc = std::fma(static_cast<float>(hi), scale_hi * a.d[b], acc);
            acc = std::fma(scale * -32.f, a.s_lo[b], acc);
            acc = std::fma(scale_hi * -32.f, a.s_hi[b], acc);
            continue;
          }
          int32_t sum = 0;
          for (int e = 0; e < QK; ++e) sum += u[e] * x[e];
          float scale = d, c;
          if (s.sc >= 0) {  // Q4_K, Q5_K
            scale = d * static_cast<float>(sb[s.sc + j * LANES + r]);
            c = -(half_to_float(load16(sb + s.m + 2 * r)) *
                  static_cast<float>(sb[s.mn + (j / 2) * 2 * LANES + 2 * r + j % 2]));
          } else {
            c = s.m >= 0 ? half_to_float(load16(sb + s.m + 2 * r)) : d * static_cast<float>(-OFFSET[w.format]);
          }
          acc = std::fma(static_cast<float>(sum), scale * a.d[b], acc);
          acc = std::fma(c, a.s[b], acc);
        }
      }
    }
    out[r] = acc;
  }
}

#if defined(__AVX2__)

#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define VNNI 1
#else
#define VNNI 0
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && VNNI
#define WIDE 1  // a 512-bit kernel: a group's 16 lanes in one vector
#else
#define WIDE 0
#endif

// 256-bit vectors: 8 lanes, half a group.
struct Y {
  using I = __m256i;
  using F = __m256;
  static constexpr int W = 8;
#if defined(__AVX512VL__)
  static constexpr int TILE = 8;  // activation rows a pass over a group (32 vector registers)
#else
  static constexpr int TILE = 4;  // (16 registers: 8 unpacked vectors, the accumulators, the scales)
#endif
  static I load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I zero() { return _mm256_setzero_si256(); }
  static I bytes(int8_t b) { return _mm256_set1_epi8(b); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  template <int n> static I shl16(I a) { return n >= 0 ? _mm256_slli_epi16(a, n) : _mm256_srli_epi16(a, -n); }
  template <int n> static I shl32(I a) { return _mm256_slli_epi32(a, n); }
  template <int n> static I sar32(I a) { return _mm256_srai_epi32(a, n); }
  template <int n> static I shr32(I a) { return _mm256_srli_epi32(a, n); }
  static I lanes(int32_t v) { return _mm256_set1_epi32(v); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm256_mullo_epi32(a, b); }
  static I u8_lanes(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
  static I u8_pairs(const uint8_t* p) { return _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I i8_pairs(const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I bcast(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  // acc + the products of pairs of int16 (a, b): exact in int32 for the values here
  static I madd(I acc, I a, I b) { return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b)); }
  // acc + the 4-product sums of w's unsigned bytes and the 4 signed bytes at x broadcast, per lane
  static I dot4(I acc, I w, const int8_t* x) {
#if VNNI && defined(__AVX512VL__)
    // the broadcast folded into the multiply-add's memory operand (EVEX {1to8}): GCC does not fold set1 into
    // vpdpbusd itself, and a separate vpbroadcastd per 32 products took a third of the instructions of wide passes
    asm("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
#elif VNNI
    return _mm256_dpbusd_avx_epi32(acc, w, bcast(x));
#else
    // pairs of products as int16 (|w| <= 128 and |x| <= 127 keep them below 2^15: exact), then pairs of pairs
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, bcast(x)), _mm256_set1_epi16(1)));
#endif
  }
  // the pairs of products of w's unsigned bytes and x's 4 signed bytes broadcast, as int16 (exact: w < 64)
  static I products16(I w, const int8_t* x) { return _mm256_maddubs_epi16(w, bcast(x)); }
  static F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static F halves(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static F set(float v) { return _mm256_set1_ps(v); }
  static F zerof() { return _mm256_setzero_ps(); }
  static F mulf(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
};

#if WIDE
// 512-bit vectors: a group's 16 lanes.
struct Z {
  using I = __m512i;
  using F = __m512;
  static constexpr int W = 16;
  static constexpr int TILE = 16;  // 16 accumulators, 8 unpacked vectors and a few more in 32 registers
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I zero() { return _mm512_setzero_si512(); }
  static I bytes(int8_t b) { return _mm512_set1_epi8(b); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  template <int n> static I shl16(I a) { return n >= 0 ? _mm512_slli_epi16(a, n) : _mm512_srli_epi16(a, -n); }
  template <int n> static I shl32(I a) { return _mm512_slli_epi32(a, n); }
  template <int n> static I sar32(I a) { return _mm512_srai_epi32(a, n); }
  template <int n> static I shr32(I a) { return _mm512_srli_epi32(a, n); }
  static I lanes(int32_t v) { return _mm512_set1_epi32(v); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I mul(I a, I b) { return _mm512_mullo_epi32(a, b); }
  static I u8_lanes(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static I u8_pairs(const uint8_t* p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I i8_pairs(const uint8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static I bcast(const void* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  static I madd(I acc, I a, I b) { return _mm512_dpwssd_epi32(acc, a, b); }
  static I dot4(I acc, I w, const int8_t* x) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const int32_t*>(x)));
    return acc;
  }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F halves(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F set(float v) { return _mm512_set1_ps(v); }
  static F zerof() { return _mm512_setzero_ps(); }
  static F mulf(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void prefetch(const uint8_t* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1); }
};
#endif

// How far ahead the kernels ask for weights, into L2: a step streams every weight once from memory, and the
// hardware's own prefetching alone left one core at ~5-7 GB/s of its ~26 (Zen 4; 8 KB ahead reached ~14).
constexpr int64_t PREFETCH_BYTES = 8192;

// Block j of a super-block, lanes from `lane` on (0, or 8 for a 256-bit kernel's second half), unpacked to the 8
// vectors of codes: v[u] holds values 4u..4u+3 of every lane (see Super).
template <class V, int F>
inline void unpack(const uint8_t* sb, int64_t j, int lane, typename V::I* v) {
  constexpr Super s = SUPER[F];
  if constexpr (F == Q8_0) {
    for (int u = 0; u < 8; ++u) v[u] = V::load(sb + s.q + 64 * u + 4 * lane);
    return;
  } else {
    const auto low = V::bytes(0x0F);
    for (int t = 0; t < 4; ++t) {
      const auto packed = V::load(sb + s.q + 256 * j + 64 * t + 4 * lane);
      v[2 * t] = V::and_(packed, low);
      v[2 * t + 1] = V::and_(V::template shl16<-4>(packed), low);
    }
    if constexpr (s.hi_bits == 1) {
      const auto h = V::load(sb + s.hi + 64 * j + 4 * lane), bit = V::bytes(0x10);
      v[0] = V::or_(v[0], V::and_(V::template shl16<4>(h), bit));
      v[1] = V::or_(v[1], V::and_(V::template shl16<3>(h), bit));
      v[2] = V::or_(v[2], V::and_(V::template shl16<2>(h), bit));
      v[3] = V::or_(v[3], V::and_(V::template shl16<1>(h), bit));
      v[4] = V::or_(v[4], V::and_(h, bit));
      v[5] = V::or_(v[5], V::and_(V::template shl16<-1>(h), bit));
      v[6] = V::or_(v[6], V::and_(V::template shl16<-2>(h), bit));
      v[7] = V::or_(v[7], V::and_(V::template shl16<-3>(h), bit));
    } else if constexpr (s.hi_bits == 2) {
      const auto bits = V::bytes(0x30);
      for (int half = 0; half < 2; ++half) {
        const auto h = V::load(sb + s.hi + 128 * j + 64 * half + 4 * lane);
        auto* w = v + 4 * half;
        w[0] = V::or_(w[0], V::and_(V::template shl16<4>(h), bits));
        w[1] = V::or_(w[1], V::and_(V::template shl16<2>(h), bits));
        w[2] = V::or_(w[2], V::and_(h, bits));
        w[3] = V::or_(w[3], V::and_(V::template shl16<-2>(h), bits));
      }
    }
  }
}

// Activations rounded per 32 values, every format: rows m0 .. m0 + R - 1 against lanes lane .. lane + V::W - 1 of
// one group: out[m * ldo + lane]. A float step per 32-block (Q6_K: per 16-value half): its integer sum times the
// weights' scale times the activations', then the min (or offset) times the activations' sum.
template <class V, int F, int R>
void group_32(const Packed& w, const uint8_t* group, int lane, const Activations& a, int64_t m0, float* out,
              int64_t ldo) {
  using I = typename V::I;
  using FV = typename V::F;
  constexpr Super s = SUPER[F];
  constexpr int64_t per = s.values / QK;
  const int64_t K = a.inputs, nb = K / QK;
  const int8_t* xq = a.q + m0 * K;
  const float *xd = a.d + m0 * nb, *xs = a.s + m0 * nb, *x_lo = a.s_lo + m0 * nb, *x_hi = a.s_hi + m0 * nb;
  alignas(64) float acc[R][V::W] = {};  // in memory past 8 rows: the registers hold the weights and the products
  for (int64_t p = 0; p < w.super_blocks; ++p) {
    const uint8_t* sb = group + p * s.bytes;
    for (int64_t line = 0; line < s.bytes; line += 64) V::prefetch(sb + PREFETCH_BYTES + line);
    const FV d = V::halves(sb + s.d + 2 * lane);
    FV second = V::zerof();  // fp16 m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K)
    if constexpr (s.m >= 0) second = V::halves(sb + s.m + 2 * lane);
    for (int64_t j = 0; j < per; ++j) {
      const int64_t b = p * per + j;
      FV scale, scale_hi = V::zerof(), c, c_hi = V::zerof();
      if constexpr (F == Q6_K) {
        const I pairs = V::i8_pairs(sb + s.sc + j * 2 * LANES + 2 * lane);  // (sc_lo, sc_hi) int16 in each lane
        scale = V::mulf(d, V::cvt(V::template sar32<16>(V::template shl32<16>(pairs))));
        scale_hi = V::mulf(d, V::cvt(V::template sar32<16>(pairs)));
        c = V::mulf(scale, V::set(-32.f));
        c_hi = V::mulf(scale_hi, V::set(-32.f));
      } else if constexpr (s.sc >= 0) {
        scale = V::mulf(d, V::cvt(V::u8_lanes(sb + s.sc + j * LANES + lane)));
        const I mins = V::u8_pairs(sb + s.mn + (j / 2) * 2 * LANES + 2 * lane);  // (m_2k, m_2k+1) in each lane
        c = V::mulf(second, V::cvt(j % 2 ? V::template shr32<16>(mins) : V::and_(mins, V::lanes(0xFFFF))));
      } else {
        scale = d;
        if constexpr (s.m >= 0) c = second;
        else c = V::mulf(scale, V::set(static_cast<float>(-OFFSET[F])));
      }
      I v[8];
      unpack<V, F>(sb, j, lane, v);
#if !VNNI
      if constexpr (F == Q8_0)  // without VNNI: the signed q (code - 128), multiplied as |q| times x with q's sign
        for (int u = 0; u < 8; ++u) v[u] = V::xor_(v[u], V::bytes(static_cast<int8_t>(0x80)));
#endif
      UNROLL for (int m = 0; m < R; ++m) {
        const int8_t* x = xq + m * K + b * QK;
        const FV dx = V::set(xd[m * nb + b]);
        FV sum_m = V::loadf(acc[m]);
        if constexpr (F == Q6_K) {
          const I lo = V::dot4(V::dot4(V::dot4(V::dot4(V::zero(), v[0], x), v[1], x + 4), v[2], x + 8), v[3], x + 12);
          const I hi = V::dot4(V::dot4(V::dot4(V::dot4(V::zero(), v[4], x + 16), v[5], x + 20), v[6], x + 24),
                               v[7], x + 28);
          sum_m = V::fmadd(V::cvt(lo), V::mulf(scale, dx), sum_m);
          sum_m = V::fmadd(V::cvt(hi), V::mulf(scale_hi, dx), sum_m);
          sum_m = V::fmadd(c, V::set(x_lo[m * nb + b]), sum_m);
          V::store(acc[m], V::fmadd(c_hi, V::set(x_hi[m * nb + b]), sum_m));
          continue;
        }
        I sum;
#if !VNNI
        if constexpr (F == Q8_0) {  // vpmaddubsw would saturate on codes up to 255: sum q * x, then add 128 * sum(x)
          const __m256i ones = _mm256_set1_epi16(1);
          __m256i even = V::zero(), odd = V::zero();
          for (int u = 0; u < 8; ++u) {
            const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(v[u]), _mm256_sign_epi8(V::bcast(x + 4 * u), v[u]));
            if (u % 2) odd = _mm256_add_epi32(odd, _mm256_madd_epi16(pairs, ones));
            else even = _mm256_add_epi32(even, _mm256_madd_epi16(pairs, ones));
          }
          sum = V::add(V::add(even, odd), _mm256_set1_epi32(128 * a.sum[(m0 + m) * nb + b]));
        } else
#endif
        if constexpr (R >= 8) {  // one chain a row: R rows are enough chains in flight for the latency
          sum = V::dot4(V::zero(), v[0], x);
          for (int u = 1; u < 8; ++u) sum = V::dot4(sum, v[u], x + 4 * u);
        } else {  // two chains (one a row was 5-10% slower at 4-9 rows: the multiply-adds' latency)
          I even = V::dot4(V::zero(), v[0], x), odd = V::dot4(V::zero(), v[1], x + 4);
          even = V::dot4(V::dot4(V::dot4(even, v[2], x + 8), v[4], x + 16), v[6], x + 24);
          odd = V::dot4(V::dot4(V::dot4(odd, v[3], x + 12), v[5], x + 20), v[7], x + 28);
          sum = V::add(even, odd);
        }
        sum_m = V::fmadd(V::cvt(sum), V::mulf(scale, dx), sum_m);
        const FV block_sum = V::set(xs[m * nb + b]);
        if constexpr (s.sc >= 0) V::store(acc[m], V::fnmadd(c, block_sum, sum_m));
        else V::store(acc[m], V::fmadd(c, block_sum, sum_m));
      }
    }
  }
  for (int m = 0; m < R; ++m) V::store(out + m * ldo, V::loadf(acc[m]));
}

// A K-quant (256-value super-blocks): rows m0 .. m0 + R - 1 against lanes lane .. lane + V::W - 1 of one group.
// Per super-block: T[m] (int32 lanes) gathers the sub-blocks' integer sums times their scales; then the float step.
template <class V, int F, int R>
void group_256(const Packed& w, const uint8_t* group, int lane, const Activations& a, int64_t m0, float* out,
               int64_t ldo) {
  using I = typename V::I;
  using FV = typename V::F;
  constexpr Super s = SUPER[F];
  const int64_t K = a.inputs, nsb = K / 256;
  const int8_t* xq = a.kq + m0 * K;
  const float* xd = a.kd + m0 * nsb;
  alignas(64) float acc[R][V::W] = {};  // in memory: the registers hold T, the weights and the products
  for (int64_t p = 0; p < w.super_blocks; ++p) {
    const uint8_t* sb = group + p * s.bytes;
    for (int64_t line = 0; line < s.bytes; line += 64) V::prefetch(sb + PREFETCH_BYTES + line);
    I T[R];
    for (int m = 0; m < R; ++m) T[m] = V::zero();
    for (int j = 0; j < 8; ++j) {
      I v[8];
      unpack<V, F>(sb, j, lane, v);
      if constexpr (F == Q6_K) {
        const I pairs = V::i8_pairs(sb + s.sc + j * 2 * LANES + 2 * lane);  // (sc_lo, sc_hi) int16 in each lane
#if VNNI
        const I sc_lo = V::template sar32<16>(V::template shl32<16>(pairs)), sc_hi = V::template sar32<16>(pairs);
#else
        const I sc_lo = _mm256_blend_epi16(pairs, _mm256_slli_epi32(pairs, 16), 0xAA);  // sc_lo in both halves
        const I sc_hi = _mm256_blend_epi16(pairs, _mm256_srli_epi32(pairs, 16), 0x55);  // sc_hi in both halves
#endif
        UNROLL for (int m = 0; m < R; ++m) {
          const int8_t* x = xq + m * K + p * 256 + j * QK;
#if VNNI
          const I lo = V::dot4(V::dot4(V::dot4(V::dot4(V::zero(), v[0], x), v[1], x + 4), v[2], x + 8), v[3], x + 12);
          const I hi = V::dot4(V::dot4(V::dot4(V::dot4(V::zero(), v[4], x + 16), v[5], x + 20), v[6], x + 24),
                               v[7], x + 28);
          T[m] = V::add(T[m], V::add(V::mul(lo, sc_lo), V::mul(hi, sc_hi)));
#else  // the scale multiplies the pairs of products in vpmaddwd (where 1 would): no int32 multiply
          for (int u = 0; u < 8; ++u) T[m] = V::madd(T[m], V::products16(v[u], x + 4 * u), u < 4 ? sc_lo : sc_hi);
#endif
        }
      } else {
        const I sc = V::u8_lanes(sb + s.sc + j * LANES + lane);
#if !VNNI
        const I sc16 = V::or_(sc, V::template shl32<16>(sc));  // the scale in both int16 halves of each lane
#endif
        UNROLL for (int m = 0; m < R; ++m) {
          const int8_t* x = xq + m * K + p * 256 + j * QK;
#if VNNI
          I sum;
          if constexpr (R >= 8) {  // one chain a row: R rows are enough chains in flight for the latency
            sum = V::dot4(V::zero(), v[0], x);
            for (int u = 1; u < 8; ++u) sum = V::dot4(sum, v[u], x + 4 * u);
          } else {  // two chains
            I even = V::dot4(V::zero(), v[0], x), odd = V::dot4(V::zero(), v[1], x + 4);
            even = V::dot4(V::dot4(V::dot4(even, v[2], x + 8), v[4], x + 16), v[6], x + 24);
            odd = V::dot4(V::dot4(V::dot4(odd, v[3], x + 12), v[5], x + 20), v[7], x + 28);
            sum = V::add(even, odd);
          }
          T[m] = V::add(T[m], V::mul(sum, sc));
#else
          for (int u = 0; u < 8; ++u) T[m] = V::madd(T[m], V::products16(v[u], x + 4 * u), sc16);
#endif
        }
      }
    }
    const FV d = V::halves(sb + s.d + 2 * lane);
    if constexpr (F == Q6_K) {
      UNROLL for (int m = 0; m < R; ++m) {
        const int16_t* x16 = a.kx16 + (m0 + m) * (K / 16) + p * 16;
        I U = V::zero();
        for (int j = 0; j < 8; ++j) U = V::madd(U, V::i8_pairs(sb + s.sc + j * 2 * LANES + 2 * lane), V::bcast(x16 + 2 * j));
        const I offset_free = V::sub(T[m], V::template shl32<5>(U));  // T - 32 U
        V::store(acc[m], V::fmadd(V::cvt(offset_free), V::mulf(d, V::set(xd[m * nsb + p])), V::loadf(acc[m])));
      }
    } else {
      const FV dmin = V::halves(sb + s.m + 2 * lane);
      I mins[4];
      for (int k = 0; k < 4; ++k) mins[k] = V::u8_pairs(sb + s.mn + k * 2 * LANES + 2 * lane);
      UNROLL for (int m = 0; m < R; ++m) {
        const int16_t* x32 = a.kx32 + (m0 + m) * (K / QK) + p * 8;
        I U = V::zero();
        for (int k = 0; k < 4; ++k) U = V::madd(U, mins[k], V::bcast(x32 + 2 * k));
        const FV dx = V::set(xd[m * nsb + p]);
        const FV sum = V::fmadd(V::cvt(T[m]), V::mulf(d, dx), V::loadf(acc[m]));
        V::store(acc[m], V::fnmadd(V::cvt(U), V::mulf(dmin, dx), sum));
      }
    }
  }
  for (int m = 0; m < R; ++m) V::store(out + m * ldo, V::loadf(acc[m]));
}

// Rows m0 .. m0 + rows - 1 (a tile of 1..MAX rows) against lanes lane.. of one group: the kernel for that many rows.
template <class V, int F, int R, int MAX>
inline void tile_kernel(int64_t rows, const Packed& w, const uint8_t* group, int lane, const Activations& a,
                        int64_t m0, float* out, int64_t ldo) {
  if constexpr (R <= MAX) {
    if (rows != R) return tile_kernel<V, F, R + 1, MAX>(rows, w, group, lane, a, m0, out, ldo);
    if constexpr (is_k(F)) {
      if (a.kq != nullptr) return group_256<V, F, R>(w, group, lane, a, m0, out, ldo);
    }
    group_32<V, F, R>(w, group, lane, a, m0, out, ldo);
  } else {
    TORCH_CHECK(false, "row tile ", rows);
  }
}

// Activation rows [r0, r1) against groups [g0, g1) of one packed matrix, with V's vectors.
template <class V, int F>
void groups_simd(const Packed& w, int64_t g0, int64_t g1, const Activations& a, int64_t r0, int64_t r1, float* out,
                 int64_t ldo) {
  // (the 32-value formats' tiles stop at 8 rows: the K-quants' longer rows are where wide passes spend their time)
  constexpr int TILE = is_k(F) ? V::TILE : (V::TILE < 8 ? V::TILE : 8);
  const int64_t M = r1 - r0, tiles = (M + TILE - 1) / TILE, tile = (M + tiles - 1) / tiles;
  const int64_t group_bytes = w.super_blocks * SUPER[F].bytes;
  float spill[TILE * V::W];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* group = w.groups + g * group_bytes;
    for (int lane = 0; lane < LANES; lane += V::W) {
      const int64_t n0 = g * LANES + lane, valid = std::min<int64_t>(V::W, w.rows - n0);
      if (valid <= 0) break;
      for (int64_t m0 = r0; m0 < r1; m0 += tile) {  // tiles of equal size (17 rows: 9 + 8)
        const int64_t R = std::min(tile, r1 - m0);
        float* dst = valid == V::W ? out + m0 * ldo + n0 : spill;
        const int64_t stride = valid == V::W ? ldo : V::W;
        tile_kernel<V, F, 1, TILE>(R, w, group, lane, a, m0, dst, stride);
        if (valid != V::W)
          for (int64_t m = 0; m < R; ++m) std::memcpy(out + (m0 + m) * ldo + n0, spill + m * V::W, valid * sizeof(float));
      }
    }
  }
}

using GroupsKernel = void (*)(const Packed&, int64_t, int64_t, const Activations&, int64_t, int64_t, float*, int64_t);
template <class V>
constexpr GroupsKernel KERNELS[NUM_FORMATS] = {groups_simd<V, Q8_0>, groups_simd<V, Q4_0>, groups_simd<V, Q4_1>,
                                               groups_simd<V, Q5_0>, groups_simd<V, Q5_1>, groups_simd<V, Q4_K>,
                                               groups_simd<V, Q5_K>, groups_simd<V, Q6_K>};

// Which vectors the products use where both are built (the numbers are the same): 512-bit on Intel, where a core
// has two 512-bit multiply-add ports; 256-bit on AMD (Zen 4 splits a 512-bit operation in two: no gain, and our
// earlier 512-bit kernels measured slower there). set_vector_bits changes it (for comparisons).
#if WIDE
bool wide_vectors = __builtin_cpu_is("intel");
#endif
#endif  // __AVX2__

// The K-quants' activation blocks: 32 (a float scale per 32 values, a float step per 32-block: the default) or 256
// (llama.cpp's Q8_K: a float step per super-block, the scales in integers). Measured on Qwen2.5-Coder-1.5B
// (docs/bench/wide_pass_2026-12-05): 256 costs +1.2% perplexity against the float model (32: +0.02%), past the
// 0.3% bar, for a pass over 5-16 tokens a few percent cheaper; set_k_activation_block chooses (for measurements).
int64_t k_block = 32;

// Activation rows [r0, r1) against groups [g0, g1) of one packed matrix, into columns of out (row stride ldo; out
// points at the part's column 0).
void groups_range(const Packed& w, int64_t g0, int64_t g1, const Activations& a, int64_t r0, int64_t r1, float* out,
                  int64_t ldo, bool use_simd) {
#if defined(__AVX2__)
  if (use_simd) {
#if WIDE
    if (wide_vectors) return KERNELS<Z>[w.format](w, g0, g1, a, r0, r1, out, ldo);
#endif
    return KERNELS<Y>[w.format](w, g0, g1, a, r0, r1, out, ldo);
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
  bool per_32 = false, per_256 = false;
  for (size_t i = 0; i < packed.size(); ++i) {
    info(formats[i]);
    parts.push_back(view_packed(packed[i], formats[i], K));
    N += parts.back().rows;
    (is_k(formats[i]) && k_block == 256 ? per_256 : per_32) = true;
  }
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0) return out;
  const Activations a = quantize_activations(x, per_32, per_256);
  float* o = out.data_ptr<float>();
  // Long prompts go through in chunks of rows whose int8 activations fit in L2 (every group of weights reads all of
  // a chunk's rows: 330 rows of 8,960 inputs were 3 MB re-read per group, and prefill ran at half speed).
  const int64_t chunk = std::max<int64_t>(16, (CHUNK_BYTES / K) / 16 * 16);
  for (int64_t r0 = 0; r0 < M; r0 += chunk) {
    const int64_t r1 = std::min(M, r0 + chunk);
    int64_t column = 0;
    for (const Packed& w : parts) {
      at::parallel_for(0, w.count, 2, [&](int64_t g0, int64_t g1) {
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

// weight [N, K] float32 (K a multiple of 32) -> [N, K / 32 * 18] Q4_0 blocks, the bytes gguf's (and llama.cpp's
// reference) quantizer writes: d = (the value of largest magnitude, the first such) / -8, q = min(15, trunc(x / d +
// 8.5)), d rounded to fp16. For requantizing a draft's heavier matrices at load (model/quant.py lighten): gguf's
// numpy version took ~9 s for the 0.5B.
torch::Tensor quantize_q4_0(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) % QK == 0, "quantize_q4_0 takes [N, K] with K a multiple of 32");
  auto w = weight.to(torch::kFloat32).contiguous();
  const int64_t N = w.size(0), nb = w.size(1) / QK;
  auto out = torch::empty({N, nb * 18}, torch::kUInt8);
  const float* src = w.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, N * nb, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* x = src + i * QK;
      float max = 0.f, amax = 0.f;
      for (int j = 0; j < QK; ++j)
        if (std::fabs(x[j]) > amax) amax = std::fabs(x[j]), max = x[j];
      const float d = max / -8.f;
      const float id = d == 0.f ? 0.f : 1.f / d;
      uint8_t* block = dst + i * 18;
      const uint16_t half = c10::Half(d).x;  // round to nearest even, as numpy's astype(float16)
      std::memcpy(block, &half, 2);
      for (int j = 0; j < 16; ++j) {
        const int lo = std::min(15, static_cast<int>(std::trunc(x[j] * id + 8.5f)));
        const int hi = std::min(15, static_cast<int>(std::trunc(x[j + 16] * id + 8.5f)));
        block[2 + j] = static_cast<uint8_t>(lo | (hi << 4));
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
#if defined(__AVX2__) && WIDE
  if (wide_vectors) return "avx512+vnni";  // 512-bit vectors, vpdpbusd
#endif
#if defined(__AVX2__) && VNNI
  return "avx2+vnni";  // 256-bit vectors, vpdpbusd for the integer multiply-adds
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// The vector width the products use (512 or 256; 0 without AVX2), and a way to choose it where both are built.
int64_t vector_bits() {
#if defined(__AVX2__) && WIDE
  return wide_vectors ? 512 : 256;
#elif defined(__AVX2__)
  return 256;
#else
  return 0;
#endif
}

void set_k_activation_block(int64_t values) {
  TORCH_CHECK(values == 32 || values == 256, "the K-quants' activation block is 32 or 256 values, got ", values);
  k_block = values;
}

int64_t k_activation_block() { return k_block; }

void set_vector_bits(int64_t bits) {
#if defined(__AVX2__) && WIDE
  TORCH_CHECK(bits == 256 || bits == 512, "vector bits must be 256 or 512, got ", bits);
  wide_vectors = bits == 512;
#else
  TORCH_CHECK(bits == vector_bits(), "this build has only ", vector_bits(), "-bit products");
#endif
}

// The core's int8 multiply-add rate (MACs/s) with the instructions and vector width the products use: 12
// independent chains of vpdpbusd (AVX2: vpmaddubsw + vpmaddwd + vpaddd) for about `seconds`, the best of 3 tries.
// What a pass's multiply-adds are compared with (bench --speed: the share of the arithmetic limit).
double int8_peak_macs(double seconds) {
#if defined(__AVX2__)
  auto run = [](auto tag, int64_t iterations) {
    using V = decltype(tag);
    using I = typename V::I;
    I acc[12];
    for (auto& a : acc) a = V::zero();
    const I w = V::bytes(3);
    const int8_t x[4] = {1, 2, 3, 4};
    for (int64_t i = 0; i < iterations; ++i) {
      UNROLL for (int k = 0; k < 12; ++k) acc[k] = V::dot4(acc[k], w, x);
      for (auto& a : acc) asm volatile("" : "+v"(a));  // the chains stay in registers, every step happens
    }
    return 12.0 * iterations * 4 * V::W;  // MACs
  };
  double best = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    const int64_t iterations = 2000000;
    timespec start, end;  // the thread's CPU time: on a shared core, waiting for it is not the core's rate
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
    double macs;
#if WIDE
    if (wide_vectors) macs = run(Z{}, iterations);
    else
#endif
      macs = run(Y{}, iterations);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
    const double elapsed = static_cast<double>(end.tv_sec - start.tv_sec) + 1e-9 * (end.tv_nsec - start.tv_nsec);
    best = std::max(best, macs / elapsed);
    if (elapsed * (attempt + 1) > seconds) break;
  }
  return best;
#else
  (void)seconds;
  return 0.0;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "x [M, K] @ dequantized(weight [N, K]).T -> [M, N] float32");
  m.def("pack", &pack, "rows of GGUF blocks -> the packed matrix the products read");
  m.def("qmatmul_parts", &qmatmul_parts, "x [M, K] @ the stacked dequantized parts .T -> [M, sum N] float32");
  m.def("dequantize_rows", &dequantize_rows, "rows of a quantized matrix as float32");
  m.def("quantize_q4_0", &quantize_q4_0, "float32 [N, K] -> Q4_0 blocks, as gguf's quantizer writes them");
  m.def("attention", &attention, "a cached forward's attention over the paged KV cache, in place",
        py::arg("q"), py::arg("keys"), py::arg("values"), py::arg("tables"), py::arg("lengths"), py::arg("pending"),
        py::arg("visible"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("new_tokens"),
        py::arg("use_simd") = true);
  m.def("layer_step", &layer_step, "one decoder layer over a cached forward's new tokens, in place");
  m.def("kernel_timing", &kernel_timing, "time layer_step's parts (the sums reset)", py::arg("on"));
  m.def("kernel_times", &kernel_times, "seconds in layer_step's products, attention and the rest so far");
  m.def("race_argmax", &race_argmax, "a seeded sample per row by the exponential race (Gumbel-max)");
  m.def("has_simd", &has_simd);
  m.def("instruction_set", &instruction_set);
  m.def("vector_bits", &vector_bits, "the vector width the products use: 512, 256, or 0 (scalar)");
  m.def("int8_peak_macs", &int8_peak_macs, "the core's int8 multiply-adds a second, as the products issue them",
        py::arg("seconds") = 0.1);
  m.def("set_k_activation_block", &set_k_activation_block, "round K-quant activations per 32 or per 256 values");
  m.def("k_activation_block", &k_activation_block);
  m.def("set_vector_bits", &set_vector_bits, "choose 512- or 256-bit products where both are built");
}
