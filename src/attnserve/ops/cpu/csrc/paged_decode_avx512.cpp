// The AVX-512 paths of the paged CPU decode kernel, compiled through per-function target
// attributes (the build's flags stay AVX2, so the library loads on any AVX2 CPU); the op picks
// them at run time where the CPU has AVX-512F/BW/VL/DQ (cpu_has_avx512) and, for bfloat16
// caches, AVX512_BF16 (cpu_has_avx512_bf16).
//
// The same blocking as the AVX2 path (tiles of up to 16 keys of one block, the query heads of a
// KV head together, an online softmax in float32), with 16-lane vectors and two changes that
// cut instructions rather than widen them (the EPYC's AVX-512 units are 256 bits wide):
// - a tile's 16 scores of a head come out of one transposing reduction of their 16 partial-sum
//   vectors (45 instructions, not 16 horizontal sums; the bf16 path folds them 4 keys at a time,
//   in registers), and the softmax runs on that vector (the accumulator rescaled only when the
//   running max moves);
// - with AVX512_BF16 and a bfloat16 cache, no row is widened: q . k is `vdpbf16ps` over the
//   raw bf16 pairs (q unscaled, exact in bf16; the scale applied to the float32 score), and the
//   weighted value sum is `vdpbf16ps` over two keys at a time: the two value rows interleaved
//   by `vpunpck[lh]wd`, the two weights rounded to bf16 as a pair (as torch's own bf16 flash
//   attention rounds them). The interleave leaves the accumulator's columns permuted within
//   each 32; they are put back in order once, when the sequence's output is written.
// Accumulation is float32 throughout; the output is rounded once. The next tile is prefetched
// into L2 a KV head at a time, as in the AVX2 path (from DRAM the kernel is bound by memory:
// batch 64 over 134 MB of cache, one thread, 20 against 9 ns a key and KV head in L3).

#include "paged_decode.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

#define ATTNSERVE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define ATTNSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma,f16c")))

namespace attnserve_cpu {

bool cpu_has_avx512() {  // libgcc's check includes the OS saving the ZMM and mask registers
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool cpu_has_avx512_bf16() { return cpu_has_avx512() && __builtin_cpu_supports("avx512bf16"); }

namespace {

constexpr int kTile = 16;  // keys scored per softmax update: one vector of scores

ATTNSERVE_AVX512 inline __mmask16 mask16(int n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1); }
ATTNSERVE_AVX512 inline __mmask32 mask32(int n) { return n >= 32 ? __mmask32(0xFFFFFFFFu) : __mmask32((1u << n) - 1); }

// 16 elements widened to float32 (lanes off the mask zero)
ATTNSERVE_AVX512 inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
ATTNSERVE_AVX512 inline __m512 load16(const bf16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
ATTNSERVE_AVX512 inline __m512 load16(const half_t* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// e^x for x <= 0, as the AVX2 path's exp8: 2^n e^r, e^r by a degree-7 polynomial; x below -87 -> ~0.
ATTNSERVE_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// Per 128-bit lane L: [sum(a.L), sum(b.L), sum(c.L), sum(d.L)].
ATTNSERVE_AVX512 inline __m512 sum4x4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // [a0+a2, b0+b2, a1+a3, b1+b3]
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
}

// Lane 4k + j: the sum over the four 128-bit lanes of lane j of r[k] (sum4x4's outputs).
ATTNSERVE_AVX512 inline __m512 fold4(const __m512* r) {
  const __m512 r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(r0, r1, 0x44), _mm512_shuffle_f32x4(r0, r1, 0xEE));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(r2, r3, 0x44), _mm512_shuffle_f32x4(r2, r3, 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
}

// Lane t: the sum of v[t]'s 16 lanes (a transposing reduction).
ATTNSERVE_AVX512 inline __m512 reduce16(const __m512* v) {
  const __m512 r[4] = {sum4x4(v[0], v[1], v[2], v[3]), sum4x4(v[4], v[5], v[6], v[7]),
                       sum4x4(v[8], v[9], v[10], v[11]), sum4x4(v[12], v[13], v[14], v[15])};
  return fold4(r);
}

// The running state of C query heads that share a KV head: queries [C, dp] (float32 pre-scaled,
// or raw bf16 for the bf16 path), value accumulators [C, dvp], running max [C] and a 16-lane
// running sum [C, 16].
struct Heads {
  const void* q;
  float* acc;
  float* m;
  float* l;
  int dp, dvp;
};

// The online softmax of one head over a tile: `s` the tile's scores (lanes off `valid` are
// not keys). Updates the running max and sum and scales the accumulator [dvp] by how far the
// max moved; returns the weights (0 off `valid`).
template <int DVP>
ATTNSERVE_AVX512 inline __m512 softmax_update(__m512 s, __mmask16 valid, float* m, float* l, float* acc, int dvp_rt) {
  const int dvp = DVP ? DVP : dvp_rt;
  s = _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), valid, s);
  const float mx = std::max(*m, _mm512_reduce_max_ps(s));
  const __m512 vmx = _mm512_set1_ps(mx);
  const __m512 p = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, vmx)));
  if (mx == *m) {  // the max stays (most tiles): nothing to rescale
    _mm512_storeu_ps(l, _mm512_add_ps(_mm512_loadu_ps(l), p));
    return p;
  }
  // e^(old max - new max): ~0 on the first tile (m = -inf), where l and acc are 0
  const __m512 alpha = exp16(_mm512_sub_ps(_mm512_set1_ps(*m), vmx));
  *m = mx;
  _mm512_storeu_ps(l, _mm512_fmadd_ps(_mm512_loadu_ps(l), alpha, p));
  for (int i = 0; i < dvp; i += 16) _mm512_storeu_ps(acc + i, _mm512_mul_ps(alpha, _mm512_loadu_ps(acc + i)));
  return p;
}

