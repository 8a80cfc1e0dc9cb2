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
  // The block of these rows and of `values` (the same slots) from key `first` on, as they lie.
  Ahead ahead(const HeadRows& values, int64_t first) const {
    return Ahead{base + first * row, values.base + first * row, kBlock * row * 2};
  }
  void slot_into(int64_t slot, uint16_t* dst) const {
    if (q8)
      dequant(base + slot * row, 1, d, dst);
    else
      std::memcpy(dst, base + slot * d, d * sizeof(uint16_t));
  }
};

HeadRows head_rows(const Attention& pb, const BlockKernel& kn, bool keys, int64_t kvh) {
  const uint16_t* base = keys ? pb.k + kvh * pb.k_head_stride : pb.v + kvh * pb.v_head_stride;
  return HeadRows{base, pb.d, pb.row(), pb.q8, kn.dequant != nullptr ? kn.dequant : dequant_q8_portable};
}

// A token's visible list: entry i is the key at slot(i), numbered first + i (attention.h).
struct TokenKeys {
  std::vector<int32_t> extras;
  int64_t total = 0, first = 0;
  int64_t contiguous = 0;  // leading entries that lie in place: entry i at key index first + i - lead
  int64_t end() const { return first + total; }
  int64_t slot(int64_t prefix, int64_t i) const { return i < prefix ? i : prefix + extras[i - prefix]; }
};

// How many leading entries lie in place, at the key index their number less `lead` gives: those can
// be read where they are and shared between the tokens that number them alike.
int64_t contiguous_len(const Attention& pb, const TokenKeys& tk) {
  const int64_t off = tk.first - pb.lead, prefix = pb.prefix();
  if (prefix > 0 && off != 0) return 0;
  int64_t n = prefix;
  for (size_t i = 0; i < tk.extras.size() && prefix + tk.extras[i] == off + n; ++i) ++n;
  return n;
}

// Entries [i0, i0 + n) of a token's list: in place when they lie in place (q8: converted into
// `scratch`), else gathered into `scratch`.
const uint16_t* block_rows(const HeadRows& src, const Attention& pb, const TokenKeys& tk, int64_t i0, int n,
                           uint16_t* scratch) {
  if (i0 + n <= tk.contiguous) return src.span(tk.first - pb.lead + i0, n, scratch);
  for (int i = 0; i < n; ++i) src.slot_into(tk.slot(pb.prefix(), i0 + i), scratch + i * pb.d);
  return scratch;
}

// An item's tokens and the blocks [sb0, sb1) (by number) every one of them sees in place.
struct ItemKeys {
  std::vector<TokenKeys> tokens;
  int64_t sb0 = 0, sb1 = 0;
  // The whole chunks among those blocks, [c0, c1): what a split reads in pieces.
  int64_t c0() const { return (sb0 + kBlocksPerChunk - 1) / kBlocksPerChunk; }
  int64_t c1() const { return std::max(c0(), sb1 / kBlocksPerChunk); }
};

