// Paged decode attention on x86-64 CPUs, one query token per sequence: the op, its input checks,
// the run-time choice of instruction-set path, and the threads.
//
// Reads the K/V cache blocks in place ([num_blocks, block_size, Hkv, D], any dtype of float32,
// bfloat16, float16): no gathered copy. A task is a whole sequence (every KV head: a block's
// tile is one contiguous read, and the next tile is prefetched), or part of its KV heads when
// sequences are too few for the threads; tasks go longest first, handed out dynamically to
// torch's intra-op threads (at::parallel_for, OpenMP), so uneven lengths balance. Each task
// runs one path's per-sequence kernel (paged_decode.h):
//   avx512_bf16  AVX-512 with bf16 dot products (vdpbf16ps) for bfloat16 caches; float32 and
//                float16 caches take the avx512 kernel (paged_decode_avx512.cpp)
//   avx512       AVX-512F/BW/VL/DQ, rows widened to float32 (paged_decode_avx512.cpp)
//   avx2         AVX2 + FMA + F16C (paged_decode_avx2.cpp)
// `isa` picks one (0: the best this CPU has); a path the CPU lacks is an error, not a crash.
//
// What it is not: prefills, masks other than the sequence length (windows, ALiBi, sinks and
// soft-capping take the PyTorch path), fp8 caches, autograd. The Python side
// (ops/cpu/paged_decode.py) builds it, checks the CPU, and holds the fallback.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <vector>

#include "paged_decode.h"

namespace attnserve_cpu {
namespace {

int64_t best_isa() {
  if (cpu_has_avx512_bf16()) return static_cast<int64_t>(Isa::kAvx512Bf16);
  if (cpu_has_avx512()) return static_cast<int64_t>(Isa::kAvx512);
  return static_cast<int64_t>(Isa::kAvx2);
}

const char* isa_name(int64_t isa) {
  switch (static_cast<Isa>(isa)) {
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx512Bf16: return "avx512_bf16";
    default: return "?";
  }
}

void run(const Problem& pb, int64_t batch, SequenceFn fn) {
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
  const int64_t scratch_size = scratch_floats(pb, per * (pb.heads / pb.kv_heads));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> buffer(scratch_size + 16);
    float* scratch = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~uintptr_t(63));
    for (int64_t i = next++; i < tasks; i = next++) {
      const int kv0 = static_cast<int>(i % splits) * per;
      fn(pb, order[i / splits], kv0, kv0 + per, scratch);
    }
  });
}

// q [B, H, D]; key_cache [N, bs, Hkv, D]; value_cache [N, bs, Hkv, Dv]; block_table [>= B, W]
// int32; seq_lens [>= B] int32 (keys per sequence, >= 0, <= W * bs); out [B, H, Dv] (written);
// isa: 0 (the best this CPU runs), 1 avx2, 2 avx512, 3 avx512_bf16.
void paged_decode(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, at::Tensor out, int64_t isa) {
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
  TORCH_CHECK(isa >= 0 && isa <= static_cast<int64_t>(Isa::kAvx512Bf16),
              "paged_decode: isa must be 0 (the best this CPU runs), 1 (avx2), 2 (avx512) or 3 (avx512_bf16), got ", isa);
  const int64_t best = best_isa();
  TORCH_CHECK(isa <= best, "paged_decode: this CPU cannot run the ", isa_name(isa), " path (it runs up to ", isa_name(best), ")");
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
  const Dtype dtype = dt == at::kFloat ? Dtype::kFloat : dt == at::kBFloat16 ? Dtype::kBFloat16 : Dtype::kHalf;
  const int group = static_cast<int>(heads / hkv);
  const int chunk = group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;  // query heads a row serves
  const Isa path = static_cast<Isa>(isa == 0 ? best : isa);
  const SequenceFn fn = path == Isa::kAvx2 ? avx2_sequence(dtype, chunk)
                                           : avx512_sequence(dtype, chunk, static_cast<int>(d), static_cast<int>(dv), path == Isa::kAvx512Bf16);
  TORCH_CHECK(fn != nullptr, "paged_decode: no kernel for this dtype and head group");
  run(pb, batch, fn);
}

}  // namespace
}  // namespace attnserve_cpu

TORCH_LIBRARY(attnserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_table, Tensor seq_lens, "
        "float scale, Tensor(a!) out, int isa=0) -> ()");
  m.def("best_isa() -> int", &attnserve_cpu::best_isa);  // the best path this CPU runs
}

TORCH_LIBRARY_IMPL(attnserve_cpu, CPU, m) { m.impl("paged_decode", &attnserve_cpu::paged_decode); }