// Prefetches the rows [t0, t0 + n) of one KV head (`row_bytes` each, `stride` elements apart)
// into L2: spread over the tiles, a KV head at a time, so that the misses in flight stay few.
template <typename T>
inline void prefetch_head(const T* first_row, int64_t stride, int n, int row_bytes) {
  for (int t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(first_row + t * stride);
    for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  }
}

// --- float32 arithmetic on widened rows (float32, float16, and bfloat16 without AVX512_BF16) ---

// One tile of up to kTile keys for C heads: scores TT keys at a time (independent FMA chains),
// then the weighted values IC chunks of 16 columns at a time. D, DV: the head dims when fixed
// at compile time (64, 128), else 0.
template <typename T, int C, int D, int DV>
ATTNSERVE_AVX512 inline void tile_f32(const Problem& pb, const Heads& hs, const T* kp, const T* vp, int tile) {
  constexpr int TT = C >= 4 ? 1 : 4 / C;
  constexpr int IC = C >= 4 ? 1 : 4 / C;
  const int d = D ? D : pb.head_dim, dv = DV ? DV : pb.v_head_dim;
  const int dp = D ? (D + 31) / 32 * 32 : hs.dp, dvp = DV ? (DV + 31) / 32 * 32 : hs.dvp;
  const int64_t ks = pb.k_s1, vs = pb.v_s1;
  const float* q = static_cast<const float*>(hs.q);
  __m512 part[C][kTile];
  int t = 0;
  for (; t + TT <= tile; t += TT) {
    __m512 a[C][TT];
    for (int g = 0; g < C; ++g)
      for (int u = 0; u < TT; ++u) a[g][u] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
      const __mmask16 mk = mask16(d - i);
      for (int u = 0; u < TT; ++u) {
        const __m512 kv = load16(kp + (t + u) * ks + i, mk);
        for (int g = 0; g < C; ++g) a[g][u] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dp + i), kv, a[g][u]);
      }
    }
    for (int g = 0; g < C; ++g)
      for (int u = 0; u < TT; ++u) part[g][t + u] = a[g][u];
  }
  for (; t < tile; ++t) {
    __m512 a[C];
    for (int g = 0; g < C; ++g) a[g] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 16) {
      const __m512 kv = load16(kp + t * ks + i, mask16(d - i));
      for (int g = 0; g < C; ++g) a[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * dp + i), kv, a[g]);
    }
    for (int g = 0; g < C; ++g) part[g][t] = a[g];
  }
  for (; t < kTile; ++t)
    for (int g = 0; g < C; ++g) part[g][t] = _mm512_setzero_ps();
  alignas(64) float w[C][kTile];
  const __mmask16 valid = mask16(tile);
  for (int g = 0; g < C; ++g)
    _mm512_store_ps(w[g], softmax_update<DV ? (DV + 31) / 32 * 32 : 0>(reduce16(part[g]), valid, hs.m + g,
                                                                        hs.l + 16 * g, hs.acc + g * dvp, dvp));
  const int chunks = (dv + 15) / 16;
  int c = 0;
  for (; c + IC <= chunks; c += IC) {
    __m512 a[C][IC];
    for (int g = 0; g < C; ++g)
      for (int j = 0; j < IC; ++j) a[g][j] = _mm512_loadu_ps(hs.acc + g * dvp + 16 * (c + j));
    for (int u = 0; u < tile; ++u) {
      for (int j = 0; j < IC; ++j) {
        const __m512 vv = load16(vp + u * vs + 16 * (c + j), mask16(dv - 16 * (c + j)));
        for (int g = 0; g < C; ++g) a[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(w[g][u]), vv, a[g][j]);
      }
    }
    for (int g = 0; g < C; ++g)
      for (int j = 0; j < IC; ++j) _mm512_storeu_ps(hs.acc + g * dvp + 16 * (c + j), a[g][j]);
  }
  for (; c < chunks; ++c) {
    __m512 a[C];
    for (int g = 0; g < C; ++g) a[g] = _mm512_loadu_ps(hs.acc + g * dvp + 16 * c);
    for (int u = 0; u < tile; ++u) {
      const __m512 vv = load16(vp + u * vs + 16 * c, mask16(dv - 16 * c));
      for (int g = 0; g < C; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(w[g][u]), vv, a[g]);
    }
    for (int g = 0; g < C; ++g) _mm512_storeu_ps(hs.acc + g * dvp + 16 * c, a[g]);
  }
}

