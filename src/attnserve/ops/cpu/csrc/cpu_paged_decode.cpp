// Paged decode attention on x86-64 CPUs with AVX2 + FMA (+ F16C), one query token per sequence.
//
// Reads the K/V cache blocks in place ([num_blocks, block_size, Hkv, D], any dtype of float32,
// bfloat16, float16): no gathered copy. The query heads that share a KV head (the GQA fold) are
// taken together, up to 8: each key and value row is loaded and widened to float32 once for all
// of them. Keys are taken in tiles of up to 16: the scores of a tile, then an online
// softmax update (running max and sum per head, float32), then the value rows weighted into a
// float32 accumulator. A task is a whole sequence (every KV head: a block's tile is one
// contiguous read, and the next tile is prefetched), or part of its KV heads when sequences are
// too few for the threads; tasks go longest first, handed out dynamically to torch's intra-op
// threads (at::parallel_for, OpenMP), so uneven lengths balance.
//
// What it is not: prefills, masks other than the sequence length (windows, ALiBi, sinks and
// soft-capping take the PyTorch path), fp8 caches, autograd. The Python side
// (ops/cpu/paged_decode.py) builds it, checks the CPU, and holds the fallback.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

constexpr int kTile = 16;  // keys scored per softmax update

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {  // bf16 is the top half of an fp32
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

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
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
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

// Prefetches rows [t0, t0 + n) of KV heads [h0, h1) of one block of one cache (their bytes are
// contiguous: a block is [block_size, Hkv, D]).
template <typename T>
inline void prefetch_rows(const T* block, int64_t tok_stride, int64_t head_stride, int t0, int n, int h0, int h1) {
  const char* first = reinterpret_cast<const char*>(block + t0 * tok_stride + h0 * head_stride);
  const char* last = reinterpret_cast<const char*>(block + (t0 + n - 1) * tok_stride + h1 * head_stride);
  for (const char* p = first; p < last; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

// Sequence b, KV heads [kv0, kv1) and their query heads, C at a time; the tiles of a block are
// read for all of those KV heads before the next tile, and the next tile is prefetched.
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
    for (int i = 0; i < d; ++i) qf[h * d + i] = static_cast<float>(q[(h0 + h) * pb.q_s1 + i]) * pb.scale;
    m[h] = -std::numeric_limits<float>::infinity();
    l[h] = 0.0f;
  }
  std::fill(acc, acc + nh * dv, 0.0f);
  const int n = pb.seq_lens[b];
  const int32_t* row = pb.block_table + b * pb.bt_s0;
  const T* kc = static_cast<const T*>(pb.k);
  const T* vc = static_cast<const T*>(pb.v);
  for (int p0 = 0, tile = 0; p0 < n; p0 += tile) {  // tiles never cross a block's end
    tile = std::min({kTile, n - p0, bs - p0 % bs});
    const int64_t blk = row[p0 / bs], t0 = p0 % bs;
    const int p1 = p0 + tile;
    if (p1 < n) {
      const int64_t nblk = row[p1 / bs];
      const int nt = std::min({kTile, n - p1, bs - p1 % bs});
      prefetch_rows(kc + nblk * pb.k_s0, pb.k_s1, pb.k_s2, p1 % bs, nt, kv0, kv1);
      prefetch_rows(vc + nblk * pb.v_s0, pb.v_s1, pb.v_s2, p1 % bs, nt, kv0, kv1);
    }
    const T* kp = kc + blk * pb.k_s0 + t0 * pb.k_s1;
    const T* vp = vc + blk * pb.v_s0 + t0 * pb.v_s1;
    for (int h = 0; h < nh; h += C) {
      const int kvh = (h0 + h) / group;
      const Heads hs{qf + h * d, acc + h * dv, m + h, l + h};
      attend_tile<T, C>(pb, hs, kp + kvh * pb.k_s2, vp + kvh * pb.v_s2, tile);
    }
  }
  T* o = static_cast<T*>(pb.out) + b * pb.out_s0;
  for (int h = 0; h < nh; ++h) {
    const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;  // an empty sequence gives zeros
    for (int i = 0; i < dv; ++i) o[(h0 + h) * pb.out_s1 + i] = static_cast<T>(acc[h * dv + i] * inv);
  }
}

template <typename T, int C>
void run(const Problem& pb, int64_t batch) {
  // a task is a sequence and a range of its KV heads: whole sequences (each block read as one
  // contiguous run) unless there are too few of them to keep every thread busy
  const int64_t threads = at::get_num_threads();
  int splits = 1;
  while (splits < pb.kv_heads && batch * splits < 4 * threads) splits *= 2;
  while (pb.kv_heads % splits) --splits;
  const int per = pb.kv_heads / splits;
  std::vector<int64_t> order(batch);  // longest first: the dynamic hand-out then balances
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return pb.seq_lens[a] > pb.seq_lens[b]; });
  const int64_t tasks = batch * splits;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, tasks));
  const int64_t scratch_size = static_cast<int64_t>(per) * (pb.heads / pb.kv_heads) * (pb.head_dim + pb.v_head_dim + 2);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_size);
    for (int64_t i = next++; i < tasks; i = next++) {
      const int kv0 = static_cast<int>(i % splits) * per;
      attend_sequence<T, C>(pb, order[i / splits], kv0, kv0 + per, scratch.data());
    }
  });
}

