// The attention driver (attention.h): visible-key lists, work items, and one item's walk over
// its blocks with whichever path's block kernel.
#include "attention.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "fastexp.h"
#include "half.h"
#include "kv_q8.h"

namespace spx {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kAhead = 4;  // the block a kernel brings in while it computes: four after its own

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

// One K/V head's rows as the block kernels take them: bfloat16 rows read in place, or q8 rows
// (kv_q8.h) turned into bfloat16 in a scratch buffer by the path's `dequant`.
struct HeadRows {
  const uint16_t* base;
  int64_t d, row;  // row: one row's size in 16-bit units
  bool q8;
  void (*dequant)(const uint16_t*, int, int64_t, uint16_t*);

  // Slots [first, first + n), contiguous.
  const uint16_t* span(int64_t first, int n, uint16_t* scratch) const {
    if (!q8) return base + first * d;
    dequant(base + first * row, n, d, scratch);
    return scratch;
  }
  // Block b of these rows and of `values` (the same slots), as they lie.
  Ahead ahead(const HeadRows& values, int64_t b) const {
    return Ahead{base + b * kBlock * row, values.base + b * kBlock * row, kBlock * row * 2};
  }
  void slot_into(int64_t slot, uint16_t* dst) const {
    if (q8)
      dequant(base + slot * row, 1, d, dst);
    else
      std::memcpy(dst, base + slot * d, d * sizeof(uint16_t));
  }
};

// Keys [b0, b0 + n) of a token's visible list: in place when they lie in place (q8: converted into
// `scratch`), else gathered into `scratch`.
const uint16_t* block_rows(const HeadRows& src, int64_t prefix, int64_t contiguous, const std::vector<int32_t>& extras,
                           int64_t b0, int n, int64_t d, uint16_t* scratch) {
  if (b0 + n <= contiguous) return src.span(b0, n, scratch);
  for (int i = 0; i < n; ++i) {
    const int64_t vis = b0 + i;
    const int64_t slot = vis < prefix ? vis : prefix + extras[vis - prefix];
    src.slot_into(slot, scratch + i * d);
  }
  return scratch;
}

HeadRows head_rows(const Attention& pb, const BlockKernel& kn, bool keys, int64_t kvh) {
  const uint16_t* base = keys ? pb.k + kvh * pb.k_head_stride : pb.v + kvh * pb.v_head_stride;
  return HeadRows{base, pb.d, pb.row(), pb.q8, kn.dequant != nullptr ? kn.dequant : dequant_q8_portable};
}

// The per-token part of an item: its visible list and where it stops being shared.
struct TokenKeys {
  std::vector<int32_t> extras;
  int64_t total = 0, contiguous = 0;
};

// Keys every token of [t0, t1) sees in place (the committed prefix, and the new tokens' slots up to
// the first one some token does not see), and each token's list.
int64_t shared_keys(const Attention& pb, int64_t t0, int64_t t1, std::vector<TokenKeys>* tokens) {
  int64_t shared = std::numeric_limits<int64_t>::max();
  std::vector<TokenKeys> local;
  std::vector<TokenKeys>& tks = tokens != nullptr ? *tokens : local;
  tks.assign(t1 - t0, TokenKeys{});
  for (int64_t i = 0; i < t1 - t0; ++i) {
    TokenKeys& tk = tks[i];
    extras_of(pb, t0 + i, tk.extras);
    tk.total = pb.prefix() + static_cast<int64_t>(tk.extras.size());
    tk.contiguous = contiguous_len(pb, tk.extras);
    shared = std::min(shared, tk.contiguous);
  }
  return shared;
}

template <typename T>
T* aligned64(std::vector<T>& buf) {  // buf has 64 bytes to spare
  const uintptr_t p = reinterpret_cast<uintptr_t>(buf.data());
  return reinterpret_cast<T*>((p + 63) & ~uintptr_t{63});
}

// An item's query rows (token-major, then query head): the scaled bfloat16 queries, the state of
// each row's current chunk, and the fold of its chunks before it.
struct ItemRows {
  int64_t d = 0;
  int nrows = 0;
  std::vector<uint16_t> qbuf;
  std::vector<float> qfbuf, accbuf, totbuf, tml;
  std::vector<RowState> rows;
  float* tacc = nullptr;  // [nrows][d], aligned: the folded chunks
  std::vector<char> folded;  // per row: whether tacc/tml hold anything yet

