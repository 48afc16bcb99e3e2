// The AVX2 + FMA (+ F16C) path of the paged CPU decode kernel: the baseline of the build's
// flags, and the fallback where the CPU has no AVX-512.
//
// The query heads that share a KV head (the GQA fold) are taken together, up to 8: each key and
// value row is loaded and widened to float32 once for all of them. Keys are taken in tiles of up
// to 16: the scores of a tile, then an online softmax update (running max and sum per head,
// float32), then the value rows weighted into a float32 accumulator.

#include "paged_decode.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace attnserve_cpu {

float half_to_float(half_t x) { return _cvtsh_ss(x.x); }
half_t float_to_half(float f) { return half_t{_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)}; }

namespace {

constexpr int kTile = 16;  // keys scored per softmax update

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const bf16_t* p) {  // bf16 is the top half of an fp32
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const half_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for x <= 0 (a score minus the running max): 2^n e^r with n = round(x / ln 2), r in
// [-ln2 / 2, ln2 / 2], e^r by a degree-7 polynomial (relative error ~1e-7); x below -87 -> ~0.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// The running state of C query heads that share a KV head: pre-scaled queries [C, d], value
// accumulators [C, dv], running max and sum.
struct Heads {
  float* q;
  float* acc;
  float* m;
  float* l;
};

// One tile of up to kTile keys (rows kp + t * k_s1, vp + t * v_s1) for C heads. The dot products
// run TT keys at a time and the value sums IC chunks of 8 at a time: independent FMA chains,
// not one chain as long as the head dimension.
template <typename T, int C>
inline void attend_tile(const Problem& pb, const Heads& hs, const T* kp, const T* vp, int tile) {
  constexpr int TT = C >= 8 ? 1 : 8 / C;
  constexpr int IC = C >= 8 ? 1 : 8 / C;
  const int d = pb.head_dim, dv = pb.v_head_dim;
  alignas(32) float s[C][kTile];
  int t = 0;
  for (; t + TT <= tile; t += TT) {  // scores, TT keys at a time
    __m256 sa[C][TT];
    for (int g = 0; g < C; ++g)
      for (int u = 0; u < TT; ++u) sa[g][u] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      for (int u = 0; u < TT; ++u) {
        const __m256 kv = load8(kp + (t + u) * pb.k_s1 + i);
        for (int g = 0; g < C; ++g) sa[g][u] = _mm256_fmadd_ps(_mm256_loadu_ps(hs.q + g * d + i), kv, sa[g][u]);
      }
    }
    for (int g = 0; g < C; ++g)
      for (int u = 0; u < TT; ++u) s[g][t + u] = hsum(sa[g][u]);
  }
  for (; t < tile; ++t) {  // the rest, one key at a time
    __m256 sa[C];
    for (int g = 0; g < C; ++g) sa[g] = _mm256_setzero_ps();
    for (int i = 0; i < d; i += 8) {
      const __m256 kv = load8(kp + t * pb.k_s1 + i);
      for (int g = 0; g < C; ++g) sa[g] = _mm256_fmadd_ps(_mm256_loadu_ps(hs.q + g * d + i), kv, sa[g]);
    }
    for (int g = 0; g < C; ++g) s[g][t] = hsum(sa[g]);
  }
  for (int g = 0; g < C; ++g) {  // online softmax: s becomes the weights
    float mx = hs.m[g];
    for (int u = 0; u < tile; ++u) mx = std::max(mx, s[g][u]);
    const float alpha = std::exp(hs.m[g] - mx);  // 0 on the first tile (m = -inf)
    hs.m[g] = mx;
    for (int u = 0; u < tile; u += 8)
      _mm256_store_ps(&s[g][u], exp8(_mm256_sub_ps(_mm256_load_ps(&s[g][u]), _mm256_set1_ps(mx))));
    float sum = 0.0f;
    for (int u = 0; u < tile; ++u) sum += s[g][u];
    hs.l[g] = hs.l[g] * alpha + sum;
    if (alpha != 1.0f) {
      const __m256 a = _mm256_set1_ps(alpha);
      for (int i = 0; i < dv; i += 8) _mm256_storeu_ps(hs.acc + g * dv + i, _mm256_mul_ps(a, _mm256_loadu_ps(hs.acc + g * dv + i)));
    }
  }
  int i = 0;
  for (; i + 8 * IC <= dv; i += 8 * IC) {  // weighted values, IC chunks of 8 at a time
    __m256 a[C][IC];
    for (int g = 0; g < C; ++g)
      for (int c = 0; c < IC; ++c) a[g][c] = _mm256_loadu_ps(hs.acc + g * dv + i + 8 * c);
    for (int u = 0; u < tile; ++u) {
      for (int c = 0; c < IC; ++c) {
        const __m256 vv = load8(vp + u * pb.v_s1 + i + 8 * c);
        for (int g = 0; g < C; ++g) a[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(s[g][u]), vv, a[g][c]);
      }
    }
    for (int g = 0; g < C; ++g)
      for (int c = 0; c < IC; ++c) _mm256_storeu_ps(hs.acc + g * dv + i + 8 * c, a[g][c]);
  }
  for (; i < dv; i += 8) {  // the rest, one chunk at a time
    __m256 a[C];
    for (int g = 0; g < C; ++g) a[g] = _mm256_loadu_ps(hs.acc + g * dv + i);
    for (int u = 0; u < tile; ++u) {
      const __m256 vv = load8(vp + u * pb.v_s1 + i);
      for (int g = 0; g < C; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(s[g][u]), vv, a[g]);
    }
    for (int g = 0; g < C; ++g) _mm256_storeu_ps(hs.acc + g * dv + i, a[g]);
  }
}

