// Quantized linear layers on the CPU: y = pre(x) W^T (+ b) (+ residual) with W in a
// block-quantized format and x quantized on the fly to int8, one scale per block of 32 values
// of each row (or of 256 for the K-quants where set_k256 asks, below). The core works on raw pointers (no PyTorch), so the exactness tests can run it
// anywhere, an emulated aarch64 included; torch_ops.cpp binds it.
//
// Why this shape: a decode step streams every weight once, so its speed is the weight bytes
// (4-6 bits each instead of 32); a verification of a draft tree multiplies the same weights by a
// few more rows, so a kernel reads each weight block once and applies it to every row of a tile
// while it is in registers.
//
// The arithmetic, the same on every path (qlinear_portable.cpp is its reference): per row,
// channel and weight group, the integer dot product of codes and int8 activations (exact), then
// t = float(dot) * d8 (the activation block's scale), acc = fma(t, scale, acc) with the group's
// float scale, and for Q4K acc = fma(-min, xs, acc) with xs = d8 * (sum of the block's codes)
// (Q2K: of the group's 16 codes);
// groups in input order. Integer sums are exact in any order, so paths may split and pair them
// as their instructions like; the float steps are the same operations in the same order.
// The K-quants per 256 (set_k256, SPECEXTEND_K256; off by default): Q4K, Q5K and IQ4 of 8 groups
// and Q6K, Q3K, Q2K (k256_format) may take activations with one scale d256 per 256 values (Rows::
// kq8, llama.cpp's Q8_K). Then per row, channel and super-block two exact int32 sums, isum =
// sum over groups of scale code * (dot - zero * the group's code sum) (zero: q6_zero, or the byte
// formats' offset) and imin = sum of minimum code * the group's code sum (Q4K, Q5K, Q2K), and two
// float steps: acc = fma(float(isum) * d256, d, acc), then acc = fma(-dmin, float(imin) * d256,
// acc) where there is a minimum (superblock_row in qlinear_portable.cpp). One product's segments
// all take one kind: a K-quant segment multiplies the per-256 codes whenever the rows carry them.
// Row independence: each row's activation scales are its own and its sums run in the same
// order whatever the other rows are, so a token gets bit-identical outputs decoded alone or
// inside a tree. Threads split output channels, never a reduction.
//
// Weight layout ("blob"): output channels in panels of 16; within a panel, super-blocks along
// the input dimension, each self-contained (scales next to their codes, one sequential stream):
//   Q4K (asymmetric 4-bit, groups of 32, G = 1..8 groups per super-block; with G = 8 the GGUF
//       Q4_K grid kept exactly; smaller G serves input widths that are not multiples of 256):
//       d[16] f16, dmin[16] f16, sc[G][16] u8, mn[G][16] u8, codes[G][4][64] (nibbles)
//       w = d*sc[g] * q - dmin*mn[g]
//   Q6K (symmetric 6-bit codes, groups of 16, super-block 256; the Q6_K grid):
//       d[16] f16, sc[16][16] i8, then per group: low nibbles of steps 0|2 and 1|3 (2 x 64 bytes),
//       high 2 bits of steps 0..3 at bits 0,2,4,6 (64 bytes)       w = d*sc[g] * (q - 32)
//   Q3K (GGUF's Q3_K in the Q6K family: Q6K's d and per-16 scales (Q3_K's six bits - 32); per
//       pair of groups 2i, 2i + 1: each one's low 2 bits of steps 0..3 at bits 2st (64 bytes
//       each), then their third bits (64 bytes: group 2i's step st at bit st, 2i + 1's at 4 + st)):
//       d[16] f16, sc[16][16] i8, pairs[8][3][64]       q = 28 + (low | third << 2), then as Q6K
//   Q2K (GGUF's Q2_K in the Q6K family: 2-bit codes with no zero point, a 4-bit scale and a 4-bit
//       minimum per group of 16 under f16 d and dmin; each group's codes of steps 0..3 at bits 2st
//       of one 64-byte plane):
//       d[16] f16, dmin[16] f16, sc[16][16] u8 (Q2_K's bytes: scale | min << 4), codes[16][64]
//       w = d*(sc & 15) * q - dmin*(sc >> 4); the Q6K epilogue (zero point 0) and then Q4K's
//       minimum term per group of 16: acc = fma(-min, xs16, acc), xs16 = d8 * s16 (q16_xs).
//   Q8 (codes in bytes, groups of 32 = super-block, one f16 scale per group; Q8_0, int8):
//       d[16] f16, codes[8][64] u8                              w = d * (q - offset)
//   Q40, Q50 and IQ4NL (Q8's header over the 4-bit codes of Q5K and IQ4, unpacked the same way
//       into Q8's byte codes; one group a super-block, so a weight costs its file's bits):
//       d[16] f16, then Q4K's nibbles (4 x 64 bytes) and for Q50 Q5K's plane of fifth bits
//       (64 bytes)                                          w = d * (byte - offset)
//       Q40's byte is the nibble (GGUF's Q4_0, offset 8), Q50's the 5-bit code (Q5_0, offset 16),
//       IQ4NL's kIq4Bytes[nibble] (IQ4_NL, offset 128). Their arithmetic is Q8's.
//   MXFP4 (GGUF's MXFP4: IQ4NL's layout under a one-byte header, the file's E8M0 exponents):
//       e[16] u8, then Q4K's nibbles (4 x 64 bytes)   w = e8m0_half(e) * (kMxfp4Bytes[nibble] - 128)
//       The scale is a power of two from 2^-128 to 2^127, past f16's range, so the blob keeps the
//       file's byte and every path builds the same float32 from its bits (e8m0_half: ggml's
//       GGML_E8M0_TO_FP32_HALF, subnormals for e < 2); the codes are ggml's kvalues_mxfp4 (twice
//       the E2M1 values, integers) + 128. A weight costs its file's 4.25 bits; Q8's arithmetic.
//   Q41 and Q51 (the same with a minimum: d[16] f16, dmin[16] f16, then Q40's or Q50's codes):
//       w = d * q - dmin, offset 0 (GGUF's Q4_1 and Q5_1, dmin = -m); Q4K's epilogue with the
//       scale d and the minimum dmin, exactly as a one-group Q4K of scale and minimum codes 1.
//   Q5K (Q4K's header with signed scale codes over 5-bit codes that the kernels unpack into Q8's
//       byte codes; G = 1..8 groups of 32 a super-block):
//       d[16] f16, dmin[16] f16, sc[G][16] i8, mn[G][16] u8, then per group: Q4K's nibbles
//       (4 x 64 bytes) and a plane of fifth bits (64 bytes: bit st of byte b is the fifth bit of
//       step st's nibble at byte b)           w = d*sc[g] * (byte - offset) - dmin*mn[g]
//       The byte is the 5-bit code (GGUF's Q5_K, G = 8; our layout accepts any G). The
//       arithmetic is Q8's dot product of the bytes (dot - offset * s32) with Q4K's epilogue
//       (both fmas).
//   IQ4 (the same without the minimum: GGUF's IQ4_XS, G = 8, has none):
//       d[16] f16, sc[G][16] i8, then per group Q4K's nibbles (4 x 64 bytes), IQ4 table indices
//       w = d*sc[g] * (byte - 128), the byte kIq4Bytes[nibble] (the IQ4 table + 128); Q8's
//       arithmetic with the scale d*sc[g].
//   IQ3S (GGUF's IQ3_S in IQ4's layout, G = 8): each weight of a group of 32 is d*(1 + 2*ls) times a
//       signed odd integer of at most 15 (its grid value and sign bit), so the scale code is 1 + 2*ls
//       and the 16 signed values are a table like IQ4's: kIq3sBytes[nibble] = value + 128. The file's
//       own values exactly (d*(1 + 2*ls) and its product with the value are exact in float32), at
//       4.31 bits a weight against the file's 3.44 (the grid's 512 entries do not fit a register table).
//   IQ3XXS, IQ2XXS, IQ1S (GGUF's IQ3_XXS, IQ2_XXS and IQ1_S the same way, G = 8): a weight is d*(2*ls + 1)
//       times one of at most 16 signed values (IQ3_XXS: its grid's 4..62 over 4; IQ2_XXS: 8, 25, 43 over 8;
//       IQ1_S: grid -1, 0, 1 plus or minus 1/8), so the table holds 4 or 8 times the values and d carries
//       the 1/4 or 1/8: d/4 of a float16 d is often below float16's normal range, so these keep d[16] as
//       float32 (f32_header): d[16] f32, sc[G][16] i8, then IQ4's nibbles; w = d*sc[g] * (byte - 128).
//   IQ2XS, IQ1M (GGUF's IQ2_XS and IQ2_S, and IQ1_M, in the Q6K family: their scales are per 16
//       weights): a weight is d*(2*ls + 1) times one of 6 signed values (IQ2: 8, 25, 43 over 8;
//       IQ1_M: IQ1_S's), so Q3K's 3-bit codes index a table of them (kIq2xsQ3, kIq1mQ3: value +
//       q6_zero) under a float32 d that carries the 1/8 and signed scale codes 2*ls + 1 a group of 16:
//       d[16] f32, sc[16][16] i8, pairs[8][3][64] (Q3K's)      w = d*sc[g] * (table[code] - q6_zero)
//       3.63 bits a weight (the files' 2.31, 2.56 and 1.75: their grids do not fit a register table).
//       Q6K's arithmetic; not a K-quant of the per-256 activations.
//   F16 and BF16 (the file's own 16-bit float weights, kept as they are): per input, the panel's
//       16 channels' values (32 bytes), super-blocks of 32 inputs (1 KB)       w = float(value), exact
//       These are products of floats, not of codes: the activations are not quantized (Rows::xf,
//       the pre-op's float32 output). Per row and channel, two partial sums, the even inputs' and
//       the odd inputs', each a chain of fused multiply-adds fma(w, x, sum) in input order from
//       0.f, then y = even + odd (and bias, residual as the other formats). Two chains give a
//       single row's loop two independent fma latencies a channel; fixed, they keep every path's
//       bits (vector lanes are channels, so no path ever adds across inputs in another order) and
//       a row's sums never meet another row's. Paths convert each weight to float32 once per
//       block of inputs for all the rows they compute (F16C / VCVTPH2PS, a 16-bit shift for
//       BF16, NEON's FCVTL); bfloat16 dot-product instructions (AVX512-BF16, AMX-BF16) are not
//       used here: they round the activations to bfloat16 and add their pairs of products in an
//       order of their own, an arithmetic of its own (BF16D, below, where the load chooses it).
//   BF16D (a BF16 file's weights on bfloat16 dot products, llama.cpp's arithmetic for them; chosen
//       at load, SPECEXTEND_BF16_PRODUCTS: runtime/kernels.py): per pair of inputs (2j, 2j + 1), the
//       panel's 16 channels' two values side by side (64 bytes: channel c's 2j at byte 4c, 2j + 1 at
//       4c + 2: VDPBF16PS's operand), super-blocks of 32 inputs (1 KB). The activations are pre(x)
//       rounded to bfloat16 (Rows::xb: nearest even, a subnormal to zero). Per row and channel one
//       chain over the pairs in input order from 0.f, each pair as a VDPBF16PS lane takes it:
//       sum = fma(w[2j+1], x[2j+1], sum), then sum = fma(w[2j], x[2j], sum), a subnormal weight read
//       as zero and a subnormal sum flushed to zero (the instruction's DAZ and FTZ); products of
//       bfloat16 values are exact in float32, so the fma is the instruction's step. y = sum (and bias,
//       residual as the other formats). The avx512 path runs VDPBF16PS where the CPU has it; a path
//       without a kernel of its own runs the portable tiles (the same bits, slowly).
// Codes of one group are stored in steps of 4 inputs: byte 4*c + j of a 64-byte step holds
// input 4*s + j of channel c (one 32-bit lane per channel: the operand layout of VPDPBUSD, of
// AVX2's VPMADDUBSW pairs and of NEON's SDOT). Q4K packs two steps per 64 bytes: step i in the
// low nibbles, step i + 4 in the high ones.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu.h"
#include "half.h"

