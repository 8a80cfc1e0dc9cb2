// Attention of new tokens over a bfloat16 KV cache on the CPU, computed so that a token's output
// depends only on its query and the keys it may see, never on which other tokens share the call.
//
// Each new token t sees the committed prefix [0, P) and, among the last M cache slots (the new
// tokens, or a draft tree's nodes), those its mask row allows, in slot order. That ordered list
// of visible keys is the same whether the token is decoded alone (its ancestors are then
// committed and it comes last) or verified inside a tree, so the kernel walks the list in blocks
// of 32 keys numbered by position in the list, with an online softmax per block, and every sum
// inside a block runs in a fixed order: the same list gives the same bits. Blocks make chunks of
// kChunk keys, each with an online softmax of its own, folded in chunk order: a long list can be
// read in pieces by several threads (flash-decoding) with the bits of one thread reading it all.
// A sliding-window layer's token sees only the tail of that list (its last `window` keys); its keys
// keep the numbers the full list gives them (`Attention::ends`), so its first block is cut short at
// the grid line and the rest lie on the grid of slots every token's window shares: a prefill's
// tokens read those blocks together, as a causal layer's do, and a token's bits are still the same
// alone, in a tree or in a prefill (its numbers depend on its own list only).
//
// The arithmetic (attention_portable.cpp is its reference; every path reproduces it): products
// of bfloat16 values with float32 accumulation in the lane structure of VDPBF16PS (a lane adds
// its odd pair's product, then its even pair's, each exact product rounded once into the sum), on
// the query (rounded to bfloat16 after scaling), the cached keys and values (stored in bfloat16)
// and the softmax weights (rounded to bfloat16 before they weigh the values); maxima,
// exponentials and sums stay in float32. A score q.k is one chain over the dimension pairs in
// order, so a register whose lanes are 16 keys computes 16 scores at once and a block of query
// rows times a block of keys is a small matrix product with no horizontal sums. A block is
// shared by every query row of the work item: all query heads of a K/V head, for all tokens
// whose visible lists share that block (a tree's tokens share the prefix; a prefill chunk's
// tokens share all but their tails).
//
// Layout: q [H, T, D] float32; k, v [Hkv, S, D] bfloat16 (views of the cache, rows contiguous), or
// q8 rows (kv_q8.h: `q8`; head strides then in 16-bit units), each block of which the driver turns
// into bfloat16 first (the path's `dequant`, the same bits on every path);
// mask [T, M] bool or none (causal over the T new tokens, M = T). Query head h uses K/V head
// h / (H / Hkv). Output [H, T, D] float32.
//
// Attention sinks (gpt-oss: sinks [H] float32, or none): head h's learned logit s_h joins every
// softmax's denominator, exp(s_h - max) beside the keys' terms, with no value. A row's running
// softmax starts from it (maximum s_h, sum 1 = exp(s_h - s_h)) instead of from nothing (-inf, 0):
// the same online-softmax steps then fold it in on every path, and a row's bits still depend only
// on its own query, head and keys.
//
// Soft-capped scores (Gemma 2: softcap > 0): each score becomes cap * tanh(score / cap) before its
// block's maximum is taken, by fastexp.h's softcap_portable, which every path computes operation for
// operation (both of tanh's forms, the one |x| selects); nothing else changes.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu.h"

