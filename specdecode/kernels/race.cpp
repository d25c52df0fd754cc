// The exponential race (the Gumbel-max trick) that samples a seeded request's tokens: row n's token is the x that
// maximises p[n, x] / E(key[n], position[n], x), where E = -log(1 - u) is an Exp(1) variate and u the uniform that
// sampling.py's RequestRandom.uniform(position, RACE, x) gives. sampling.race_tokens computes the same thing with
// torch operations where this cannot be built; this loop is ~10x faster because it never stores the noise and
// takes a logarithm only for a token that could still win (-log(1 - u) >= u, so p / E <= p / u).
#include "quant.h"

#include <cmath>
#include <cstdint>

namespace {

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kRaceStream = 4;  // sampling.RACE

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

}  // namespace

torch::Tensor race_argmax(const torch::Tensor& probs, const torch::Tensor& keys, const torch::Tensor& positions) {
  TORCH_CHECK(probs.dim() == 2 && probs.scalar_type() == torch::kFloat32, "probs must be [N, V] float32");
  TORCH_CHECK(keys.numel() == probs.size(0) && positions.numel() == probs.size(0), "one key and position per row");
  TORCH_CHECK(probs.size(1) < (1 << 20), "the vocabulary must have fewer than 2**20 tokens");
  const auto p = probs.contiguous();
  const auto k = keys.to(torch::kInt64).contiguous();
  const auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t N = p.size(0), V = p.size(1);
  auto out = torch::empty({N}, torch::kInt64);
  const float* pp = p.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* posp = pos.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    const float* row = pp + n * V;
    const uint64_t key = static_cast<uint64_t>(kp[n]);
    const uint64_t base = (static_cast<uint64_t>(posp[n]) << 24) | (kRaceStream << 20);
    double best = -1.0;
    int64_t best_x = 0;
    for (int64_t x = 0; x < V; ++x) {
      const double px = row[x];
      if (!(px > 0.0)) continue;
      const uint64_t z = mix64(key + kGamma * ((base | static_cast<uint64_t>(x)) + 1));
      const double u = static_cast<double>(z >> 11) * 0x1p-53;
      if (!(px > best * u)) continue;  // p / E <= p / u <= best: this token cannot win
      const double e = -std::log1p(-u);
      const double ratio = px / e;  // e == 0 (u == 0) gives +inf: that token wins
      if (ratio > best) {
        best = ratio;
        best_x = x;
      }
    }
    op[n] = best_x;
  }
  return out;
}
