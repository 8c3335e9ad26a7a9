"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral.

A router scores every expert per token; each token runs through its top-k experts (gated SiLU MLPs),
whose outputs are weighted by the routing probabilities and summed. Routing follows transformers
exactly, so the same experts win, ties included: softmax over the router logits in float32, `torch.topk`
of the probabilities, optionally renormalised to sum to 1 (always for Mixtral), and the weights cast to
the model dtype (Qwen3-MoE) or kept in float32 (Mixtral) where they scale the experts' outputs.

The experts' weights are stacked, one tensor per projection (`gate_up_proj` [E, 2 * I, H]: each expert's
gate rows, then its up rows; `down_proj` [E, H, I]). The token-expert pairs are sorted by expert and each
expert that has tokens runs them in one matmul per projection; the weighted outputs are summed per token
in float32 and rounded to the model dtype once, as transformers' default (grouped) experts do.

Routing and experts run as one custom op, `torch_shift::sparse_moe`: its token counts per expert are
data-dependent, which a compiled graph could only take with a graph break per layer, and its routing
stays bit for bit the eager one under torch.compile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch_shift.config import ModelConfig


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
          float32_routing_weights: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (routing weights [T, top_k], expert ids [T, top_k]), as transformers'
    Qwen3MoeTopKRouter (float32_routing_weights=False) and MixtralTopKRouter (norm_topk_prob=True,
    float32_routing_weights=True) compute them."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not float32_routing_weights:
        weights = weights.to(router_logits.dtype)
    return weights, expert_ids


def run_experts(x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor) -> torch.Tensor:
    """x [T, H], each token's experts and weights [T, k] -> the weighted sum of its experts' outputs [T, H]."""
    num_tokens, top_k = expert_ids.shape
    pair_expert = expert_ids.flatten()
    order = torch.argsort(pair_expert, stable=True)  # the token-expert pairs grouped by expert
    pair_token = order // top_k
    pair_weight = routing_weights.flatten()[order]
    counts = torch.bincount(pair_expert, minlength=gate_up_proj.shape[0]).tolist()
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = pair_token[start:start + count]
        gate, up = F.linear(x[tokens], gate_up_proj[expert]).chunk(2, dim=-1)
        expert_out = F.linear(F.silu(gate) * up, down_proj[expert])
        out.index_add_(0, tokens, (expert_out * pair_weight[start:start + count, None]).float())
        start += count
    return out.to(x.dtype)


@torch.library.custom_op("torch_shift::sparse_moe", mutates_args=())
def sparse_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               top_k: int, norm_topk_prob: bool, float32_routing_weights: bool) -> torch.Tensor:
    weights, expert_ids = route(router_logits, top_k, norm_topk_prob, float32_routing_weights)
    return run_experts(x, expert_ids, weights, gate_up_proj, down_proj)


@sparse_moe.register_fake
def _(x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
      top_k: int, norm_topk_prob: bool, float32_routing_weights: bool) -> torch.Tensor:
    return torch.empty_like(x)


class Experts(nn.Module):
    """The experts' weights, stacked: `gate_up_proj` [E, 2 * I, H], `down_proj` [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # a plain nn.Linear, never packed (torch_shift.models.linear): the router logits come from the same
        # matmul as transformers', so that near-ties between experts are decided the same way
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.float32_routing_weights = config.float32_routing_weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse_moe(x, self.router(x), self.experts.gate_up_proj, self.experts.down_proj, self.top_k,
                          self.norm_topk_prob, self.float32_routing_weights)