namespace spx {

constexpr int kBlock = 32;
constexpr int kTokensPerItem = 32;  // at most this many tokens share one pass over the prefix blocks
// A row's visible keys are cut into chunks of kChunk keys by their position in its list: the online
// softmax runs within each chunk from a fresh state, and the chunks' states (maximum, sum, weighted
// values) are folded into one in chunk order (`fold_state`). The cut depends on positions only, so a
// long cache can be read in pieces by several threads at once (flash-decoding) and the bits are those
// of one thread reading it all; a list of at most kChunk keys is one chunk (no fold at all).
constexpr int kChunk = 512;
constexpr int kBlocksPerChunk = kChunk / kBlock;

struct Attention {
  const float* q;
  const uint16_t* k;
  const uint16_t* v;
  float* out;
  int64_t heads, kv_heads, t, d, s, m;  // m: trailing slots under the mask
  int64_t k_head_stride, v_head_stride;
  const bool* mask;  // [t, m] or null (causal)
  float scale;
  const float* sinks = nullptr;  // [heads] or null
  bool q8 = false;               // k, v hold q8 rows (kv_q8.h), not bfloat16
  float softcap = 0.f;           // > 0: scores soft-capped at it (Gemma 2); 0: none
  // How keys are numbered (blocks and chunks are cut where the numbers cross multiples of kBlock and
  // kChunk). Null: a token's visible list from 0 (its entries' places in it). Else token t's list is
  // numbered on to ends[t], its own key, and a key read in place is key index number - lead: a
  // windowed layer's keys keep the numbers the full list gives them (their slots), whichever key
  // its window starts at, so the window's blocks lie on one grid and its tokens share them.
  const int64_t* ends = nullptr;
  int64_t lead = 0;
  int64_t prefix() const { return s - m; }
  int64_t row() const;  // one cache row's size in 16-bit units
};

// The query heads of K/V head kvh for tokens [t0, t1), all their keys (split < 0), or a piece of
// them: chunks [c0, c1) of the keys every one of those tokens sees in place (`AttentionSplit`).
struct AttentionItem {
  int64_t kvh, t0, t1;
  int64_t split = -1;  // index into AttentionPlan::splits, or -1: the whole item
  int64_t c0 = 0, c1 = 0;
};

// Tokens [t0, t1) of K/V head kvh read in pieces: each piece leaves the states of its chunks here, and
// the piece that finishes last (`done`) folds them all in chunk order and reads the rest of the keys.
struct AttentionSplit {
  int64_t kvh = 0, t0 = 0, t1 = 0, first_chunk = 0, chunks = 0, pieces = 0;  // chunks [first_chunk, + chunks)
  std::vector<float> ml;   // [chunks][rows][2]: maximum, sum
  std::vector<float> acc;  // [chunks][rows][d], in the path's own dimension order
  std::atomic<int64_t> done{0};
};

struct AttentionPlan {
  std::vector<AttentionItem> items;  // most work first, so threads taking them in order finish together
  std::vector<std::unique_ptr<AttentionSplit>> splits;
};

// Tokens in balanced groups of at most kTokensPerItem (a draft tree's 9 tokens: one group), one
// item per K/V head and group, at least `threads` items where there are tokens enough; where that
// still leaves fewer than kItemsPerThread items a thread (a decode step, a small tree), a group's
// shared prefix is read in pieces of at least kMinPieceChunks chunks. Neither the grouping nor
// the pieces change a token's bits. A plan may be run again on new q, k, v of the same shapes
// (the next layer) once every item of the last run has returned.
constexpr int kItemsPerThread = 4;
constexpr int kMinPieceChunks = 2;
AttentionPlan plan_attention(const Attention& pb, int threads = 1);

// How many keys token t sees: the committed prefix and what its mask row (or the causal triangle)
// allows among the last m slots. With the list's numbers from 0, its own key is numbered this less one.
int64_t visible_keys(const Attention& pb, int64_t t);

// Work of item i, in arbitrary units (for ordering items across sequences).
int64_t item_cost(const Attention& pb, const AttentionItem& it);

// Runs item i of the plan (any thread, any order; every item exactly once per run).
void attend_item(Path path, const Attention& pb, const AttentionPlan& plan, int64_t i);

// Every item of the plan in order, on the calling thread.
void attend_all(Path path, const Attention& pb, const AttentionPlan& plan);

// One chunk's state (m, l, acc: d floats in a path's dimension order) folded into a running fold
// (tml: maximum, sum; tacc: d floats; *started: whether it holds a chunk yet), the same on every
// path: the first chunk is copied, a later one rescales both sides to the larger maximum and adds.
void fold_state(float m, float l, const float* acc, char* started, float* tml, float* tacc, int64_t d);

// fold_state's scalar part, every path's: a first chunk copied (false: nothing left to do), else the fold's
// maximum and sum moved on, with the rescales *a = exp(tm - mn) and *b = exp(m - mn) from exp2 (the path's
// exp_portable, on two values) for the weighted values, tacc * a + acc * b, that the caller computes next.
template <class Exp2>
inline bool fold_scalars(float m, float l, const float* acc, char* started, float* tml, float* tacc, int64_t d,
                         Exp2 exp2, float* a, float* b) {
  if (!*started) {
    tml[0] = m;
    tml[1] = l;
    std::memcpy(tacc, acc, d * sizeof(float));
    *started = 1;
    return false;
  }
  const float mn = std::fmax(tml[0], m);
  exp2(tml[0] - mn, m - mn, a, b);
  const float la = tml[1] * *a, lb = l * *b;
  tml[0] = mn;
  tml[1] = la + lb;
  return true;
}

// ------------------------------------------------------------------ per path

// The rows' folds a run of blocks across chunk boundaries completes its chunks into (`fold_state`'s
// arguments for every row): the run's first block's number (a chunk starts at each multiple of
// kBlocksPerChunk after it), and per row its fold's maximum and sum (tml [2 * nrows]), weighted values
// (tacc [nrows][d], 64-byte aligned rows) and whether it holds a chunk yet (started [nrows]).
struct ChunkFolds {
  int64_t first_block;
  float* tml;
  float* tacc;
  char* started;
};

// Where a run of nblocks blocks (from `chunks`' first block; null: one chunk) starts chunks after its first
// block: at `first` and every kBlocksPerChunk blocks on (`first` >= nblocks: none).
struct ChunkStarts {
  int64_t first, nblocks;
  ChunkStarts(const ChunkFolds* chunks, int64_t n)
      : first(chunks == nullptr ? n : kBlocksPerChunk - chunks->first_block % kBlocksPerChunk), nblocks(n) {}
  bool any() const { return first < nblocks; }
  bool at(int64_t b) const { return b >= first && (b - first) % kBlocksPerChunk == 0; }
};

// One query row's running softmax: maximum, sum, and the weighted sum of values.
struct RowState {
  const uint16_t* q;  // bfloat16 [d], already scaled
  const float* qf;    // the same values widened to float32 (exact), for paths that multiply in float32
  float* acc;         // float32 [d], 64-byte aligned, in the path's own dimension order
  float m, l;
  float cap = 0.f;  // > 0: the row's scores soft-capped at it (Attention::softcap)
};

// A block read in place further on (the prefix's keys and values at its own rows), which a block kernel
// may bring into the caches while it computes: a long cache's blocks are otherwise read and computed in
// turn, their times added. Null pointers: nothing ahead.
// The block a kernel brings in while it computes: kAheadBlocks after its own. With both threads streaming
// their parts of a long cache, blocks fetched further ahead arrived later, not sooner
// (docs/log/2026-12-long-decode.md).
constexpr int64_t kAheadBlocks = 2;

struct Ahead {
  const void* k = nullptr;
  const void* v = nullptr;
  int64_t bytes = 0;  // of each
};

#if defined(__x86_64__)
// One stream of the block ahead (its keys, or its values: `bytes` from p) brought into L2 over `steps` steps
// of a kernel's loop, a few lines a step: the keys' over the scores, the values' over the weighted sums, so
// the requests run through the whole block's work rather than in bursts (a burst stalls the loads behind it).
// Null p: nothing ahead.
class Trickle {
 public:
  Trickle(const void* p, int64_t bytes, int64_t steps)
      : p_(static_cast<const char*>(p)), lines_(p != nullptr ? bytes / 64 : 0),
        per_(static_cast<int>((lines_ + steps - 1) / steps)) {}
  // Written as asm: GCC 12 dropped _mm_prefetch calls in these loops at -O1 and above.
  void step() {
    for (int i = 0; i < per_ && next_ < lines_; ++i, ++next_)
      asm volatile("prefetcht1 %0" : : "m"(*(p_ + 64 * next_)));
  }

