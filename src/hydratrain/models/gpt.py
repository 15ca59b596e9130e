"""A decoder-only transformer: RMSNorm, rotary position embeddings, SwiGLU MLP, optional tied embeddings.

Components and where they come from:
- RMSNorm: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization" (``torch.nn.RMSNorm``).
- Rotary embeddings (RoPE): Su et al. 2021, "RoFormer", applied to query and key in the rotate-half layout.
- SwiGLU feed-forward: Shazeer 2020, "GLU Variants Improve Transformer"; hidden width 8/3 * d_model as in LLaMA.
- Grouped-query attention (``n_kv_head < n_head``): Ainslie et al. 2023.
- Initialisation: normal(0, init_std), residual output projections scaled by 1/sqrt(2 * n_layer) (GPT-2).

Shapes: token ids ``(B, T)`` int64 -> logits ``(B, T, vocab_size)`` in the compute dtype.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from hydratrain.errors import ConfigError


@dataclass
class GPTConfig:
    """The decoder's size and numerics; the keyword arguments of :class:`GPT` (``conf/model/gpt_*.yaml``,
    ``llama_*.yaml``). Checked on construction: :class:`~hydratrain.errors.ConfigError` naming ``model.<key>``."""

    vocab_size: int = 256  # tokens; in a config, null = the data's (256 bytes, or the tokenizer's padded to 64)
    max_seq_len: int = 256  # longest sequence the rotary table covers, tokens
    d_model: int = 128  # residual width
    n_layer: int = 4  # decoder blocks
    n_head: int = 4  # query heads; head_dim = d_model // n_head
    n_kv_head: Optional[int] = None  # key/value heads for grouped-query attention; null = n_head
    d_ff: Optional[int] = None  # SwiGLU hidden width; null = 8/3 * d_model rounded up to ff_multiple_of
    ff_multiple_of: int = 64  # rounds the width d_ff=null derives; another value next to d_ff is a config error
    tie_embeddings: bool = True  # share the token embedding with the output projection
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for f in fields(self):
            value, kind = getattr(self, f.name), _KINDS[f.name]
            if value is None and f.name in ("n_kv_head", "d_ff"):
                continue
            if kind is bool:
                if not isinstance(value, bool):
                    raise ConfigError(f"model.{f.name}", value, "must be true or false")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise ConfigError(f"model.{f.name}", value, f"must be {'an integer' if kind is int else 'a number'}")
            if not math.isfinite(value) or value <= 0:
                raise ConfigError(f"model.{f.name}", value, "must be finite and > 0")
            setattr(self, f.name, kind(value))
        if self.vocab_size < 2:
            raise ConfigError("model.vocab_size", self.vocab_size, "must be >= 2 (one token has nothing to predict)")
        if self.d_model % self.n_head:
            raise ConfigError("model.n_head", self.n_head, f"must divide model.d_model={self.d_model}")
        if (self.d_model // self.n_head) % 2:
            raise ConfigError("model.n_head", self.n_head, "head_dim = d_model // n_head must be even for rotary "
                              "embeddings")
        if self.d_ff and self.ff_multiple_of != 64:  # it would be ignored, yet recorded as an hparam
            raise ConfigError("model.ff_multiple_of", self.ff_multiple_of, f"unused with model.d_ff={self.d_ff} (it "
                              "rounds only the width that d_ff=null derives); drop one of the two")
        if self.n_head % self.kv_heads:
            raise ConfigError("model.n_kv_head", self.n_kv_head, f"must divide model.n_head={self.n_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def ff_dim(self) -> int:
        if self.d_ff:
            return self.d_ff
        hidden = int(8 * self.d_model / 3)
        return self.ff_multiple_of * math.ceil(hidden / self.ff_multiple_of)


_KINDS = {"vocab_size": int, "max_seq_len": int, "d_model": int, "n_layer": int, "n_head": int, "n_kv_head": int,
          "d_ff": int, "ff_multiple_of": int, "tie_embeddings": bool, "rope_theta": float, "norm_eps": float,
          "init_std": float}


def rotary_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, each ``(max_seq_len, head_dim)`` float32, for the rotate-half RoPE layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``(B, H, T, head_dim)`` by position; ``cos``/``sin`` are ``(T, head_dim)``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal multi-head (or grouped-query) self-attention with RoPE, via ``F.scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        gqa = self.n_kv_head != self.n_head
        if gqa and expand_kv_heads(q):
            k, v = (t.repeat_interleave(self.n_head // self.n_kv_head, dim=1) for t in (k, v))
            gqa = False
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def expand_kv_heads(q: torch.Tensor) -> bool:
    """Whether grouped-query attention should repeat k/v to every query head before SDPA instead of passing
    ``enable_gqa``: on CUDA in float32, where the flash kernel (fp16/bf16 only) is out and the memory-efficient one
    does not take ``enable_gqa``, so SDPA would fall back to the math kernel and materialise the full (T, T) scores."""
    return q.is_cuda and q.dtype == torch.float32


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: ``(B, T, d_model) -> (B, T, d_model)`` through ``ff_dim`` hidden units."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ff_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ff_dim, bias=False)
        self.w2 = nn.Linear(cfg.ff_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``. The unit FSDP and AC wrap."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """The decoder. ``forward(idx (B, T) int64) -> logits (B, T, vocab_size)``; ``T <= max_seq_len``.

    ``GPT(GPTConfig(...))`` or ``GPT(**keywords of GPTConfig)`` (how ``conf/model/*.yaml`` builds it, ``_target_:
    hydratrain.models.GPT``). Build on ``torch.device("meta")`` and call :meth:`init_weights` after ``to_empty`` to
    materialise lazily; hydratrain initialises it through :meth:`init_param_` (one generator per parameter, so the
    weights do not depend on how the model is built or sharded).

    Raises :class:`~hydratrain.errors.ConfigError` naming ``model.<key>`` for a keyword :class:`GPTConfig` does
    not take or a value it refuses.
    """

    #: constructor keywords that change what weights of the same shapes compute: a checkpoint or weights file
    #: written with other values is refused (:meth:`architecture`)
    ARCHITECTURE_KEYS = ("d_model", "n_layer", "n_head", "n_kv_head", "d_ff", "tie_embeddings", "rope_theta",
                         "norm_eps")

    def __init__(self, cfg: Optional[GPTConfig] = None, **kwargs):
        super().__init__()
        if cfg is None:
            unknown = sorted(set(kwargs) - {f.name for f in fields(GPTConfig)})
            if unknown:
                raise ConfigError(f"model.{unknown[0]}", kwargs[unknown[0]], "not a keyword of hydratrain.models.GPT; "
                                  f"allowed: {', '.join(f.name for f in fields(GPTConfig))}")
            cfg = GPTConfig(**{k: v for k, v in kwargs.items() if v is not None or k in ("n_kv_head", "d_ff")})
        elif kwargs:
            raise TypeError("GPT takes a GPTConfig or its keywords, not both")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if not self.tok_emb.weight.is_meta:
            self.init_weights()

    def init_param_(self, name: str, tensor: torch.Tensor, generator: Optional[torch.Generator] = None) -> None:
        """Fill ``tensor`` (the full shape of parameter ``name``) with its initial values, drawing from ``generator``
        (on ``tensor``'s device): RMSNorm gains 1, residual output projections normal(0, init_std / sqrt(2 *
        n_layer)) (GPT-2), everything else normal(0, init_std)."""
        std = self.cfg.init_std
        with torch.no_grad():
            if tensor.ndim == 1:
                tensor.fill_(1.0)
            elif name.endswith(("attn.wo.weight", "mlp.w2.weight")):
                tensor.normal_(0.0, std / math.sqrt(2 * self.cfg.n_layer), generator=generator)
            else:
                tensor.normal_(0.0, std, generator=generator)

    @torch.no_grad()
    def init_weights(self, generator_for=None) -> None:
        """(Re)initialise every parameter (plain tensors) and the rotary tables in place. ``generator_for(name)``
        gives each parameter its own ``torch.Generator``; None draws from the global RNG."""
        for name, p in self.named_parameters():
            self.init_param_(name, p, generator_for(name) if generator_for else None)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Recompute the rotary tables in place on their device (after ``to_empty`` they hold garbage)."""
        cos, sin = rotary_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than model.max_seq_len={self.cfg.max_seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.lm_head(self.norm(x))

    @classmethod
    def architecture(cls, kwargs: dict) -> dict:
        """``{key: effective value}`` of :data:`ARCHITECTURE_KEYS` for constructor keywords ``kwargs`` (a saved
        config's model node; absent keys take :class:`GPTConfig`'s defaults): ``n_kv_head`` null is ``n_head``,
        ``d_ff`` is the width the model builds (null derives it from ``d_model`` and ``ff_multiple_of``), so naming
        the width a preset derives anyway is no difference."""
        known = {f.name: f.default for f in fields(GPTConfig)}
        full = {**known, **{k: v for k, v in kwargs.items() if k in known and (v is not None or k == "d_ff")}}
        out = {k: full[k] for k in cls.ARCHITECTURE_KEYS}
        out["n_kv_head"] = full["n_kv_head"] or full["n_head"]
        if not full["d_ff"] and isinstance(full["d_model"], int):
            multiple = full["ff_multiple_of"] or 64
            out["d_ff"] = multiple * math.ceil(int(8 * full["d_model"] / 3) / multiple)
        return out

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameter count (tied weights counted once); ``exclude_embedding`` drops the lookup-only embedding."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.cfg.tie_embeddings:
            n -= self.tok_emb.weight.numel()
        return n

    @classmethod
    def memory_plan(cls, setup):
        """The memory planner's hook (:mod:`hydratrain.footprint`): the :class:`~hydratrain.footprint.Plan` of
        ``setup`` (a :class:`~hydratrain.footprint.Setup`) by this class's own moment-by-moment model
        (:mod:`hydratrain.models.gpt_memory`); None for a subclass, whose forward that model may not describe (the
        planner then simulates the whole model)."""
        if cls is not GPT:
            return None
        from hydratrain.models.gpt_memory import predict  # (the planner's hook: gpt_memory builds GPT's Blocks)

        return predict(setup)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6*N + 12*L*H*Q*T (PaLM, Chowdhery et al. 2022, appendix B)."""
        c = self.cfg
        return 6 * self.num_params(exclude_embedding=True) + 12 * c.n_layer * c.n_head * c.head_dim * seq_len
