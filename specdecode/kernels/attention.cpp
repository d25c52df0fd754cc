// Attention of a cached forward's new tokens over the paged KV cache, read in place: prefill chunks, verify passes
// over draft trees and one-token steps all run here (layer.cpp calls it; `attention` exposes it for the tests).
//
// The flash-attention recurrence over tiles of 16 positions: each query row keeps a running max m, a running sum l
// and an accumulator acc [hd]; a tile's scores s = q.k, then m' = max(m, max s), alpha = exp(m - m'),
// p = exp(s - m'), l = l * alpha + sum p, acc = acc * alpha + p.V; at the end out = acc / l. The query heads that
// share a kv head, and up to TOKENS_PER_ITEM new tokens of a row, are stacked as the rows of each tile's products, so
// a key or value is read once per stack instead of once per (token, head); no mask is built and no copy gathered.
//
// Exactness (batch invariance): a row's numbers depend only on what it sees, never on which other rows share its
// tiles, how many new tokens the forward has, the chunking of a prefill or where the blocks sit. Each row walks
// its *logical* positions - the committed prefix, then the fresh positions it sees, in order - in tiles aligned to
// multiples of 16, so a draft-tree node whose ancestors sit at scattered fresh slots walks the same tiles, with the
// same keys, as the same token decoded after those ancestors were committed to consecutive positions. Within a
// tile: each score is one chain of FMAs over d (lanes are positions); sum p is a fixed pairwise tree; acc's lanes
// (d) each add p_j v_j[d] in order of j; positions a row does not see contribute exact zeros. The scalar reference
// does the same operations in the same order, so every SIMD path (512- or 256-bit) gives its bits.
//
// Cost, Qwen2.5-Coder-1.5B (12 heads, 2 kv heads, head dim 128, 28 layers): 4 * L * 1,536 * 28 multiply-adds a new
// token at context L, half in q.k, half in p.V, in float32 (16-bit caches widen exactly on load). On a 2-core AMD
// EPYC (Zen 4, 256-bit path), one thread: 50-79 GFLOP/s at prefill and verify widths (~50-70% of the float32
// peak), ~23 at one-token decode over 16k positions (waiting on the cache); the 1.5B prefilled 4,096 tokens at 47
// tok/s, 61 at 512 (a 512-token chunk at context 3.6k: 21 tok/s with the per-(token, head) kernel before this).
// Measured with docs/bench/long_prompt_2026-12-07/attention_bench.py and `specdecode bench long`.
#include "quant.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

constexpr int64_t TILE = 16;  // logical positions per tile
constexpr int64_t TOKENS_PER_ITEM = 8;
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 1
#endif  // new tokens of a row stacked (with their heads) into one work item

// Where one (row, kv head)'s keys and values live: keys [blocks][kv_heads][hd][bs] (transposed), values
// [blocks][kv_heads][bs][hd]; position p of the row is offset p % bs of block table[p / bs].
template <typename E>
struct Source {
  const E* keys;
  const E* values;
  const int64_t* table;
  int64_t bs, hd, g, kv_heads;
  int64_t rows;  // values stored per position and kv head: hd, or for an 8-bit cache hd and its scales' bytes
  const E* key(int64_t pos) const {  // &K[pos][0]; its d-th value at + d * bs
    return keys + ((table[pos / bs] * kv_heads + g) * rows) * bs + pos % bs;
  }
  const E* value(int64_t pos) const {  // &V[pos][0], hd contiguous values
    return values + ((table[pos / bs] * kv_heads + g) * bs + pos % bs) * rows;
  }
};

// What a tile of the cache's element type E is computed in: E itself (float32, or 16-bit values widened exactly
// as they are read), float for the 8-bit cache (each tile dequantized once, then shared by every row of a stack).
template <typename E> struct TileOf { using type = E; };
template <> struct TileOf<int8_t> { using type = float; };

