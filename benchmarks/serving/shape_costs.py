"""What a forward costs from the model's shape, with a device's measured constants (the cost model's prices for a
pair no device has run: ``hybrid_h200.py``).

``Shape`` is a decoder as its config.json gives it (attention and Gated DeltaNet layers): the weights a forward
reads, the key and value bytes per column of its attention layers, a row's recurrent state (per linear-attention
layer a recurrent state, ``value heads x key dim x value dim`` in fp32 as HF's gated delta rule keeps it, and a conv
state, ``kernel x conv channels`` in the model's dtype). A captured forward of k rows (its rows bucket) x g tokens
attending ``span`` columns costs (``read_seconds``)

    t = L (o + q k) + (W + k span KV + 2 k S) / B + k (2 g P + 2 V H) / R

L layers, W the weights it reads, S a row's state read and written once, P the body's parameters, V H the head's;
the constants (``fit``) are the first H200 run's: ``B`` from its two fused one-token steps (the 1.5B's and the
32B's, with a shared per-layer overhead), ``o``, ``q`` and ``R`` from three points of the 32B's captured grid on HF's
forward (1 x 1, 8 x 1, 8 x 64 tokens), the grid's other points then predicted (``residuals``). ``ShapeCosts`` prices
a pair so for the replay (``replay.Costs``), a checkpoint or a restore copying each row's state once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from r2r_hf.core.fast.static_reads import BUCKETS

BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Shape:
    """A decoder's shape, as its config.json gives it; ``linear`` of its ``layers`` are Gated DeltaNet layers (the
    rest full attention). ``gated``: its attention's query projection also makes the output gate (Qwen3.5's
    ``attn_output_gate``); ``bias``: its q/k/v projections have biases (Qwen2.5)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    linear: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 0
    gated: bool = False
    bias: bool = False
    qk_norm: bool = False
    source: dict = field(default_factory=dict, compare=False)

    @property
    def attention(self) -> int:
        return self.layers - self.linear

    @property
    def conv_channels(self) -> int:
        """Channels of a linear-attention layer's short convolution: its queries, keys and values."""
        return 2 * self.linear_k_heads * self.linear_k_dim + self.linear_v_heads * self.linear_v_dim

    def attention_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        weights = self.hidden * q * (2 if self.gated else 1) + 2 * self.hidden * kv + q * self.hidden
        return weights + (q + 2 * kv if self.bias else 0) + (2 * self.head_dim if self.qk_norm else 0)

    def linear_params(self) -> int:
        """A Gated DeltaNet layer's: qkv, z, b and a projections, the depthwise conv, dt bias, A, the gated norm and
        the output projection (HF's ``Qwen3_5GatedDeltaNet``)."""
        value = self.linear_v_heads * self.linear_v_dim
        return (self.hidden * (self.conv_channels + value + 2 * self.linear_v_heads)
                + self.conv_channels * self.conv_kernel + 2 * self.linear_v_heads + self.linear_v_dim
                + value * self.hidden)

    def body_params(self) -> int:
        """Every parameter but the embedding table and the output head."""
        per_layer = 3 * self.hidden * self.intermediate + 2 * self.hidden  # the MLP and the layer's two norms
        return (self.layers * per_layer + self.attention * self.attention_params()
                + self.linear * self.linear_params() + self.hidden)

    def params(self) -> int:
        return self.body_params() + self.vocab * self.hidden * (1 if self.tied else 2)

    def weight_bytes(self) -> int:
        """What one forward reads of the weights (bf16): the body and the head (a forward reads only its tokens'
        rows of the embedding table; a tied head is that table)."""
        return BF16 * (self.body_params() + self.vocab * self.hidden)

    def kv_bytes(self) -> int:
        """Key and value bytes per column per row, over the full-attention layers only."""
        return self.attention * 2 * self.kv_heads * self.head_dim * BF16

    def state_bytes(self) -> int:
        """One row's recurrent state: per linear-attention layer, the recurrent state (fp32) and the conv state (the
        model's dtype, ``kernel`` columns: ``slot_state.SlotStates.update_conv`` keeps that many)."""
        recurrent = self.linear_v_heads * self.linear_k_dim * self.linear_v_dim * FP32
        return self.linear * (recurrent + self.conv_channels * self.conv_kernel * BF16)


