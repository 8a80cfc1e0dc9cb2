// The portable path of the quantized linear layers: the reference arithmetic in scalar code
// (see qlinear.h), which every vector path reproduces bit for bit.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fastexp.h"
#include "half.h"
#include "qlinear.h"

namespace spx {

void quantize_row_portable(const float* x, int64_t k, int8_t* q, float* d8, int32_t* s16, int32_t* s32, float* xs) {
  for (int64_t b = 0; b < k / kActBlock; ++b) {
    const float* xb = x + b * kActBlock;
    float amax = 0.f;
    for (int i = 0; i < kActBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    int32_t sums[2] = {0, 0};
    for (int i = 0; i < kActBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      q[b * kActBlock + i] = static_cast<int8_t>(v);
      sums[i / 16] += v;
    }
    d8[b] = d;
    s16[2 * b] = sums[0];
    s16[2 * b + 1] = sums[1];
    s32[b] = sums[0] + sums[1];
    xs[b] = d * static_cast<float>(s32[b]);
  }
}

void quantize_row256_portable(const float* x, int64_t k, int8_t* q, float* d, int16_t* s16, int16_t* s32) {
  for (int64_t b = 0; b < k / kKBlock; ++b) {
    const float* xb = x + b * kKBlock;
    float amax = 0.f;
    for (int i = 0; i < kKBlock; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
    const float db = amax / 127.f;
    const float id = db != 0.f ? 1.f / db : 0.f;
    int32_t sums[kKBlock / 16] = {0};
    for (int i = 0; i < kKBlock; ++i) {
      const int v = static_cast<int>(std::nearbyint(xb[i] * id));
      q[b * kKBlock + i] = static_cast<int8_t>(v);
      sums[i / 16] += v;
    }
    d[b] = db;
    for (int j = 0; j < kKBlock / 16; ++j) s16[b * (kKBlock / 16) + j] = static_cast<int16_t>(sums[j]);
    for (int j = 0; j < kKBlock / 32; ++j) s32[b * (kKBlock / 32) + j] = static_cast<int16_t>(sums[2 * j] + sums[2 * j + 1]);
  }
}

// RMSNorm sums squares in 16 interleaved partial sums (lane i%16) added in lane order; SiLU is
// elementwise. Vector paths keep the same partial sums in their registers.
void pre_op_row_portable(const float* x, int64_t k, const PreOp& op, float* out) {
  if (op.silu_mul) {
    for (int64_t i = 0; i < k; ++i) out[i] = x[i] / (1.f + exp_portable(-x[i])) * x[k + i];
    return;
  }
  float sq[16] = {0.f};
  for (int64_t i = 0; i < k; ++i) sq[i % 16] = std::fma(x[i], x[i], sq[i % 16]);
  float total = 0.f;
  for (float v : sq) total += v;
  const float inv = 1.f / std::sqrt(total / static_cast<float>(k) + op.eps);
  for (int64_t i = 0; i < k; ++i) out[i] = x[i] * inv * op.norm[i];
}

namespace {

// One group's codes [16 channels][group] and float scales (and Q4K mins); for the per-256
// arithmetic also the integer scale and minimum codes and the super-block's d and dmin.
struct Group {
  float scale[kPanel], mins[kPanel];
  int32_t codes[kPanel][32];
  int32_t isc[kPanel], imn[kPanel];
  float d[kPanel], dmin[kPanel];
};

void unpack_group(const Segment& s, const uint8_t* p, int g, Group& out) {
  const uint16_t* dh = reinterpret_cast<const uint16_t*>(p);
  for (int c = 0; c < kPanel; ++c) {
    const float d = channel_d(s.fmt, p, c);
    out.d[c] = d;
    out.dmin[c] = has_minimum(s.fmt) || s.fmt == Q4K || s.fmt == Q2K ? half_to_float(dh[16 + c]) : 0.f;
    out.imn[c] = 0;
    if (s.fmt == Q4K) {
      const uint8_t* sc = p + 64 + 16 * g;
      const uint8_t* mn = p + 64 + 16 * s.sbg + 16 * g;
      out.isc[c] = sc[c];
      out.imn[c] = mn[c];
      out.scale[c] = d * static_cast<float>(sc[c]);
      out.mins[c] = half_to_float(dh[16 + c]) * static_cast<float>(mn[c]);
      const uint8_t* cb = p + 64 + 32 * s.sbg + 256 * g;
      for (int st = 0; st < 8; ++st)
        for (int j = 0; j < 4; ++j) {
          const uint8_t byte = cb[64 * (st % 4) + 4 * c + j];
          out.codes[c][4 * st + j] = st < 4 ? (byte & 15) : (byte >> 4);
        }
    } else if (s.fmt == Q2K) {  // a byte of a 4-bit scale and a 4-bit minimum
      const uint8_t sm = p[64 + 16 * g + c];
      out.isc[c] = sm & 15;
      out.imn[c] = sm >> 4;
      out.scale[c] = d * static_cast<float>(sm & 15);
      out.mins[c] = half_to_float(dh[16 + c]) * static_cast<float>(sm >> 4);
      for (int st = 0; st < 4; ++st)
        for (int j = 0; j < 4; ++j) out.codes[c][4 * st + j] = q6_code(s.fmt, p, g, st, 4 * c + j);
    } else if (six_bit(s.fmt)) {
      out.isc[c] = reinterpret_cast<const int8_t*>(p + q6_scales_at(s.fmt))[16 * g + c];
      out.scale[c] = d * static_cast<float>(out.isc[c]);
      for (int st = 0; st < 4; ++st)
        for (int j = 0; j < 4; ++j) out.codes[c][4 * st + j] = q6_code(s.fmt, p, g, st, 4 * c + j);
    } else {
      out.scale[c] = e8m0_header(s.fmt) ? e8m0_half(p[c]) : d;
      out.isc[c] = scale_codes(s.fmt) ? reinterpret_cast<const int8_t*>(group_scales(s.fmt, p, g))[c] : 1;
      if (k_header(s.fmt)) out.imn[c] = group_mins(s.sbg, p, g)[c];
      if (scale_codes(s.fmt))
        out.scale[c] = d * static_cast<float>(reinterpret_cast<const int8_t*>(group_scales(s.fmt, p, g))[c]);
      if (has_minimum(s.fmt)) out.mins[c] = half_to_float(dh[16 + c]);
      if (k_header(s.fmt)) out.mins[c] = out.mins[c] * static_cast<float>(group_mins(s.sbg, p, g)[c]);
      const uint8_t* cb = byte_codes(s.fmt, s.sbg, p, g);
      for (int st = 0; st < 8; ++st)
        for (int j = 0; j < 4; ++j) out.codes[c][4 * st + j] = byte_code(s.fmt, cb, st, 4 * c + j);
    }
  }
}

// One group of one row into acc[16]: the reference epilogue.
void group_row(const Segment& s, const Group& grp, const Rows& x, int64_t row, int64_t k0, float* acc) {
  const FormatInfo fi = s.fi();
  const int64_t kb = x.k / 32;
  const int8_t* q = x.q8 + row * x.k + k0;
  const float d8 = x.d8[row * kb + k0 / 32];
  for (int c = 0; c < kPanel; ++c) {
    int32_t dot = 0;
    for (int i = 0; i < fi.group; ++i) dot += grp.codes[c][i] * static_cast<int32_t>(q[i]);
    if (six_bit(s.fmt)) dot -= q6_zero(s.fmt) * x.s16[row * (x.k / 16) + k0 / 16];
    if (byte_format(s.fmt)) dot -= static_cast<int32_t>(s.offset) * x.s32[row * kb + k0 / 32];
    const float t = static_cast<float>(dot) * d8;
    acc[c] = std::fma(t, grp.scale[c], acc[c]);
    if (s.fmt == Q4K || has_minimum(s.fmt)) acc[c] = std::fma(-grp.mins[c], x.xs[row * kb + k0 / 32], acc[c]);
    if (s.fmt == Q2K) acc[c] = std::fma(-grp.mins[c], q16_xs(x, row, k0), acc[c]);
  }
}

// One super-block (256 inputs, from k0) of one row into acc[16] with the per-256 activations: the
// reference of the K-quants' arithmetic (qlinear.h). Per channel the exact integer sums
// isum = sum_g scale code * (dot_g - zero * codes' sum) and imin = sum_g minimum code * codes' sum,
// then acc = fma(float(isum) * d256, d, acc) and acc = fma(-dmin, float(imin) * d256, acc).
void superblock_row(const Segment& s, const Group* grp, const Rows& x, int64_t row, int64_t k0, float* acc) {
  const FormatInfo fi = s.fi();
  const int groups = kKBlock / fi.group;
  const int8_t* q = x.kq8 + row * x.k + k0;
  const int16_t* s16 = x.ks16 + row * (x.k / 16) + k0 / 16;
  const float dk = x.kd[row * (x.k / kKBlock) + k0 / kKBlock];
  const int32_t zero = six_bit(s.fmt) ? q6_zero(s.fmt) : byte_format(s.fmt) ? static_cast<int32_t>(s.offset) : 0;
  for (int c = 0; c < kPanel; ++c) {
    int32_t isum = 0, imin = 0;
    for (int g = 0; g < groups; ++g) {
      int32_t dot = 0, sum = 0;
      for (int i = 0; i < fi.group; ++i) dot += grp[g].codes[c][i] * static_cast<int32_t>(q[g * fi.group + i]);
      for (int j = 0; j < fi.group / 16; ++j) sum += s16[g * fi.group / 16 + j];
      isum += grp[g].isc[c] * (dot - zero * sum);
      imin += grp[g].imn[c] * sum;
    }
    acc[c] = std::fma(static_cast<float>(isum) * dk, grp[0].d[c], acc[c]);
    if (s.fmt == Q4K || s.fmt == Q2K || has_minimum(s.fmt))
      acc[c] = std::fma(-grp[0].dmin[c], static_cast<float>(imin) * dk, acc[c]);
  }
}

// The float formats' reference (qlinear.h): two fma chains a row and channel, even and odd inputs.
void float_tile(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, float* acc) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x.xf + (r0 + r) * x.k;
    for (int c = 0; c < kPanel; ++c) {
      float sum[2] = {0.f, 0.f};
      for (int64_t i = 0; i < s.k; ++i) sum[i % 2] = std::fma(float_weight(s.fmt, p, i, c), xr[i], sum[i % 2]);
      acc[r * kPanel + c] = sum[0] + sum[1];
    }
  }
}

// BF16D's reference (qlinear.h): one chain a row and channel over the input pairs, each pair as a
// VDPBF16PS lane takes it (odd input first; DAZ in, FTZ out).
float bf16d_step(float w, float x, float sum) {
  const float r = std::fma(w, x, sum);
  return std::fpclassify(r) == FP_SUBNORMAL ? std::copysign(0.f, r) : r;
}

void bf16d_tile(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, float* acc) {
  for (int r = 0; r < rows; ++r) {
    const uint32_t* xr = x.xb + r0 + r;  // word j at xr[j * x.xbm]
    for (int c = 0; c < kPanel; ++c) {
      float sum = 0.f;
      for (int64_t j = 0; j < s.k / 2; ++j) {
        const uint32_t xj = xr[j * x.xbm];
        sum = bf16d_step(bf16d_weight(p, 2 * j + 1, c), bf16_daz(static_cast<uint16_t>(xj >> 16)), sum);
        sum = bf16d_step(bf16d_weight(p, 2 * j, c), bf16_daz(static_cast<uint16_t>(xj & 0xFFFF)), sum);
      }
      acc[r * kPanel + c] = sum;
    }
  }
}

// BF16D's stored value of input i, channel c (the file's bits, a subnormal kept).
uint16_t bf16d_bits(const uint8_t* p, int64_t i, int c) {
  uint16_t h;
  std::memcpy(&h, p + 64 * (i / 2) + 4 * c + 2 * (i % 2), 2);
  return h;
}

}  // namespace

float bf16d_weight(const uint8_t* p, int64_t i, int c) { return bf16_daz(bf16d_bits(p, i, c)); }

float float_weight(int64_t fmt, const uint8_t* p, int64_t i, int c) {
  uint16_t h;
  std::memcpy(&h, p + 32 * i + 2 * c, 2);
  return fmt == F16 ? half_to_float(h) : bf16_to_float(h);
}

void tile_portable(const Segment& s, const uint8_t* p, const Rows& x, int64_t r0, int rows, const TileOut& out) {
  float acc[kMaxTile * kPanel] = {0.f};
  const FormatInfo fi = s.fi();
  const int groups = fi.superblock / fi.group;
  Group grp;
  if (float_format(s.fmt)) {
    float_tile(s, p, x, r0, rows, acc);
  } else if (bf16_dot_format(s.fmt)) {
    bf16d_tile(s, p, x, r0, rows, acc);
  } else if (uses_k256(s, x)) {
    Group sb_groups[16];
    for (int64_t sb = 0; sb < s.k / kKBlock; ++sb, p += fi.bytes) {
      for (int g = 0; g < groups; ++g) unpack_group(s, p, g, sb_groups[g]);
      for (int r = 0; r < rows; ++r) superblock_row(s, sb_groups, x, r0 + r, sb * kKBlock, acc + r * kPanel);
    }
  } else
    for (int64_t sb = 0; sb < s.k / fi.superblock; ++sb, p += fi.bytes)
      for (int g = 0; g < groups; ++g) {
        unpack_group(s, p, g, grp);
        const int64_t k0 = sb * fi.superblock + static_cast<int64_t>(g) * fi.group;
        for (int r = 0; r < rows; ++r) group_row(s, grp, x, r0 + r, k0, acc + r * kPanel);
      }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < out.valid; ++c) {
      float v = acc[r * kPanel + c] + (out.bias ? out.bias[c] : 0.f);
      if (out.residual) v = out.residual[(r0 + r) * out.ldo + c] + v;
      out.y[(r0 + r) * out.ldo + c] = v;
    }
}