  ItemRows(const Attention& pb, const AttentionItem& it) : d(pb.d) {
    const int64_t g = pb.heads / pb.kv_heads;
    nrows = static_cast<int>((it.t1 - it.t0) * g);
    qbuf.resize(nrows * d);
    qfbuf.resize(nrows * d);
    accbuf.assign(nrows * d + 16, 0.f);
    totbuf.assign(nrows * d + 16, 0.f);
    tml.assign(2 * nrows, 0.f);
    folded.assign(nrows, 0);
    rows.resize(nrows);
    tacc = aligned64(totbuf);
    float* acc0 = aligned64(accbuf);
    for (int64_t i = 0; i < it.t1 - it.t0; ++i)
      for (int64_t r = 0; r < g; ++r) {
        uint16_t* q = qbuf.data() + (i * g + r) * d;
        float* qf = qfbuf.data() + (i * g + r) * d;
        const float* src = pb.q + ((it.kvh * g + r) * pb.t + it.t0 + i) * d;
        for (int64_t x = 0; x < d; ++x) {
          q[x] = float_to_bf16(src[x] * pb.scale);
          qf[x] = bf16_to_float(q[x]);
        }
        rows[i * g + r] = RowState{q, qf, acc0 + (i * g + r) * d, kNegInf, 0.f, pb.softcap};
        if (pb.sinks != nullptr) {  // the sink is the fold's first term: maximum s_h, sum 1, no value
          const int64_t row = i * g + r;
          folded[row] = 1;
          tml[2 * row] = pb.sinks[it.kvh * g + r];  // query head kvh * g + r
          tml[2 * row + 1] = 1.f;
        }
      }
  }

  void reset(int r0, int n) {
    for (int r = r0; r < r0 + n; ++r) {
      rows[r].m = kNegInf;
      rows[r].l = 0.f;
      std::fill(rows[r].acc, rows[r].acc + d, 0.f);
    }
  }

  // Rows [r0, r0 + n)'s current chunk into their fold (fold_state), and a fresh chunk.
  void fold(int r0, int n) {
    for (int r = r0; r < r0 + n; ++r)
      fold_state(rows[r].m, rows[r].l, rows[r].acc, &folded[r], &tml[2 * r], tacc + r * d, d);
    reset(r0, n);
  }
};

}  // namespace

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

// The running fold (m, l, acc at tml/tacc; `started` says whether it holds a chunk yet) absorbs
// one chunk's state: both rescaled to the larger maximum, then summed, in this order on every path.
void fold_state(float m, float l, const float* acc, char* started, float* tml, float* tacc, int64_t d) {
  if (!*started) {
    tml[0] = m;
    tml[1] = l;
    std::memcpy(tacc, acc, d * sizeof(float));
    *started = 1;
    return;
  }
  const float mn = std::fmax(tml[0], m);
  const float a = exp_portable(tml[0] - mn), b = exp_portable(m - mn);
  const float la = tml[1] * a, lb = l * b;
  tml[0] = mn;
  tml[1] = la + lb;
  for (int64_t x = 0; x < d; ++x) {
    const float ta = tacc[x] * a, tb = acc[x] * b;
    tacc[x] = ta + tb;
  }
}

