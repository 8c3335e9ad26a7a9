"""The sparse mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE, Mixtral and GPT-OSS.

A router scores every expert per token; each token runs through its top-k experts (gated SiLU MLPs),
whose outputs are weighted by the routing probabilities and summed. Routing follows transformers
exactly, so the same experts win, ties included: softmax over the router logits in float32, `torch.topk`
of the probabilities, optionally renormalised to sum to 1 (always for Mixtral), and the weights cast to
the model dtype (Qwen3-MoE) or kept in float32 (Mixtral) where they scale the experts' outputs. GPT-OSS
("topk_softmax") takes the top-k of its router's logits (the router has a bias) and a softmax over those
in the model dtype; its experts have biases and a clamped SwiGLU (gate clamped above, up on both sides at
`swiglu_limit`, gate * sigmoid(alpha * gate) * (up + 1)); its checkpoints interleave each expert's gate
and up columns, which the loader separates. Qwen2-MoE adds a shared expert that every token runs (a gated SiLU MLP
of its own width, sharded as a dense MLP in every layout) scaled by sigmoid(shared_expert_gate(x)), and adds it to
the routed experts' sum in the model dtype, as transformers' Qwen2MoeSparseMoeBlock does.

The experts' weights are stacked, one tensor per projection (`gate_up_proj` [E, 2 * I, H]: each expert's
gate rows, then its up rows; `down_proj` [E, H, I]). The token-expert pairs are sorted by expert and each
expert that has tokens runs them in one matmul per projection; the weighted outputs are summed per token
in float32 and rounded to the model dtype once, as transformers' default (grouped) experts do.

Routing and experts run as one custom op, `torch_shift::sparse_moe`: its token counts per expert are
data-dependent, which a compiled graph could only take with a graph break per layer, and its routing
stays bit for bit the eager one under torch.compile. On the CPU, once experts are packed, the op runs in C++
(kernels/cpu_ops.cpp): the same ATen operators in the same order, without each layer's Python.

`prepare_linears` (torch_shift.models.linear) packs each expert's two projections for oneDNN as it packs
every dense weight (`Experts.pack`); the op then runs them by their handles: oneDNN's packed matmul, or the
GEMV kernel for the few tokens an expert gets in a decode step, instead of `F.linear` on slices of the
stacked weights (MKL, about half oneDNN's rate on this CPU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torch_shift.config import ModelConfig
from torch_shift.custom_ops import custom_op
from torch_shift.kernels import register_native_moe
from torch_shift.models.fused import silu_mul
from torch_shift.models.linear import PackedWeight, drop_parameter, packed_weight, packing_supported
from torch_shift.models.mlp import MLP


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool, float32_routing_weights: bool,
          routing: str = "softmax_topk") -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (routing weights [T, top_k], expert ids [T, top_k]), as transformers'
    Qwen3MoeTopKRouter (float32_routing_weights=False), MixtralTopKRouter (norm_topk_prob=True,
    float32_routing_weights=True) and GptOssTopKRouter (routing="topk_softmax") compute them."""
    if routing == "topk_softmax":
        top_logits, expert_ids = torch.topk(router_logits, top_k, dim=-1)
        return torch.softmax(top_logits, dim=-1, dtype=top_logits.dtype), expert_ids
    assert routing == "softmax_topk", routing
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, expert_ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not float32_routing_weights:
        weights = weights.to(router_logits.dtype)
    return weights, expert_ids


def gated(gate_up: torch.Tensor, swiglu_limit: float | None, swiglu_alpha: float) -> torch.Tensor:
    """An expert's activation of its gate/up projection [n, 2 * I] (gate rows first): SiLU(gate) * up, or
    GPT-OSS's clamped SwiGLU where `swiglu_limit` is set."""
    if swiglu_limit is None:
        return silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))


