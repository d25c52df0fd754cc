// One Llama decoder layer over the new tokens of a cached forward, in one call: RMSNorm, the q/k/v product (with
// Qwen2's biases, Qwen3's per-head q/k RMSNorm), rotary, the cache write, attention over the cache, the output
// product and residual, RMSNorm, gate/up, SiLU-mul, the down product and residual. Python's version
// (model/llama.py + attention.py) runs ~60 operators a layer; here the only allocations are the products' outputs.
//
// Numbers: float32 throughout (the activations' dtype of a quantized model on CPU; the cache is float32 on CPU).
// Every token's result is computed by the same operations in the same order whatever else shares the forward
// (other rows, the row's other new tokens, how many there are): the products are quant.cpp's (batch-invariant),
// and attention runs per (token, head) over positions in order with a fixed exp. So a token's logits are the same
// in a one-token decode step and in a verify pass over a draft tree.
//
// Cache layout (model/cache.py): keys [blocks, kv_heads, head_dim, bs] (transposed), values [blocks, kv_heads, bs,
// head_dim]; row b's position p is offset p % bs of block tables[b][p / bs]. Reading positions block by block in
// order gives every position the same numbers whatever the block size and placement (the slots layout is one block
// of max_len a row). Row b's new token t is written at lengths[b] + pending + t and sees the
// row's committed prefix [0, lengths[b]) and, among the pending + T fresh positions after it, those that
// visible[b][t] marks (no mask: the causal ones, fresh position f <= pending + t).
#include "quant.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// rms_norm(x) * w for each of `rows` rows of width D, written to out.
void rms_norm(const float* x, const float* w, float eps, int64_t rows, int64_t D, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    const float* v = x + i * D;
    double sum = 0.0;  // (a double accumulator: the same on every path, and exact enough not to matter)
    for (int64_t j = 0; j < D; ++j) sum += static_cast<double>(v[j]) * v[j];
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum / D) + eps);
    float* o = out + i * D;
    for (int64_t j = 0; j < D; ++j) o[j] = (v[j] * inv) * w[j];
  }
}

#if defined(__AVX2__)
// exp for 8 floats (Cephes' expf: range reduction by ln 2, a degree-6 polynomial; ~1 ulp), exp(-inf) = 0.
inline __m256 exp256(__m256 x) {
  const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
  const __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                           _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(is_tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// The same function, one float at a time, operation for operation (the tail of a row of scores).
inline float exp1(float x) {
  if (x < -88.3762626647949f) return 0.0f;
  x = std::min(std::max(x, -88.3762626647949f), 88.3762626647949f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p * r, r, r + 1.0f);
  const int32_t bits = (static_cast<int32_t>(std::nearbyint(n)) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The cache's element types: float32, bfloat16, float16. A stored key or value is read as the float it exactly is
// (the 16-bit formats widen without rounding), the same number on the vector and the scalar paths.
inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return static_cast<float>(x); }
inline float widen(c10::Half x) { return static_cast<float>(x); }
template <typename T> inline T narrow(float x) { return static_cast<T>(x); }  // round to nearest even

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const c10::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
#endif
}
#endif

// Scores of one query q [hd] (already scaled) over positions [0, L) of keys stored in blocks of bs positions:
// key_blocks[i] [hd][bs] (transposed) holds positions i*bs... scores [L]. Each position's score is the same chain of
// FMAs over d whichever loop computes it, so the numbers do not depend on the block size or where blocks sit.
template <typename T>
void score_positions(const float* q, const T* const* key_blocks, int64_t bs, int64_t L, int64_t hd,
                     float* scores) {
  // position j's key: column(j)[d * bs] (a shift and a mask for the paged sizes, powers of two; else a division)
  const bool pow2 = (bs & (bs - 1)) == 0;
  const int shift = pow2 ? __builtin_ctzll(static_cast<unsigned long long>(bs)) : 0;
  auto column = [&](int64_t j) {
    return pow2 ? key_blocks[j >> shift] + (j & (bs - 1)) : key_blocks[j / bs] + j % bs;
  };
  int64_t j = 0;
  while (j < L) {
#if defined(__AVX2__)
    auto in_block = [&](int64_t at) { return (pow2 ? (at & (bs - 1)) : at % bs) + 8 <= bs; };  // 8 in one block
    if (j + 32 <= L && in_block(j) && in_block(j + 8) && in_block(j + 16) && in_block(j + 24)) {
      // four runs of 8 positions at once: four independent chains of FMAs
      const T *k0 = column(j), *k1 = column(j + 8), *k2 = column(j + 16), *k3 = column(j + 24);
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < hd; ++d) {
        const __m256 qd = _mm256_set1_ps(q[d]);
        a0 = _mm256_fmadd_ps(qd, load8(k0 + d * bs), a0);
        a1 = _mm256_fmadd_ps(qd, load8(k1 + d * bs), a1);
        a2 = _mm256_fmadd_ps(qd, load8(k2 + d * bs), a2);
        a3 = _mm256_fmadd_ps(qd, load8(k3 + d * bs), a3);
      }
      _mm256_storeu_ps(scores + j, a0);
      _mm256_storeu_ps(scores + j + 8, a1);
      _mm256_storeu_ps(scores + j + 16, a2);
      _mm256_storeu_ps(scores + j + 24, a3);
      j += 32;
      continue;
    }
    if (j + 8 <= L && in_block(j)) {
      const T* k0 = column(j);
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < hd; ++d) acc = _mm256_fmadd_ps(_mm256_set1_ps(q[d]), load8(k0 + d * bs), acc);
      _mm256_storeu_ps(scores + j, acc);
      j += 8;
      continue;
    }
#endif
    const T* k0 = column(j);
    float acc = 0.0f;
    for (int64_t d = 0; d < hd; ++d) acc = std::fma(q[d], widen(k0[d * bs]), acc);
    scores[j++] = acc;
  }
}