template <typename T>
void dispatch(const Problem& pb, int64_t batch) {
  const int group = pb.heads / pb.kv_heads;
  if (group % 8 == 0) return run<T, 8>(pb, batch);
  if (group % 4 == 0) return run<T, 4>(pb, batch);
  if (group % 2 == 0) return run<T, 2>(pb, batch);
  run<T, 1>(pb, batch);
}

// q [B, H, D]; key_cache [N, bs, Hkv, D]; value_cache [N, bs, Hkv, Dv]; block_table [>= B, W]
// int32; seq_lens [>= B] int32 (keys per sequence, >= 0, <= W * bs); out [B, H, Dv] (written).
void paged_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "paged_decode: q/out [B, H, D], caches [N, block, Hkv, D]");
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu() &&
              block_table.device().is_cpu() && seq_lens.device().is_cpu() && out.device().is_cpu(),
              "paged_decode: CPU tensors only");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "paged_decode: float32, bfloat16 or float16");
  TORCH_CHECK(key_cache.scalar_type() == dt && value_cache.scalar_type() == dt && out.scalar_type() == dt,
              "paged_decode: q, caches and out must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "paged_decode: int32 block_table and seq_lens");
  TORCH_CHECK(block_table.dim() == 2 && block_table.stride(1) == 1 && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "paged_decode: block_table [B, W] with contiguous rows, seq_lens [B] contiguous");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t nblocks = key_cache.size(0), bs = key_cache.size(1), hkv = key_cache.size(2), dv = value_cache.size(3);
  TORCH_CHECK(key_cache.size(3) == d && value_cache.size(0) == nblocks && value_cache.size(1) == bs &&
              value_cache.size(2) == hkv, "paged_decode: cache shapes do not match q");
  TORCH_CHECK(out.size(0) == batch && out.size(1) == heads && out.size(2) == dv, "paged_decode: out must be [B, H, Dv]");
  TORCH_CHECK(hkv > 0 && heads % hkv == 0, "paged_decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(d % 8 == 0 && dv % 8 == 0 && d <= 1024 && dv <= 1024, "paged_decode: head dims must be multiples of 8, <= 1024");
  TORCH_CHECK(bs > 0 && (bs & (bs - 1)) == 0, "paged_decode: block size must be a power of two");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "paged_decode: the head dimension must be contiguous");
  TORCH_CHECK(block_table.size(0) >= batch && seq_lens.size(0) >= batch, "paged_decode: one block-table row and length per sequence");
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t width = block_table.size(1);
  for (int64_t b = 0; b < batch; ++b) {  // every block read must exist
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= width * bs, "paged_decode: sequence length out of range of the block table");
    for (int64_t j = 0; j < (lens[b] + bs - 1) / bs; ++j) {
      const int32_t id = bt[b * block_table.stride(0) + j];
      TORCH_CHECK(id >= 0 && id < nblocks, "paged_decode: block id ", id, " out of range");
    }
  }
  Problem pb{q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr(), bt, lens,
             q.stride(0), q.stride(1), out.stride(0), out.stride(1),
             key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
             value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_table.stride(0),
             static_cast<int>(heads), static_cast<int>(hkv), static_cast<int>(d), static_cast<int>(dv),
             static_cast<int>(bs), static_cast<float>(scale)};
  if (batch == 0) return;
  if (dt == at::kFloat) return dispatch<float>(pb, batch);
  if (dt == at::kBFloat16) return dispatch<c10::BFloat16>(pb, batch);
  dispatch<c10::Half>(pb, batch);
}

}  // namespace

TORCH_LIBRARY(attnserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(attnserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
