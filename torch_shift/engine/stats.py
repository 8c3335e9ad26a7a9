"""What the engine's steps did: steps by layout, layout switches, where rank 0's time went, decode batches."""

from __future__ import annotations

from collections import Counter

from torch_shift.engine.scheduler import ScheduledRequest
from torch_shift.engine.step_plan import StepPlan
from torch_shift.parallel.layouts import Deployment


class EngineStats:
    def __init__(self, deployment: Deployment):
        self.deployment = deployment
        self.num_steps = 0
        self.last_step_layout: str | None = None  # the layouts of the last step, '+'-joined
        self.last_step_switched = False  # a replica of it ran under another layout the last time
        self.last_step_seconds = 0.0  # its wall time on rank 0, from scheduling to outputs
        self._replica_layouts: dict[int, str] = {}  # replica -> the layout it last ran under
        self.steps_by_layout: Counter[str] = Counter()
        self.num_switches = 0
        self._step_seconds = [0.0, 0]  # sum and count over steps that kept their layouts
        self._switch_seconds = [0.0, 0]  # the same over steps that switched
        self.num_scheduled_tokens = 0  # tokens computed over the engine's life (recomputation included)
        # rank 0's wall time by what its steps did (prefill, decode, mixed; less the time in tier copies and
        # weight switches, counted apart), and the decode-only steps' batch sizes
        self.time_s: Counter[str] = Counter()
        self._decode_batches = [0, 0]  # requests and steps of decode-only steps
        self._run_steps = 1  # decode steps the last plan runs (a multi-step run's)
        # speculative decoding (vLLM's counters): checks (a request with proposed tokens in a step), proposed
        # tokens, accepted ones, and accepted ones by position in the proposal
        self.spec_method: str | None = None
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position: list[int] = []
        self.num_cut_tokens = 0  # proposed tokens the goodput budget left unchecked (spec_decode/budget.py)
        self.stages_by_rows: dict[int, list] = {}  # the speculator's own dict (Speculator.stages_by_rows)

    def record_plan(self, plan: StepPlan) -> None:
        """A step plan about to run: its layouts, and whether some replica switched layout. A multi-step run
        (GroupStep.num_steps) counts as its steps, their tokens and mean time (`record_step`)."""
        self._run_steps = 1
        if not plan.groups:
            return  # only tier copies this step
        runs = self._run_steps = plan.groups[0].num_steps
        names = [g.layout for g in plan.groups]
        # a switch: some replica runs under another layout than the last time it ran (replicas of data
        # parallelism that idle or rejoin under their own layout do not switch)
        switched = False
        for name in names:
            for replica in self.deployment[name].replicas:
                switched |= self._replica_layouts.get(replica, name) != name
                self._replica_layouts[replica] = name
        self.last_step_switched = switched
        self.num_switches += switched
        self.last_step_layout = "+".join(names)
        self.num_steps += runs
        for name in names:
            self.steps_by_layout[name] += runs
        self.num_scheduled_tokens += sum(g.num_tokens for g in plan.groups) * runs

    def cut_run(self, plan: StepPlan, steps_run: list[int]) -> None:
        """A multi-step run whose groups ran `steps_run` steps each, some fewer than `record_plan` counted (a group
        that drew a stop token, or that rank 0 interrupted, ends its run)."""
        planned = self._run_steps
        for group, ran in zip(plan.groups, steps_run):
            self.steps_by_layout[group.layout] -= planned - ran
            self.num_scheduled_tokens -= group.num_tokens * (planned - ran)
        self._run_steps = max(steps_run)
        self.num_steps -= planned - self._run_steps

    def record_step(self, entries: list[list[ScheduledRequest]], elapsed: float, swap_s: float,
                    reshard_s: float) -> None:
        """A step that ran: its wall time on rank 0, of which `swap_s` in tier copies and `reshard_s` in weight
        switches."""
        runs = self._run_steps
        self.last_step_seconds = elapsed / runs
        totals = self._switch_seconds if self.last_step_switched else self._step_seconds
        totals[0] += elapsed
        totals[1] += runs
        num_requests = sum(len(group) for group in entries)
        num_decodes = 0
        for group in entries:  # one-token decodes come first in a group, then checks of proposals and prompt chunks
            if group and group[-1].num_tokens == 1:
                num_decodes += len(group)
            else:  # a check of proposals decodes (a chunk recomputing a preempted request's outputs does not)
                num_decodes += sum(1 for e in group if e.num_tokens == 1 or e.spec_token_ids)
        kind = "decode" if num_decodes == num_requests else "prefill" if num_decodes == 0 else "mixed"
        if num_requests:
            self.time_s[kind] += elapsed - swap_s - reshard_s
        self.time_s["swapping"] += swap_s
        self.time_s["resharding"] += reshard_s
        if kind == "decode" and num_requests:
            self._decode_batches[0] += num_requests * runs
            self._decode_batches[1] += runs

    def record_spec(self, checks: list[tuple[int, int]]) -> None:
        """The step's checks of proposed tokens, each as (proposed, accepted) tokens (Speculator.observe)."""
        for num_proposed, accepted in checks:
            self.num_drafts += 1
            self.num_draft_tokens += num_proposed
            self.num_accepted_tokens += accepted
            if len(self.accepted_per_position) < num_proposed:
                self.accepted_per_position += [0] * (num_proposed - len(self.accepted_per_position))
            for position in range(accepted):
                self.accepted_per_position[position] += 1

    def spec_dict(self) -> dict | None:
        """Speculative decoding's figures: acceptance rate (accepted / proposed tokens) and the mean accepted
        length (tokens a check adds: the accepted ones and the one drawn after them)."""
        if self.spec_method is None:
            return None
        return {"method": self.spec_method, "num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None,
                "mean_accepted_length": 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None,
                "accepted_per_position": list(self.accepted_per_position), "num_cut_tokens": self.num_cut_tokens,
                "stages_by_rows": {rows: {"stages": num, "mean_seconds": seconds / num, "mean_accepted": accepted / num}
                                   for rows, (num, seconds, accepted) in sorted(self.stages_by_rows.items())}}

    def as_dict(self) -> dict:
        """Which layouts ran: steps by layout name, layout switches (steps in which some replica runs under
        another layout than the last time it ran) and the mean wall time of switching steps beside that of
        the others (a switch is a change of step plan: its cost is what the first step in the new layouts
        costs)."""
        def mean(totals):
            return totals[0] / totals[1] if totals[1] else None

        decode_requests, decode_steps = self._decode_batches
        return {"num_steps": self.num_steps, "steps_by_layout": dict(self.steps_by_layout),
                "num_switches": self.num_switches, "mean_step_s": mean(self._step_seconds),
                "mean_switch_step_s": mean(self._switch_seconds), "num_scheduled_tokens": self.num_scheduled_tokens,
                "time_s": {k: self.time_s[k] for k in ("prefill", "decode", "mixed", "resharding", "swapping")},
                "num_decode_steps": decode_steps,
                "mean_decode_batch": decode_requests / decode_steps if decode_steps else None,
                "spec_decode": self.spec_dict()}
