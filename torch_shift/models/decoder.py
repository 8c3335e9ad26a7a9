"""One decoder-only transformer for Llama 1/2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3 (its norms after
attention and the MLP, scaling by 1 + weight, windowed layers with rotary tables of their own, GeGLU), and with a
sparse mixture of experts as the MLP of some or all layers (torch_shift.models.moe) Qwen2-MoE, Qwen3-MoE, Mixtral
and GPT-OSS (with its attention sinks and alternating windowed and full layers).

No parallel code lives here. Head counts are attributes read when q/k/v are split, so a
parallel plan that shards `qkv_proj` sets the local counts; tokens arrive flattened
(`[num_tokens]`, no batch dimension) and attention over the paged KV cache is the
`attention` callable the runner passes in.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from torch_shift.config import ModelConfig
from torch_shift.models.fused import (
    add_rms_norm,
    gpu_add_rms_norm,
    gpu_rms_norm,
    gpu_rms_norm_applies,
    rms_norm,
    rms_norm_expression,
)
from torch_shift.models.linear import Linear
from torch_shift.models.mlp import MLP, GeluMLP
from torch_shift.models.moe import SparseMoeBlock
from torch_shift.models.rope import RotaryEmbedding


class AttentionFn(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
        """q: [T, heads, head_dim], k/v: [T, kv_heads, head_dim] -> [T, heads, head_dim].

        `sinks` [heads]: one logit per query head that its softmax also normalises over, with no value
        (GPT-OSS's attention sinks); `sliding_window`: this layer's window, where layers differ (GPT-OSS
        alternates windowed and full layers), instead of the step's (the model's one window, or none)."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`, (norm(x + residual), x + residual): a decoder layer's residual add and the norm
        after it, one kernel on a GPU and one pass on the CPU."""
        if gpu_rms_norm_applies(x, self.weight, residual):
            if residual is None:
                return gpu_rms_norm(x, self.weight, self.eps)
            return gpu_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            fused = add_rms_norm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = x + residual
            return self._norm(x), x
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        fused = rms_norm(x, self.weight, self.eps)  # one pass on the CPU
        if fused is not None:
            return fused
        return rms_norm_expression(x, self.weight, self.eps)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: in float32, scaled by 1 + weight, rounded to the input's dtype once (transformers'
    Gemma3RMSNorm); with `residual`, (norm(x + residual), x + residual) as RMSNorm's."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            return self.forward(x), x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def make_norm(config: ModelConfig, dim: int) -> nn.Module:
    """The family's RMSNorm over `dim` features."""
    return (GemmaRMSNorm if config.gemma_norms else RMSNorm)(dim, config.rms_norm_eps)


def embed(config: ModelConfig, embed_tokens: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The tokens' embeddings, times Gemma's sqrt(hidden_size) rounded to their dtype where the family scales them."""
    x = embed_tokens(input_ids)
    return x if config.embed_scale is None else x * torch.tensor(config.embed_scale, dtype=x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, model_layer_idx: int | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = config.layer_window(layer_idx if model_layer_idx is None else model_layer_idx)
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_rows, bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=config.o_proj_bias)
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.attention_sinks else None
        if config.qk_norm:
            self.q_norm, self.k_norm = make_norm(config, self.head_dim), make_norm(config, self.head_dim)
        else:
            self.q_norm = self.k_norm = None
        # Gemma 3's windowed layers rotate by their own table (RotaryEmbedding's local one)
        self.local_rope = config.local_rope is not None and self.sliding_window is not None
        self.query_scale = config.query_scale

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attention: AttentionFn,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """-> the output projection of every token's attention, or of the tokens at `logits_indices` only (every
        token's keys and values are still computed and written)."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(positions, q, k, local=True) if self.local_rope else rotary(positions, q, k)
        if self.query_scale is not None:
            q = q * self.query_scale
        if self.sinks is None and self.sliding_window is None:
            out = attention(self.layer_idx, q, k, v)
        else:
            out = attention(self.layer_idx, q, k, v, self.sinks, self.sliding_window)
        out = out.flatten(1)
        return self.o_proj(out if logits_indices is None else out[logits_indices])


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int, model_layer_idx: int | None = None):
        """`layer_idx`: the layer in the KV cache attention reads; `model_layer_idx`: the layer in the model
        (whose MLP may be sparse), when the two differ (a pipeline stage's cache holds only its layers)."""
        super().__init__()
        model_layer_idx = layer_idx if model_layer_idx is None else model_layer_idx
        self.input_norm = make_norm(config, config.hidden_size)
        self.attn = Attention(config, layer_idx, model_layer_idx)
        self.post_attention_norm = make_norm(config, config.hidden_size)
        dense = GeluMLP if config.hidden_act == "gelu_pytorch_tanh" else MLP
        self.mlp = (SparseMoeBlock(config) if model_layer_idx in config.sparse_layers
                    else dense(config.hidden_size, config.intermediate_size))
        # Gemma 3: the attention's output normed before the residual add, the MLP's input and output normed
        self.pre_feedforward_norm = make_norm(config, config.hidden_size) if config.gemma_norms else None
        self.post_feedforward_norm = make_norm(config, config.hidden_size) if config.gemma_norms else None

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, attention: AttentionFn,
        residual: torch.Tensor | None = None, logits_indices: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output, the residual stream before it): the hidden state after the layer is their
        sum, which the next norm adds (`residual`: the last layer's residual stream, x its MLP output; None: x is
        the hidden state itself). With `logits_indices`, of those tokens only: the last layer's attention reads
        every token, and nothing after it needs the other tokens' rows (llama.cpp's graphs skip them alike)."""
        if self.pre_feedforward_norm is not None:
            hidden = x if residual is None else x + residual
            attended = self.attn(self.input_norm(hidden), positions, rotary, attention, logits_indices)
            hidden = (hidden if logits_indices is None else hidden[logits_indices]) + self.post_attention_norm(attended)
            return self.post_feedforward_norm(self.mlp(self.pre_feedforward_norm(hidden))), hidden
        if residual is None:
            h, residual = self.input_norm(x), x
        else:
            h, residual = self.input_norm(x, residual)
        h = self.attn(h, positions, rotary, attention, logits_indices)
        h, residual = self.post_attention_norm(h, residual if logits_indices is None else residual[logits_indices])
        return self.mlp(h), residual


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = make_norm(config, config.hidden_size)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings, config.local_rope)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden_size], or [R, hidden_size] of the tokens at
        `logits_indices` ([R], the rows the LM head reads): the last layer's output projection and MLP run on
        those rows alone (a 512-token prompt's first token: 10.7% of an 8-layer Llama's linear FLOPs skipped)."""
        x, residual = embed(self.config, self.embed_tokens, input_ids), None
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, positions, self.rotary, attention, residual, logits_indices if i == last else None)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
