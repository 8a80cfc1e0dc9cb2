// The attention driver (attention.h): visible-key lists, work items, and one item's walk over
// its blocks with whichever path's block kernel.
#include "attention.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "half.h"

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Visible slots after the prefix for token t (offsets into the last m slots), in slot order.
void extras_of(const Attention& pb, int64_t t, std::vector<int32_t>& out) {
  out.clear();
  if (pb.mask == nullptr) {
    for (int64_t j = 0; j <= t; ++j) out.push_back(static_cast<int32_t>(pb.m - pb.t + j));
    return;
  }
  const bool* row = pb.mask + t * pb.m;
  for (int64_t j = 0; j < pb.m; ++j)
    if (row[j]) out.push_back(static_cast<int32_t>(j));
}

// How many leading visible keys sit in consecutive slots from 0 (the prefix, plus extras that
// follow it without a gap): those blocks can be read in place and shared between tokens.
int64_t contiguous_len(const Attention& pb, const std::vector<int32_t>& extras) {
  int64_t n = pb.prefix();
  for (size_t i = 0; i < extras.size() && extras[i] == static_cast<int32_t>(i); ++i) ++n;
  return n;
}

// Keys [b0, b0 + n) of a token's visible list: a pointer into the cache when they lie in place,
// else gathered into `scratch`.
const uint16_t* block_rows(const uint16_t* base, int64_t prefix, int64_t contiguous, const std::vector<int32_t>& extras,
                           int64_t b0, int n, int64_t d, uint16_t* scratch) {
  if (b0 + n <= contiguous) return base + b0 * d;
  for (int i = 0; i < n; ++i) {
    const int64_t vis = b0 + i;
    const int64_t slot = vis < prefix ? vis : prefix + extras[vis - prefix];
    std::memcpy(scratch + i * d, base + slot * d, d * sizeof(uint16_t));
  }
  return scratch;
}

BlockKernel kernel_for(Path path, int64_t d) {
  BlockKernel k{};
  switch (vector_path(path)) {  // the amx paths attend on their vector path's kernels
#if defined(__x86_64__)
    case Path::AVX512:
      if (block_kernel_avx512(d, &k) || block_kernel_avx2(d, &k)) return k;
      break;
    case Path::AVX2:
      if (block_kernel_avx2(d, &k)) return k;
      break;
#endif
#if defined(__aarch64__)
    case Path::NEON:
      if (block_kernel_neon(d, &k)) return k;
      break;
#endif
    default: break;
  }
  return block_kernel_portable();
}

// The per-token part of an item: its visible list and where it stops being shared.
struct TokenKeys {
  std::vector<int32_t> extras;
  int64_t total = 0, contiguous = 0;
};

// Rows of the item (token-major, then query head): the scaled bfloat16 query and zeroed state.
void start_rows(const Attention& pb, const AttentionItem& it, uint16_t* qbuf, float* qfbuf, float* acc0,
                RowState* rows) {
  const int64_t g = pb.heads / pb.kv_heads, d = pb.d;
  for (int64_t i = 0; i < it.t1 - it.t0; ++i)
    for (int64_t r = 0; r < g; ++r) {
      uint16_t* q = qbuf + (i * g + r) * d;
      float* qf = qfbuf + (i * g + r) * d;
      const float* src = pb.q + ((it.kvh * g + r) * pb.t + it.t0 + i) * d;
      for (int64_t x = 0; x < d; ++x) {
        q[x] = float_to_bf16(src[x] * pb.scale);
        qf[x] = bf16_to_float(q[x]);
      }
      const float* sink = pb.sinks ? pb.sinks + it.kvh * g + r : nullptr;  // query head kvh * g + r
      rows[i * g + r] = RowState{q, qf, acc0 + (i * g + r) * d, sink ? *sink : kNegInf, sink ? 1.f : 0.f};
    }
}