// Asks for the keys and values of the 16 positions from `pos` (all in one block) while the tile before is computed:
// a tile's keys are a page of their own in the paged layout, which the hardware prefetchers do not enter on their
// own, and without this a long context's decode step waited on memory more than it computed.
template <typename E>
inline void prefetch_tile(const Source<E>& src, int64_t pos) {
#if defined(__AVX2__)
  const char* k = reinterpret_cast<const char*>(src.key(pos));
  const int64_t k_row = src.bs * static_cast<int64_t>(sizeof(E));  // bytes between d and d + 1
  const int64_t step = k_row >= 64 ? 1 : 64 / k_row;
  for (int64_t d = 0; d < src.rows; d += step) _mm_prefetch(k + d * k_row, _MM_HINT_T0);
  const char* v = reinterpret_cast<const char*>(src.value(pos));
  for (int64_t at = 0; at < TILE * src.rows * static_cast<int64_t>(sizeof(E)); at += 64)
    _mm_prefetch(v + at, _MM_HINT_T0);
#else
  (void)src, (void)pos;
#endif
}

// One tile's keys and values as the products read them: k + d * k_stride + j is position j's d-th key value,
// v + j * hd its values; n positions are real (keys past n are zeros when gathered, never read as values).
template <typename E>
struct Tile {
  const E* k;
  int64_t k_stride;
  const E* v;
  int64_t n;
};

// The tile of logical positions [first, first + n): read in place when they are physical positions in one block
// (every committed position, every causal fresh one), else gathered into kbuf [hd][TILE] / vbuf [TILE][hd]
// (physical(i) maps a logical position to where it is stored: a tree's fresh nodes).
template <typename E, typename Map>
Tile<E> tile_at(const Source<E>& src, int64_t first, int64_t n, bool identity, Map physical, E* kbuf, E* vbuf) {
  const int64_t bs = src.bs, hd = src.hd;
  if (identity && first % bs + TILE <= bs) return {src.key(first), bs, src.value(first), n};  // (keys past n unread)
  for (int64_t j = 0; j < TILE; ++j) {
    if (j < n) {
      const int64_t pos = identity ? first + j : physical(first + j);
      const E* k = src.key(pos);
      for (int64_t d = 0; d < hd; ++d) kbuf[d * TILE + j] = k[d * bs];
      std::memcpy(vbuf + j * hd, src.value(pos), hd * sizeof(E));
    } else {
      for (int64_t d = 0; d < hd; ++d) kbuf[d * TILE + j] = narrow<E>(0.0f);
    }
  }
  return {kbuf, TILE, vbuf, n};
}

// The 8-bit cache's tile of logical positions [first, first + n), dequantized into kbuf [hd][TILE] / vbuf
// [TILE][hd]: value = scale * q, exact in float32 (a float16 scale times an 8-bit integer fits its 24 bits), so a
// tile holds the very numbers a float32 cache of the dequantized entries would, and every path gives their bits.
template <typename Map>
Tile<float> tile_at(const Source<int8_t>& src, int64_t first, int64_t n, bool identity, Map physical, float* kbuf,
                    float* vbuf) {
  const int64_t bs = src.bs, hd = src.hd;
  for (int64_t j = 0; j < TILE; ++j) {
    if (j < n) {
      const int64_t pos = identity ? first + j : physical(first + j);
      const int8_t* k = src.key(pos);
      const int8_t* v = src.value(pos);
      for (int64_t b = 0; b < hd / Q8_GROUP; ++b) {
        const float ks = q8_scale(k[(hd + 2 * b) * bs], k[(hd + 2 * b + 1) * bs]);
        const float vs = q8_scale(v[hd + 2 * b], v[hd + 2 * b + 1]);
        for (int64_t d = b * Q8_GROUP; d < (b + 1) * Q8_GROUP; ++d) {
          kbuf[d * TILE + j] = ks * static_cast<float>(k[d * bs]);
          vbuf[j * hd + d] = vs * static_cast<float>(v[d]);
        }
      }
    } else {
      for (int64_t d = 0; d < hd; ++d) kbuf[d * TILE + j] = 0.0f;
    }
  }
  return {kbuf, TILE, vbuf, n};
}

// ---- the three per-tile operations, each as the scalar reference and its vector forms -------------------------