// Prefetches the rows [t0, t0 + n) of one KV head (`row_bytes` each, `stride` elements apart)
// into L2: spread over the tiles, a KV head at a time, so that the misses in flight stay few (a
// whole tile at once into L1 stalled on them: 3x slower from DRAM).
template <typename T>
inline void prefetch_head(const T* first_row, int64_t stride, int n, int row_bytes) {
  for (int t = 0; t < n; ++t) {
    const char* p = reinterpret_cast<const char*>(first_row + t * stride);
    for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
  }
}

// Sequence b, KV heads [kv0, kv1) and their query heads, C at a time; the tiles of a block are
// read for all of those KV heads before the next tile, and the next tile is prefetched a KV head
// at a time.
template <typename T, int C>
void attend_sequence(const Problem& pb, int64_t b, int kv0, int kv1, float* scratch) {
  const int d = pb.head_dim, dv = pb.v_head_dim, bs = pb.block_size, group = pb.heads / pb.kv_heads;
  const int h0 = kv0 * group, nh = (kv1 - kv0) * group;
  float* qf = scratch;  // [nh, d], pre-scaled
  float* acc = qf + nh * d;  // [nh, dv]
  float* m = acc + nh * dv;  // [nh]
  float* l = m + nh;  // [nh]
  const T* q = static_cast<const T*>(pb.q) + b * pb.q_s0;
  for (int h = 0; h < nh; ++h) {
    for (int i = 0; i < d; ++i) qf[h * d + i] = to_float(q[(h0 + h) * pb.q_s1 + i]) * pb.scale;
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
  }
  std::fill(acc, acc + nh * dv, 0.0f);
  const int n = pb.seq_lens[b];
  const int32_t* row = pb.block_table + b * pb.bt_s0;
  const T* kc = static_cast<const T*>(pb.k);
  const T* vc = static_cast<const T*>(pb.v);
  const int krow = d * static_cast<int>(sizeof(T)), vrow = dv * static_cast<int>(sizeof(T));
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
      if (nt && (h0 + h) % group == 0) {  // the next tile's rows of this KV head
        prefetch_head(kc + nblk * pb.k_s0 + (p1 % bs) * pb.k_s1 + kvh * pb.k_s2, pb.k_s1, nt, krow);
        prefetch_head(vc + nblk * pb.v_s0 + (p1 % bs) * pb.v_s1 + kvh * pb.v_s2, pb.v_s1, nt, vrow);
      }
      const Heads hs{qf + h * d, acc + h * dv, m + h, l + h};
      attend_tile<T, C>(pb, hs, kp + kvh * pb.k_s2, vp + kvh * pb.v_s2, tile);
    }
  }
  T* o = static_cast<T*>(pb.out) + b * pb.out_s0;
  for (int h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // an empty sequence gives zeros
    for (int i = 0; i < dv; ++i) o[(h0 + h) * pb.out_s1 + i] = from_float<T>(acc[h * dv + i] * inv);
  }
}

template <typename T>
SequenceFn pick(int chunk) {
  switch (chunk) {
    case 8: return &attend_sequence<T, 8>;
    case 4: return &attend_sequence<T, 4>;
    case 2: return &attend_sequence<T, 2>;
    case 1: return &attend_sequence<T, 1>;
    default: return nullptr;
  }
}

}  // namespace

SequenceFn avx2_sequence(Dtype dtype, int chunk) {
  switch (dtype) {
    case Dtype::kFloat: return pick<float>(chunk);
    case Dtype::kBFloat16: return pick<bf16_t>(chunk);
    case Dtype::kHalf: return pick<half_t>(chunk);
  }
  return nullptr;
}

}  // namespace attnserve_cpu
