"""Expert parallelism: the experts of every sparse layer split across the ranks of a group, each rank holding
E / n of them whole (Shard(0) of the stacked experts' parameters; parallel/plan.py), the router replicated.

Two ways tokens reach their experts, by where the layout keeps its tokens:
- tokens partitioned over the group (Ulysses SP's base layout: each rank its own slice of the step): each
  token-expert pair is sent to the rank that holds the expert by an all-to-all of unequal parts, computed
  there, and its output sent back by a second all-to-all; the owner of the token weights and sums them.
- tokens replicated over the group (TP, and Shift's shift layout): every rank computes the pairs of its own
  experts for every token, and one all-reduce sums the tokens' outputs, as TP inside the experts does.

Shift keeps one copy of the experts: its shift layout runs the base layout's expert shards as they are, only
switching from dispatch to the all-reduce. Each pair is computed by the one rank holding its expert (with
its biases), so nothing is added twice. The routing, dispatch and combine run as one custom op,
`torch_shift::expert_parallel_moe`, whose token counts per rank are data-dependent (as `sparse_moe`).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from torch_shift.custom_ops import custom_op
from torch_shift.models.moe import Experts, add_shared_expert, adopt_routing, expert_forward, route
from torch_shift.parallel import comm

_groups: dict[int, dist.ProcessGroup] = {}  # the custom op names its group by id
_group_ids = itertools.count()


def _through_experts(rows: torch.Tensor, row_expert: torch.Tensor, num_experts: int, gate_up_proj: torch.Tensor,
                     down_proj: torch.Tensor, packed, gate_up_bias, down_bias, swiglu_limit,
                     swiglu_alpha) -> torch.Tensor:
    """Each row through its (local) expert: [R, H] in the model dtype, in the rows' order."""
    out = rows.new_empty(rows.shape)
    order = torch.argsort(row_expert, stable=True)
    start = 0
    for expert, count in enumerate(torch.bincount(row_expert, minlength=num_experts).tolist()):
        if count:
            index = order[start:start + count]
            out[index] = expert_forward(expert, rows[index], gate_up_proj, down_proj, packed, gate_up_bias,
                                        down_bias, swiglu_limit, swiglu_alpha)
            start += count
    return out


@custom_op("torch_shift::expert_parallel_moe")
def expert_parallel_moe(x: torch.Tensor, router_logits: torch.Tensor, gate_up_proj: torch.Tensor,
                        down_proj: torch.Tensor, top_k: int, norm_topk_prob: bool, float32_routing_weights: bool,
                        gate_up_handles: list[int], down_handles: list[int], routing: str,
                        gate_up_bias: torch.Tensor | None, down_bias: torch.Tensor | None,
                        swiglu_limit: float | None, swiglu_alpha: float, first_expert: int, num_local_experts: int,
                        group_id: int, tokens_partitioned: bool) -> torch.Tensor:
    group = _groups[group_id]
    packed = (gate_up_handles, down_handles) if gate_up_handles else None
    weights, expert_ids = route(router_logits, top_k, norm_topk_prob, float32_routing_weights, routing)
    num_tokens, k = expert_ids.shape
    pair_expert = expert_ids.flatten()
    args = (num_local_experts, gate_up_proj, down_proj, packed, gate_up_bias, down_bias, swiglu_limit, swiglu_alpha)
    # the pairs in expert order (so grouped by the rank holding the expert): dispatched, each token's outputs are
    # summed in the order one rank's sparse_moe sums them
    order = torch.argsort(pair_expert, stable=True)
    if tokens_partitioned:
        n = dist.get_world_size(group)
        destination = pair_expert // num_local_experts  # the rank holding the pair's expert
        send_counts = torch.bincount(destination, minlength=n)
        recv_counts = comm.all_to_all(send_counts, group)
        sends, receives = send_counts.tolist(), recv_counts.tolist()
        rows = comm.all_to_all(x[order // k], group, sends, receives)
        local_expert = comm.all_to_all(pair_expert[order] - destination[order] * num_local_experts, group, sends,
                                       receives)
        outputs = comm.all_to_all(_through_experts(rows, local_expert, *args), group, receives, sends)
        pair_token, pair_weight = order // k, weights.flatten()[order]
    else:
        ordered = pair_expert[order]
        pairs = order[(ordered >= first_expert) & (ordered < first_expert + num_local_experts)]
        pair_token, pair_weight = pairs // k, weights.flatten()[pairs]
        outputs = _through_experts(x[pair_token], pair_expert[pairs] - first_expert, *args)
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, pair_token, (outputs * pair_weight[:, None]).float())
    if not tokens_partitioned:
        # each rank's partial sum, then the sum of the partials, in float32 and rounded once; with top-k > 2 the
        # grouping differs from one rank's sequential sum (as TP's partial down projections do)
        out = comm.all_reduce(out, group)
    return out.to(x.dtype)


@expert_parallel_moe.register_fake
def _(x, router_logits, gate_up_proj, down_proj, top_k, norm_topk_prob, float32_routing_weights, gate_up_handles,
      down_handles, routing, gate_up_bias, down_bias, swiglu_limit, swiglu_alpha, first_expert, num_local_experts,
      group_id, tokens_partitioned):
    return torch.empty_like(x)


class ExpertParallelSparseMoe(nn.Module):
    """A sparse MoE block holding experts [first_expert, first_expert + E / n) of the model's E, whole; its
    parameters keep SparseMoeBlock's names (the router's whole, the experts' a run of them). A shared expert (Qwen2-MoE)
    runs on the rank's tokens as a dense MLP: whole where the tokens are partitioned (SP ranks), split over the TP ranks
    (its own partial sums reduced by its down projection) where they are replicated."""

    def __init__(self, block: nn.Module, experts: Experts, group: dist.ProcessGroup, tokens_partitioned: bool):
        super().__init__()
        adopt_routing(self, block)
        self.experts = experts
        self.group = group
        self.group_id = next(_group_ids)
        _groups[self.group_id] = group
        self.tokens_partitioned = tokens_partitioned

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.experts
        packed = e.packed
        routed = expert_parallel_moe(
            x, self.router(x), e.gate_up_proj, e.down_proj, self.top_k, self.norm_topk_prob,
            self.float32_routing_weights, packed.gate_up_handles if packed else [],
            packed.down_handles if packed else [], self.routing, e.gate_up_bias, e.down_bias, self.swiglu_limit,
            self.swiglu_alpha, e.first_expert, e.num_experts, self.group_id, self.tokens_partitioned)
        return add_shared_expert(self, x, routed)
