"""The layers of hydratrain's GPT (:mod:`hydratrain.models.gpt`): its config, rotary embeddings, grouped-query
attention, the SwiGLU feed-forward and the decoder block. Kept apart from the model so that its memory model
(:mod:`hydratrain.models.gpt_memory`), which builds blocks, and the model, which uses that memory model, import it
without importing each other."""
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