// --- bfloat16 dot products (AVX512_BF16) on the raw rows --------------------------------------

ATTNSERVE_AVX512_BF16 inline __m512 dot2(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

// The weighted values of a tile, IC chunks of 32 columns: two keys a step, their rows
// interleaved into (key 2u, key 2u + 1) pairs per column (an odd tile's last key pairs with
// zeros, not read). Accumulator lane 4L + j of a chunk's low half is column 8L + j, of its high
// half column 8L + 4 + j.
template <int C, int IC>
ATTNSERVE_AVX512_BF16 inline void values_bf16(float* acc, int dvp, const bf16_t* vp, int64_t vs, int c, int dv,
                                              const uint32_t (*pairs)[kTile / 2], int tile) {
  __m512 lo[C][IC], hi[C][IC];
  for (int g = 0; g < C; ++g)
    for (int j = 0; j < IC; ++j) {
      lo[g][j] = _mm512_loadu_ps(acc + g * dvp + 32 * (c + j));
      hi[g][j] = _mm512_loadu_ps(acc + g * dvp + 32 * (c + j) + 16);
    }
  __mmask32 mk[IC];
  for (int j = 0; j < IC; ++j) mk[j] = mask32(dv - 32 * (c + j));
  for (int t = 0; t < tile; t += 2) {
    const bf16_t* r0 = vp + t * vs;
    const bool second = t + 1 < tile;
    const bf16_t* r1 = second ? r0 + vs : r0;
    for (int j = 0; j < IC; ++j) {
      const __m512i a = _mm512_maskz_loadu_epi16(mk[j], r0 + 32 * (c + j));
      const __m512i b = _mm512_maskz_loadu_epi16(second ? mk[j] : __mmask32(0), r1 + 32 * (c + j));
      const __m512i il = _mm512_unpacklo_epi16(a, b), ih = _mm512_unpackhi_epi16(a, b);
      for (int g = 0; g < C; ++g) {
        const __m512i wp = _mm512_set1_epi32(static_cast<int>(pairs[g][t / 2]));
        lo[g][j] = dot2(lo[g][j], il, wp);
        hi[g][j] = dot2(hi[g][j], ih, wp);
      }
    }
  }
  for (int g = 0; g < C; ++g)
    for (int j = 0; j < IC; ++j) {
      _mm512_storeu_ps(acc + g * dvp + 32 * (c + j), lo[g][j]);
      _mm512_storeu_ps(acc + g * dvp + 32 * (c + j) + 16, hi[g][j]);
    }
}

template <int C, int D, int DV>
ATTNSERVE_AVX512_BF16 inline void tile_bf16(const Problem& pb, const Heads& hs, const bf16_t* kp, const bf16_t* vp,
                                            int tile) {
  constexpr int IC = C >= 4 ? 1 : 2;
  const int d = D ? D : pb.head_dim, dv = DV ? DV : pb.v_head_dim;
  const int dp = D ? (D + 31) / 32 * 32 : hs.dp, dvp = DV ? (DV + 31) / 32 * 32 : hs.dvp;
  const int64_t ks = pb.k_s1;
  const uint16_t* q = static_cast<const uint16_t*>(hs.q);
  // scores: 32 products a key and head per instruction, keys in groups of 4 whose partial sums
  // fold at once (sum4x4) into r[g][k]: lane 4L + j of 128-bit lane L sums key 4k + j's lane L
  __m512 r[C][4];
  for (int k = 0; k < 4; ++k) {
    if (4 * k >= tile) {
      for (int g = 0; g < C; ++g) r[g][k] = _mm512_setzero_ps();
      continue;
    }
    __m512 a[C][4];
    for (int g = 0; g < C; ++g)
      for (int u = 0; u < 4; ++u) a[g][u] = _mm512_setzero_ps();
    for (int i = 0; i < d; i += 32) {
      const __mmask32 mk = mask32(d - i);
      for (int u = 0; u < 4; ++u) {  // keys past the tile read nothing (a zero mask)
        const int key = 4 * k + u;
        const __m512i kv =
            _mm512_maskz_loadu_epi16(key < tile ? mk : __mmask32(0), kp + std::min(key, tile - 1) * ks + i);
        for (int g = 0; g < C; ++g) a[g][u] = dot2(a[g][u], _mm512_loadu_si512(q + g * dp + i), kv);
      }
    }
    for (int g = 0; g < C; ++g) r[g][k] = sum4x4(a[g][0], a[g][1], a[g][2], a[g][3]);
  }
  // the weights as bf16 pairs: pairs[g][u] holds keys 2u and 2u + 1 (0 past the tile)
  alignas(64) uint32_t pairs[C][kTile / 2];
  const __mmask16 valid = mask16(tile);
  const __m512 scale = _mm512_set1_ps(pb.scale);
  for (int g = 0; g < C; ++g) {
    const __m512 w = softmax_update<DV ? (DV + 31) / 32 * 32 : 0>(_mm512_mul_ps(fold4(r[g]), scale), valid,
                                                                 hs.m + g, hs.l + 16 * g, hs.acc + g * dvp, dvp);
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[g]), (__m256i)_mm512_cvtneps_pbh(w));
  }
  const int chunks = (dv + 31) / 32;
  int c = 0;
  for (; c + IC <= chunks; c += IC) values_bf16<C, IC>(hs.acc, dvp, vp, pb.v_s1, c, dv, pairs, tile);
  for (; c < chunks; ++c) values_bf16<C, 1>(hs.acc, dvp, vp, pb.v_s1, c, dv, pairs, tile);
}