SHAPES = {
    "qwen3.5-0.8b": Shape(
        "Qwen3.5-0.8B", hidden=1024, intermediate=3584, layers=24, heads=8, kv_heads=2, head_dim=256, vocab=248320,
        tied=True, linear=18, linear_k_heads=16, linear_v_heads=16, linear_k_dim=128, linear_v_dim=128,
        conv_kernel=4, gated=True, qk_norm=True,
        source={"hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, tied":
                "github.com/THUDM/slime scripts/models/qwen3.5-0.8B.sh (commit f8879db: --hidden-size 1024, "
                "--ffn-hidden-size 3584, --num-layers 24, --num-attention-heads 8, --num-query-groups 2, "
                "--kv-channels 256, --vocab-size 248320, embeddings tied); apxml.com/models/qwen35-08b (the same, "
                "'6 x (3 x DeltaNet -> FFN -> 1 x Attention -> FFN)')",
                "linear heads and dims, conv kernel, fp32 state":
                "not read from Qwen's own config.json here: two third-party copies of it in public code "
                "(test fixtures quoting Qwen3.5-0.8B's text_config: linear_num_key_heads 16, "
                "linear_num_value_heads 16, linear_key/value_head_dim 128, linear_conv_kernel_dim 4, "
                "mamba_ssm_dtype float32) agree"}),
    "qwen3.5-27b": Shape(
        "Qwen3.5-27B", hidden=5120, intermediate=17408, layers=64, heads=24, kv_heads=4, head_dim=256, vocab=248320,
        tied=False, linear=48, linear_k_heads=16, linear_v_heads=48, linear_k_dim=128, linear_v_dim=128,
        conv_kernel=4, gated=True, qk_norm=True,
        source={"hidden, intermediate, layers, heads, kv_heads, head_dim, vocab, untied":
                "github.com/THUDM/slime scripts/models/qwen3.5-27B.sh (--hidden-size 5120, --ffn-hidden-size 17408, "
                "--num-layers 64, --num-attention-heads 24, --num-query-groups 4, --kv-channels 256, "
                "--vocab-size 248320, --untie-embeddings-and-output-weights); the TevunahAi/Qwen3.5-27B-GPTQ card "
                "(base Qwen/Qwen3.5-27B: 48 Gated DeltaNet + 16 full-attention layers, 24 Q / 4 KV heads, head_dim "
                "256, intermediate 17,408, hidden 5,120)",
                "linear heads and dims, conv kernel, fp32 state":
                "Qwen3.6-27B's (the same qwen3_5 architecture and every dimension above): its model card (Gated "
                "DeltaNet: 48 V heads, 16 QK heads, head dimension 128; mirrored at "
                "shilu.ai/articles/qwen-hf/qwen-qwen3.6-27b) and its config.json at revision 6a9e13bd as quoted in "
                "public code (linear_num_key_heads 16, linear_num_value_heads 48, linear_conv_kernel_dim 4, "
                "mamba_ssm_dtype float32); Modular MAX's Qwen3_5Config defaults the same 16 / 48. Not confirmed on "
                "Qwen3.5-27B's own config.json"}),
    # the first device run's random-weight pair (``benchmarks/synthetic.CONFIGS``): what the constants are fitted on
    "qwen2.5-1.5b": Shape("Qwen2.5-1.5B", hidden=1536, intermediate=8960, layers=28, heads=12, kv_heads=2,
                          head_dim=128, vocab=151936, tied=True, bias=True),
    "qwen2.5-32b": Shape("Qwen2.5-32B", hidden=5120, intermediate=27648, layers=64, heads=40, kv_heads=8,
                         head_dim=128, vocab=152064, tied=False, bias=True),
}


@dataclass(frozen=True)
class Constants:
    """The H200's constants (``fit``): bandwidth achieved (bytes/s), per-layer overhead of a captured forward on
    HF's forward (s) and per row (s), compute per token-parameter (s: a token through P parameters costs 2 P / R)."""

    bandwidth: float
    layer: float
    row: float
    flop: float  # seconds per FLOP (1 / the compute rate achieved)
    fused_layer: float  # the fused reads' per-layer overhead (reported; hybrids are not fused)

    def as_dict(self) -> dict:
        return {"bandwidth_TB_per_s": self.bandwidth / 1e12, "layer_overhead_us": self.layer * 1e6,
                "row_overhead_us_per_layer": self.row * 1e6, "compute_TFLOP_per_s": 1e-12 / self.flop,
                "fused_layer_overhead_us": self.fused_layer * 1e6}