// s[r][j] = sum over d of q[r][d] * k[d][j], one FMA chain per (r, j) in order of d.
template <typename E>
void scores_scalar(const float* const* q, int64_t rows, const Tile<E>& t, int64_t hd, float* s) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < TILE; ++j) {
      float acc = 0.0f;
      for (int64_t d = 0; d < hd; ++d) acc = std::fma(q[r][d], widen(t.k[d * t.k_stride + j]), acc);
      s[r * TILE + j] = acc;
    }
}

// acc[r][:] = acc[r][:] * alpha[r], then += p[r][j] * v[j][:] for j < n in order.
template <typename E>
void values_scalar(float* const* acc, const float* alpha, const float* p, int64_t rows, const Tile<E>& t,
                   int64_t hd) {
  for (int64_t r = 0; r < rows; ++r) {
    float* a = acc[r];
    for (int64_t d = 0; d < hd; ++d) a[d] *= alpha[r];
    for (int64_t j = 0; j < t.n; ++j) {
      const float pj = p[r * TILE + j];
      const E* v = t.v + j * hd;
      for (int64_t d = 0; d < hd; ++d) a[d] = std::fma(pj, widen(v[d]), a[d]);
    }
  }
}

// The sum of a tile's 16 p's as a fixed tree: halves, quarters, eighths, then the last pair.
inline float sum16_scalar(const float* p) {
  float h[8], q[4];
  for (int i = 0; i < 8; ++i) h[i] = p[i] + p[i + 8];
  for (int i = 0; i < 4; ++i) q[i] = h[i] + h[i + 4];
  return (q[0] + q[2]) + (q[1] + q[3]);
}

#if defined(__AVX2__) && defined(__FMA__)
inline float sum16_avx2(__m256 lo, __m256 hi) {
  const __m256 h = _mm256_add_ps(lo, hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // q[i] = h[i] + h[i + 4]
  const __m128 e = _mm_add_ps(q, _mm_movehl_ps(q, q));  // (q0 + q2, q1 + q3)
  return _mm_cvtss_f32(_mm_add_ss(e, _mm_movehdup_ps(e)));
}

// 256-bit: RB rows at a time (6, 4, 3, 2, 1: no row computed twice), 16 positions as two vectors each (up to 12
// independent FMA chains: a kv group's 6 query heads of one token fill the 16 registers with its two keys and q).
template <int RB, typename E>
void scores_avx2_rows(const float* const* q, const Tile<E>& t, int64_t hd, float* s) {
  __m256 a[RB][2];
  UNROLL for (int i = 0; i < RB; ++i) a[i][0] = a[i][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    const E* k = t.k + d * t.k_stride;
    const __m256 k0 = load8(k), k1 = load8(k + 8);
    UNROLL for (int i = 0; i < RB; ++i) {
      const __m256 qd = _mm256_broadcast_ss(q[i] + d);
      a[i][0] = _mm256_fmadd_ps(qd, k0, a[i][0]);
      a[i][1] = _mm256_fmadd_ps(qd, k1, a[i][1]);
    }
  }
  UNROLL for (int i = 0; i < RB; ++i) {
    _mm256_storeu_ps(s + i * TILE, a[i][0]);
    _mm256_storeu_ps(s + i * TILE + 8, a[i][1]);
  }
}

template <typename E>
void scores_avx2(const float* const* q, int64_t rows, const Tile<E>& t, int64_t hd, float* s) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) scores_avx2_rows<6>(q + r, t, hd, s + r * TILE);
  if (r + 4 <= rows) scores_avx2_rows<4>(q + r, t, hd, s + r * TILE), r += 4;
  if (r + 3 <= rows) scores_avx2_rows<3>(q + r, t, hd, s + r * TILE), r += 3;
  if (r + 2 <= rows) scores_avx2_rows<2>(q + r, t, hd, s + r * TILE), r += 2;
  if (r < rows) scores_avx2_rows<1>(q + r, t, hd, s + r * TILE);
}