namespace spx {

enum Format : int64_t {
  Q4K = 0, Q6K = 1, Q8 = 2, Q5K = 3, IQ4 = 4, Q3K = 5, Q2K = 6, F16 = 7, BF16 = 8, Q40 = 9, Q50 = 10, IQ4NL = 11,
  Q41 = 12, Q51 = 13, MXFP4 = 14, BF16D = 15, IQ3S = 16, IQ3XXS = 17, IQ2XXS = 18, IQ1S = 19, IQ2XS = 20, IQ1M = 21
};

// The float formats (F16, BF16): products of float32 activations, not of int8 codes.
inline bool float_format(int64_t fmt) { return fmt == F16 || fmt == BF16; }
// BF16D: a BF16 file's weights on bfloat16 activations (Rows::xb).
constexpr bool bf16_dot_format(int64_t fmt) { return fmt == BF16D; }
constexpr int kFloatBlock = 128;  // inputs a vector path converts to float32 at once for all its rows

constexpr int kPanel = 16;
constexpr int kActBlock = 32;  // activation quantization block
constexpr int kMaxTile = 16;   // the most rows any path's tile takes
constexpr int kRowBlock = 64;  // the most rows a rows kernel takes at once (see linear_block)

struct FormatInfo {
  int group;       // inputs per scale
  int superblock;  // inputs per self-contained block of the blob
  int64_t bytes;   // blob bytes per (panel, super-block)
};

// False for an unknown format or a Q4K/Q5K/IQ4 super-block size outside 1..8 groups.
bool format_info(int64_t fmt, int64_t sbg, FormatInfo* out);

// The byte-code formats, codes unpacked into bytes under one of four headers: Q8's (one f16
// scale a channel and group, no minimum: Q8, Q40, Q50, IQ4NL), the same with an f16 minimum (Q41,
// Q51), Q4K's (d, dmin, scale and minimum codes a group: Q5K) or IQ4's (d and scale codes).
constexpr bool k_header(int64_t fmt) { return fmt == Q5K; }  // minimum codes a group
constexpr bool q8_header(int64_t fmt) { return fmt == Q8 || fmt == Q40 || fmt == Q50 || fmt == IQ4NL; }
constexpr bool min_header(int64_t fmt) { return fmt == Q41 || fmt == Q51; }
// A one-byte E8M0 exponent a channel and group instead of d (MXFP4): see e8m0_half.
constexpr bool e8m0_header(int64_t fmt) { return fmt == MXFP4; }
// d[16] as float32, not float16 (the table formats whose d carries a 1/4 or 1/8): the byte-code
// ones (f32_header) and the Q6K family's (q3_table).
constexpr bool f32_header(int64_t fmt) { return fmt == IQ3XXS || fmt == IQ2XXS || fmt == IQ1S; }
constexpr bool f32_d(int64_t fmt) { return f32_header(fmt) || fmt == IQ2XS || fmt == IQ1M; }
constexpr bool scale_codes(int64_t fmt) {  // a signed scale code a group
  return fmt == Q5K || fmt == IQ4 || fmt == IQ3S || f32_header(fmt);
}
constexpr bool has_minimum(int64_t fmt) { return k_header(fmt) || min_header(fmt); }
constexpr bool byte_format(int64_t fmt) {
  return scale_codes(fmt) || q8_header(fmt) || min_header(fmt) || e8m0_header(fmt);
}
// How a byte-code format's codes unpack: Q8 (bytes), Q5K (nibble and fifth bit), IQ4 (a table of
// 16 bytes, code_table) or Q40 (the nibble).
constexpr int64_t code_kind(int64_t fmt) {
  return fmt == Q50 || fmt == Q51                                         ? Q5K
         : fmt == IQ4NL || fmt == MXFP4 || fmt == IQ3S || f32_header(fmt) ? IQ4
         : fmt == Q41                                                     ? Q40
                                                                          : fmt;
}
constexpr int code_bytes(int64_t fmt) {  // a group's
  return code_kind(fmt) == Q5K ? 320 : code_kind(fmt) == Q8 ? 512 : 256;
}
// Codes below 32 by their layout (a nibble, or a nibble and a fifth bit): paths may multiply
// them as unsigned bytes without the sign trick.
constexpr bool small_codes(int64_t fmt) { return code_kind(fmt) == Q5K || code_kind(fmt) == Q40; }

// A byte-code super-block's header: d[16] f16 first; then the minimum's dmin[16] f16 (Q5K, Q41,
// Q51); then group g's signed scale codes (Q5K, IQ4: [16] i8) and minimum codes (Q5K: [16] u8);
// then the codes. A group's scale is d (x its scale code), its minimum dmin (x its minimum code).
constexpr int64_t byte_header(int64_t fmt, int64_t sbg) {
  if (e8m0_header(fmt)) return 16;
  if (q8_header(fmt)) return 32;
  return min_header(fmt) ? 64 : k_header(fmt) ? 64 + 32 * sbg : (f32_header(fmt) ? 64 : 32) + 16 * sbg;
}
inline const uint8_t* group_scales(int64_t fmt, const uint8_t* sb, int g) {
  return sb + (k_header(fmt) || f32_header(fmt) ? 64 : 32) + 16 * g;
}
// Channel c's d of a super-block at sb (float16, or float32 where f32_d).
inline float channel_d(int64_t fmt, const uint8_t* sb, int c) {
  if (f32_d(fmt)) {
    float d;
    std::memcpy(&d, sb + 4 * c, 4);
    return d;
  }
  return half_to_float(reinterpret_cast<const uint16_t*>(sb)[c]);
}
inline const uint8_t* group_mins(int64_t sbg, const uint8_t* sb, int g) { return sb + 64 + 16 * sbg + 16 * g; }
inline const uint8_t* byte_codes(int64_t fmt, int64_t sbg, const uint8_t* sb, int g) {
  return sb + byte_header(fmt, sbg) + code_bytes(fmt) * g;
}

// The table formats of the Q6K family (IQ2XS, IQ1M: Q3K's 3-bit codes index a table of their
// values, under a float32 d and signed per-16 scale codes).
constexpr bool q3_table(int64_t fmt) { return fmt == IQ2XS || fmt == IQ1M; }
// The 6-bit formats (Q6K, Q3K, Q2K, and the table formats: codes of at most 7 bits in groups of
// 16): a group's bytes in the blob (a Q3K pair's 192 shared), the header before the codes, where
// a group's scale codes sit, the zero point the kernels subtract (zero x the group's activation
// sum) and whether a minimum term follows (Q2K).
constexpr bool six_bit(int64_t fmt) { return fmt == Q6K || fmt == Q3K || fmt == Q2K || q3_table(fmt); }
constexpr int group16_bytes(int64_t fmt) { return fmt == Q2K ? 64 : fmt == Q3K || q3_table(fmt) ? 96 : 192; }
constexpr int q6_header(int64_t fmt) { return fmt == Q2K || q3_table(fmt) ? 320 : 288; }
constexpr int q6_scales_at(int64_t fmt) { return fmt == Q2K || q3_table(fmt) ? 64 : 32; }
constexpr int q6_zero(int64_t fmt) { return fmt == Q2K ? 0 : fmt == IQ2XS ? 43 : fmt == IQ1M ? 9 : 32; }
// The largest code a format's vector unpacking gives (codes_zero's grid): how many steps of
// products of a code and an int8 activation (pairs of inputs, at most 2 x max x 128 each) an int16
// sum holds (AVX2's VPMADDUBSW): 4, 2 or 1.
constexpr int q6_code_max(int64_t fmt) {
  return fmt == Q2K ? 3 : fmt == Q3K ? 7 : fmt == IQ2XS ? 86 : fmt == IQ1M ? 18 : 63;
}
constexpr int int16_steps(int64_t fmt) {
  return 4 * 2 * 128 * q6_code_max(fmt) <= 32767 ? 4 : 2 * 2 * 128 * q6_code_max(fmt) <= 32767 ? 2 : 1;
}
// The zero point of the codes a vector path unpacks straight from the bits: Q3K's as their 3 bits
// (0-7) with zero point 4, not shifted by 28 into q6_zero's grid (an add a step saved; the integer
// sums, and so the bits, are the same).
constexpr int32_t codes_zero(int64_t fmt) { return fmt == Q3K ? 4 : q6_zero(fmt); }
// The table formats' values + their zero point, by 3-bit code (16 bytes: a byte shuffle's table;
// unused codes give the zero point, a weight of 0). IQ2XS (GGUF's IQ2_XS and IQ2_S): their grids'
// 8, 25, 43 and a sign (d carries the 1/8) + 43; IQ1M (IQ1_M): IQ1_S's values, 8 x (grid -1, 0, 1
// plus or minus 1/8) + 9.
alignas(16) constexpr uint8_t kIq2xsQ3[16] = {0, 18, 35, 51, 68, 86, 43, 43, 43, 43, 43, 43, 43, 43, 43, 43};
alignas(16) constexpr uint8_t kIq1mQ3[16] = {0, 2, 8, 10, 16, 18, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};
constexpr const uint8_t* q3_table_bytes(int64_t fmt) { return fmt == IQ1M ? kIq1mQ3 : kIq2xsQ3; }

// The 6-bit code of step st (0..3), lane byte b of group g (0..15) of the super-block at sb: the
// reference unpacking of Q6K, Q3K, Q2K and the table formats (their table's byte), which each
// path's vector unpacking reproduces.
inline int q6_code(int64_t fmt, const uint8_t* sb, int g, int st, int b) {
  if (fmt == Q2K) return (sb[320 + 64 * g + b] >> (2 * st)) & 3;
  if (fmt == Q3K || q3_table(fmt)) {
    const uint8_t* pair = sb + q6_header(fmt) + 192 * (g / 2);
    const int raw = ((pair[64 * (g % 2) + b] >> (2 * st)) & 3) | (((pair[128 + b] >> (4 * (g % 2) + st)) & 1) << 2);
    return fmt == Q3K ? 28 + raw : q3_table_bytes(fmt)[raw];
  }
  const uint8_t* cb = sb + 288 + 192 * g;
  const uint8_t lo = cb[64 * (st % 2) + b];
  return ((st < 2 ? lo : lo >> 4) & 15) | (((cb[128 + b] >> (2 * st)) & 3) << 4);
}

// IQ4_NL's 16 values (ggml's kvalues_iq4nl) + 128: IQ4's byte codes.
alignas(16) constexpr uint8_t kIq4Bytes[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
// MXFP4's 16 values (ggml's kvalues_mxfp4: twice E2M1's, so integers) + 128.
alignas(16) constexpr uint8_t kMxfp4Bytes[16] = {128, 129, 130, 131, 132, 134, 136, 140,
                                                 128, 127, 126, 125, 124, 122, 120, 116};
// IQ3_S's 16 signed values (the odd integers -15..15: its grid bytes 1, 3, .., 15 and a sign) + 128.
alignas(16) constexpr uint8_t kIq3sBytes[16] = {113, 115, 117, 119, 121, 123, 125, 127,
                                                129, 131, 133, 135, 137, 139, 141, 143};
// IQ3_XXS's 16 signed values (its grid's 4, 12, .., 62 and a sign; d carries their 1/4) + 128.
alignas(16) constexpr uint8_t kIq3xxsBytes[16] = {66, 76, 84, 92, 100, 108, 116, 124,
                                                  132, 140, 148, 156, 164, 172, 180, 190};
// IQ2_XXS's 6 signed values (its grid's 8, 25, 43 and a sign; d carries their 1/8) + 128, then unused.
alignas(16) constexpr uint8_t kIq2xxsBytes[16] = {85, 103, 120, 136, 153, 171, 128, 128,
                                                  128, 128, 128, 128, 128, 128, 128, 128};
// IQ1_S's 6 values, 8 x (grid -1, 0, 1 plus or minus 1/8) (d carries the 1/8) + 128, then unused.
alignas(16) constexpr uint8_t kIq1sBytes[16] = {119, 121, 127, 129, 135, 137, 128, 128,
                                                128, 128, 128, 128, 128, 128, 128, 128};
// The table a code_kind IQ4 format's nibbles index.
constexpr const uint8_t* code_table(int64_t fmt) {
  return fmt == MXFP4    ? kMxfp4Bytes
         : fmt == IQ3S   ? kIq3sBytes
         : fmt == IQ3XXS ? kIq3xxsBytes
         : fmt == IQ2XXS ? kIq2xxsBytes
         : fmt == IQ1S   ? kIq1sBytes
                         : kIq4Bytes;
}

// An E8M0 byte's scale with ggml's half folded in, 2^(e - 128), exactly (GGML_E8M0_TO_FP32_HALF:
// float bits (e - 1) << 23, or the subnormals 2^-128 and 2^-127 for e < 2). The vector paths build
// the same bits with their shifts.
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// The byte code of step st (0..7), lane byte b (4 * channel + input) of a byte-code group at cb:
// the reference unpacking, which each path's vector unpacking reproduces.
inline int byte_code(int64_t fmt, const uint8_t* cb, int st, int b) {
  if (fmt == Q8) return cb[64 * st + b];
  const uint8_t v = cb[64 * (st % 4) + b];
  const int nib = st < 4 ? v & 15 : v >> 4;
  if (code_kind(fmt) == IQ4) return code_table(fmt)[nib];
  if (code_kind(fmt) == Q40) return nib;
  return nib | (((cb[256 + b] >> st) & 1) << 4);
}

struct Segment {
  const uint8_t* blob;
  int64_t fmt, n, k, offset, sbg;  // sbg: Q4K/Q5K/IQ4 groups per super-block (the others: fixed layouts)
  FormatInfo fi() const {
    FormatInfo f{};
    format_info(fmt, sbg, &f);
    return f;
  }
  int64_t panels() const { return (n + kPanel - 1) / kPanel; }
  int64_t panel_bytes() const { return fi().bytes * (k / fi().superblock); }
};

// The byte-code formats' groups of a panel in input order: f(activation block, the group's
// super-block, its index g there, its codes).
template <class F>
inline void for_q8_groups(const Segment& s, const uint8_t* p, F&& f) {
  const FormatInfo fi = s.fi();
  const int groups = fi.superblock / 32;
  for (int64_t sb = 0; sb < s.k / fi.superblock; ++sb, p += fi.bytes)
    for (int g = 0; g < groups; ++g) f(sb * groups + g, p, g, byte_codes(s.fmt, s.sbg, p, g));
}

// The K-quant super-blocks of 256 inputs whose products may take activations with one scale per
// 256 values (Rows::kq8): Q4K, Q5K and IQ4 with 8 groups a super-block, Q6K, Q3K and Q2K.
constexpr bool k256_format(int64_t fmt, int64_t sbg) {
  return (six_bit(fmt) && !q3_table(fmt)) || ((fmt == Q4K || fmt == Q5K || fmt == IQ4) && sbg == 8);
}
constexpr int kKBlock = 256;  // the K-quants' activation block (llama.cpp's Q8_K)

// Quantized activations of m rows of width k: q8 [m, k] int8, d8 [m, k/32] (scale per block),
// s16 [m, k/16] and s32 [m, k/32] (sums of 16 and 32 codes), xs [m, k/32] = d8 * s32.
struct Rows {
  int8_t* q8;
  float* d8;
  int32_t* s16;
  int32_t* s32;
  float* xs;
  int64_t k;
  float* xf = nullptr;  // [m, k]: pre(x) in float32, for the float formats (null when no segment is one)
  // The same codes group-major, [k/32][gm][32] (gm >= m): each block of 32 inputs of every row side
  // by side, for the rows kernels, whose tile of rows then sits at one pointer plus constant
  // offsets (row r at 32 r) and streams one contiguous run a group; null: none kept.
  int8_t* q8g = nullptr;
  int64_t gm = 0;
  // The same rows with one scale per 256 values (k a multiple of 256), for the K-quants: codes
  // kq8 [m, k], scales kd [m, k/256], sums of 16 and of 32 codes ks16 [m, k/16], ks32 [m, k/32]
  // (int16: at most 127 x 32 in size, the operand of the vector paths' int16 products). Null: the
  // product keeps every segment on the per-32 codes above. A K-quant segment (k256_format) takes
  // these whenever they are set, so every path and row count of one product has one arithmetic.
  int8_t* kq8 = nullptr;
  float* kd = nullptr;
  int16_t* ks16 = nullptr;
  int16_t* ks32 = nullptr;
  // pre(x) rounded to bfloat16 (bf16_round) for BF16D, pair-major: word j of row r (inputs 2j and
  // 2j + 1 in its low and high half) at xb[j * xbm + r], xbm >= m, so a tile's rows' words for one
  // pair sit side by side at one pointer (null when no segment is BF16D).
  uint32_t* xb = nullptr;
  int64_t xbm = 0;
};

// Which K-quant formats quantize their activations per 256 (bit fmt of a mask: set_k256; the
// others, and every format while the mask is 0, per 32 as before). Set once, before any product.
int64_t k256_formats();
void set_k256(int64_t formats);
inline bool k256_enabled() { return k256_formats() != 0; }
inline bool k256_segment(int64_t fmt, int64_t sbg) { return k256_format(fmt, sbg) && ((k256_formats() >> fmt) & 1); }

// Whether segment s multiplies the per-256 activations of x.
inline bool uses_k256(const Segment& s, const Rows& x) { return x.kq8 != nullptr && k256_segment(s.fmt, s.sbg); }

// Row `row`'s codes from input k0 in the group-major copy (the next rows follow 32 bytes apart).
inline const int8_t* group_rows(const Rows& x, int64_t row, int64_t k0) {
  return x.q8g + ((k0 / 32) * x.gm + row) * 32 + k0 % 32;
}

// Q2K's minimum term's activation factor for group k0 (16 inputs) of a row: the block's scale
// times the group's code sum, one float multiply the same on every path.
inline float q16_xs(const Rows& x, int64_t row, int64_t k0) {
  return x.d8[row * (x.k / 32) + k0 / 32] * static_cast<float>(x.s16[row * (x.k / 16) + k0 / 16]);
}

// What is applied to each input row before it is quantized (fused into the same pass).
struct PreOp {
  const float* norm = nullptr;  // RMSNorm weight [k]: row * rsqrt(mean(row^2) + eps) * norm
  float eps = 0.f;
  // LayerNorm without a bias (Cohere): the row's mean subtracted first (family.h's center_row), then the RMSNorm
  // above, which over a centred row is the LayerNorm.
  bool center = false;
  bool silu_mul = false;  // the row holds [gate | up] (2k values): silu(gate) * up
};

// Whether `path`'s products of m rows read the group-major codes (Rows::q8g): the caller keeps
// them only then (without them such a product runs its tiles).
bool wants_group_rows(Path path, int64_t m);

// pre(x) of rows [r0, r1) quantized into `a`, and kept in float32 in a.xf where it is set (x: row
// stride ldx; scratch: k floats).
void quantize_rows(Path path, const float* x, int64_t ldx, const PreOp& op, const Rows& a, int64_t r0, int64_t r1,
                   float* scratch);

// One product: every segment's columns side by side in y [m, ldy].
struct Linear {
  const Segment* segs;
  const int64_t* first_panel;  // [nsegs + 1]: global index of each segment's first panel
  int64_t nsegs;
  Rows x;
  int64_t m;
  float* y;
  int64_t ldy;
  const float* bias;      // [ldy] or null
  const float* residual;  // [m, ldy] or null
};

// Panels [p0, p1) of the product (global panel indices) for rows [r0, r1). scratch: the
// accumulators of one row block, kRowBlock * kPanel floats, 64-byte aligned.
void linear_block(Path path, const Linear& op, int64_t p0, int64_t p1, int64_t r0, int64_t r1, float* scratch);

// Panels [p0, p1) for every row (allocates its own scratch).
void linear_panels(Path path, const Linear& op, int64_t p0, int64_t p1);

// A product cut into units of (row block, chunk of panels) that threads take in any order: each
// unit writes its own outputs with the same arithmetic, so the split never changes a bit. Row
// blocks keep a block's activations in L2 while every panel passes over them; chunks are small
// enough that two threads finish together on a product of any shape.
struct LinearWork {
  int64_t m, panels, row_block, row_blocks, chunk, chunks;
  int64_t units() const { return row_blocks * chunks; }
};
// A unit: a chunk of panels times a block of rows (kRowBlock; the amx path's kernels, which
// prepare each panel once for all the rows they are given, kAmxRowBlock).
constexpr int kAmxRowBlock = 256;
LinearWork plan_linear(Path path, const Linear& op, int64_t panels, int threads);
void linear_unit(Path path, const Linear& op, const LinearWork& w, int64_t unit, float* scratch);

// Weight row `row` of a segment in float32 (embedding lookups, float conversions, tests).
void dequantize_row(const Segment& s, int64_t row, float* out);
// Channels [c0, c1) of one panel (rows panel * 16 + c), row c - c0 at out + (c - c0) * ldo: the same
// floats as dequantize_row, each group unpacked once for all of them.
void dequantize_channels(const Segment& s, int64_t panel, int c0, int c1, float* out, int64_t ldo);

// The float formats' sums of one full panel for rows [r0, r0 + n), n <= kRowBlock, into sum [n][16]
// (the bias and residual not yet added): the vector paths' shared loop over their pieces V::
//   one(p, x, sum): one row (x: its floats), converting each weight as it streams;
//   convert(p, len, w): a block of len inputs' weights into w [len][16] float32;
//   tiles(w, len, x, xk, part, n): n rows' even and odd chains part [n][2][16] over that block
//   (x: the first row's floats at the block, xk: the row stride).
template <class V>
void float_sums(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, float* sum) {
  if (n == 1) return V::one(s, p, x.xf + r0 * x.k, sum);
  alignas(64) float w[kFloatBlock * kPanel];
  alignas(64) float part[kRowBlock][2][kPanel];
  std::memset(part, 0, sizeof(float) * 2 * kPanel * n);
  for (int64_t k0 = 0; k0 < s.k; k0 += kFloatBlock) {
    const int len = static_cast<int>(std::min<int64_t>(kFloatBlock, s.k - k0));
    V::convert(p + 32 * k0, len, w);
    V::tiles(w, len, x.xf + r0 * x.k + k0, x.k, part, n);
  }
  for (int r = 0; r < n; ++r)
    for (int c = 0; c < kPanel; ++c) sum[kPanel * r + c] = part[r][0][c] + part[r][1][c];
}

// ------------------------------------------------------------------ per path

// One tile: panel `p` (16 channels, `valid` of them real) times rows [r0, r0 + rows), written
// to out (row stride ldo) with bias and residual already offset to the panel's first column.
struct TileOut {
  float* y;
  int64_t ldo;
  const float* bias;
  const float* residual;
  int valid;
};

// BF16D's weight: input i, channel c of the panel at p, as the product reads it (a subnormal as zero).
float bf16d_weight(const uint8_t* p, int64_t i, int c);
void tile_portable(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, const TileOut& out);
// The float formats' weight: input i, channel c of the panel at p (exact).
float float_weight(int64_t fmt, const uint8_t* p, int64_t i, int c);
void quantize_row_portable(const float* x, int64_t k, int8_t* q, float* d8, int32_t* s16, int32_t* s32, float* xs);
// One row's per-256 activations (Rows::kq8): as quantize_row_portable with blocks of 256.
void quantize_row256_portable(const float* x, int64_t k, int8_t* q, float* d, int16_t* s16, int16_t* s32);
void pre_op_row_portable(const float* x, int64_t k, const PreOp& op, float* out);

#define SPX_DECLARE_PATH(isa)                                                                                \
  int tile_rows_##isa();                                                                                     \
  void tile_##isa(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, const TileOut& out); \
  int rows_from_##isa();                                                                                     \
  void rows_##isa(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out,   \
                  float* acc);                                                                               \
  void quantize_row_##isa(const float* x, int64_t k, int8_t* q, float* d8, int32_t* s16, int32_t* s32, float* xs); \
  void pre_op_row_##isa(const float* x, int64_t k, const PreOp& op, float* out);

#if defined(__x86_64__)
// BF16D on VDPBF16PS (qlinear_bf16_avx512.cpp; only where the CPU has AVX512-BF16): n <= kRowBlock rows
// of one or two adjacent full panels, and one row over up to four (outputs of panel i at outs[i]).
void bf16d_rows_avx512(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, int panels,
                       const TileOut* outs);
void bf16d_one_avx512(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int panels, const TileOut* outs);
// One row over two adjacent full panels of a float format (p and the next), written to a and b.
void float_pair_avx2(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, const TileOut& a,
                     const TileOut& b);
SPX_DECLARE_PATH(avx2)
SPX_DECLARE_PATH(avx512)
void quantize_row256_avx512(const float* x, int64_t k, int8_t* q, float* d, int16_t* s16, int16_t* s32);
#endif
#if defined(__aarch64__)
SPX_DECLARE_PATH(neon)
#endif
#undef SPX_DECLARE_PATH

// The amx path's many-row product (qlinear_amx.cpp), the rows kernel of the amx paths (the rest of
// each is its vector path's, cpu.h): on the tiles, and the same code on emulated tiles (any CPU).
// Whether `path`'s rows kernel runs format fmt's per-256 segments on the tiles (Q4K, where the tile
// code has AVX-512 beside it); the others run their vector path's per-256 kernels.
bool amx_k256_tiles(Path path, int64_t fmt);
#if defined(__x86_64__)
void rows_amx(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out, float* acc);
#endif
void rows_amx_emulated(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int n, const TileOut& out,
                       float* acc);

}  // namespace spx