def read_seconds(shape: Shape, c: Constants, rows: int, tokens: int, span: int, state: bool = True) -> float:
    """One captured forward of ``shape`` on HF's forward (see the module docstring)."""
    moved = shape.weight_bytes() + rows * span * shape.kv_bytes() + (2 * rows * shape.state_bytes() if state else 0)
    compute = 2 * c.flop * rows * (tokens * shape.body_params() + shape.vocab * shape.hidden)
    return shape.layers * (c.layer + c.row * rows) + moved / c.bandwidth + compute


GRID_SPAN = 256  # the columns the first run's component reads attended (``fused.MIN_ATTENDED``; prompt 64)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """``a x = b`` for a small square system (Gauss-Jordan with pivoting)."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for i in range(n):
        p = max(range(i, n), key=lambda r: abs(m[r][i]))
        m[i], m[p] = m[p], m[i]
        for r in range(n):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [x - f * y for x, y in zip(m[r], m[i])]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit(first: dict, fused: dict) -> Constants:
    """The constants from the first device run (``gpu_check.json``, ``gpu_check_rerun.json``; see the docstring)."""
    small, large = SHAPES["qwen2.5-1.5b"], SHAPES["qwen2.5-32b"]
    t_slm = first["components_ms"]["1"]["captured"]["t_slm"] / 1e3  # the fused SLM's captured step, 1 row
    t_llm = fused["llm_fused_ms"]["1"]["ms_per_token"] / 1e3  # the fused 32B alone, batch 1
    layer_f, inverse_b = _solve([[small.layers, small.weight_bytes()], [large.layers, large.weight_bytes()]],
                                [t_slm, t_llm])
    bandwidth = 1 / inverse_b
    grid = {k: {int(g): t / 1e3 for g, t in first["components_ms"][str(k)]["captured"]["t_llm"].items()}
            for k in (1, 8)}
    rows, equations = [], []
    for k, g in ((1, 1), (8, 1), (8, 64)):  # unknowns: per-layer, per row per layer, seconds per FLOP
        fixed = (large.weight_bytes() + k * GRID_SPAN * large.kv_bytes()) / bandwidth
        rows.append([large.layers, large.layers * k, 2 * k * (g * large.body_params() + large.vocab * large.hidden)])
        equations.append(grid[k][g] - fixed)
    layer, row, flop = _solve(rows, equations)
    return Constants(bandwidth, layer, row, flop, layer_f)


def residuals(first: dict, c: Constants) -> dict[str, float]:
    """Every point of the 32B's captured grid (1 and 8 rows x 1-64 tokens): predicted over measured."""
    large, out = SHAPES["qwen2.5-32b"], {}
    for k in (1, 8):
        for g, ms in first["components_ms"][str(k)]["captured"]["t_llm"].items():
            out[f"{k}x{g}"] = read_seconds(large, c, k, int(g), GRID_SPAN, state=False) / (ms / 1e3)
    return out


@dataclass(frozen=True)
class ShapeCosts:
    """The replay's costs (``replay.Costs``) of a pair from its shapes: each forward by ``read_seconds``, the router
    ``a + b k``, the host per step and per drafted step; ``recurrent``, ``widths``, ``split``, ``rewind`` as
    ``cost_model.Costs``; ``state``: False prices the recurrent state's traffic (reads, writes, copies) at zero;
    ``llm_free``: the LLM's reads cost nothing (the LLM alone on the engine reads with the model in the SLM's
    place, ``gpu/serve.ALONE_OPTIONS``)."""

    slm: Shape
    llm: Shape
    constants: Constants
    router: tuple[float, float]
    step: float
    plan: float = 1e-4
    capacity: int = 2048
    recurrent: tuple[str, ...] = ("slm", "llm")
    widths: tuple[int, ...] = BUCKETS
    split: bool = True
    rewind: bool = True
    state: bool = True
    llm_free: bool = False
    name: str = ""
    packed: bool = False  # (a hybrid's reads are HF's forward: never fused, so never packed)
    captured_shapes: bool = True
    gathered_rows: bool = True

    def forward(self, role: str, rows: int, tokens: int, span: int = 0) -> float:
        if role == "llm" and self.llm_free:
            return 0.0
        shape = self.slm if role == "slm" else self.llm
        return read_seconds(shape, self.constants, rows, tokens, span, self.state and role in self.recurrent)

    def state_copy(self, role: str, rows: int) -> float:
        """A checkpoint or a restore: each row's state read and written once."""
        if not self.state or (role == "llm" and self.llm_free):
            return 0.0
        shape = self.slm if role == "slm" else self.llm
        return 2 * rows * shape.state_bytes() / self.constants.bandwidth
