// One Llama decoder layer over the new tokens of a cached forward, in one call: RMSNorm, the q/k/v product (with
// Qwen2's biases, Qwen3's per-head q/k RMSNorm), rotary, the cache write, attention over the cache, the output
// product and residual, RMSNorm, gate/up, SiLU-mul, the down product and residual. Python's version
// (model/llama.py + attention.py) runs ~60 operators a layer; here the only allocations are the products' outputs.
//
// Numbers: float32 throughout (the activations' dtype of a quantized model on CPU; the cache float32, bfloat16 or
// float16). Every token's result is computed by the same operations in the same order whatever else shares the
// forward (other rows, the row's other new tokens, how many there are): the products are quant.cpp's
// (batch-invariant), attention is attention.cpp's (the same). So a token's logits are the same in a one-token
// decode step, in a verify pass over a draft tree and in any chunk of a prefill.
//
// Cache layout (model/cache.py): keys [blocks, kv_heads, head_dim, bs] (transposed), values [blocks, kv_heads, bs,
// head_dim]; row b's position p is offset p % bs of block tables[b][p / bs]. Row b's new token t is written at lengths[b] + pending + t and sees the
// row's committed prefix [0, lengths[b]) and, among the pending + T fresh positions after it, those that
// visible[b][t] marks (no mask: the causal ones, fresh position f <= pending + t). A chunk of another row's prompt
// can ride along (chunk_tokens rows of x after the B*T, causal from chunk_length): each product then reads its
// weights once for the step and the chunk together, and every row's numbers are the ones it gets alone.
#include "quant.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Where the layers' time goes, when asked (kernel_timing): seconds in the products, in attention (the cache write
// and the attention itself) and in the rest (norms, rotary, residuals, SiLU), summed over calls. Read on the
// calling thread around each part: the parts' own threads are inside them.
bool timing = false;
double spent[3] = {0.0, 0.0, 0.0};
enum Part { PRODUCTS, ATTENTION, OTHER };

