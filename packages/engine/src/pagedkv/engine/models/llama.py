"""The Llama family: Llama 2/3, SmolLM2 and Mistral decoders (Qwen2 subclasses it, ``qwen2.py``).

Pre-norm decoder layers: RMSNorm -> attention with rotary positions -> residual, RMSNorm ->
SwiGLU MLP -> residual. Q, K and V are one fused projection and gate/up another, so each layer
runs four matmuls; checkpoints with separate ``q_proj``/``k_proj``/... are stitched together in
``load_weights``.

The residual stream is carried between layers as vLLM does: a layer takes and returns
``(x, residual)`` and each residual add happens inside the next norm, which on CUDA is one
fused kernel (``fused_add_rms_norm``) instead of an add and eight norm kernels. Same sums in
the same dtype, so the CPU outputs are those of the plain pre-norm formulation, bit for bit.

A Llama-like family that differs only in which projections carry a bias subclasses
:class:`LlamaForCausalLM` and overrides :meth:`~LlamaForCausalLM.attention_bias`; what it needs
outside the model (shape, tensor-parallel split, GGUF names, sliding window) is its entry in
``models/registry.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedkv.engine.attention import Attention, AttentionMetadata
from pagedkv.engine.distributed.communication import TPInfo, tp_rank_size
from pagedkv.engine.models.layers import (
    RMSNorm,
    RotaryAngles,
    RotaryEmbedding,
    check_all_loaded,
    gate_up_silu_and_mul,
    rope_inv_freq,
)
from pagedkv.engine.models.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    divide,
    load_parameter,
    materialize,
    vocab_parallel_logits,
)

logger = logging.getLogger(__name__)

# checkpoint tensors that are not weights of the model
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    """Self-attention over this rank's heads: Q/K/V column-parallel by head, output
    row-parallel (one rank: all heads)."""

    def __init__(
        self, cfg: Any, tp: TPInfo | None = None, *, qkv_bias: bool = False, o_bias: bool = False
    ):
        super().__init__()
        _, size = tp_rank_size(tp)
        total_heads = cfg.num_attention_heads
        total_kv_heads = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.num_heads = divide(total_heads, size, "num_attention_heads")
        self.num_kv_heads = divide(total_kv_heads, size, "num_key_value_heads")
        self.head_dim = _head_dim(cfg)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        q_total, kv_total = total_heads * self.head_dim, total_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, (q_total, kv_total, kv_total), bias=qkv_bias, tp=tp
        )
        self.o_proj = RowParallelLinear(q_total, cfg.hidden_size, bias=o_bias, tp=tp)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)

    def forward(
        self,
        x: torch.Tensor,
        rope: RotaryAngles,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # the attention layer rotates q and k (on a GPU, in the kernel that writes the cache)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, rope=rope))


class LlamaMLP(nn.Module):
    """SwiGLU over this rank's slice of the intermediate features: gate/up column-parallel,
    down row-parallel."""

    def __init__(self, cfg: Any, tp: TPInfo | None = None):
        super().__init__()
        if cfg.hidden_act not in ("silu", "swish"):
            raise ValueError(f"Llama-family MLP needs hidden_act 'silu', got {cfg.hidden_act!r}")
        bias = bool(getattr(cfg, "mlp_bias", False))
        _, size = tp_rank_size(tp)
        total = cfg.intermediate_size
        self.intermediate_size = divide(total, size, "intermediate_size")
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, (total, total), bias=bias, tp=tp, what="intermediate_size"
        )
        self.down_proj = RowParallelLinear(
            total, cfg.hidden_size, bias=bias, tp=tp, what="intermediate_size"
        )
        self.fp8_act = False  # the activation kernel quantizes for an fp8 down projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu_and_mul(self.gate_up_proj, x, self.fp8_act))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: Any, tp: TPInfo | None = None, *, qkv_bias: bool = False, o_bias: bool = False
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp, qkv_bias=qkv_bias, o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def use_fp8_inputs(self) -> None:
        """fp8 weights (``quantize_model``): the two norms and the MLP's activation quantize
        the inputs of the Q/K/V, gate/up and down projections in their own kernels."""
        self.input_layernorm.fp8_out = True
        self.post_attention_layernorm.fp8_out = True
        self.mlp.fp8_act = True

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

    ``tp``: this rank's place in a tensor-parallel group (None: the whole model on one device).
    Then each rank holds its heads, its MLP slice and its vocabulary slice; ``compute_logits``
    returns the whole vocabulary's logits on rank 0 and None on the others.
    """

    @staticmethod
    def attention_bias(cfg: Any) -> tuple[bool, bool]:
        """(bias on the Q/K/V projections, bias on the output projection): Llama's
        ``attention_bias`` covers all four."""
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    def __init__(self, hf_config: Any, tp: TPInfo | None = None):
        super().__init__()
        cfg = hf_config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        qkv_bias, o_bias = self.attention_bias(cfg)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, tp, qkv_bias=qkv_bias, o_bias=o_bias)
            for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(_head_dim(cfg), rope_inv_freq(cfg, _head_dim(cfg)))
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp)
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

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        return vocab_parallel_logits(
            hidden, self.embed_tokens if self.lm_head is None else self.lm_head, float32
        )

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load Hugging Face-named tensors (``model.layers.0.self_attn.q_proj.weight``, ...),
        fusing Q/K/V and gate/up, each rank reading its shard only. ``rope_freqs`` (from GGUF)
        rescales the rotary frequencies."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "rope_freqs":
                self.rotary.apply_freq_factors(materialize(tensor))
                continue
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the input embedding is the output matrix
            target, shard = _fused_target(name)
            if target not in params:
                logger.warning("ignoring checkpoint tensor %r: no such weight in the model", name)
                continue
            load_parameter(modules, target, tensor, shard, name)
            loaded.add(target)
        check_all_loaded(self, loaded)


# checkpoint projection -> (our fused projection, its part)
_FUSED_PARTS = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


def _fused_target(name: str) -> tuple[str, int | None]:
    """Our parameter name, and the part of it, for a checkpoint tensor name."""
    for source, (fused, part) in _FUSED_PARTS.items():
        if source in name:
            return name.replace(source, fused), part
    return name, None