// The tiles of sequence b for KV heads [kv0, kv1), C query heads at a time, through tile_bf16
// or tile_f32 (no target attribute here: it walks the blocks, the tiles hold the vector code).
// Before a KV head's part of a tile, the next tile's rows of that head are prefetched.
#ifndef ATTNSERVE_PF_DIST
#define ATTNSERVE_PF_DIST 1
#endif
template <typename T, int C, int D, int DV, bool Bf16Dot>
inline void walk(const Problem& pb, int64_t b, int kv0, int kv1, const Heads& all, int group) {
  const int n = pb.seq_lens[b], bs = pb.block_size, h0 = kv0 * group, nh = (kv1 - kv0) * group;
  const int krow = pb.head_dim * static_cast<int>(sizeof(T)), vrow = pb.v_head_dim * static_cast<int>(sizeof(T));
  const int32_t* row = pb.block_table + b * pb.bt_s0;
  const T* kc = static_cast<const T*>(pb.k);
  const T* vc = static_cast<const T*>(pb.v);
  for (int p0 = 0, tile = 0; p0 < n; p0 += tile) {  // tiles never cross a block's end
    tile = std::min({kTile, n - p0, bs - p0 % bs});
    const int64_t blk = row[p0 / bs], t0 = p0 % bs;
    const int p1 = p0 + tile;
    const int nt = p1 < n ? std::min({kTile, n - p1, bs - p1 % bs}) : 0;
    const int64_t nblk = nt ? row[p1 / bs] : 0;
    const T* kp = kc + blk * pb.k_s0 + t0 * pb.k_s1;
    const T* vp = vc + blk * pb.v_s0 + t0 * pb.v_s1;
    for (int h = 0; h < nh; h += C) {
      const int kvh = (h0 + h) / group;
      if (nt && (h0 + h) % group == 0) {
        prefetch_head(kc + nblk * pb.k_s0 + (p1 % bs) * pb.k_s1 + kvh * pb.k_s2, pb.k_s1, nt, krow);
        prefetch_head(vc + nblk * pb.v_s0 + (p1 % bs) * pb.v_s1 + kvh * pb.v_s2, pb.v_s1, nt, vrow);
      }
      const Heads hs{Bf16Dot ? static_cast<const void*>(static_cast<const uint16_t*>(all.q) + h * all.dp)
                             : static_cast<const void*>(static_cast<const float*>(all.q) + h * all.dp),
                     all.acc + h * all.dvp, all.m + h, all.l + 16 * h, all.dp, all.dvp};
      if constexpr (Bf16Dot) {
        tile_bf16<C, D, DV>(pb, hs, reinterpret_cast<const bf16_t*>(kp + kvh * pb.k_s2),
                            reinterpret_cast<const bf16_t*>(vp + kvh * pb.v_s2), tile);
      } else {
        tile_f32<T, C, D, DV>(pb, hs, kp + kvh * pb.k_s2, vp + kvh * pb.v_s2, tile);
      }
    }
  }
}