// RB rows (6, 4, 3, 2, 1: a compile-time count, so the accumulators stay in registers) x 16 values of d at a time:
// up to 12 independent FMA chains, each over j in order.
template <int RB, typename E>
void values_avx2_rows(float* const* acc, const float* alpha, const float* p, const Tile<E>& t, int64_t hd) {
  for (int64_t d = 0; d < hd; d += 16) {
    const bool two = d + 16 <= hd;  // hd % 8 == 0: the last step may be one vector
    __m256 a[RB][2];
    UNROLL for (int i = 0; i < RB; ++i) {
      const __m256 scale = _mm256_set1_ps(alpha[i]);
      a[i][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d), scale);
      a[i][1] = two ? _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d + 8), scale) : _mm256_setzero_ps();
    }
    for (int64_t j = 0; j < t.n; ++j) {
      const E* v = t.v + j * hd + d;
      const __m256 v0 = load8(v), v1 = two ? load8(v + 8) : _mm256_setzero_ps();
      UNROLL for (int i = 0; i < RB; ++i) {
        const __m256 pj = _mm256_broadcast_ss(p + i * TILE + j);
        a[i][0] = _mm256_fmadd_ps(pj, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(pj, v1, a[i][1]);
      }
    }
    UNROLL for (int i = 0; i < RB; ++i) {
      _mm256_storeu_ps(acc[i] + d, a[i][0]);
      if (two) _mm256_storeu_ps(acc[i] + d + 8, a[i][1]);
    }
  }
}

template <typename E>
void values_avx2(float* const* acc, const float* alpha, const float* p, int64_t rows, const Tile<E>& t, int64_t hd) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) values_avx2_rows<6>(acc + r, alpha + r, p + r * TILE, t, hd);
  if (r + 4 <= rows) values_avx2_rows<4>(acc + r, alpha + r, p + r * TILE, t, hd), r += 4;
  if (r + 3 <= rows) values_avx2_rows<3>(acc + r, alpha + r, p + r * TILE, t, hd), r += 3;
  if (r + 2 <= rows) values_avx2_rows<2>(acc + r, alpha + r, p + r * TILE, t, hd), r += 2;
  if (r < rows) values_avx2_rows<1>(acc + r, alpha + r, p + r * TILE, t, hd);
}
#endif

#if defined(__AVX512F__)

// 512-bit: RB rows at a time (12, 8, 6, 4, 2, 1: no row computed twice), one vector of 16 positions each.
template <int RB, typename E>
void scores_avx512_rows(const float* const* q, const Tile<E>& t, int64_t hd, float* s) {
  __m512 a[RB];
  UNROLL for (int i = 0; i < RB; ++i) a[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < hd; ++d) {
    const __m512 k = load16(t.k + d * t.k_stride);
    UNROLL for (int i = 0; i < RB; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(q[i][d]), k, a[i]);
  }
  UNROLL for (int i = 0; i < RB; ++i) _mm512_storeu_ps(s + i * TILE, a[i]);
}

template <typename E>
void scores_avx512(const float* const* q, int64_t rows, const Tile<E>& t, int64_t hd, float* s) {
  int64_t r = 0;
  for (; r + 12 <= rows; r += 12) scores_avx512_rows<12>(q + r, t, hd, s + r * TILE);
  if (r + 8 <= rows) scores_avx512_rows<8>(q + r, t, hd, s + r * TILE), r += 8;
  if (r + 6 <= rows) scores_avx512_rows<6>(q + r, t, hd, s + r * TILE), r += 6;
  if (r + 4 <= rows) scores_avx512_rows<4>(q + r, t, hd, s + r * TILE), r += 4;
  if (r + 2 <= rows) scores_avx512_rows<2>(q + r, t, hd, s + r * TILE), r += 2;
  if (r < rows) scores_avx512_rows<1>(q + r, t, hd, s + r * TILE);
}