// Softmax attention of one query q [hd] (already scaled) over positions [0, L) of one kv head, stored in blocks of
// bs positions: key_blocks[i] [hd][bs] (transposed) and val_blocks[i] [bs][hd] hold positions i*bs...; allowed(j)
// says which positions it sees. scores: scratch of L floats. out [hd].
template <typename T, typename Allowed>
void attend_one(const float* q, const T* const* key_blocks, const T* const* val_blocks, int64_t bs,
                int64_t L, int64_t hd, Allowed allowed, float* scores, float* out) {
  score_positions(q, key_blocks, bs, L, hd, scores);
  int64_t j = 0;
  float top = -INFINITY;
  for (j = 0; j < L; ++j) {
    if (allowed(j)) top = std::max(top, scores[j]);
    else scores[j] = -INFINITY;
  }
  j = 0;
#if defined(__AVX2__)
  const __m256 top8 = _mm256_set1_ps(top);
  for (; j + 8 <= L; j += 8)
    _mm256_storeu_ps(scores + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top8)));
#endif
  for (; j < L; ++j) scores[j] = exp1(scores[j] - top);
  float total = 0.0f;
  for (j = 0; j < L; ++j) total += scores[j];
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < hd; ++d) out[d] = 0.0f;
  for (int64_t start = 0, block = 0; start < L; start += bs, ++block) {  // positions in order, block by block
    const T* values = val_blocks[block];
    for (j = start; j < std::min(start + bs, L); ++j) {
      if (scores[j] == 0.0f) continue;  // masked (or underflowed): adds nothing
      const float p = scores[j] * inv;
      const T* v = values + (j - start) * hd;
      int64_t d = 0;
#if defined(__AVX2__)
      const __m256 p8 = _mm256_set1_ps(p);
      for (; d + 8 <= hd; d += 8)
        _mm256_storeu_ps(out + d, _mm256_fmadd_ps(p8, load8(v + d), _mm256_loadu_ps(out + d)));
#endif
      for (; d < hd; ++d) out[d] = std::fma(p, widen(v[d]), out[d]);
    }
  }
}

// What the cache write and attention of one layer_step need besides the cache (see layer_step).
struct CacheStep {
  int64_t B, T, H, G, hd, bs, width, pending, qkv_width;
  const int64_t* table;  // [B, width]
  const int64_t* length;  // [B]
  const bool* mask;  // [B, T, pending + T] or null
};

