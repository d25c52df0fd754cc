// Shared between quant.cpp (block-quantized matrix products) and layer.cpp (a whole decoder layer in one call).
#pragma once
#include <torch/extension.h>

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
                int64_t num_kv_heads, int64_t new_tokens);

// The vector width the products (and attention) use: 512, 256, or 0 (scalar).
int64_t vector_bits();

// One cached forward's attention (attention.cpp): B rows of T new tokens, H query heads over G kv heads of head
// dim hd; row b's new token t is at lengths[b] + pending + t and sees the committed prefix and the fresh positions
// that mask[b][t] ([pending + T] bool) marks, or (no mask) the causal ones.
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