// Writes head h's output: the accumulator (natural column order in `acc`) over its sum.
template <typename T>
ATTNSERVE_AVX512 inline void write_out(const Problem& pb, T* o, const float* acc, const float* l) {
  const float sum = _mm512_reduce_add_ps(_mm512_loadu_ps(l));
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;  // an empty sequence gives zeros
  for (int i = 0; i < pb.v_head_dim; ++i) o[i] = from_float<T>(acc[i] * inv);
}

template <typename T, int C, int D, int DV>
ATTNSERVE_AVX512 void sequence_f32(const Problem& pb, int64_t b, int kv0, int kv1, float* scratch) {
  const int d = pb.head_dim, group = pb.heads / pb.kv_heads, h0 = kv0 * group, nh = (kv1 - kv0) * group;
  const int dp = static_cast<int>(round_up(d, 32)), dvp = static_cast<int>(round_up(pb.v_head_dim, 32));
  float* qf = scratch;  // [nh, dp] pre-scaled, zero-padded
  float* acc = qf + nh * dp;  // [nh, dvp]
  float* m = acc + nh * dvp;  // [nh]
  float* l = m + nh;  // [nh, 16]
  const T* q = static_cast<const T*>(pb.q) + b * pb.q_s0;
  for (int h = 0; h < nh; ++h) {
    for (int i = 0; i < dp; ++i) qf[h * dp + i] = i < d ? to_float(q[(h0 + h) * pb.q_s1 + i]) * pb.scale : 0.0f;
    m[h] = -std::numeric_limits<float>::infinity();
  }
  std::fill(acc, acc + nh * dvp, 0.0f);
  std::fill(l, l + 16 * nh, 0.0f);
  walk<T, C, D, DV, false>(pb, b, kv0, kv1, Heads{qf, acc, m, l, dp, dvp}, group);
  T* o = static_cast<T*>(pb.out) + b * pb.out_s0;
  for (int h = 0; h < nh; ++h) write_out(pb, o + (h0 + h) * pb.out_s1, acc + h * dvp, l + 16 * h);
}