namespace {

// Shared blocks [b0, b1) (every row, keys in place) with a fold at each chunk's start but the first.
void shared_blocks(const Attention& pb, const AttentionItem& it, const BlockKernel& kn, ItemRows& ir, int64_t b0,
                   int64_t b1, float* ws) {
  const int64_t d = pb.d;
  const HeadRows ks = head_rows(pb, kn, true, it.kvh), vs = head_rows(pb, kn, false, it.kvh);
  const bool runs = kn.run != nullptr && ir.nrows >= kn.run_rows;
  const int64_t span = runs ? kChunk : kBlock;  // keys read in one call
  std::vector<uint16_t> scratch(pb.q8 ? 2 * span * d : 0);
  for (int64_t b = b0; b < b1;) {
    if (b > b0 && b % kBlocksPerChunk == 0) ir.fold(0, ir.nrows);
    // Up to the chunk's end: a run of blocks in one call where the path has one, else a block.
    const int64_t n = runs ? std::min(b1, (b / kBlocksPerChunk + 1) * kBlocksPerChunk) - b : 1;
    const int nk = static_cast<int>(n * kBlock);
    const uint16_t* kb = ks.span(b * kBlock, nk, scratch.data());
    const uint16_t* vb = vs.span(b * kBlock, nk, scratch.data() + (pb.q8 ? span * d : 0));
    if (runs)
      kn.run(kb, vb, static_cast<int>(n), d, ir.rows.data(), ir.nrows, ws);
    else
      kn.block(kb, vb, kBlock, d, ir.rows.data(), ir.nrows, ws, b + kAhead < b1 ? ks.ahead(vs, b + kAhead) : Ahead{});
    b += n;
  }
}

std::vector<float> workspace_for(const BlockKernel& kn, int64_t d, int nrows, float** wsp) {
  std::vector<float> ws(kn.workspace(d, nrows) + 16);
  *wsp = aligned64(ws);
  return ws;
}

// The item from block `from` on (the blocks before it are folded into ir already, if any): the
// shared blocks, then each token's own, folding at chunk starts; then every row's output.
void finish_item(const Attention& pb, const AttentionItem& it, const BlockKernel& kn, ItemRows& ir, int64_t from) {
  const int64_t g = pb.heads / pb.kv_heads, d = pb.d, prefix = pb.prefix();
  const int ntok = static_cast<int>(it.t1 - it.t0);
  std::vector<TokenKeys> tokens;
  const int64_t shared = shared_keys(pb, it.t0, it.t1, &tokens);
  float* wsp = nullptr;
  const std::vector<float> ws = workspace_for(kn, d, ir.nrows, &wsp);
  const int64_t sb = std::max(from, shared / kBlock);
  shared_blocks(pb, it, kn, ir, from, sb, wsp);
  const HeadRows ks = head_rows(pb, kn, true, it.kvh), vs = head_rows(pb, kn, false, it.kvh);
  std::vector<uint16_t> kscratch(kBlock * d), vscratch(kBlock * d);
  for (int i = 0; i < ntok; ++i) {
    const TokenKeys& tk = tokens[i];
    const int r0 = i * static_cast<int>(g), n = static_cast<int>(g);
    for (int64_t b0 = sb * kBlock; b0 < tk.total; b0 += kBlock) {
      if (b0 > from * kBlock && b0 % kChunk == 0) ir.fold(r0, n);
      const int nk = static_cast<int>(std::min<int64_t>(kBlock, tk.total - b0));
      const uint16_t* kb = block_rows(ks, prefix, tk.contiguous, tk.extras, b0, nk, d, kscratch.data());
      const uint16_t* vb = block_rows(vs, prefix, tk.contiguous, tk.extras, b0, nk, d, vscratch.data());
      kn.block(kb, vb, nk, d, ir.rows.data() + r0, n, wsp, Ahead{});
    }
    // The last chunk (a token whose keys all lie before `from` has none left: nothing to fold).
    if (tk.total > from * kBlock) ir.fold(r0, n);
  }
  for (int i = 0; i < ntok; ++i)
    for (int64_t r = 0; r < g; ++r) {
      const int row = static_cast<int>(i * g + r);
      const RowState st{nullptr, nullptr, ir.tacc + row * d, ir.tml[2 * row], ir.tml[2 * row + 1]};
      kn.finish(st, d, pb.out + ((it.kvh * g + r) * pb.t + it.t0 + i) * d);
    }
}

// A piece: chunks [c0, c1) of the split's shared keys, each from a fresh state into its slot; the
// piece that finishes last folds every slot in chunk order and finishes the item.
void run_piece(const Attention& pb, const AttentionItem& it, AttentionSplit& sp, const BlockKernel& kn) {
  const int64_t d = pb.d;
  ItemRows ir(pb, it);
  float* wsp = nullptr;
  const std::vector<float> ws = workspace_for(kn, d, ir.nrows, &wsp);
  for (int64_t c = it.c0; c < it.c1; ++c) {
    ir.reset(0, ir.nrows);
    shared_blocks(pb, it, kn, ir, c * kBlocksPerChunk, (c + 1) * kBlocksPerChunk, wsp);
    for (int r = 0; r < ir.nrows; ++r) {
      sp.ml[(c * ir.nrows + r) * 2] = ir.rows[r].m;
      sp.ml[(c * ir.nrows + r) * 2 + 1] = ir.rows[r].l;
      std::memcpy(sp.acc.data() + (c * ir.nrows + r) * d, ir.rows[r].acc, d * sizeof(float));
    }
  }
  if (sp.done.fetch_add(1, std::memory_order_acq_rel) != sp.pieces - 1) return;
  sp.done.store(0, std::memory_order_relaxed);  // ready for the plan's next run (after the caller's barrier)
  ir.reset(0, ir.nrows);
  for (int64_t c = 0; c < sp.chunks; ++c)
    for (int r = 0; r < ir.nrows; ++r)
      fold_state(sp.ml[(c * ir.nrows + r) * 2], sp.ml[(c * ir.nrows + r) * 2 + 1],
                 sp.acc.data() + (c * ir.nrows + r) * d, &ir.folded[r], &ir.tml[2 * r], ir.tacc + r * d, d);
  AttentionItem whole = it;
  whole.split = -1;
  finish_item(pb, whole, kn, ir, sp.chunks * kBlocksPerChunk);
}

}  // namespace