// The new keys and values into the cache (rounded to its element type E), then every (token, head)'s attention
// over its row, written to attn_data [B*T, H*hd].
template <typename E>
void cache_attention(const CacheStep& step, const float* qkv_data, E* kd, E* vd, float* attn_data) {
  const int64_t B = step.B, T = step.T, H = step.H, G = step.G, hd = step.hd, bs = step.bs, width = step.width;
  const int64_t pending = step.pending, qkv_width = step.qkv_width;
  const int64_t* table = step.table;
  const int64_t* length = step.length;
  const bool* mask = step.mask;
  const int64_t group = H / G, fresh = pending + T;
  const int64_t k_block = G * hd * bs, v_block = G * bs * hd;  // elements per block (one layer)
  for (int64_t b = 0; b < B; ++b) {  // the new keys and values into the cache
    for (int64_t t = 0; t < T; ++t) {
      const int64_t pos = length[b] + pending + t, block = table[b * width + pos / bs], at = pos % bs;
      const float* row = qkv_data + (b * T + t) * qkv_width;
      for (int64_t g = 0; g < G; ++g) {
        const float* k = row + (H + g) * hd;
        const float* v = row + (H + G + g) * hd;
        E* kt = kd + block * k_block + g * hd * bs + at;
        E* vt = vd + block * v_block + (g * bs + at) * hd;
        for (int64_t d = 0; d < hd; ++d) kt[d * bs] = narrow<E>(k[d]);
        for (int64_t d = 0; d < hd; ++d) vt[d] = narrow<E>(v[d]);
      }
    }
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, B * T * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(width * bs), q(hd);
    std::vector<const E*> key_blocks(width), val_blocks(width);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t i = item / H, head = item % H, b = i / T, t = i % T, g = head / group;
      const int64_t prefix = length[b], L = prefix + fresh;
      const float* src = qkv_data + i * qkv_width + head * hd;
      for (int64_t d = 0; d < hd; ++d) q[d] = src[d] * scale;
      for (int64_t n = 0; n * bs < L; ++n) {
        const int64_t block = table[b * width + n];
        key_blocks[n] = kd + block * k_block + g * hd * bs;
        val_blocks[n] = vd + block * v_block + g * bs * hd;
      }
      float* out = attn_data + i * H * hd + head * hd;
      if (mask != nullptr) {
        const bool* seen = mask + (b * T + t) * fresh;
        attend_one(q.data(), key_blocks.data(), val_blocks.data(), bs, L, hd,
                   [&](int64_t j) { return j < prefix || seen[j - prefix]; }, scores.data(), out);
      } else {
        const int64_t last = prefix + pending + t;  // causal among the fresh positions
        attend_one(q.data(), key_blocks.data(), val_blocks.data(), bs, L, hd, [&](int64_t j) { return j <= last; },
                   scores.data(), out);
      }
    }
  });
}

}  // namespace