def expert_forward(expert: int, rows: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
                   packed: tuple[list[int], list[int]] | None, gate_up_bias: torch.Tensor | None,
                   down_bias: torch.Tensor | None, swiglu_limit: float | None, swiglu_alpha: float) -> torch.Tensor:
    """Expert `expert`'s output [n, H] for its rows [n, H], in the model dtype (biases added after each matmul)."""
    if packed:
        gate_up = packed_weight(packed[0][expert])(rows, None)  # C++ where kernels/cpu_ops.cpp builds
    else:
        gate_up = F.linear(rows, gate_up_proj[expert])
    if gate_up_bias is not None:
        gate_up = gate_up + gate_up_bias[expert]
    hidden = gated(gate_up, swiglu_limit, swiglu_alpha)
    out = packed_weight(packed[1][expert])(hidden, None) if packed else F.linear(hidden, down_proj[expert])
    return out if down_bias is None else out + down_bias[expert]


def run_experts(x: torch.Tensor, expert_ids: torch.Tensor, routing_weights: torch.Tensor, gate_up_proj: torch.Tensor,
                down_proj: torch.Tensor, packed: tuple[list[int], list[int]] | None = None,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                swiglu_limit: float | None = None, swiglu_alpha: float = 1.0) -> torch.Tensor:
    """x [T, H], each token's experts and weights [T, k] -> the weighted sum of its experts' outputs [T, H].
    `packed`: the handles of each expert's packed gate/up and down weights, used instead of the stacked ones.
    Biases ([E, 2 * I], [E, H]) are added after each matmul, rounded as transformers' grouped experts do."""
    num_tokens, top_k = expert_ids.shape
    pair_expert = expert_ids.flatten()
    order = torch.argsort(pair_expert, stable=True)  # the token-expert pairs grouped by expert
    pair_token = order // top_k
    pair_weight = routing_weights.flatten()[order]
    num_experts = len(packed[0]) if packed else gate_up_proj.shape[0]
    counts = torch.bincount(pair_expert, minlength=num_experts).tolist()
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = pair_token[start:start + count]
        expert_out = expert_forward(expert, x[tokens], gate_up_proj, down_proj, packed, gate_up_bias, down_bias,
                                    swiglu_limit, swiglu_alpha)
        out.index_add_(0, tokens, (expert_out * pair_weight[start:start + count, None]).float())
        start += count
    return out.to(x.dtype)


@custom_op("torch_shift::sparse_moe")
def sparse_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
               top_k: int, norm_topk_prob: bool, float32_routing_weights: bool, gate_up_handles: list[int],
               down_handles: list[int], routing: str, gate_up_bias: torch.Tensor | None,
               down_bias: torch.Tensor | None, swiglu_limit: float | None, swiglu_alpha: float) -> torch.Tensor:
    weights, expert_ids = route(router_logits, top_k, norm_topk_prob, float32_routing_weights, routing)
    packed = (gate_up_handles, down_handles) if gate_up_handles else None
    return run_experts(x, expert_ids, weights, gate_up_proj, down_proj, packed, gate_up_bias, down_bias,
                       swiglu_limit, swiglu_alpha)


custom_op("torch_shift::sparse_moe_python")(sparse_moe.__wrapped__)


@sparse_moe.register_fake
def _(x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor,
      top_k: int, norm_topk_prob: bool, float32_routing_weights: bool, gate_up_handles: list[int],
      down_handles: list[int], routing: str, gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
      swiglu_limit: float | None, swiglu_alpha: float) -> torch.Tensor:
    return torch.empty_like(x)


class PackedExperts:
    """Each expert's gate/up and down weights packed (`PackedWeight`), counted as one packed weight."""

    def __init__(self, gate_up: list[PackedWeight], down: list[PackedWeight]):
        self.gate_up, self.down = gate_up, down
        self.gate_up_handles = [w.handle for w in gate_up]
        self.down_handles = [w.handle for w in down]
        self.handle = self.gate_up_handles[0]
        self.nbytes = sum(w.nbytes for w in gate_up + down)


