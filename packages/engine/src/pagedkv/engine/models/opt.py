"""OPT (the family the PagedAttention paper measured).

Learned absolute positions stored with an offset of 2, LayerNorm before (``do_layer_norm_before``,
most sizes) or after (OPT-350m) each block, ReLU MLP, and for OPT-350m a narrower word embedding
projected in and out (``word_embed_proj_dim != hidden_size``). The output matrix is the input
embedding unless the checkpoint carries its own ``lm_head``.
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

POSITION_OFFSET = 2  # OPT's position embedding table starts at index 2


class OPTAttention(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_heads}"
            )
        self.head_dim = self.hidden_size // self.num_heads
        bias = bool(getattr(cfg, "enable_bias", True))
        self.qkv_proj = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=bias)
        self.out_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x, kv_cache, meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        bias = bool(getattr(cfg, "enable_bias", True))
        self.pre_norm = bool(cfg.do_layer_norm_before)
        self.self_attn = OPTAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_dim, bias=bias)
        self.fc2 = nn.Linear(cfg.ffn_dim, cfg.hidden_size, bias=bias)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.act = get_activation(cfg.activation_function)

    def forward(self, x, kv_cache, meta) -> torch.Tensor:
        h = self.self_attn_layer_norm(x) if self.pre_norm else x
        x = x + self.self_attn(h, kv_cache, meta)
        if not self.pre_norm:
            x = self.self_attn_layer_norm(x)
        h = self.final_layer_norm(x) if self.pre_norm else x
        x = x + self.fc2(self.act(self.fc1(h)))
        if not self.pre_norm:
            x = self.final_layer_norm(x)
        return x


class OPTForCausalLM(nn.Module):
    """OPT causal LM over a packed batch with a paged KV cache (same interface as Llama)."""

    def __init__(self, hf_config: Any):
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        embed_dim = getattr(cfg, "word_embed_proj_dim", None) or cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, embed_dim)
        self.embed_positions = nn.Embedding(
            cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size
        )
        projected = embed_dim != cfg.hidden_size
        self.project_in = nn.Linear(embed_dim, cfg.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(cfg.hidden_size, embed_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        final_norm = cfg.do_layer_norm_before and not getattr(
            cfg, "_remove_final_layer_norm", False
        )
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        self.final_layer_norm = (
            nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine) if final_norm else None
        )
        # OPT ties the output matrix to the input embedding unless told otherwise.
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.lm_head = (
            None if self.tie_word_embeddings else nn.Linear(embed_dim, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.project_in is not None:
            x = self.project_in(x)
        x = x + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, kv_cache, meta)
        if self.final_layer_norm is not None:
            x = self.final_layer_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (``model.decoder.layers.0.fc1.weight`` or the
        original ``decoder.layers.0.fc1.weight``), fusing Q/K/V."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        hidden = self.config.hidden_size
        shards = {
            ".self_attn.q_proj.": 0,
            ".self_attn.k_proj.": hidden,
            ".self_attn.v_proj.": 2 * hidden,
        }
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, start = name, None
            for source, offset in shards.items():
                if source in name:
                    target, start = name.replace(source, ".self_attn.qkv_proj."), offset
                    break
            if target not in params:
                logger.warning("ignoring checkpoint tensor %r: no such weight in the model", name)
                continue
            param = params[target] if start is None else params[target].narrow(0, start, hidden)
            copy_weight(param, tensor, name)
            loaded.add(target)
        check_all_loaded(self, loaded)
