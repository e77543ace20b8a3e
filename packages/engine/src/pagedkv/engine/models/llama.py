"""The Llama family: Llama 2/3, SmolLM2, Mistral and Qwen2-style (bias on Q/K/V) decoders.

Pre-norm decoder layers: RMSNorm -> attention with rotary positions -> residual, RMSNorm ->
SwiGLU MLP -> residual. Q, K and V are one fused projection and gate/up another, so each layer
runs four matmuls; checkpoints with separate ``q_proj``/``k_proj``/... are stitched together in
``load_weights``.

The residual stream is carried between layers as vLLM does: a layer takes and returns
``(x, residual)`` and each residual add happens inside the next norm, which on CUDA is one
fused kernel (``fused_add_rms_norm``) instead of an add and eight norm kernels. Same sums in
the same dtype, so the CPU outputs are those of the plain pre-norm formulation, bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.engine.attention import Attention, AttentionMetadata
from pagedkv.engine.models.layers import (
    RMSNorm,
    RotaryAngles,
    RotaryEmbedding,
    check_all_loaded,
    copy_weight,
    rope_inv_freq,
    silu_and_mul,
)

logger = logging.getLogger(__name__)

# checkpoint tensors that are not weights of the model
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(cfg)
        # Llama's attention_bias covers all four projections; Qwen2 has bias on Q/K/V only.
        qkv_bias = bool(getattr(cfg, "attention_bias", False)) or cfg.model_type == "qwen2"
        o_bias = bool(getattr(cfg, "attention_bias", False)) and cfg.model_type != "qwen2"
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rope.apply(
            q.view(num_tokens, self.num_heads, self.head_dim),
            k.view(num_tokens, self.num_kv_heads, self.head_dim),
        )
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Llama-family MLP needs hidden_act 'silu', got {cfg.hidden_act!r}")
        bias = bool(getattr(cfg, "mlp_bias", False))
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x``: the previous layer's MLP output, ``residual``: the stream it adds to (None in
        the first layer, whose ``x`` is the embeddings). Returns this layer's MLP output and the
        stream before it; the add happens in the next norm. Consumes ``x`` and ``residual``
        (the fused norms write into them)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a packed batch with a paged KV cache.

    ``forward(input_ids [T], positions [T], kv_caches, meta) -> hidden [T, hidden]``;
    ``compute_logits(hidden [N, hidden]) -> [N, vocab]`` float32.
    """

    def __init__(self, hf_config: Any):
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(_head_dim(cfg), rope_inv_freq(cfg, _head_dim(cfg)))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.prepare(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        if residual is None:
            return self.norm(x)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...),
        fusing Q/K/V and gate/up. ``rope_freqs`` (from GGUF) rescales the rotary frequencies."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        shards = _shard_table(self.layers[0] if len(self.layers) else None)
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "rope_freqs":
                self.rotary.apply_freq_factors(tensor)
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the input embedding is the output matrix
            target, shard = _fused_target(name, shards)
            if target not in params:
                logger.warning("ignoring checkpoint tensor %r: no such weight in the model", name)
                continue
            param = params[target]
            if shard is None:
                copy_weight(param, tensor, name)
            else:
                start, size = shard
                copy_weight(param.narrow(0, start, size), tensor, name)
            loaded.add(target)
        check_all_loaded(self, loaded)


def _shard_table(layer: LlamaDecoderLayer | None) -> dict[str, tuple[str, int, int]]:
    """Checkpoint projection -> (our fused projection, first row, rows)."""
    if layer is None:
        return {}
    attn, mlp = layer.self_attn, layer.mlp
    return {
        ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0, attn.q_size),
        ".self_attn.k_proj.": (".self_attn.qkv_proj.", attn.q_size, attn.kv_size),
        ".self_attn.v_proj.": (".self_attn.qkv_proj.", attn.q_size + attn.kv_size, attn.kv_size),
        ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0, mlp.intermediate_size),
        ".mlp.up_proj.": (".mlp.gate_up_proj.", mlp.intermediate_size, mlp.intermediate_size),
    }


def _fused_target(
    name: str, shards: dict[str, tuple[str, int, int]]
) -> tuple[str, tuple[int, int] | None]:
    """Our parameter name and row range for a checkpoint tensor name."""
    for source, (fused, start, size) in shards.items():
        if source in name:
            return name.replace(source, fused), (start, size)
    return name, None