// RB rows x 32 values of d at a time: up to 12 independent FMA chains.
template <int RB, typename E>
void values_avx512_rows(float* const* acc, const float* alpha, const float* p, const Tile<E>& t, int64_t hd) {
  for (int64_t d = 0; d < hd; d += 32) {
    const bool two = d + 32 <= hd;  // hd % 16 == 0: the last step may be one vector
    __m512 a[RB][2];
    UNROLL for (int i = 0; i < RB; ++i) {
      const __m512 scale = _mm512_set1_ps(alpha[i]);
      a[i][0] = _mm512_mul_ps(_mm512_loadu_ps(acc[i] + d), scale);
      a[i][1] = two ? _mm512_mul_ps(_mm512_loadu_ps(acc[i] + d + 16), scale) : _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < t.n; ++j) {
      const E* v = t.v + j * hd + d;
      const __m512 v0 = load16(v), v1 = two ? load16(v + 16) : _mm512_setzero_ps();
      UNROLL for (int i = 0; i < RB; ++i) {
        const __m512 pj = _mm512_set1_ps(p[i * TILE + j]);
        a[i][0] = _mm512_fmadd_ps(pj, v0, a[i][0]);
        a[i][1] = _mm512_fmadd_ps(pj, v1, a[i][1]);
      }
    }
    UNROLL for (int i = 0; i < RB; ++i) {
      _mm512_storeu_ps(acc[i] + d, a[i][0]);
      if (two) _mm512_storeu_ps(acc[i] + d + 16, a[i][1]);
    }
  }
}

template <typename E>
void values_avx512(float* const* acc, const float* alpha, const float* p, int64_t rows, const Tile<E>& t,
                   int64_t hd) {
  int64_t r = 0;
  for (; r + 6 <= rows; r += 6) values_avx512_rows<6>(acc + r, alpha + r, p + r * TILE, t, hd);
  if (r + 4 <= rows) values_avx512_rows<4>(acc + r, alpha + r, p + r * TILE, t, hd), r += 4;
  if (r + 2 <= rows) values_avx512_rows<2>(acc + r, alpha + r, p + r * TILE, t, hd), r += 2;
  if (r < rows) values_avx512_rows<1>(acc + r, alpha + r, p + r * TILE, t, hd);
}
#endif

enum class Path { scalar, avx2, avx512 };

Path simd_path(bool use_simd, int64_t hd) {
  if (!use_simd) return Path::scalar;
#if defined(__AVX512F__)
  if (vector_bits() == 512 && hd % 16 == 0) return Path::avx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (hd % 8 == 0) return Path::avx2;
#endif
  return Path::scalar;
}

// The running state of a stack of query rows over one kv head.
struct Rows {
  int64_t n = 0, hd = 0;
  std::vector<const float*> q;  // [n] scaled queries [hd]
  std::vector<float*> acc;  // [n] accumulators [hd]
  std::vector<int64_t> seen;  // [n] how many logical positions each row sees
  std::vector<float> m, l, alpha, s;  // [n], [n], [n], [n][TILE] (scores, then p)
  std::vector<float> shift, total;  // [n] scratch of the vector softmax step: m - top, sum16(p)
};

