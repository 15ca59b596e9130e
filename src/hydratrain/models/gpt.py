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
from dataclasses import fields
from typing import Optional

import torch
from torch import nn

from hydratrain.errors import ConfigError
from hydratrain.models.gpt_layers import (  # noqa: F401 (their home was here: hydratrain.models.gpt.Block etc.)
    Attention,
    Block,
    GPTConfig,
    SwiGLU,
    apply_rotary,
    expand_kv_heads,
    rotary_tables,
)
from hydratrain.models.gpt_memory import predict


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
    rope_cos: torch.Tensor  # the rotary tables: buffers (register_buffer), not parameters
    rope_sin: torch.Tensor

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
        return predict(setup)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, 6*N + 12*L*H*Q*T (PaLM, Chowdhery et al. 2022, appendix B)."""
        c = self.cfg
        return 6 * self.num_params(exclude_embedding=True) + 12 * c.n_layer * c.n_head * c.head_dim * seq_len
