"""The layers of a Llama-family decoder: RoPE, RMSNorm, the linear layer in its three weight
forms, the embedding, and the decoder block; and `Rows`, one sequence's new tokens in a forward.

A block runs either as PyTorch operations (`Block.forward`: float weights, any device, float64
for exactness tests) or, on the quantized runtime, as five kernel calls over the rows of several
sequences (`Block.forward_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from . import kernels
from .attention import Backend, attend, list_ends, window_mask
from .config import ModelConfig
from .experts import Experts, clamped_swiglu
from .kv_cache import KVCache
from .quant import QWeight, qlinear


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies in float32, as Hugging Face computes them (so outputs match exactly).
    `local`: the windowed layers' own rope (`ModelConfig.local_rope_theta`, never scaled)."""
    dim = cfg.rotary_dim or cfg.head_dim
    theta = cfg.local_rope_theta if local else cfg.rope_theta
    sc = None if local else cfg.rope_scaling
    kind = None if sc is None else sc.get("rope_type", sc.get("type"))
    if kind == "longrope":  # per-frequency divisors: the long ones where the context exceeds the original window
        factors = torch.tensor(sc["long_factor" if cfg.long_rope else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if sc is None:
        return inv
    if kind == "linear":
        return inv / float(sc["factor"])
    if kind == "yarn":
        return _yarn_inv_freq(sc, theta, dim)
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = float(sc["factor"])
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_ctx = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(sc: dict, theta: float, dim: int) -> torch.Tensor:
    """YaRN (config.yarn_scaling's settings): each frequency blends the original (extrapolated) and
    the one slowed by `factor` (interpolated) along a linear ramp between the dimensions that turn
    beta_fast and beta_slow times over the original window, in float32 as transformers computes it."""
    factor, original = float(sc["factor"]), float(sc["original_max_position_embeddings"])

    def turns_dim(turns: float) -> float:  # the dimension whose wavelength fits `turns` times in the window
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_dim(sc["beta_fast"]), turns_dim(sc["beta_slow"])
    if sc["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    extrapolated = 1 - ramp
    return 1.0 / (factor * pos) * (1 - extrapolated) + 1.0 / pos * extrapolated


def query_temperature(beta: float, length: int, positions: torch.Tensor) -> torch.Tensor | None:
    """Llama 4's attention temperature per position (`ModelConfig.attn_temperature`: beta, `temperature_length`),
    in float32 as transformers and llama.cpp compute it; None where every position is inside the first `length`
    (all exactly 1)."""
    if not beta or positions.numel() == 0 or int(positions.max()) < length:
        return None
    return 1 + beta * torch.log(1 + torch.floor(positions / length))


def gated(activation: str, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """act(gate, up) of a dense gated MLP by the family's `activation` (the experts' are
    experts.ACTIVATIONS, gpt-oss's clamped SwiGLU among them)."""
    if activation == "swiglu_oai":
        return clamped_swiglu(g, u)
    return (F.gelu(g, approximate="tanh") if activation == "gelu_tanh" else F.silu(g)) * u


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [heads, T, D] by per-token angles (cos/sin: [T, R]), the rotate-half convention; with
    R < D (partial rotary) the first R dimensions rotate and the rest pass."""
    if cos.shape[-1] < x.shape[-1]:
        r = cos.shape[-1]
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def conv_taps(rows: int, length: int, tree_mask: torch.Tensor | None, kernel: int) -> torch.Tensor:
    """[rows, kernel] the cache slots a short convolution reads for each new row (the rows at slots length + r): the
    kernel - 1 tokens before it on its path (what it may see: the tree mask over the last M slots, all slots before
    those), oldest first, then its own; -1 where the sequence has no such token. Without a mask, the slots before."""
    own = torch.arange(length, length + rows)
    if tree_mask is None:
        taps = own[:, None] + torch.arange(1 - kernel, 1)[None, :]
        return torch.where(taps >= 0, taps, -1)
    mask = tree_mask.cpu()
    first = length + rows - mask.shape[1]  # the slot of the mask's first column
    out = torch.full((rows, kernel), -1, dtype=torch.long)
    earlier = list(range(max(0, first - kernel + 1), first))  # before the mask: every slot is seen
    for r in range(rows):
        seen = (first + torch.nonzero(mask[r, : mask.shape[1] - rows + r]).flatten()).tolist()
        prev = (earlier + seen)[-(kernel - 1):] if kernel > 1 else []
        out[r, kernel - 1 - len(prev):] = torch.tensor([*prev, int(own[r])], dtype=torch.long)
    return out


def conv_slots(taps: torch.Tensor, base: int, layer: int | None = None) -> torch.Tensor:
    """`conv_taps` as slots of a state whose slot 0 holds position `base` (-1: none); RuntimeError where a tap is
    no longer held (the state slid past it)."""
    held = taps >= 0
    if bool((taps[held] < base).any()):
        where = "" if layer is None else f"layer {layer} "
        raise RuntimeError(f"{where}needs inputs from {int(taps[held].min())}, its cache holds them from {base}")
    return torch.where(held, taps - base, -1)


@dataclass
class Rows:
    """One sequence's new tokens in a forward: `Transformer.forward`'s arguments as one value."""

    tokens: torch.Tensor
    positions: torch.Tensor
    cache: KVCache
    tree_mask: torch.Tensor | None = None
    logits_rows: torch.Tensor | slice | None = None
    keep_q: dict[int, torch.Tensor] | None = None
    backend: Backend = "efficient"  # the attention of the float paths (the quantized runtime's is its own)
    # (keys, window) -> window_mask's (first, mask): the same for every windowed layer of a forward
    windows: dict[tuple[int, int], tuple[int, torch.Tensor]] = field(default_factory=dict, repr=False)
    # (beta, length) -> query_temperature's scales: the same for every layer of a forward
    scales: dict[tuple[float, int], torch.Tensor | None] = field(default_factory=dict, repr=False)
    # (kernel, cache length) -> conv_taps of these rows: the same for every convolution layer of a forward
    taps: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, repr=False)

    def temperature(self, beta: float, length: int) -> torch.Tensor | None:
        """`query_temperature` of these rows, computed once per forward (every layer scales by it)."""
        if (beta, length) not in self.scales:
            self.scales[beta, length] = query_temperature(beta, length, self.positions)
        return self.scales[beta, length]

    def conv_taps(self, kernel: int) -> torch.Tensor:
        """`conv_taps` of these rows (their cache's length before the forward), computed once per forward."""
        key = (kernel, self.cache.length)
        if key not in self.taps:
            self.taps[key] = conv_taps(self.size, self.cache.length, self.tree_mask, kernel)
        return self.taps[key]

    def window(self, keys: int, window: int) -> tuple[int, torch.Tensor]:
        """`window_mask` of these rows over `keys` cache slots, computed once per forward."""
        if (keys, window) not in self.windows:
            self.windows[keys, window] = window_mask(self.positions, keys, self.tree_mask, window)
        return self.windows[keys, window]

    @property
    def size(self) -> int:
        return int(self.tokens.shape[0])


class RMSNorm(nn.Module):
    """RMSNorm, or with `center` a LayerNorm without bias (Cohere's): the RMSNorm of the row less its mean, which
    is the same function (the quantized kernels fold both into a product's input: `PreOp::center`)."""

    def __init__(self, dim: int, eps: float, center: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.center = center

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the model dtype (as the reference implementations do).
        xf = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
        if self.center:
            xf = xf - xf.mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Linear(nn.Module):
    """y = x W^T (+ b) with the weight in one of three forms, chosen when the model is loaded:

    - a float weight (any device, any dtype): `F.linear`; float64 is what exactness tests use;
    - the same reordered by oneDNN (`pack()`, float32/bfloat16 on CPU): PyTorch's default GEMM
      for 1-16 rows runs at a fraction of memory bandwidth on this kind of CPU, and decoding and
      verification are exactly that case; fewer than 4 rows are padded to 4, its fastest shape;
    - a block-quantized weight (`quantize()`, a `quant.QWeight`): the C++ kernels quantize the
      input to int8 per block of 32 of each row and read each weight block once for all rows.
    """

    def __init__(self, d_in: int, d_out: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(d_out), requires_grad=False) if bias else None
        self.packed: torch.Tensor | None = None
        self.qweight: QWeight | None = None

    def pack(self) -> None:
        w = self.weight
        if w is None or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            return
        if not torch.backends.mkldnn.is_available():
            return
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.data, None)
        self.weight = None  # type: ignore[assignment]

    def quantize(self, qweight: QWeight) -> None:
        """Compute with a block-quantized weight from now on (the float weight is dropped)."""
        self.qweight = qweight
        self.weight = None  # type: ignore[assignment]
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return qlinear(x, self.qweight, self.bias)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        t = x.shape[0]
        if t < 4:
            x = torch.cat([x, x.new_zeros(4 - t, x.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return y[:t] if t < 4 else y


class Embedding(nn.Module):
    """Token embeddings: a float table, or a block-quantized one whose rows are dequantized on lookup."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim), requires_grad=False)
        self.qweight: QWeight | None = None

    def quantize(self, qweight: QWeight) -> None:
        self.qweight = qweight
        self.weight = None  # type: ignore[assignment]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.rows(ids)
        return F.embedding(ids, self.weight)


class Workspace:
    """A reusable output buffer for the quantized runtime's widest product (gate/up: 2 x the MLP
    width per token). A prefill chunk's is tens of MB; allocated anew for every layer, the C
    library maps fresh pages for it each time and the page faults cost a visible share of prefill
    (docs/benchmarks.md). One per model: its layers run one after another."""

    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def take(self, rows: int, cols: int) -> torch.Tensor:
        if self._buf.numel() < rows * cols:
            self._buf = torch.empty(rows * cols)
        return self._buf[: rows * cols].view(rows, cols)


def _normed(lin: Linear, h: torch.Tensor, norm: RMSNorm | None, **kw: object) -> torch.Tensor:
    """The quantized product of h with `lin`'s weight (and bias), through the norm before it if any (folded in)."""
    if norm is None:
        return qlinear(h, lin.qweight, lin.bias, **kw)
    return qlinear(h, lin.qweight, lin.bias, norm=norm.weight, eps=norm.eps, center=norm.center, **kw)


Ropes = list[tuple[torch.Tensor, torch.Tensor]]  # (cos, sin) per rope kind (`ModelConfig.rope_kind`)


class Block(nn.Module):
    """One decoder layer: the Llama block with its family's switches (`ModelConfig`, families.py)."""

    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        # LFM2's short convolution in place of attention: `qkv` is its input projection (B, C and x, each of the
        # hidden size), `o` its output projection, `conv` the depthwise kernel [hidden, kernel].
        self.conv = nn.Parameter(torch.zeros(cfg.hidden_size, cfg.conv_kernel), requires_grad=False) \
            if cfg.conv(index) else None
        if self.conv is not None:
            q_out, kv_out = cfg.hidden_size, cfg.hidden_size
        self.qkv = Linear(cfg.hidden_size, q_out + 2 * kv_out, bias=cfg.attention_bias and self.conv is None)
        self.o = Linear(q_out, cfg.hidden_size, bias=cfg.o_bias and self.conv is None)
        # The MLP: a dense one, or a mixture of experts (experts.py) where the family has them.
        self.moe = Experts(cfg, Linear) if cfg.expert_layer(index) else None
        self.gate_up = None if self.moe else Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = None if self.moe else Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

        def norm(name: str) -> RMSNorm | None:
            return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.layer_norm) if name in cfg.norms else None

        self.attn_norm, self.attn_out_norm = norm("attn_norm"), norm("attn_out_norm")
        self.mlp_norm, self.mlp_out_norm = norm("mlp_norm"), norm("mlp_out_norm")
        if cfg.parallel and (self.moe is not None or self.attn_out_norm is not None or self.mlp_out_norm is not None):
            raise ValueError("a parallel block has no experts and no post norms")
        # Cohere's parallel block: the MLP reads the layer's input through the attention norm (`_mlp_input`).
        self.parallel = cfg.parallel
        self.qk_full = cfg.qk_norm == "full"
        qk_dim = (q_out, kv_out) if self.qk_full else (cfg.head_dim, cfg.head_dim)
        self.q_norm = RMSNorm(qk_dim[0], cfg.rms_norm_eps) if cfg.qk_norm and self.conv is None else None
        self.k_norm = RMSNorm(qk_dim[1], cfg.rms_norm_eps) if cfg.qk_norm and self.conv is None else None
        self.plain = cfg.plain
        self.rope_kind = cfg.rope_kind(index)
        self.window = cfg.sliding_window if cfg.windowed(index) else 0
        self.attn_scale, self.attn_softcap = cfg.attn_scale, cfg.attn_softcap
        self.temperature = (cfg.attn_temperature, cfg.temperature_length)
        self.residual_scale = cfg.residual_scale
        self.activation = cfg.activation
        self.gelu = cfg.activation == "gelu_tanh"  # the whole-step call's GeGLU (fused_step.py)
        # gpt-oss's attention sinks: a learned logit per query head in every softmax's denominator.
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads), requires_grad=False) if cfg.attn_sinks else None
        # [kv_heads, head_dim] float32 or None: what a q8 cache's keys are stored less
        # (Transformer.calibrate_key_offset); bfloat16 caches ignore it.
        self.k_offset: torch.Tensor | None = None
        # (block, q, k, v) -> (q, k, v) just before attention, or None (always, but in bench/emulate.py's
        # `@scores-q8`: another score arithmetic emulated on a float model, before it is built)
        self.score_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None
        self.workspace = Workspace()  # the model gives all its layers one (Transformer.__init__)

    def _act(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return gated(self.activation, g, u)

    def _residual(self, x: torch.Tensor, y: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """x plus a sublayer's output y, through its post-norm and the residual multiplier if any."""
        if norm is not None:
            y = norm(y)
        if self.residual_scale != 1.0:
            y = y * self.residual_scale
        return x + y

    def _held(self, first: int, base: int) -> None:
        """Refuse to attend when the cache no longer holds the first key the rows see (it slid past)."""
        if first < base:
            raise RuntimeError(f"layer {self.index} needs keys from {first}, its cache holds them from {base}")

    def _window(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, base: int, tree_mask: torch.Tensor | None,
                positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, int] | None]:
        """The keys, values, mask and key numbers (`attend`'s) a windowed layer attends with (others:
        as given, numbered from 0); k and v hold the tokens from position `base` on."""
        if not self.window:
            return k, v, tree_mask, None
        keys = base + k.shape[1]
        first, mask = window_mask(positions, keys, tree_mask, self.window)
        self._held(first, base)
        numbers = (list_ends(keys, tree_mask, q.shape[1]), first)
        return k[:, first - base:], v[:, first - base:], mask.to(q.device), numbers

    def forward(
        self,
        x: torch.Tensor,
        ropes: Ropes,
        cache: KVCache,
        tree_mask: torch.Tensor | None,
        backend: Backend,
        keep_q: dict[int, torch.Tensor] | None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.conv is not None:
            h = self.qkv(self.attn_norm(x) if self.attn_norm is not None else x)
            return self._mlp(self._residual(x, self.o(self._convolve(h, cache, tree_mask)), self.attn_out_norm), x)
        t = x.shape[0]
        hd, nh, nkv = self.head_dim, self.n_heads, self.n_kv
        qkv = self.qkv(self.attn_norm(x) if self.attn_norm is not None else x)
        q, k, v = qkv[:, : nh * hd], qkv[:, nh * hd : (nh + nkv) * hd], qkv[:, (nh + nkv) * hd :]
        if self.qk_full:  # one norm over all heads' queries (and keys), before they are split
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(t, nh, hd).transpose(0, 1)
        k = k.reshape(t, nkv, hd).transpose(0, 1)
        v = v.reshape(t, nkv, hd).transpose(0, 1)
        if self.q_norm is not None and not self.qk_full:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_kind >= 0:
            cos, sin = ropes[self.rope_kind]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        scales = None if positions is None else query_temperature(*self.temperature, positions)
        if scales is not None:
            q = q * scales.to(q.dtype)[None, :, None]
        if keep_q is not None and self.index in keep_q:
            keep_q[self.index] = q
        k_all, v_all, base = cache.write(self.index, k, v)
        k_all, v_all, mask, numbers = self._window(q, k_all, v_all, base, tree_mask, positions)
        if self.score_inputs is not None:
            q, k_all, v_all = self.score_inputs(self, q, k_all, v_all)
        a = attend(q, k_all, v_all, mask, backend, self.attn_scale, self.attn_softcap, self.sinks, numbers)
        return self._mlp(self._residual(x, self.o(a.transpose(0, 1).reshape(t, nh * hd)), self.attn_out_norm), x)

    def _mlp_input(self, x: torch.Tensor, layer_in: torch.Tensor) -> tuple[torch.Tensor, RMSNorm | None]:
        """What the MLP reads, through which norm: the residual stream after attention through the MLP's norm, or in
        a parallel block the layer's input through the attention norm."""
        return (layer_in, self.attn_norm) if self.parallel else (x, self.mlp_norm)

    def _mlp(self, x: torch.Tensor, layer_in: torch.Tensor) -> torch.Tensor:
        """x plus the MLP's (or the experts') output, as PyTorch operations."""
        h, norm = self._mlp_input(x, layer_in)
        h = norm(h) if norm is not None else h
        if self.moe is not None:
            return self._residual(x, self.moe(h), self.mlp_out_norm)
        g, u = self.gate_up(h).chunk(2, dim=-1)
        return self._residual(x, self.down(self._act(g, u)), self.mlp_out_norm)

    def _convolve(self, h: torch.Tensor, cache: KVCache, tree_mask: torch.Tensor | None,
                  taps: torch.Tensor | None = None) -> torch.Tensor:
        """LFM2's short convolution of one sequence's rows, from its input projection h [T, 3 x hidden] (B, C, x):
        C times the depthwise convolution of B * x over each row's last `kernel` tokens along its path
        (`conv_taps`), whose B * x the cache keeps as this layer's state. Elementwise products and sums in a fixed
        order (csrc/core/family.h's conv_row in float32; these PyTorch operations in float64 and on other
        devices, the same arithmetic): a row's bits depend on its own taps alone."""
        state, _, base = cache.layer(self.index)
        if taps is None:
            taps = conv_taps(h.shape[0], cache.length, tree_mask, self.conv.shape[1])
        slots = conv_slots(taps, base, self.index)
        held = slots >= 0
        if h.dtype == state.dtype == self.conv.dtype == torch.float32 and h.device.type == "cpu" \
                and kernels.available():
            return kernels.load().conv_rows(h, state[0], slots, self.conv)
        b, c, xs = h.chunk(3, dim=-1)
        state[0, slots[:, -1].to(state.device)] = (b * xs).to(state.dtype)
        seen = state[0, slots.clamp(min=0).to(state.device)]  # [T, kernel, hidden]
        seen = torch.where(held.to(state.device)[..., None], seen, 0)
        w = self.conv.to(state.dtype)
        acc = w[:, 0] * seen[:, 0]
        for j in range(1, w.shape[1]):
            acc = acc + w[:, j] * seen[:, j]
        return c * acc.to(c.dtype)

    @property
    def quantized(self) -> bool:
        dense = (self.gate_up, self.down)
        mlp = self.moe.quantized if self.moe is not None else all(m.qweight is not None for m in dense)
        return mlp and all(m.qweight is not None for m in (self.qkv, self.o))

    def forward_rows(self, x: torch.Tensor, ropes: Ropes, parts: list[Rows]) -> torch.Tensor:
        """The layer in five kernel calls over the rows of several sequences (x: their rows one
        after the other): a decode step is a few dozen microseconds of Python per layer instead of
        some forty small tensor operations (the norms, SiLU and residual adds are folded into the
        quantized products; RoPE and the cache write are one call). The products take every row at
        once; RoPE, the cache write and attention run per sequence, over its own cache.

        A family's switches that the folded products cannot express (post-norms, GeGLU, residual
        multipliers, whole-projection q/k norms) run as the row operations of csrc/core/family.h
        between the same kernels, as the whole-step call runs them (the same bits); every
        operation stays row-independent, so a token's bits do not depend on the other rows of its
        forward."""
        if self.plain:
            cos, sin = self._rope_table(ropes, x.shape[0])
            qkv = qlinear(x, self.qkv.qweight, self.qkv.bias, norm=self.attn_norm.weight, eps=self.attn_norm.eps)
            a = self._attend_rows(qkv, cos, sin, parts)
            x = qlinear(a, self.o.qweight, residual=x)
            gu = qlinear(x, self.gate_up.qweight, norm=self.mlp_norm.weight, eps=self.mlp_norm.eps,
                         out=self.workspace.take(x.shape[0], self.gate_up.qweight.n))
            return qlinear(gu, self.down.qweight, silu_mul=True, residual=x)
        return self._switched_rows(x, ropes, parts)

    def _switched_rows(self, x: torch.Tensor, ropes: Ropes, parts: list[Rows]) -> torch.Tensor:
        ext = kernels.load()

        qkv = _normed(self.qkv, x, self.attn_norm)
        if self.conv is not None:
            return self._mlp_rows(self._post(x, self._convolve_rows(qkv, parts), self.o, self.attn_out_norm), x)
        if self.qk_full:  # one norm over a row's queries, one over its keys (family.h's rms_row)
            nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            qkv = torch.cat([ext.rms_rows(qkv[:, :nq], self.q_norm.weight, self.q_norm.eps),
                             ext.rms_rows(qkv[:, nq : nq + nk], self.k_norm.weight, self.k_norm.eps),
                             qkv[:, nq + nk :]], 1)
        cos, sin = self._rope_table(ropes, x.shape[0])  # [T, rotary dims]: rope_store rotates those
        a = self._attend_rows(qkv, cos, sin, parts)
        return self._mlp_rows(self._post(x, a, self.o, self.attn_out_norm), x)

    def _convolve_rows(self, h: torch.Tensor, parts: list[Rows]) -> torch.Tensor:
        """`_convolve` per sequence over its own cache (its rows one after the other in h)."""
        outs, off = [], 0
        for p in parts:
            outs.append(self._convolve(h[off : off + p.size], p.cache, p.tree_mask, p.conv_taps(self.conv.shape[1])))
            off += p.size
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _mlp_rows(self, x: torch.Tensor, layer_in: torch.Tensor) -> torch.Tensor:
        """x plus the MLP's (or the experts') output, in the quantized kernels."""
        ext = kernels.load()

        if self.moe is not None:  # (no family has experts in a parallel block or LayerNorms: config.py)
            norm = self.mlp_norm
            y = self.moe.forward_rows(x, None if norm is None else norm.weight, 0.0 if norm is None else norm.eps)
            return self._add(x, y, self.mlp_out_norm)
        h, norm = self._mlp_input(x, layer_in)
        gu = _normed(self.gate_up, h, norm, out=self.workspace.take(x.shape[0], self.gate_up.qweight.n))
        if self.gelu:
            return self._post(x, ext.gelu_mul(gu), self.down, self.mlp_out_norm)
        if self.activation == "silu":
            return self._post(x, gu, self.down, self.mlp_out_norm, silu_mul=True)
        g, u = gu.chunk(2, dim=-1)
        return self._post(x, self._act(g, u), self.down, self.mlp_out_norm)

    def _post(self, x: torch.Tensor, h: torch.Tensor, lin: Linear, norm: RMSNorm | None, **kw: object
              ) -> torch.Tensor:
        """x plus the product h . W (+ bias) through the sublayer's post-norm and the residual
        multiplier (family.h's residual_row), or, with neither, added by the product itself: what
        the whole-step call does (step.cpp, post_phase)."""
        if norm is None and self.residual_scale == 1.0:
            return qlinear(h, lin.qweight, lin.bias, residual=x, **kw)
        return self._add(x, qlinear(h, lin.qweight, lin.bias, **kw), norm)

    def _add(self, x: torch.Tensor, y: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """x + residual_scale * post_norm(y), row by row (family.h's residual_row)."""
        if norm is None and self.residual_scale == 1.0:
            return x + y
        weight, eps = (None, 1e-6) if norm is None else (norm.weight, norm.eps)
        return kernels.load().post_residual(x, y, weight, eps, self.residual_scale)

    def _rope_table(self, ropes: Ropes, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) rope_store rotates this layer's rows with: its rope kind's, or where it has
        none (a NoPE layer; `ropes` empty: rotated already), angle zero, which rope_store's
        arithmetic applies exactly as the identity (the whole-step call takes the same table)."""
        if self.rope_kind >= 0 and ropes:
            return ropes[self.rope_kind]
        return torch.ones(rows, self.head_dim), torch.zeros(rows, self.head_dim)

    def _attend_rows(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[Rows]
                     ) -> torch.Tensor:
        """RoPE, the cache write and row-wise attention, per sequence; the attention's rows."""
        ext = kernels.load()
        per_head = self.q_norm is not None and not self.qk_full
        q_norm = self.q_norm.weight if per_head else None
        k_norm = self.k_norm.weight if per_head else None
        eps = self.q_norm.eps if per_head else 1e-6
        outs = []
        off = 0
        for p in parts:
            t, cache = p.size, p.cache
            k_layer, v_layer, base = cache.layer(self.index)
            start = cache.length
            rows = slice(off, off + t)
            q = ext.rope_store(qkv[rows], cos[rows], sin[rows], self.n_heads, q_norm, k_norm, eps,
                               k_layer, v_layer, start - base, self.k_offset)
            scales = p.temperature(*self.temperature) if self.temperature[0] else None
            if scales is not None:  # the whole-step call leaves such rows to these kernels (Transformer._takes_step)
                q = q * scales[None, :, None]
            if p.keep_q is not None and self.index in p.keep_q:
                p.keep_q[self.index] = q
            end = start + cache.pending
            first, mask = p.window(end, self.window) if self.window else (0, p.tree_mask)
            self._held(first, base)
            k, v = k_layer[:, first - base:end - base], v_layer[:, first - base:end - base]
            # the score scale and cap in the kernel, as the whole-step call has them
            ends = list_ends(end, p.tree_mask, t) if self.window else None
            a = kernels.attend(q, k, v, mask, self.attn_scale, self.sinks, self.attn_softcap, ends, first)
            outs.append(a.transpose(0, 1).reshape(t, -1))
            off += t
        return outs[0] if len(outs) == 1 else torch.cat(outs)