// The softmax step of one tile for rows [r0, r1), their scores in s: top = max(m, the scores the row sees),
// p = exp(s - top) where it sees (else 0), alpha = exp(m - top), l = l * alpha + sum16(p), m = top. A row that sees
// nothing of the tile keeps its state (p = 0, alpha = 1).
void softmax_scalar(Rows& rows, int64_t r0, int64_t r1, int64_t first) {
  for (int64_t r = r0; r < r1; ++r) {
    float* sr = rows.s.data() + r * TILE;
    const int64_t visible = std::min(TILE, rows.seen[r] - first);  // the row's positions in this tile: [0, visible)
    if (visible <= 0) {
      for (int64_t j = 0; j < TILE; ++j) sr[j] = 0.0f;
      rows.alpha[r] = 1.0f;
      continue;
    }
    float top = rows.m[r];
    for (int64_t j = 0; j < visible; ++j) top = std::max(top, sr[j]);
    for (int64_t j = 0; j < TILE; ++j) sr[j] = j < visible ? exp1(sr[j] - top) : 0.0f;
    const float alpha = exp1(rows.m[r] - top);  // 0 on the row's first tile (m = -inf)
    rows.l[r] = rows.l[r] * alpha + sum16_scalar(sr);
    rows.m[r] = top;
    rows.alpha[r] = alpha;
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// The same, a row's 16 scores as two vectors, the alphas of 8 rows by one vector exponential.
void softmax_avx2(Rows& rows, int64_t r0, int64_t r1, int64_t first) {
  const __m256i lanes_lo = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i lanes_hi = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
  for (int64_t r = r0; r < r1; ++r) {
    float* sr = rows.s.data() + r * TILE;
    const int64_t visible = std::min(TILE, rows.seen[r] - first);
    if (visible <= 0) {
      _mm256_storeu_ps(sr, _mm256_setzero_ps());
      _mm256_storeu_ps(sr + 8, _mm256_setzero_ps());
      rows.total[r] = 0.0f, rows.shift[r] = 0.0f;  // alpha = exp(0) = 1
      continue;
    }
    const __m256i seen = _mm256_set1_epi32(static_cast<int>(visible));
    const __m256 lo = _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(sr),
                                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, lanes_lo)));
    const __m256 hi = _mm256_blendv_ps(minus_inf, _mm256_loadu_ps(sr + 8),
                                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen, lanes_hi)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(_mm256_max_ps(lo, hi)),
                           _mm256_extractf128_ps(_mm256_max_ps(lo, hi), 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float top = std::max(rows.m[r], _mm_cvtss_f32(m4));
    const __m256 top8 = _mm256_set1_ps(top);
    const __m256 p_lo = exp256(_mm256_sub_ps(lo, top8)), p_hi = exp256(_mm256_sub_ps(hi, top8));  // unseen: 0
    _mm256_storeu_ps(sr, p_lo);
    _mm256_storeu_ps(sr + 8, p_hi);
    rows.total[r] = sum16_avx2(p_lo, p_hi);
    rows.shift[r] = rows.m[r] - top;
    rows.m[r] = top;
  }
  int64_t r = r0;
  for (; r + 8 <= r1; r += 8) _mm256_storeu_ps(&rows.alpha[r], exp256(_mm256_loadu_ps(&rows.shift[r])));
  for (; r < r1; ++r) rows.alpha[r] = exp1(rows.shift[r]);
  for (r = r0; r < r1; ++r) rows.l[r] = rows.l[r] * rows.alpha[r] + rows.total[r];
}
#endif

// One tile for the rows [r0, r1) of `rows`: scores, the softmax step, the values.
template <typename E>
void step_tile(Rows& rows, int64_t r0, int64_t r1, int64_t first, const Tile<E>& t, Path path) {
  const int64_t hd = rows.hd, n = r1 - r0;
  const float* const* q = rows.q.data() + r0;
  float* s = rows.s.data() + r0 * TILE;
  switch (path) {
#if defined(__AVX512F__)
    case Path::avx512: scores_avx512(q, n, t, hd, s); break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case Path::avx2: scores_avx2(q, n, t, hd, s); break;
#endif
    default: scores_scalar(q, n, t, hd, s);
  }
#if defined(__AVX2__) && defined(__FMA__)
  if (path != Path::scalar) softmax_avx2(rows, r0, r1, first);
  else
#endif
    softmax_scalar(rows, r0, r1, first);
  float* const* acc = rows.acc.data() + r0;
  const float* alpha = rows.alpha.data() + r0;
  switch (path) {
#if defined(__AVX512F__)
    case Path::avx512: values_avx512(acc, alpha, s, n, t, hd); break;
#endif
#if defined(__AVX2__) && defined(__FMA__)
    case Path::avx2: values_avx2(acc, alpha, s, n, t, hd); break;
#endif
    default: values_scalar(acc, alpha, s, n, t, hd);
  }
}