ItemKeys item_keys(const Attention& pb, int64_t t0, int64_t t1) {
  ItemKeys ik;
  ik.tokens.assign(t1 - t0, TokenKeys{});
  int64_t first = 0, end = std::numeric_limits<int64_t>::max();
  for (int64_t i = 0; i < t1 - t0; ++i) {
    TokenKeys& tk = ik.tokens[i];
    extras_of(pb, t0 + i, tk.extras);
    tk.total = pb.prefix() + static_cast<int64_t>(tk.extras.size());
    tk.first = pb.ends != nullptr ? pb.ends[t0 + i] - tk.total + 1 : 0;
    tk.contiguous = contiguous_len(pb, tk);
    first = std::max(first, tk.first);
    end = std::min(end, tk.first + tk.contiguous);
  }
  ik.sb0 = (first + kBlock - 1) / kBlock;
  ik.sb1 = std::max(ik.sb0, end / kBlock);
  return ik;
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
  std::vector<char> open;    // per row: whether its current chunk holds keys
  decltype(BlockKernel::fold) fold_fn;  // the path's fold_state

  ItemRows(const Attention& pb, const AttentionItem& it, const BlockKernel& kn)
      : d(pb.d), fold_fn(kn.fold != nullptr ? kn.fold : fold_state) {
    const int64_t g = pb.heads / pb.kv_heads;
    nrows = static_cast<int>((it.t1 - it.t0) * g);
    qbuf.resize(nrows * d);
    qfbuf.resize(nrows * d);
    accbuf.assign(nrows * d + 16, 0.f);
    totbuf.assign(nrows * d + 16, 0.f);
    tml.assign(2 * nrows, 0.f);
    folded.assign(nrows, 0);
    open.assign(nrows, 0);
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
      open[r] = 0;
    }
  }

  // Rows [r0, r0 + n) have taken a block into their current chunk.
  void opened(int r0, int n) { std::fill(open.begin() + r0, open.begin() + r0 + n, 1); }

  // Those of rows [r0, r0 + n) whose current chunk holds keys: it goes into their fold (fold_fn),
  // and a fresh chunk starts. An empty chunk folds nothing.
  void fold(int r0, int n) {
    for (int r = r0; r < r0 + n; ++r) {
      if (!open[r]) continue;
      fold_fn(rows[r].m, rows[r].l, rows[r].acc, &folded[r], &tml[2 * r], tacc + r * d, d);
      reset(r, 1);
    }
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
  float a, b;
  const auto exp2 = [](float x, float y, float* ex, float* ey) {
    *ex = exp_portable(x);
    *ey = exp_portable(y);
  };
  if (!fold_scalars(m, l, acc, started, tml, tacc, d, exp2, &a, &b)) return;
  for (int64_t x = 0; x < d; ++x) {
    const float ta = tacc[x] * a, tb = acc[x] * b;
    tacc[x] = ta + tb;
  }
}

