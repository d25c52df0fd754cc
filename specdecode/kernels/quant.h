// Shared between quant.cpp (block-quantized matrix products) and layer.cpp (a whole decoder layer in one call).
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>

// Before a constant-bound loop over a block of rows or tiles: unrolled, its accumulators stay in registers.
#define UNROLL _Pragma("GCC unroll 16")

// rows [N, bytes] of GGUF blocks -> the packed matrix (8 rows interleaved) that the products read (see quant.cpp).
torch::Tensor pack(const torch::Tensor& weight, int64_t format, int64_t in_features);

// x [M, K] (any float dtype) @ dequantized(weight [N, K]).T -> [M, N] float32 (packs the weight first).
torch::Tensor qmatmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t format, bool use_simd);

// The same over a matrix stacked from packed parts of their own formats -> [M, sum of their rows] float32.
torch::Tensor qmatmul_parts(const torch::Tensor& x, const std::vector<torch::Tensor>& weights,
                            const std::vector<int64_t>& formats, bool use_simd);

// The exponential race over probs [N, V] with each row's (key, position) noise -> tokens [N] (see race.cpp).
torch::Tensor race_argmax(const torch::Tensor& probs, const torch::Tensor& keys, const torch::Tensor& positions);

// One Llama decoder layer over the new tokens of a cached forward, in place on x (see layer.cpp).
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
                int64_t chunk_length, int64_t chunk_tokens);

// Timing of layer_step's parts (layer.cpp): on or off (the sums reset), and the seconds so far in the products,
// in attention (with the cache write) and in the rest.
void kernel_timing(bool on);
std::vector<double> kernel_times();

// The vector width the products (and attention) use: 512, 256, or 0 (scalar).
int64_t vector_bits();

// One cached forward's attention (attention.cpp): B rows of T new tokens, H query heads over G kv heads of head
// dim hd; row b's new token t is at lengths[b] + pending + t and sees the committed prefix and the fresh positions
// that mask[b][t] ([pending + T] bool) marks, or (no mask) the causal ones.
// The 8-bit KV cache (as llama.cpp's q8_0 cache): each group of Q8_GROUP values of a position's key or value is
// q = round(x / d) in [-127, 127] with d = max |x| / 127 kept as float16, its two bytes stored beside the group's
// values: keys [blocks][kv_heads][hd + 2 hd / Q8_GROUP][bs] (rows hd + 2b, hd + 2b + 1 hold group b's scale, low
// byte first, for every position), values [blocks][kv_heads][bs][hd + 2 hd / Q8_GROUP]. A position's scales thus
// move with it wherever the cache copies positions or blocks.
constexpr int64_t Q8_GROUP = 32;

template <typename E> inline int64_t stored_rows(int64_t hd) { return hd; }
template <> inline int64_t stored_rows<int8_t>(int64_t hd) { return hd + 2 * hd / Q8_GROUP; }

inline float q8_scale(int8_t low, int8_t high) {
  const uint16_t bits = static_cast<uint16_t>(static_cast<uint8_t>(low) | (static_cast<uint8_t>(high) << 8));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// x[0..Q8_GROUP) -> q[i * q_stride] and its scale's two bytes at scale[0] and scale[scale_stride].
inline void q8_quantize(const float* x, int8_t* q, int64_t q_stride, int8_t* scale, int64_t scale_stride) {
  float amax = 0.0f;
  for (int64_t i = 0; i < Q8_GROUP; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
  for (int64_t i = 0; i < Q8_GROUP; ++i)
    q[i * q_stride] = static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, std::nearbyint(x[i] * id))));
  const uint16_t bits = c10::Half(d).x;
  scale[0] = static_cast<int8_t>(bits & 0xFF);
  scale[scale_stride] = static_cast<int8_t>(bits >> 8);
}

struct AttentionStep {
  int64_t B, T, H, G, hd, bs, width, pending, q_stride;
  const int64_t* table;  // [B, width]
  const int64_t* length;  // [B]
  const bool* mask;  // [B, T, pending + T] or null
};

// Refuses a cache or tables that a step cannot use (tables and lengths int64, contiguous).
void check_attention_inputs(const torch::Tensor& keys, const torch::Tensor& values, const torch::Tensor& tables,
                            const torch::Tensor& lengths, int64_t B, int64_t fresh);

// q [B*T rows of q_stride floats, head h at h*hd] -> out [B*T, H*hd], reading keys/values in place.
void paged_attention(const AttentionStep& step, const torch::Tensor& keys, const torch::Tensor& values,
                     const float* q, float* out, bool use_simd);

// The same from tensors (for the tests): q [B*T, H*hd] float32 -> [B*T, H*hd].
torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                        const torch::Tensor& tables, const torch::Tensor& lengths, int64_t pending,
                        const c10::optional<torch::Tensor>& visible, int64_t num_heads, int64_t num_kv_heads,
                        int64_t new_tokens, bool use_simd);