template <typename E>
void attend_all(const AttentionStep& step, const E* keys, const E* values, const float* q_data, float* out,
                bool use_simd) {
  const int64_t B = step.B, T = step.T, H = step.H, G = step.G, hd = step.hd, group = H / G;
  const int64_t fresh = step.pending + T;
  const int64_t blocks_per_row = (T + TOKENS_PER_ITEM - 1) / TOKENS_PER_ITEM;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const Path path = simd_path(use_simd, hd);
  at::parallel_for(0, B * G * blocks_per_row, 1, [&](int64_t begin, int64_t end) {
    const int64_t most = TOKENS_PER_ITEM * group;
    std::vector<float> q_buf(most * hd), acc_buf(most * hd);
    using T_ = typename TileOf<E>::type;
    std::vector<T_> kbuf(hd * TILE), vbuf(TILE * hd);
    std::vector<int64_t> where(fresh);  // a tree row's visible fresh slots, in order
    Rows rows;
    rows.hd = hd;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (G * blocks_per_row), g = item / blocks_per_row % G;
      const int64_t t0 = item % blocks_per_row * TOKENS_PER_ITEM, t1 = std::min(T, t0 + TOKENS_PER_ITEM);
      const int64_t prefix = step.length[b];
      const Source<E> src{keys, values, step.table + b * step.width, step.bs, hd, g, G, stored_rows<E>(hd)};
      rows.n = (t1 - t0) * group;
      rows.q.assign(rows.n, nullptr), rows.acc.assign(rows.n, nullptr), rows.seen.assign(rows.n, 0);
      rows.m.assign(rows.n, -INFINITY), rows.l.assign(rows.n, 0.0f), rows.alpha.assign(rows.n, 1.0f);
      rows.s.assign(rows.n * TILE, 0.0f), rows.shift.assign(rows.n, 0.0f), rows.total.assign(rows.n, 0.0f);
      for (int64_t t = t0; t < t1; ++t) {
        const bool* seen_fresh = step.mask ? step.mask + (b * T + t) * fresh : nullptr;
        int64_t n_fresh = step.pending + t + 1;  // causal: every fresh position up to its own
        if (seen_fresh) {
          n_fresh = 0;
          for (int64_t f = 0; f < fresh; ++f) n_fresh += seen_fresh[f];
        }
        for (int64_t h = 0; h < group; ++h) {
          const int64_t r = (t - t0) * group + h, head = g * group + h;
          float* qr = q_buf.data() + r * hd;
          const float* src_q = q_data + (b * T + t) * step.q_stride + head * hd;
          for (int64_t d = 0; d < hd; ++d) qr[d] = src_q[d] * scale;
          float* a = acc_buf.data() + r * hd;
          std::fill(a, a + hd, 0.0f);
          rows.q[r] = qr, rows.acc[r] = a, rows.seen[r] = prefix + n_fresh;
        }
      }
      int64_t shared_end = 0;  // tiles before it are read by every row of the item at their physical positions
      for (int64_t r = 0; r < rows.n; ++r) shared_end = std::max(shared_end, rows.seen[r]);
      auto identity = [](int64_t i) { return i; };
      if (step.mask) shared_end = prefix / TILE * TILE;  // a tree's fresh nodes: each token's own tiles below
      for (int64_t first = 0; first < shared_end; first += TILE) {
        const int64_t ahead = first + PREFETCH_TILES * TILE;
        if (ahead + TILE <= shared_end && ahead % step.bs + TILE <= step.bs) prefetch_tile(src, ahead);
        const Tile<T_> t = tile_at(src, first, std::min(TILE, shared_end - first), true, identity, kbuf.data(),
                                   vbuf.data());
        step_tile(rows, 0, rows.n, first, t, path);
      }
      if (step.mask) {  // per token: the prefix's last partial tile and its visible fresh nodes, compacted
        for (int64_t t = t0; t < t1; ++t) {
          const bool* seen_fresh = step.mask + (b * T + t) * fresh;
          int64_t n = 0;
          for (int64_t f = 0; f < fresh; ++f)
            if (seen_fresh[f]) where[n++] = prefix + f;
          auto physical = [&](int64_t i) { return i < prefix ? i : where[i - prefix]; };
          const int64_t r0 = (t - t0) * group, seen = prefix + n;
          for (int64_t first = shared_end; first < seen; first += TILE) {
            const Tile<T_> tile = tile_at(src, first, std::min(TILE, seen - first), false, physical, kbuf.data(),
                                          vbuf.data());
            step_tile(rows, r0, r0 + group, first, tile, path);
          }
        }
      }
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < group; ++h) {
          const int64_t r = (t - t0) * group + h, head = g * group + h;
          const float inv = 1.0f / rows.l[r];
          float* o = out + (b * T + t) * H * hd + head * hd;
          for (int64_t d = 0; d < hd; ++d) o[d] = rows.acc[r][d] * inv;
        }
    }
  });
}

}  // namespace

