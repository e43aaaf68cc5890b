"""A decoder-only transformer whose norms, linears, activations and residual adds are fusible ops.

Two styles: "llama" (RMSNorm, no biases, SwiGLU, rotary positions) and "gpt2" (LayerNorm, biases,
tanh GELU, learned positions). Each layer is three fuser groups with attention between them:

    qkv = attn_in(x)          # Sequential(norm, Linear(d, 3d))
    a   = attention(qkv)      # torch's scaled_dot_product_attention, causal (flash on the GPU)
    x   = attn_out(a, x)      # Sequential(Linear(d, d), AddExtraInput): + the residual x
    x   = mlp(x, x)           # Sequential(norm, Linear, activation, Linear, AddExtraInput)

The model takes its op library as an argument and uses only names and keywords that
TransformerEngine's te.ops has, so `GPT(config, ops=transformer_engine.pytorch.ops)` builds the
same model on te.ops, and `GPT(config, ops=torch_ops)` (torch_ops.py) on plain torch.nn modules.
"""

import dataclasses
import math
import types

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 8192
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    style: str = "llama"  # "llama" or "gpt2"
    d_ff: int = 0  # 0: 4 d_model (gpt2), or 8/3 d_model rounded up to 64 (llama, SwiGLU)
    eps: float = 1e-5
    rope_base: float = 10000.0

    @property
    def ffn(self):
        if self.d_ff:
            return self.d_ff
        if self.style == "gpt2":
            return 4 * self.d_model
        return -(-8 * self.d_model // 3 // 64) * 64


# Sizes named by the benchmark and the training script (vocab: the BPE's of gpt_data.py).
CONFIGS = {
    "tiny": GPTConfig(vocab_size=512, seq_len=64, n_layer=2, n_head=2, d_model=64),
    "small": GPTConfig(vocab_size=16384, seq_len=256, n_layer=6, n_head=6, d_model=384),
    "gpt_small": GPTConfig(vocab_size=16384, seq_len=1024, n_layer=12, n_head=12, d_model=768),
    "gpt_medium": GPTConfig(vocab_size=16384, seq_len=2048, n_layer=20, n_head=16, d_model=2048),
}


def _norm(ops, config, device, dtype):
    norm = ops.RMSNorm if config.style == "llama" else ops.LayerNorm
    return norm(config.d_model, eps=config.eps, device=device, dtype=dtype)


class Attention(torch.nn.Module):
    """Causal self-attention over a packed [batch, seq, 3 d] projection; rotary positions for the
    llama style. Not a fusible op: it runs between fuser groups. `split_qkv_rotary` (qkv,
    num_heads, cos, sin) -> (q, k, v) splits the projection and rotates q and k."""

    def __init__(self, config, split_qkv_rotary):
        super().__init__()
        self.split_qkv_rotary = split_qkv_rotary
        self.n_head, self.rotary = config.n_head, config.style == "llama"
        self.head_dim, self.rope_base, self.seq_len = (
            config.d_model // config.n_head,
            config.rope_base,
            config.seq_len,
        )
        # Not saved (recomputed on any device, identical everywhere); reset_buffers() fills them.
        self.register_buffer("cos", torch.empty(self.seq_len, self.head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(self.seq_len, self.head_dim // 2), persistent=False)
        self.reset_buffers()

    def reset_buffers(self):
        """The rotary tables, on the buffers' device (after to_empty(), say)."""
        if self.cos.is_meta:
            return
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=self.cos.device)
        inv_freq = self.rope_base ** (-half / self.head_dim)
        positions = torch.arange(self.seq_len, dtype=torch.float64, device=self.cos.device)
        angles = torch.outer(positions, inv_freq)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, qkv):
        if self.rotary:
            q, k, v = self.split_qkv_rotary(qkv, self.n_head, self.cos, self.sin)
        else:
            q, k, v = split_heads(qkv, self.n_head)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.transpose(1, 2).reshape(qkv.shape[0], qkv.shape[1], -1)


def split_heads(qkv, num_heads):
    """[batch, seq, 3 heads head_dim] -> q, k, v [batch, heads, seq, head_dim] (views)."""
    batch, seq, _ = qkv.shape
    return qkv.view(batch, seq, 3, num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)


def torch_split_qkv_rotary(qkv, num_heads, cos, sin):
    """split_heads, then q and k rotated: pair (2i, 2i + 1) of a head at position s by the angle
    with cosine cos[s, i] and sine sin[s, i], in PyTorch ops (fusible.functional.split_qkv_rotary
    is the same math in one kernel each way)."""
    q, k, v = split_heads(qkv, num_heads)
    seq = qkv.shape[1]
    cos, sin = cos[:seq].to(qkv.dtype), sin[:seq].to(qkv.dtype)

    def rotate(t):
        even, odd = t[..., 0::2], t[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).flatten(-2)

    return rotate(q), rotate(k), v


def torch_cross_entropy(logits, targets):
    """The mean cross-entropy of logits [batch, seq, vocab] in float32, as PyTorch users write it
    (fusible.functional.cross_entropy: the same without the float32 copy of the logits)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


# The functions between fuser groups in PyTorch ops; GPT(functional=...) replaces them (e.g. with
# fusible.functional, which has the same names).
torch_functional = types.SimpleNamespace(
    split_qkv_rotary=torch_split_qkv_rotary, cross_entropy=torch_cross_entropy
)


class Block(torch.nn.Module):
    def __init__(self, config, ops, device, dtype, functional):
        super().__init__()
        d, bias = config.d_model, config.style == "gpt2"
        kw = dict(device=device, dtype=dtype)
        self.attn_in = ops.Sequential(
            _norm(ops, config, device, dtype), ops.Linear(d, 3 * d, bias=bias, **kw)
        )
        self.attention = Attention(config, functional.split_qkv_rotary)
        self.attn_out = ops.Sequential(ops.Linear(d, d, bias=bias, **kw), ops.AddExtraInput())
        if config.style == "llama":
            up, act = ops.Linear(d, 2 * config.ffn, bias=False, **kw), ops.SwiGLU()
        else:
            up, act = ops.Linear(d, config.ffn, bias=True, **kw), ops.GELU()
        self.mlp = ops.Sequential(
            _norm(ops, config, device, dtype),
            up,
            act,
            ops.Linear(config.ffn, d, bias=bias, **kw),
            ops.AddExtraInput(),
        )

    def forward(self, x):
        x = self.attn_out(self.attention(self.attn_in(x)), x)
        return self.mlp(x, x)


class GPT(torch.nn.Module):
    """tokens [batch, seq] -> logits [batch, seq, vocab]. `functional`: the functions between
    fuser groups, split_qkv_rotary and cross_entropy (default torch_functional, PyTorch ops;
    fusible.functional has fused ones of the same names and math)."""

    def __init__(self, config, ops, device=None, dtype=None, functional=None):
        super().__init__()
        self.config = config
        functional = functional or torch_functional
        self.cross_entropy = functional.cross_entropy
        kw = dict(device=device, dtype=dtype)
        self.embed = torch.nn.Embedding(config.vocab_size, config.d_model, **kw)
        self.positions = (
            torch.nn.Embedding(config.seq_len, config.d_model, **kw)
            if config.style == "gpt2"
            else None
        )
        self.blocks = torch.nn.ModuleList(
            Block(config, ops, device, dtype, functional) for _ in range(config.n_layer)
        )
        self.head = ops.Sequential(
            _norm(ops, config, device, dtype),
            ops.Linear(config.d_model, config.vocab_size, bias=False, **kw),
        )

    def forward(self, tokens):
        x = self.embed(tokens)
        if self.positions is not None:
            x = x + self.positions.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def reset_parameters(self):
        """GPT-2's initialization: normal(0, 0.02) for embeddings and linear weights (the
        projections into the residual stream scaled by 1/sqrt(2 n_layer)), zero biases, unit norm
        scales; and the rotary tables. Call it after materializing a model built on `meta`."""
        std = 0.02
        residual_std = std / math.sqrt(2 * self.config.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0 if _is_norm_weight(self, name) else 0.0)
                else:
                    p.normal_(0.0, residual_std if _is_output_projection(name) else std)
        for block in self.blocks:
            block.attention.reset_buffers()

    def loss(self, tokens, targets):
        return self.cross_entropy(self(tokens), targets)


def _is_norm_weight(model, name):
    module = model.get_submodule(name.rsplit(".", 1)[0])
    return "norm" in type(module).__name__.lower() and name.endswith("weight")


def _is_output_projection(name):
    # attn_out.0 (attention's output linear) and the MLP's down projection (mlp.3).
    return ".attn_out.0." in name or ".mlp.3." in name


def parameter_count(model):
    return sum(p.numel() for p in model.parameters())