struct Clock {
  std::chrono::steady_clock::time_point last;
  Clock() {
    if (timing) last = std::chrono::steady_clock::now();
  }
  void lap(Part part) {  // the time since the last lap goes to `part`
    if (!timing) return;
    const auto now = std::chrono::steady_clock::now();
    spent[part] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

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

// Every new token's key and value of each kv head (hd floats each, after rotary) and where its position lies in
// the cache: put(k, v, kt, vt) with kt its key's first value (the next at + bs: keys are transposed) and vt its
// value's row; `rows` values are stored per position and kv head (hd, and the 8-bit cache's scales).
template <typename E, typename Put>
void for_each_new_entry(const AttentionStep& step, const float* qkv_data, E* kd, E* vd, int64_t rows, Put put) {
  const int64_t T = step.T, H = step.H, G = step.G, hd = step.hd, bs = step.bs;
  const int64_t k_block = G * rows * bs, v_block = G * bs * rows;  // elements per block (one layer)
  for (int64_t b = 0; b < step.B; ++b) {
    for (int64_t t = 0; t < T; ++t) {  // row b's new token t sits at position lengths[b] + pending + t
      const int64_t pos = step.length[b] + step.pending + t, block = step.table[b * step.width + pos / bs];
      const int64_t at = pos % bs;
      const float* row = qkv_data + (b * T + t) * step.q_stride;
      for (int64_t g = 0; g < G; ++g)
        put(row + (H + g) * hd, row + (H + G + g) * hd, kd + block * k_block + g * rows * bs + at,
            vd + block * v_block + (g * bs + at) * rows);
    }
  }
}

// The new keys and values into the cache, rounded to its element type E.
template <typename E>
void write_cache(const AttentionStep& step, const float* qkv_data, E* kd, E* vd) {
  const int64_t hd = step.hd, bs = step.bs;
  for_each_new_entry(step, qkv_data, kd, vd, hd, [&](const float* k, const float* v, E* kt, E* vt) {
    for (int64_t d = 0; d < hd; ++d) kt[d * bs] = narrow<E>(k[d]);
    for (int64_t d = 0; d < hd; ++d) vt[d] = narrow<E>(v[d]);
  });
}

// The 8-bit cache (quant.h's Q8_GROUP layout): each group of a new key or value quantized, its scale beside it.
void write_cache_q8(const AttentionStep& step, const float* qkv_data, int8_t* kd, int8_t* vd) {
  const int64_t hd = step.hd, bs = step.bs;
  for_each_new_entry(step, qkv_data, kd, vd, stored_rows<int8_t>(hd),
                     [&](const float* k, const float* v, int8_t* kt, int8_t* vt) {
    for (int64_t grp = 0; grp < hd / Q8_GROUP; ++grp) {
      q8_quantize(k + grp * Q8_GROUP, kt + grp * Q8_GROUP * bs, bs, kt + (hd + 2 * grp) * bs, bs);
      q8_quantize(v + grp * Q8_GROUP, vt + grp * Q8_GROUP, 1, vt + hd + 2 * grp, 1);
    }
  });
}

// The new keys and values of a step into the cache, in its element type.
void write_new_entries(const AttentionStep& step, const float* qkv_data, torch::Tensor& keys, torch::Tensor& values) {
  if (keys.scalar_type() == torch::kFloat32)
    write_cache(step, qkv_data, keys.data_ptr<float>(), values.data_ptr<float>());
  else if (keys.scalar_type() == torch::kBFloat16)
    write_cache(step, qkv_data, keys.data_ptr<c10::BFloat16>(), values.data_ptr<c10::BFloat16>());
  else if (keys.scalar_type() == torch::kInt8) {
    TORCH_CHECK(step.hd % Q8_GROUP == 0, "an 8-bit KV cache needs a head size that is a multiple of ", Q8_GROUP);
    write_cache_q8(step, qkv_data, keys.data_ptr<int8_t>(), values.data_ptr<int8_t>());
  } else
    write_cache(step, qkv_data, keys.data_ptr<c10::Half>(), values.data_ptr<c10::Half>());
}

}  // namespace

void kernel_timing(bool on) {
  timing = on;
  spent[PRODUCTS] = spent[ATTENTION] = spent[OTHER] = 0.0;
}

std::vector<double> kernel_times() { return {spent[PRODUCTS], spent[ATTENTION], spent[OTHER]}; }

void layer_step(torch::Tensor x, const torch::Tensor& input_norm, const torch::Tensor& post_norm, double eps,
                const std::vector<torch::Tensor>& w_qkv, const std::vector<int64_t>& f_qkv,
                const c10::optional<torch::Tensor>& b_qkv, const c10::optional<torch::Tensor>& q_norm,
                const c10::optional<torch::Tensor>& k_norm, const std::vector<torch::Tensor>& w_o,
                const std::vector<int64_t>& f_o, const std::vector<torch::Tensor>& w_gate_up,
                const std::vector<int64_t>& f_gate_up, const std::vector<torch::Tensor>& w_down,
                const std::vector<int64_t>& f_down, const torch::Tensor& cos, const torch::Tensor& sin,
                torch::Tensor keys, torch::Tensor values, const torch::Tensor& tables, const torch::Tensor& lengths,
                int64_t pending, const c10::optional<torch::Tensor>& visible, int64_t num_heads,
                int64_t num_kv_heads, int64_t new_tokens, const c10::optional<torch::Tensor>& chunk_table,
                int64_t chunk_length, int64_t chunk_tokens) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.dim() == 2, "x must be [B*T, D] float32");
  const int64_t C = chunk_tokens, rows = x.size(0), BT = rows - C, D = x.size(1), T = new_tokens, B = BT / T;
  const int64_t H = num_heads, G = num_kv_heads, hd = cos.size(1);
  const int64_t bs = keys.size(3), fresh = pending + T;
  TORCH_CHECK(C >= 0 && B * T == BT && tables.dim() == 2 && tables.size(0) == B && lengths.numel() == B,
              "rows and new tokens do not match x");
  TORCH_CHECK(cos.size(0) == rows && sin.size(0) == rows && cos.is_contiguous() && sin.is_contiguous() &&
              cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32,
              "cos/sin must be [B*T + chunk tokens, hd] float32");
  auto table_list = tables.to(torch::kInt64).contiguous();
  auto length_list = lengths.to(torch::kInt64).contiguous();
  check_attention_inputs(keys, values, table_list, length_list, B, fresh);
  // A chunk of another row's prompt riding along (its C rows of x after the B*T): C causal new tokens from
  // chunk_length, in the blocks of chunk_table [1, width]; the products read the weights once for all rows.
  torch::Tensor chunk_tables, chunk_lengths;
  if (C > 0) {
    chunk_lengths = torch::full({1}, chunk_length, torch::kInt64);
    TORCH_CHECK(chunk_table.has_value() && chunk_table->defined() && chunk_table->dim() == 2 &&
                chunk_table->size(0) == 1, "a chunk needs its row's block table [1, width]");
    chunk_tables = chunk_table->to(torch::kInt64).contiguous();
    check_attention_inputs(keys, values, chunk_tables, chunk_lengths, 1, C);
  }
  const int64_t width = tables.size(1);
  const int64_t* table = table_list.data_ptr<int64_t>();  // [B, width]: row b's blocks in order of position
  const int64_t* length = length_list.data_ptr<int64_t>();
  const bool* mask = nullptr;
  torch::Tensor mask_tensor;
  if (visible.has_value() && visible->defined()) {
    mask_tensor = visible->to(torch::kBool).contiguous();
    TORCH_CHECK(mask_tensor.numel() == B * T * fresh, "visible must be [B, T, pending + T]");
    mask = mask_tensor.data_ptr<bool>();
  }
  float* xs = x.data_ptr<float>();
  Clock clock;

  // attention block
  auto h = torch::empty({rows, D}, torch::kFloat32);
  rms_norm(xs, input_norm.data_ptr<float>(), static_cast<float>(eps), rows, D, h.data_ptr<float>());
  clock.lap(OTHER);
  auto qkv = qmatmul_parts(h, w_qkv, f_qkv, true);  // [rows, (H + 2G) * hd]
  clock.lap(PRODUCTS);
  if (b_qkv.has_value() && b_qkv->defined()) qkv += *b_qkv;
  const int64_t qkv_width = (H + 2 * G) * hd, half = hd / 2;
  float* qkv_data = qkv.data_ptr<float>();
  if (q_norm.has_value() && q_norm->defined()) {  // Qwen3: each q and k head RMS-normalised before rotary
    TORCH_CHECK(k_norm.has_value() && k_norm->defined() && q_norm->numel() == hd && k_norm->numel() == hd,
                "q_norm and k_norm must both be given, [head_dim] each");
    const float* qw = q_norm->data_ptr<float>();
    const float* kw = k_norm->data_ptr<float>();
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t head = 0; head < H + G; ++head) {
        float* v = qkv_data + i * qkv_width + head * hd;
        rms_norm(v, head < H ? qw : kw, static_cast<float>(eps), 1, hd, v);  // (in place: it reads before it writes)
      }
  }
  const float* cs = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  std::vector<float> rolled(hd);
  for (int64_t i = 0; i < rows; ++i) {  // rotary on the q and k heads: x * cos + roll(x, hd/2) * signed_sin
    for (int64_t head = 0; head < H + G; ++head) {
      float* v = qkv_data + i * qkv_width + head * hd;
      for (int64_t d = 0; d < hd; ++d) rolled[d] = v[(d + half) % hd];
      for (int64_t d = 0; d < hd; ++d) v[d] = v[d] * cs[i * hd + d] + rolled[d] * sn[i * hd + d];
    }
  }
  auto attn = torch::empty({rows, H * hd}, torch::kFloat32);
  clock.lap(OTHER);
  const AttentionStep step{B, T, H, G, hd, bs, width, pending, qkv_width, table, length, mask};
  write_new_entries(step, qkv_data, keys, values);
  paged_attention(step, keys, values, qkv_data, attn.data_ptr<float>(), true);
  if (C > 0) {
    const AttentionStep chunk{1, C, H, G, hd, bs, chunk_tables.size(1), 0, qkv_width,
                              chunk_tables.data_ptr<int64_t>(), chunk_lengths.data_ptr<int64_t>(), nullptr};
    write_new_entries(chunk, qkv_data + BT * qkv_width, keys, values);
    paged_attention(chunk, keys, values, qkv_data + BT * qkv_width, attn.data_ptr<float>() + BT * H * hd, true);
  }
  clock.lap(ATTENTION);
  auto o = qmatmul_parts(attn, w_o, f_o, true);  // [rows, D]
  clock.lap(PRODUCTS);
  const float* od = o.data_ptr<float>();
  for (int64_t i = 0; i < rows * D; ++i) xs[i] += od[i];

  // MLP block
  rms_norm(xs, post_norm.data_ptr<float>(), static_cast<float>(eps), rows, D, h.data_ptr<float>());
  clock.lap(OTHER);
  auto gate_up = qmatmul_parts(h, w_gate_up, f_gate_up, true);  // [rows, 2F]
  clock.lap(PRODUCTS);
  const int64_t F = gate_up.size(1) / 2;
  auto act = torch::empty({rows, F}, torch::kFloat32);
  const float* gu = gate_up.data_ptr<float>();
  float* a = act.data_ptr<float>();
  for (int64_t i = 0; i < rows; ++i) {  // silu(gate) * up = gate / (1 + exp(-gate)) * up
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
  clock.lap(OTHER);
  auto down = qmatmul_parts(act, w_down, f_down, true);  // [rows, D]
  clock.lap(PRODUCTS);
  const float* dd = down.data_ptr<float>();
  for (int64_t i = 0; i < rows * D; ++i) xs[i] += dd[i];
  clock.lap(OTHER);
}