template <int C, int D, int DV>
ATTNSERVE_AVX512_BF16 void sequence_bf16(const Problem& pb, int64_t b, int kv0, int kv1, float* scratch) {
  const int d = pb.head_dim, group = pb.heads / pb.kv_heads, h0 = kv0 * group, nh = (kv1 - kv0) * group;
  const int dp = static_cast<int>(round_up(d, 32)), dvp = static_cast<int>(round_up(pb.v_head_dim, 32));
  uint16_t* qb = reinterpret_cast<uint16_t*>(scratch);  // [nh, dp] raw bf16, zero-padded (half the floats)
  float* acc = scratch + nh * dp;  // [nh, dvp], columns permuted within each 32
  float* m = acc + nh * dvp;  // [nh]
  float* l = m + nh;  // [nh, 16]
  const bf16_t* q = static_cast<const bf16_t*>(pb.q) + b * pb.q_s0;
  for (int h = 0; h < nh; ++h) {
    for (int i = 0; i < dp; ++i) qb[h * dp + i] = i < d ? q[(h0 + h) * pb.q_s1 + i].x : 0;
    m[h] = -std::numeric_limits<float>::infinity();
  }
  std::fill(acc, acc + nh * dvp, 0.0f);
  std::fill(l, l + 16 * nh, 0.0f);
  walk<bf16_t, C, D, DV, true>(pb, b, kv0, kv1, Heads{qb, acc, m, l, dp, dvp}, group);
  // the columns back in order: lanes 0-3 of the low half, 0-3 of the high half, 4-7 of the low, ...
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  bf16_t* o = static_cast<bf16_t*>(pb.out) + b * pb.out_s0;
  for (int h = 0; h < nh; ++h) {
    float* a = acc + h * dvp;
    for (int c = 0; c < dvp; c += 32) {
      const __m512 lo = _mm512_loadu_ps(a + c), hi = _mm512_loadu_ps(a + c + 16);
      _mm512_storeu_ps(a + c, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(a + c + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
    write_out(pb, o + (h0 + h) * pb.out_s1, a, l + 16 * h);
  }
}

// The kernel of a path for a head chunk C and head dims: 64 and 128 fixed at compile time.
template <template <int, int, int> class K, int C>
SequenceFn by_dims(int d, int dv) {
  if (d == 64 && dv == 64) return K<C, 64, 64>::fn;
  if (d == 128 && dv == 128) return K<C, 128, 128>::fn;
  return K<C, 0, 0>::fn;
}

template <template <int, int, int> class K>
SequenceFn by_chunk(int chunk, int d, int dv) {
  switch (chunk) {
    case 8: return by_dims<K, 8>(d, dv);
    case 4: return by_dims<K, 4>(d, dv);
    case 2: return by_dims<K, 2>(d, dv);
    case 1: return by_dims<K, 1>(d, dv);
    default: return nullptr;
  }
}

template <typename T>
struct F32 {
  template <int C, int D, int DV>
  struct K {
    static constexpr SequenceFn fn = &sequence_f32<T, C, D, DV>;
  };
};

template <int C, int D, int DV>
struct Bf16 {
  static constexpr SequenceFn fn = &sequence_bf16<C, D, DV>;
};

}  // namespace

SequenceFn avx512_sequence(Dtype dtype, int chunk, int head_dim, int v_head_dim, bool bf16_dot) {
  switch (dtype) {
    case Dtype::kFloat: return by_chunk<F32<float>::K>(chunk, head_dim, v_head_dim);
    case Dtype::kBFloat16:
      return bf16_dot ? by_chunk<Bf16>(chunk, head_dim, v_head_dim) : by_chunk<F32<bf16_t>::K>(chunk, head_dim, v_head_dim);
    case Dtype::kHalf: return by_chunk<F32<half_t>::K>(chunk, head_dim, v_head_dim);
  }
  return nullptr;
}

}  // namespace attnserve_cpu