void dequantize_channels(const Segment& s, int64_t panel, int c0, int c1, float* o, int64_t ldo) {
  const FormatInfo fi = s.fi();
  const uint8_t* p = s.blob + panel * s.panel_bytes();
  if (float_format(s.fmt)) {
    for (int c = c0; c < c1; ++c)
      for (int64_t i = 0; i < s.k; ++i) o[(c - c0) * ldo + i] = float_weight(s.fmt, p, i, c);
    return;
  }
  if (bf16_dot_format(s.fmt)) {
    for (int c = c0; c < c1; ++c)
      for (int64_t i = 0; i < s.k; ++i) o[(c - c0) * ldo + i] = bf16_to_float(bf16d_bits(p, i, c));
    return;
  }
  // Each group is unpacked once for all the channels asked of it (unpacking is most of the work).
  const int groups = fi.superblock / fi.group;
  Group grp;
  for (int64_t sb = 0; sb < s.k / fi.superblock; ++sb, p += fi.bytes)
    for (int g = 0; g < groups; ++g) {
      unpack_group(s, p, g, grp);
      const int64_t i0 = sb * fi.superblock + g * fi.group;
      for (int c = c0; c < c1; ++c) {
        // One branch-free form for every format, so the loop vectorizes: scale * (code - zero) - min
        // with min = 0 where a format has none (x - 0 is x, bit for bit, -0 included).
        const float scale = grp.scale[c];
        const float mn = s.fmt == Q4K || s.fmt == Q2K || has_minimum(s.fmt) ? grp.mins[c] : 0.f;
        const int zero = s.fmt == Q4K ? 0 : six_bit(s.fmt) ? q6_zero(s.fmt) : static_cast<int>(s.offset);
        const auto* codes = grp.codes[c];
        float* og = o + (c - c0) * ldo + i0;
        for (int i = 0; i < fi.group; ++i) og[i] = scale * static_cast<float>(codes[i] - zero) - mn;
      }
    }
}

void dequantize_row(const Segment& s, int64_t row, float* o) {
  const int c = static_cast<int>(row % kPanel);
  dequantize_channels(s, row / kPanel, c, c + 1, o, s.k);
}

}  // namespace spx