class Experts(nn.Module):
    """The experts' weights, stacked: `gate_up_proj` [E, 2 * I, H], `down_proj` [E, H, I], and with `bias`
    `gate_up_bias` [E, 2 * I] and `down_bias` [E, H] (GPT-OSS)."""

    packed: PackedExperts | None = None

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False,
                 first_expert: int = 0):
        """`first_expert`: the model's index of expert 0 here (a rank's run of them under expert parallelism)."""
        super().__init__()
        self.num_experts = num_experts
        self.first_expert = first_expert
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.gate_up_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.down_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None

    def pack(self, drop_dense: bool) -> int:
        """Pack every expert's projections where the device and dtype allow it (then, with `drop_dense`, the
        stacked weights are dropped); returns the bytes packed."""
        if not packing_supported(self.gate_up_proj.device, self.gate_up_proj.dtype):
            return 0
        self.packed = PackedExperts([PackedWeight(w) for w in self.gate_up_proj.detach()],
                                    [PackedWeight(w) for w in self.down_proj.detach()])
        register_native_moe()  # packed experts run in C++, eager or compiled (where the operator library builds)
        if drop_dense:
            drop_parameter(self, "gate_up_proj")
            drop_parameter(self, "down_proj")
        return self.packed.nbytes

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                float32_routing_weights: bool, routing: str = "softmax_topk", swiglu_limit: float | None = None,
                swiglu_alpha: float = 1.0, down_bias: bool = True) -> torch.Tensor:
        """The routed experts' weighted outputs for x [T, H]; `down_bias` False: without the down projections'
        bias (a TP rank whose partial sums another rank's bias joins)."""
        packed = self.packed
        return sparse_moe(x, router_logits, self.gate_up_proj, self.down_proj, top_k, norm_topk_prob,
                          float32_routing_weights, packed.gate_up_handles if packed else [],
                          packed.down_handles if packed else [], routing, self.gate_up_bias,
                          self.down_bias if down_bias else None, swiglu_limit, swiglu_alpha)


ROUTING_SETTINGS = ("top_k", "norm_topk_prob", "float32_routing_weights", "routing", "swiglu_limit", "swiglu_alpha")


def adopt_routing(module: nn.Module, block: nn.Module) -> None:
    """`module` routes as `block` does: its router (the same module), its routing and activation settings, and its
    shared expert and that expert's gate (the same modules; a layout that slices the shared expert replaces it)."""
    module.router = block.router
    for name in ROUTING_SETTINGS:
        setattr(module, name, getattr(block, name))
    module.shared_expert = block.shared_expert
    module.shared_expert_gate = block.shared_expert_gate


def add_shared_expert(block: nn.Module, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """The routed experts' sum `routed` plus the block's shared expert on x, scaled by sigmoid(its gate) (Qwen2-MoE),
    or `routed` where the block has none."""
    if block.shared_expert is None:
        return routed
    return routed + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        # a plain nn.Linear, never packed (torch_shift.models.linear): the router logits come from the same
        # matmul as transformers', so that near-ties between experts are decided the same way
        self.router = nn.Linear(config.hidden_size, config.num_experts, bias=config.router_bias)
        self.experts = Experts(config.num_experts, config.hidden_size, config.moe_intermediate_size,
                               bias=config.expert_bias)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.float32_routing_weights = config.float32_routing_weights
        self.routing = config.moe_routing
        self.swiglu_limit = config.swiglu_limit
        self.swiglu_alpha = config.swiglu_alpha
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
            # a plain nn.Linear of one output, as the router: transformers' bits
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = self.experts(x, self.router(x), self.top_k, self.norm_topk_prob, self.float32_routing_weights,
                              self.routing, self.swiglu_limit, self.swiglu_alpha)
        return add_shared_expert(self, x, routed)