 private:
  const char* p_;
  int64_t lines_;
  int per_;
  int64_t next_ = 0;
};
#endif

// A path's block kernel: one block of n <= kBlock keys (kb, vb: n rows of d bfloat16) into
// every row's state; `finish` writes acc / l in natural dimension order.
struct BlockKernel {
  void (*block)(const uint16_t* kb, const uint16_t* vb, int n, int64_t d, RowState* rows, int nrows, float* ws,
                const Ahead& ahead);
  void (*finish)(const RowState& st, int64_t d, float* out);
  size_t (*workspace)(int64_t d, int nrows);  // floats of `ws` the block kernel needs
  // n q8 rows into bfloat16 rows with dequant_q8_portable's bits (kv_q8.h); null: that function.
  void (*dequant)(const uint16_t* rows, int n, int64_t d, uint16_t* out) = nullptr;
  // nblocks full blocks of contiguous keys and values (kb, vb: nblocks * kBlock rows) into every row's
  // state, with the bits of `block` called on each in turn; for nrows >= run_rows (null: none). With
  // `chunks`, the blocks may cross chunk boundaries, and each chunk the run completes goes into the rows'
  // folds as `fold` would put it there (the rows' states then hold the last chunk's); null: one chunk.
  void (*run)(const uint16_t* kb, const uint16_t* vb, int nblocks, int64_t d, RowState* rows, int nrows,
              float* ws, const ChunkFolds* chunks) = nullptr;
  int run_rows = 0;
  // fold_state with its bits, on the path's instructions (null: fold_state itself).
  void (*fold)(float m, float l, const float* acc, char* started, float* tml, float* tacc, int64_t d) = nullptr;
};

// The block kernel a path attends with (the amx paths take their vector path's): attend_item's only
// use of its path, so two paths with the same kernel attend alike (the exactness program's checks).
BlockKernel kernel_for(Path path, int64_t d);

BlockKernel block_kernel_portable();
#if defined(__x86_64__)
bool block_kernel_avx2(int64_t d, BlockKernel* out);
bool block_kernel_avx512(int64_t d, BlockKernel* out);
#endif
#if defined(__aarch64__)
bool block_kernel_neon(int64_t d, BlockKernel* out);
#endif

}  // namespace spx