void run_item(const Attention& pb, const AttentionItem& it, const BlockKernel& kn) {
  const int64_t g = pb.heads / pb.kv_heads, d = pb.d, prefix = pb.prefix();
  const int ntok = static_cast<int>(it.t1 - it.t0), nrows = ntok * static_cast<int>(g);
  std::vector<uint16_t> qbuf(nrows * d);
  std::vector<float> accbuf(nrows * d + 16, 0.f), qfbuf(nrows * d);
  float* acc0 = accbuf.data() + ((16 - (reinterpret_cast<uintptr_t>(accbuf.data()) / 4) % 16) % 16);
  std::vector<RowState> rows(nrows);
  start_rows(pb, it, qbuf.data(), qfbuf.data(), acc0, rows.data());
  std::vector<TokenKeys> tokens(ntok);
  int64_t shared = std::numeric_limits<int64_t>::max();
  for (int i = 0; i < ntok; ++i) {
    TokenKeys& tk = tokens[i];
    extras_of(pb, it.t0 + i, tk.extras);
    tk.total = prefix + static_cast<int64_t>(tk.extras.size());
    tk.contiguous = contiguous_len(pb, tk.extras);
    shared = std::min(shared, tk.contiguous);
  }
  const uint16_t* kbase = pb.k + it.kvh * pb.k_head_stride;
  const uint16_t* vbase = pb.v + it.kvh * pb.v_head_stride;
  std::vector<float> ws(kn.workspace(d, nrows) + 16);
  float* wsp = ws.data() + ((16 - (reinterpret_cast<uintptr_t>(ws.data()) / 4) % 16) % 16);
  // Blocks every token sees in place are shared by all rows; the rest run token by token.
  const int64_t shared_blocks = shared / kBlock;
  for (int64_t b = 0; b < shared_blocks; ++b)
    kn.block(kbase + b * kBlock * d, vbase + b * kBlock * d, kBlock, d, rows.data(), nrows, wsp);
  std::vector<uint16_t> kscratch(kBlock * d), vscratch(kBlock * d);
  for (int i = 0; i < ntok; ++i) {
    const TokenKeys& tk = tokens[i];
    for (int64_t b0 = shared_blocks * kBlock; b0 < tk.total; b0 += kBlock) {
      const int n = static_cast<int>(std::min<int64_t>(kBlock, tk.total - b0));
      const uint16_t* kb = block_rows(kbase, prefix, tk.contiguous, tk.extras, b0, n, d, kscratch.data());
      const uint16_t* vb = block_rows(vbase, prefix, tk.contiguous, tk.extras, b0, n, d, vscratch.data());
      kn.block(kb, vb, n, d, rows.data() + i * g, static_cast<int>(g), wsp);
    }
  }
  for (int i = 0; i < ntok; ++i)
    for (int64_t r = 0; r < g; ++r)
      kn.finish(rows[i * g + r], d, pb.out + ((it.kvh * g + r) * pb.t + it.t0 + i) * d);
}

}  // namespace

std::vector<AttentionItem> attention_items(const Attention& pb, int threads) {
  std::vector<AttentionItem> items;
  const int64_t min_groups = (threads + pb.kv_heads - 1) / pb.kv_heads;
  const int64_t groups =
      std::min(pb.t, std::max<int64_t>((pb.t + kTokensPerItem - 1) / kTokensPerItem, min_groups));
  // Later groups see more keys (a causal chunk's tails): they go first.
  for (int64_t gi = groups - 1; gi >= 0; --gi) {
    const int64_t t0 = gi * pb.t / groups, t1 = (gi + 1) * pb.t / groups;
    for (int64_t h = 0; h < pb.kv_heads; ++h) items.push_back({h, t0, t1});
  }
  return items;
}

void attend_items(Path path, const Attention& pb, const AttentionItem* items, int64_t i0, int64_t i1) {
  const BlockKernel kn = kernel_for(path, pb.d);
  for (int64_t i = i0; i < i1; ++i) run_item(pb, items[i], kn);
}

}  // namespace spx
