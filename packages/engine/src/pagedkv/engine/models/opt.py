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
from torch import nn

from pagedkv.engine.attention import Attention, AttentionMetadata
from pagedkv.engine.distributed.communication import TPInfo, tp_rank_size
from pagedkv.engine.models.layers import check_all_loaded, get_activation
from pagedkv.engine.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    load_parameter,
    vocab_parallel_logits,
)

logger = logging.getLogger(__name__)

POSITION_OFFSET = 2  # OPT's position embedding table starts at index 2


class OPTAttention(nn.Module):
    """Self-attention over this rank's heads (Q/K/V column-parallel, output row-parallel)."""

    def __init__(self, cfg: Any, tp: TPInfo | None = None):
        super().__init__()
        total_heads = cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        if self.hidden_size % total_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {total_heads}"
            )
        _, size = tp_rank_size(tp)
        self.num_heads = divide(total_heads, size, "num_attention_heads")
        self.head_dim = self.hidden_size // total_heads
        bias = bool(getattr(cfg, "enable_bias", True))
        h = self.hidden_size
        self.qkv_proj = ColumnParallelLinear(h, (h, h, h), bias=bias, tp=tp, what="hidden_size")
        self.out_proj = RowParallelLinear(h, h, bias=bias, tp=tp, what="hidden_size")
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x, kv_cache, meta) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TPInfo | None = None):
        super().__init__()
        affine = bool(getattr(cfg, "layer_norm_elementwise_affine", True))
        bias = bool(getattr(cfg, "enable_bias", True))
        self.pre_norm = bool(cfg.do_layer_norm_before)
        self.self_attn = OPTAttention(cfg, tp)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(
            cfg.hidden_size, (cfg.ffn_dim,), bias=bias, tp=tp, what="ffn_dim"
        )
        self.fc2 = RowParallelLinear(cfg.ffn_dim, cfg.hidden_size, bias=bias, tp=tp, what="ffn_dim")
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
    """OPT causal LM over a packed batch with a paged KV cache (same interface as Llama,
    tensor parallelism included; positions and the OPT-350m projections are replicated)."""

    def __init__(self, hf_config: Any, tp: TPInfo | None = None):
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        embed_dim = getattr(cfg, "word_embed_proj_dim", None) or cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, embed_dim, tp=tp)
        self.embed_positions = nn.Embedding(
            cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size
        )
        projected = embed_dim != cfg.hidden_size
        self.project_in = nn.Linear(embed_dim, cfg.hidden_size, bias=False) if projected else None
        self.project_out = nn.Linear(cfg.hidden_size, embed_dim, bias=False) if projected else None
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp) for _ in range(cfg.num_hidden_layers))
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
            None if self.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, embed_dim, tp=tp)
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

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return vocab_parallel_logits(
            hidden, self.embed_tokens if self.lm_head is None else self.lm_head, float32
        )

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load Hugging Face-named tensors (``model.decoder.layers.0.fc1.weight`` or the
        original ``decoder.layers.0.fc1.weight``), fusing Q/K/V, each rank reading its shard."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        parts = {".self_attn.q_proj.": 0, ".self_attn.k_proj.": 1, ".self_attn.v_proj.": 2}
        for name, tensor in weights:
            name = name.removeprefix("model.").removeprefix("decoder.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            target, part = name, None
            for source, k in parts.items():
                if source in name:
                    target, part = name.replace(source, ".self_attn.qkv_proj."), k
                    break
            if target not in params:
                logger.warning("ignoring checkpoint tensor %r: no such weight in the model", name)
                continue
            load_parameter(modules, target, tensor, part, name)
            loaded.add(target)
        check_all_loaded(self, loaded)
