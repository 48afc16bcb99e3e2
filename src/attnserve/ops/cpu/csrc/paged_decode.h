// What the paged CPU decode kernels share: the problem record, the element types, the scalar
// conversions, and the per-sequence entry points of each instruction-set path.
//
// cpu_paged_decode.cpp holds the op (input checks, the run-time choice of path, the threads);
// paged_decode_avx2.cpp the AVX2 + FMA path (the build's baseline flags); paged_decode_avx512.cpp
// the AVX-512 paths, compiled through per-function target attributes only, so that the library
// still loads on a CPU without AVX-512. The kernel files include no ATen header: nothing of
// torch is compiled with AVX-512 enabled.
#pragma once

#include <cstdint>
#include <cstring>

namespace attnserve_cpu {

// Element types of q, the caches and out (the raw 16 bits of bfloat16 and float16).
struct bf16_t {
  uint16_t x;
};
struct half_t {
  uint16_t x;
};
enum class Dtype : int { kFloat = 0, kBFloat16 = 1, kHalf = 2 };

// The instruction-set paths, in order: a path runs where the CPU has its features.
enum class Isa : int { kAuto = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

struct Problem {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const int32_t* block_table;
  const int32_t* seq_lens;
  int64_t q_s0, q_s1, out_s0, out_s1;  // element strides of [B, H, D]
  int64_t k_s0, k_s1, k_s2, v_s0, v_s1, v_s2;  // block, token, KV head
  int64_t bt_s0;
  int heads, kv_heads, head_dim, v_head_dim, block_size;
  float scale;
};

// Sequence b, its KV heads [kv0, kv1) and their query heads, written into out; `scratch` holds
// at least scratch_floats(pb, (kv1 - kv0) * group) floats, 64-byte aligned.
using SequenceFn = void (*)(const Problem& pb, int64_t b, int kv0, int kv1, float* scratch);

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// Every path's scratch for nh query heads: queries and accumulators padded to 32 elements, the
// running max, a 16-lane running sum, and room to align.
inline int64_t scratch_floats(const Problem& pb, int nh) {
  return nh * (round_up(pb.head_dim, 32) + round_up(pb.v_head_dim, 32) + 1 + 16) + 64;
}

inline float to_float(float x) { return x; }
inline float to_float(bf16_t x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
T from_float(float f);
template <>
inline float from_float<float>(float f) { return f; }
template <>
inline bf16_t from_float<bf16_t>(float f) {  // round to nearest even, as c10::BFloat16
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{0x7fc0};  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return bf16_t{static_cast<uint16_t>(u >> 16)};
}

// float16 <-> float32 live in the AVX2 file (F16C); declared here for both paths.
float half_to_float(half_t x);
half_t float_to_half(float f);
inline float to_float(half_t x) { return half_to_float(x); }
template <>
inline half_t from_float<half_t>(float f) { return float_to_half(f); }

// The entry points of each path for a dtype and a head chunk C (1, 2, 4 or 8 query heads read
// each key and value row together); nullptr where a path has no kernel for them.
SequenceFn avx2_sequence(Dtype dtype, int chunk);
SequenceFn avx512_sequence(Dtype dtype, int chunk, int head_dim, int v_head_dim, bool bf16_dot);

// What this CPU runs (cpuid, and the OS saving the AVX-512 registers).
bool cpu_has_avx512();
bool cpu_has_avx512_bf16();

}  // namespace attnserve_cpu