namespace {

// Shared blocks [b0, b1) (by number; every row, keys in place), folding the rows that hold keys
// at each chunk's start. A path's run takes the rest of the blocks in one call, folding inside (its
// rows stay in its own layout from chunk to chunk); q8 rows, converted into a chunk's scratch, a chunk.
void shared_blocks(const Attention& pb, const AttentionItem& it, const BlockKernel& kn, ItemRows& ir, int64_t b0,
                   int64_t b1, float* ws) {
  const int64_t d = pb.d;
  const HeadRows ks = head_rows(pb, kn, true, it.kvh), vs = head_rows(pb, kn, false, it.kvh);
  const bool runs = kn.run != nullptr && ir.nrows >= kn.run_rows;
  const int64_t span = runs ? kChunk : kBlock;  // keys read in one call (q8)
  std::vector<uint16_t> scratch(pb.q8 ? 2 * span * d : 0);
  for (int64_t b = b0; b < b1;) {
    if (b % kBlocksPerChunk == 0) ir.fold(0, ir.nrows);
    // A run of blocks in one call where the path has one, else a block.
    const int64_t n = !runs ? 1 : pb.q8 ? std::min(b1, (b / kBlocksPerChunk + 1) * kBlocksPerChunk) - b : b1 - b;
    const int nk = static_cast<int>(n * kBlock);
    const int64_t key = b * kBlock - pb.lead;  // the block's first key index
    const uint16_t* kb = ks.span(key, nk, scratch.data());
    const uint16_t* vb = vs.span(key, nk, scratch.data() + (pb.q8 ? span * d : 0));
    const ChunkFolds folds{b, ir.tml.data(), ir.tacc, ir.folded.data()};
    if (runs)
      kn.run(kb, vb, static_cast<int>(n), d, ir.rows.data(), ir.nrows, ws, &folds);
    else
      kn.block(kb, vb, kBlock, d, ir.rows.data(), ir.nrows, ws,
               b + kAheadBlocks < b1 ? ks.ahead(vs, key + kAheadBlocks * kBlock) : Ahead{});
    ir.opened(0, ir.nrows);
    b += n;
  }
}

std::vector<float> workspace_for(const BlockKernel& kn, int64_t d, int nrows, float** wsp) {
  std::vector<float> ws(kn.workspace(d, nrows) + 16);
  *wsp = aligned64(ws);
  return ws;
}

// One token's keys numbered [lo, hi) into its rows [r0, r0 + n), in blocks cut where the numbers
// cross a multiple of kBlock, folding at each chunk's start.
void own_keys(const Attention& pb, const TokenKeys& tk, const HeadRows& ks, const HeadRows& vs, const BlockKernel& kn,
              ItemRows& ir, int r0, int n, int64_t lo, int64_t hi, uint16_t* kscratch, uint16_t* vscratch, float* ws) {
  for (int64_t a = lo; a < hi;) {
    const int64_t b = std::min(hi, (a / kBlock + 1) * kBlock);
    if (a % kChunk == 0) ir.fold(r0, n);
    const int nk = static_cast<int>(b - a);
    const uint16_t* kb = block_rows(ks, pb, tk, a - tk.first, nk, kscratch);
    const uint16_t* vb = block_rows(vs, pb, tk, a - tk.first, nk, vscratch);
    kn.block(kb, vb, nk, pb.d, ir.rows.data() + r0, n, ws, Ahead{});
    ir.opened(r0, n);
    a = b;
  }
}

constexpr int64_t kNoEnd = std::numeric_limits<int64_t>::max() / (4 * kChunk);

// Every token's keys numbered in blocks [from, to), in number order: a token's own keys below the
// shared blocks, the shared blocks for every row at once, then each token's keys above them.
void walk(const Attention& pb, const AttentionItem& it, const BlockKernel& kn, ItemRows& ir, const ItemKeys& ik,
          int64_t from, int64_t to, float* ws) {
  const int g = static_cast<int>(pb.heads / pb.kv_heads);
  const HeadRows ks = head_rows(pb, kn, true, it.kvh), vs = head_rows(pb, kn, false, it.kvh);
  std::vector<uint16_t> kscratch(kBlock * pb.d), vscratch(kBlock * pb.d);
  const int64_t lo = from * kBlock, hi = to * kBlock;
  for (size_t i = 0; i < ik.tokens.size(); ++i) {
    const TokenKeys& tk = ik.tokens[i];
    own_keys(pb, tk, ks, vs, kn, ir, static_cast<int>(i) * g, g, std::max(tk.first, lo),
             std::min({tk.end(), ik.sb0 * kBlock, hi}), kscratch.data(), vscratch.data(), ws);
  }
  shared_blocks(pb, it, kn, ir, std::max(from, ik.sb0), std::min(to, ik.sb1), ws);
  for (size_t i = 0; i < ik.tokens.size(); ++i) {
    const TokenKeys& tk = ik.tokens[i];
    own_keys(pb, tk, ks, vs, kn, ir, static_cast<int>(i) * g, g, std::max({tk.first, ik.sb1 * kBlock, lo}),
             std::min(tk.end(), hi), kscratch.data(), vscratch.data(), ws);
  }
}

// Every row's last chunk into its fold, and its output.
void finish_rows(const Attention& pb, const AttentionItem& it, const BlockKernel& kn, ItemRows& ir) {
  const int64_t g = pb.heads / pb.kv_heads, d = pb.d;
  ir.fold(0, ir.nrows);
  for (int64_t i = 0; i < it.t1 - it.t0; ++i)
    for (int64_t r = 0; r < g; ++r) {
      const int row = static_cast<int>(i * g + r);
      const RowState st{nullptr, nullptr, ir.tacc + row * d, ir.tml[2 * row], ir.tml[2 * row + 1]};
      kn.finish(st, d, pb.out + ((it.kvh * g + r) * pb.t + it.t0 + i) * d);
    }
}

// A piece: chunks [c0, c1) of the split's shared keys, each from a fresh state into its slot; the
// piece that finishes last reads the keys before those chunks, folds every slot in chunk order,
// reads the keys after them and finishes the item.
void run_piece(const Attention& pb, const AttentionItem& it, AttentionSplit& sp, const BlockKernel& kn) {
  const int64_t d = pb.d;
  ItemRows ir(pb, it, kn);
  float* wsp = nullptr;
  const std::vector<float> ws = workspace_for(kn, d, ir.nrows, &wsp);
  for (int64_t c = it.c0; c < it.c1; ++c) {
    ir.reset(0, ir.nrows);
    shared_blocks(pb, it, kn, ir, c * kBlocksPerChunk, (c + 1) * kBlocksPerChunk, wsp);
    const int64_t slot = c - sp.first_chunk;
    for (int r = 0; r < ir.nrows; ++r) {
      sp.ml[(slot * ir.nrows + r) * 2] = ir.rows[r].m;
      sp.ml[(slot * ir.nrows + r) * 2 + 1] = ir.rows[r].l;
      std::memcpy(sp.acc.data() + (slot * ir.nrows + r) * d, ir.rows[r].acc, d * sizeof(float));
    }
  }
  if (sp.done.fetch_add(1, std::memory_order_acq_rel) != sp.pieces - 1) return;
  sp.done.store(0, std::memory_order_relaxed);  // ready for the plan's next run (after the caller's barrier)
  ir.reset(0, ir.nrows);
  const ItemKeys ik = item_keys(pb, it.t0, it.t1);
  walk(pb, it, kn, ir, ik, 0, sp.first_chunk * kBlocksPerChunk, wsp);
  ir.fold(0, ir.nrows);
  for (int64_t c = 0; c < sp.chunks; ++c)
    for (int r = 0; r < ir.nrows; ++r)
      ir.fold_fn(sp.ml[(c * ir.nrows + r) * 2], sp.ml[(c * ir.nrows + r) * 2 + 1],
                 sp.acc.data() + (c * ir.nrows + r) * d, &ir.folded[r], &ir.tml[2 * r], ir.tacc + r * d, d);
  walk(pb, it, kn, ir, ik, (sp.first_chunk + sp.chunks) * kBlocksPerChunk, kNoEnd, wsp);
  finish_rows(pb, it, kn, ir);
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
  std::vector<int64_t> first_chunk(n, 0), shared_chunks(n, 0);  // each group's whole shared chunks
  for (int64_t i = 0; i < n && per_group > 1; ++i) {
    if (i > 0 && groups[i].t0 == groups[i - 1].t0) {
      first_chunk[i] = first_chunk[i - 1];  // same tokens, another head: the same keys
      shared_chunks[i] = shared_chunks[i - 1];
      continue;
    }
    const ItemKeys ik = item_keys(pb, groups[i].t0, groups[i].t1);
    first_chunk[i] = ik.c0();
    shared_chunks[i] = ik.c1() - ik.c0();
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
    sp->first_chunk = first_chunk[i];
    sp->chunks = shared_chunks[i];
    sp->pieces = pieces;
    sp->ml.assign(sp->chunks * rows * 2, 0.f);
    sp->acc.assign(sp->chunks * rows * pb.d, 0.f);
    const int64_t id = static_cast<int64_t>(plan.splits.size());
    for (int64_t p = 0; p < pieces; ++p)
      plan.items.push_back({gr.kvh, gr.t0, gr.t1, id, sp->first_chunk + p * sp->chunks / pieces,
                            sp->first_chunk + (p + 1) * sp->chunks / pieces});
    plan.splits.push_back(std::move(sp));
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [&](const AttentionItem& a, const AttentionItem& b) {
    return item_cost(pb, a) > item_cost(pb, b);
  });
  return plan;
}

int64_t Attention::row() const { return q8 ? q8_row_units(d) : d; }

int64_t visible_keys(const Attention& pb, int64_t t) {
  if (pb.mask == nullptr) return pb.prefix() + pb.m - pb.t + t + 1;
  return pb.prefix() + std::count(pb.mask + t * pb.m, pb.mask + (t + 1) * pb.m, true);
}

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
  ItemRows ir(pb, it, kn);
  float* wsp = nullptr;
  const std::vector<float> ws = workspace_for(kn, pb.d, ir.nrows, &wsp);
  walk(pb, it, kn, ir, item_keys(pb, it.t0, it.t1), 0, kNoEnd, wsp);
  finish_rows(pb, it, kn, ir);
}

void attend_all(Path path, const Attention& pb, const AttentionPlan& plan) {
  for (int64_t i = 0; i < static_cast<int64_t>(plan.items.size()); ++i) attend_item(path, pb, plan, i);
}

}  // namespace spx
