"""GPT-2: learned absolute positions, pre-LayerNorm blocks, tanh-approximated GELU, tied output.

Hugging Face stores GPT-2's projections as ``Conv1D`` weights ``[in, out]``; they are transposed
to ``nn.Linear``'s ``[out, in]`` on load. ``c_attn`` is already a fused Q/K/V projection.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.engine.attention import Attention, AttentionMetadata
from pagedkv.engine.models.layers import check_all_loaded, copy_weight, get_activation

logger = logging.getLogger(__name__)

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# causal-mask buffers that old checkpoints carry
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int):
        super().__init__()
        self.num_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        scale = self.head_dim**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn = Attention(self.num_heads, self.head_dim, scale)

    def forward(self, x, kv_cache, meta) -> torch.Tensor:
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, meta))


class GPT2MLP(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.c_proj = nn.Linear(inner, cfg.n_embd)
        self.act = get_activation(cfg.activation_function)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = GPT2Attention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x, kv_cache, meta) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, meta)
        return x + self.mlp(self.ln_2(x))


class GPT2LMHeadModel(nn.Module):
    """GPT-2 causal LM over a packed batch with a paged KV cache (same interface as Llama)."""

    def __init__(self, hf_config: Any):
        super().__init__()
        cfg = hf_config
        if getattr(cfg, "add_cross_attention", False):
            raise ValueError("GPT-2 with cross-attention (an encoder-decoder) is not supported")
        self.config = cfg
        self.num_layers = cfg.n_layer
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = (
            None if self.tie_word_embeddings else nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches, strict=True):
            x = block(x, kv_cache, meta)
        return self.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        weight = self.wte.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        return logits.float() if float32 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (``transformer.h.0.attn.c_attn.weight`` or the
        original unprefixed ``h.0.attn.c_attn.weight``), transposing Conv1D weights."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("transformer.")
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            if name not in params:
                logger.warning("ignoring checkpoint tensor %r: no such weight in the model", name)
                continue
            if name.endswith(_CONV1D):
                tensor = tensor.t()
            copy_weight(params[name], tensor, name)
            loaded.add(name)
        check_all_loaded(self, loaded)