void layer_step(torch::Tensor x, const torch::Tensor& input_norm, const torch::Tensor& post_norm, double eps,
                const std::vector<torch::Tensor>& w_qkv, const std::vector<int64_t>& f_qkv,
                const c10::optional<torch::Tensor>& b_qkv, const c10::optional<torch::Tensor>& q_norm,
                const c10::optional<torch::Tensor>& k_norm, const std::vector<torch::Tensor>& w_o,
                const std::vector<int64_t>& f_o, const std::vector<torch::Tensor>& w_gate_up,
                const std::vector<int64_t>& f_gate_up, const std::vector<torch::Tensor>& w_down,
                const std::vector<int64_t>& f_down, const torch::Tensor& cos, const torch::Tensor& sin,
                torch::Tensor keys, torch::Tensor values, const torch::Tensor& tables, const torch::Tensor& lengths,
                int64_t pending, const c10::optional<torch::Tensor>& visible, int64_t num_heads,
                int64_t num_kv_heads, int64_t new_tokens) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x must be [B*T, D] float32");
  TORCH_CHECK(keys.dtype() == values.dtype() && keys.is_contiguous() && values.is_contiguous() &&
              (keys.dtype() == torch::kFloat32 || keys.dtype() == torch::kBFloat16 ||
               keys.dtype() == torch::kFloat16), "the cache must be contiguous float32, bfloat16 or float16");
  const int64_t BT = x.size(0), D = x.size(1), T = new_tokens, B = BT / T;
  const int64_t H = num_heads, G = num_kv_heads, hd = cos.size(1), group = H / G;
  const int64_t bs = keys.size(3), num_blocks = keys.size(0), fresh = pending + T;
  TORCH_CHECK(B * T == BT && tables.dim() == 2 && tables.size(0) == B && lengths.numel() == B,
              "rows and new tokens do not match x");
  TORCH_CHECK(cos.size(0) == BT && sin.size(0) == BT && cos.is_contiguous() && sin.is_contiguous() &&
              cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32, "cos/sin must be [B*T, hd] float32");
  auto table_list = tables.to(torch::kInt64).contiguous();
  auto length_list = lengths.to(torch::kInt64).contiguous();
  const int64_t width = tables.size(1);
  const int64_t* table = table_list.data_ptr<int64_t>();  // [B, width]: row b's blocks in order of position
  const int64_t* length = length_list.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t used = (length[b] + fresh + bs - 1) / bs;
    TORCH_CHECK(used <= width, "the KV cache holds ", width * bs, " positions per row; this step needs ",
                length[b] + fresh);
    for (int64_t i = 0; i < used; ++i)
      TORCH_CHECK(table[b * width + i] >= 0 && table[b * width + i] < num_blocks,
                  "row ", b, " has no KV-cache block for positions from ", i * bs, " (reserve them first)");
  }
  const bool* mask = nullptr;
  torch::Tensor mask_tensor;
  if (visible.has_value() && visible->defined()) {
    mask_tensor = visible->to(torch::kBool).contiguous();
    TORCH_CHECK(mask_tensor.numel() == B * T * fresh, "visible must be [B, T, pending + T]");
    mask = mask_tensor.data_ptr<bool>();
  }
  float* xs = x.data_ptr<float>();

  // attention block
  auto h = torch::empty({BT, D}, torch::kFloat32);
  rms_norm(xs, input_norm.data_ptr<float>(), static_cast<float>(eps), BT, D, h.data_ptr<float>());
  auto qkv = qmatmul_parts(h, w_qkv, f_qkv, true);  // [BT, (H + 2G) * hd]
  if (b_qkv.has_value() && b_qkv->defined()) qkv += *b_qkv;
  const int64_t qkv_width = (H + 2 * G) * hd, half = hd / 2;
  float* qkv_data = qkv.data_ptr<float>();
  if (q_norm.has_value() && q_norm->defined()) {  // Qwen3: each q and k head RMS-normalised before rotary
    TORCH_CHECK(k_norm.has_value() && k_norm->defined() && q_norm->numel() == hd && k_norm->numel() == hd,
                "q_norm and k_norm must both be given, [head_dim] each");
    const float* qw = q_norm->data_ptr<float>();
    const float* kw = k_norm->data_ptr<float>();
    for (int64_t i = 0; i < BT; ++i)
      for (int64_t head = 0; head < H + G; ++head) {
        float* v = qkv_data + i * qkv_width + head * hd;
        rms_norm(v, head < H ? qw : kw, static_cast<float>(eps), 1, hd, v);  // (in place: it reads before it writes)
      }
  }
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  std::vector<float> rolled(hd);
  for (int64_t i = 0; i < BT; ++i) {  // rotary on the q and k heads: x * cos + roll(x, hd/2) * signed_sin
    for (int64_t head = 0; head < H + G; ++head) {
      float* v = qkv_data + i * qkv_width + head * hd;
      for (int64_t d = 0; d < hd; ++d) rolled[d] = v[(d + half) % hd];
      for (int64_t d = 0; d < hd; ++d) v[d] = v[d] * cs[i * hd + d] + rolled[d] * sn[i * hd + d];
    }
  }
  auto attn = torch::empty({BT, H * hd}, torch::kFloat32);
  const CacheStep step{B, T, H, G, hd, bs, width, pending, qkv_width, table, length, mask};
  if (keys.scalar_type() == torch::kFloat32)
    cache_attention(step, qkv_data, keys.data_ptr<float>(), values.data_ptr<float>(), attn.data_ptr<float>());
  else if (keys.scalar_type() == torch::kBFloat16)
    cache_attention(step, qkv_data, keys.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>(),
                    attn.data_ptr<float>());
  else
    cache_attention(step, qkv_data, keys.data_ptr<c10::Half>(), values.data_ptr<c10::Half>(), attn.data_ptr<float>());
  auto o = qmatmul_parts(attn, w_o, f_o, true);  // [BT, D]
  const float* od = o.data_ptr<float>();
  for (int64_t i = 0; i < BT * D; ++i) xs[i] += od[i];

  // MLP block
  rms_norm(xs, post_norm.data_ptr<float>(), static_cast<float>(eps), BT, D, h.data_ptr<float>());
  auto gate_up = qmatmul_parts(h, w_gate_up, f_gate_up, true);  // [BT, 2F]
  const int64_t F = gate_up.size(1) / 2;
  auto act = torch::empty({BT, F}, torch::kFloat32);
  const float* gu = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t i = 0; i < BT; ++i) {  // silu(gate) * up = gate / (1 + exp(-gate)) * up
    const float* gate = gu + i * 2 * F;
    const float* up = gate + F;
    float* out = a + i * F;
    int64_t j = 0;
#if defined(__AVX2__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= F; j += 8) {
      const __m256 g = _mm256_loadu_ps(gate + j);
      const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
      _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + j)));
    }
#endif
    for (; j < F; ++j) out[j] = gate[j] / (1.0f + exp1(-gate[j])) * up[j];
  }
  auto down = qmatmul_parts(act, w_down, f_down, true);  // [BT, D]
  const float* dd = down.data_ptr<float>();
  for (int64_t i = 0; i < BT * D; ++i) xs[i] += dd[i];
}