void check_attention_inputs(const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& tables,
                            const torch::Tensor& lengths, int64_t B, int64_t fresh) {
  TORCH_CHECK(keys.dtype() == values.dtype() && keys.is_contiguous() && values.is_contiguous() &&
              (keys.dtype() == torch::kFloat32 || keys.dtype() == torch::kBFloat16 ||
               keys.dtype() == torch::kFloat16 || keys.dtype() == torch::kInt8),
              "the cache must be contiguous float32, bfloat16, float16 or int8 (8-bit entries and their scales)");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && lengths.numel() == B, "one table and length per row");
  const int64_t bs = keys.size(3), num_blocks = keys.size(0), width = tables.size(1);
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (length[b] + fresh + bs - 1) / bs;
    TORCH_CHECK(used <= width, "the KV cache holds ", width * bs, " positions per row; this step needs ",
                length[b] + fresh);
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < num_blocks,
                  "row ", b, " has no KV-cache block for positions from ", i * bs, " (reserve them first)");
  }
}

void paged_attention(const AttentionStep& step, const torch::Tensor& keys, const torch::Tensor& values,
                     const float* q, float* out, bool use_simd) {
  if (keys.scalar_type() == torch::kFloat32)
    attend_all(step, keys.data_ptr<float>(), values.data_ptr<float>(), q, out, use_simd);
  else if (keys.scalar_type() == torch::kBFloat16)
    attend_all(step, keys.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>(), q, out, use_simd);
  else if (keys.scalar_type() == torch::kInt8)
    attend_all(step, keys.data_ptr<int8_t>(), values.data_ptr<int8_t>(), q, out, use_simd);
  else
    attend_all(step, keys.data_ptr<c10::Half>(), values.data_ptr<c10::Half>(), q, out, use_simd);
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                        const torch::Tensor& tables, const torch::Tensor& lengths, int64_t pending,
                        const c10::optional<torch::Tensor>& visible, int64_t num_heads, int64_t num_kv_heads,
                        int64_t new_tokens, bool use_simd) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && q.dim() == 2 && q.is_contiguous(), "q must be [B*T, H*hd] float32");
  const int64_t T = new_tokens, B = q.size(0) / T;
  const int64_t hd = keys.scalar_type() == torch::kInt8 ? keys.size(2) * Q8_GROUP / (Q8_GROUP + 2) : keys.size(2);
  auto table_list = tables.to(torch::kInt64).contiguous();
  auto length_list = lengths.to(torch::kInt64).contiguous();
  torch::Tensor mask_tensor;
  const bool* mask = nullptr;
  if (visible.has_value() && visible->defined()) {
    mask_tensor = visible->to(torch::kBool).contiguous();
    TORCH_CHECK(mask_tensor.numel() == B * T * (pending + T), "visible must be [B, T, pending + T]");
    mask = mask_tensor.data_ptr<bool>();
  }
  check_attention_inputs(keys, values, table_list, length_list, B, pending + T);
  const AttentionStep step{B, T, num_heads, num_kv_heads, hd, keys.size(3), tables.size(1), pending,
                           q.size(1), table_list.data_ptr<int64_t>(), length_list.data_ptr<int64_t>(), mask};
  auto out = torch::empty({B * T, num_heads * hd}, torch::kFloat32);
  paged_attention(step, keys, values, q.data_ptr<float>(), out.data_ptr<float>(), use_simd);
  return out;
}
