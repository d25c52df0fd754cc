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