AttentionPlan plan_attention(const Attention& pb, int threads) {
  AttentionPlan plan;
  std::vector<AttentionItem> groups;
  const int64_t min_groups = (threads + pb.kv_heads - 1) / pb.kv_heads;
  const int64_t ngroups =
      std::min(pb.t, std::max<int64_t>((pb.t + kTokensPerItem - 1) / kTokensPerItem, min_groups));
  // Later groups see more keys (a causal chunk's tails): they go first.
  for (int64_t gi = ngroups - 1; gi >= 0; --gi) {
    const int64_t t0 = gi * pb.t / ngroups, t1 = (gi + 1) * pb.t / ngroups;
    for (int64_t h = 0; h < pb.kv_heads; ++h) groups.push_back({h, t0, t1});
  }
  const int64_t want = static_cast<int64_t>(threads) * kItemsPerThread;
  const int64_t n = static_cast<int64_t>(groups.size());
  const int64_t per_group = threads > 1 && n < want ? (want + n - 1) / n : 1;
  const int64_t g = pb.heads / pb.kv_heads;
  std::vector<int64_t> shared_chunks(n, 0);
  for (int64_t i = 0; i < n && per_group > 1; ++i) {
    if (i > 0 && groups[i].t0 == groups[i - 1].t0) {
      shared_chunks[i] = shared_chunks[i - 1];  // same tokens, another head: the same keys
      continue;
    }
    shared_chunks[i] = shared_keys(pb, groups[i].t0, groups[i].t1, nullptr) / kChunk;
  }
  for (int64_t i = 0; i < n; ++i) {
    const AttentionItem& gr = groups[i];
    const int64_t pieces = std::min(per_group, shared_chunks[i] / kMinPieceChunks);
    if (pieces < 2) {
      plan.items.push_back(gr);
      continue;
    }
    auto sp = std::make_unique<AttentionSplit>();
    const int64_t rows = (gr.t1 - gr.t0) * g;
    sp->kvh = gr.kvh;
    sp->t0 = gr.t0;
    sp->t1 = gr.t1;
    sp->chunks = shared_chunks[i];
    sp->pieces = pieces;
    sp->ml.assign(sp->chunks * rows * 2, 0.f);
    sp->acc.assign(sp->chunks * rows * pb.d, 0.f);
    const int64_t id = static_cast<int64_t>(plan.splits.size());
    for (int64_t p = 0; p < pieces; ++p)
      plan.items.push_back({gr.kvh, gr.t0, gr.t1, id, p * sp->chunks / pieces, (p + 1) * sp->chunks / pieces});
    plan.splits.push_back(std::move(sp));
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [&](const AttentionItem& a, const AttentionItem& b) {
    return item_cost(pb, a) > item_cost(pb, b);
  });
  return plan;
}

int64_t Attention::row() const { return q8 ? q8_row_units(d) : d; }

int64_t item_cost(const Attention& pb, const AttentionItem& it) {
  const int64_t keys = it.split < 0 ? pb.s : (it.c1 - it.c0) * kChunk;
  return (it.t1 - it.t0) * keys;
}

void attend_item(Path path, const Attention& pb, const AttentionPlan& plan, int64_t i) {
  const BlockKernel kn = kernel_for(path, pb.d);
  const AttentionItem& it = plan.items[i];
  if (it.split >= 0) {
    run_piece(pb, it, *plan.splits[it.split], kn);
    return;
  }
  ItemRows ir(pb, it);
  finish_item(pb, it, kn, ir, 0);
}

void attend_all(Path path, const Attention& pb, const AttentionPlan& plan) {
  for (int64_t i = 0; i < static_cast<int64_t>(plan.items.size()); ++i) attend_item(path, pb, plan, i);
}

}  // namespace spx
