"""One rank's part of every step: copy its replica's KV to and from the host tier as the plan says,
apply the plan's deltas to its replica's persistent batch, build the inputs of the group it
belongs to, run the model in that group's layout over the paged KV cache (viewed as the layout
views it: by KV width, or as a pipeline stage's layers), and return logits.

With asynchronous scheduling on the CPU, a step the C++ decoder runs on the decode pool (a replica's own, whose
matmuls all run the GEMV) is launched on the decoder's thread and `execute` returns before its logits are written:
the engine samples and prepares the next step meanwhile, and its thread helps with the step's GEMVs once it waits
for it. Any other step waits for the launched ones first.

Every rank runs this, rank 0 included, on the same plan: there is one path for one rank and many.
Rank 0 returns the logits of every group in plan order; a group without rank 0 sends its logits
from the rank that has them (the first, or a pipeline's last stage) to rank 0 (the only other
traffic outside the layouts' own collectives and the pipeline's activations). A multi-step run's group
(GroupStep.num_steps) returns, and sends, the tokens its steps drew instead.
"""

from __future__ import annotations

import copy
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from torch_shift.attention import attention_backend as make_attention_backend
from torch_shift.attention.backend import AttentionBatch
from torch_shift.engine import decode_pool as pool
from torch_shift.engine.input_batch import HostInputs, InputBatch
from torch_shift.engine.step_plan import GroupStep, StepPlan, split_micro_batches
from torch_shift.engine.torch_state import TorchState
from torch_shift.kv.cache import KVCache, kv_bytes_per_block
from torch_shift.kv.host_tier import KVRegion, SwapExecutor
from torch_shift.models.fused import ROW_ARGMAX, argmax_list, sample_rows
from torch_shift.models.native_decoder import LaunchedStep, Redraft, redraft_counts_length
from torch_shift.parallel import comm
from torch_shift.parallel.launch import own_threads
from torch_shift.parallel.layout_model import LayoutModel, MicroBatch
from torch_shift.parallel.layouts import Deployment, Layout
from torch_shift.parallel.runs import RUN_WORDS, Run, clear_interrupt, interrupt, limit_word


class ModelRunner:
    def __init__(self, model: LayoutModel, kv_cache: KVCache, deployment: Deployment, rank: int, max_rows: int,
                 max_model_len: int, vocab_size: int, sliding_window: int | None = None,
                 attention_backend: str = "auto", compile: bool = False, host_tier: torch.Tensor | None = None,
                 kv_swap: str = "sync", interconnect_gbps: float | None = None,
                 barrier: Callable[[], None] | None = None, cuda_graphs: bool = False, host_cores: int | None = None,
                 decode_pool: bool = True, native_decode: bool = True, launch_steps: bool = False,
                 run_words: np.ndarray | None = None):
        """`host_tier`: the host tier's memory (torch_shift.kv.host_tier), shared by every rank, copies
        run `kv_swap` ("sync" or "async") and wait for every rank with `barrier` around them (None: one rank);
        `interconnect_gbps`: emulate a link of that bandwidth (comm.emulated_link); `cuda_graphs`: capture decode
        steps at start-up (torch_shift.engine.cuda_graphs; one rank on a GPU, Triton attention); `host_cores`:
        the cores this rank shares with the deployment's other local ranks, whose idle ones it borrows in a step
        that leaves them without work (`step_threads`; None: never); `decode_pool`: run steps whose matmuls all run the
        GEMV on that kernel's decode pool where the model's weights allow it (torch_shift.engine.decode_pool);
        `native_decode`: run them through one C++ call where the layout and model allow it
        (torch_shift.models.native_decoder); `launch_steps`: launch those of them that run on the decode pool on the
        C++ decoder's thread and return before their logits are written (asynchronous scheduling, one rank);
        `run_words`: the int64 words every rank shares, through which rank 0 interrupts multi-step runs
        (torch_shift.parallel.runs; None: a process's own with one rank, and no interrupt with several)."""
        pool.idle()  # another engine of this thread may hold its threads: this one compiles and starts with them
        self.model = model
        self.kv_cache = kv_cache
        self.deployment = deployment
        self.rank = rank
        self.replica = deployment.replica_of(rank)
        self.vocab_size = vocab_size
        self.device = kv_cache.device
        self.dtype = kv_cache.dtype
        self.attention = make_attention_backend(attention_backend, self.device, self.dtype)
        self.batch = InputBatch(max_rows, max_model_len, kv_cache.block_size, self.device, sliding_window)
        self._kv_views: dict[str, tuple[KVCache, KVRegion | None]] = {}
        # the suffix proposer's tree of earlier outputs (suffix.py's GlobalTree) that a redrafting check's drafts look
        # in too (GroupStep.redraft): rank 0's own (set by the engine), or on the ranks of another replica a copy
        # that adds what rank 0's took before each step (`copies_global_tree`, set by Worker.build)
        self.suffix_global_tree = None
        self.copies_global_tree = False
        self.swapper = None
        if host_tier is not None:
            assert barrier is not None or deployment.world_size == 1
            # the swapper reaches the runner weakly: an engine with a tier is freed when dropped, not at the
            # collector's next full pass (a runner <-> swapper cycle held the tier and the weights until then)
            pool_view = weakref.WeakMethod(self.pool_view)
            self.swapper = SwapExecutor(host_tier, kv_swap, self.replica,
                                        lambda layout_name: pool_view()(layout_name), barrier)
        self.interconnect_gbps = interconnect_gbps
        self.host_cores = host_cores
        # the intra-op threads of this rank's steps, whatever the calling thread's count is when one runs (the user's
        # torch.set_num_threads, another engine's rank 0 in the same process): dynamo guards on the count, and a
        # compiled forward called at one it was not compiled for has no graph for it (it raised "Recompilation
        # triggered"; compilation.CompiledForward now runs such a call eagerly)
        self.threads = (own_threads(host_cores, deployment.world_size) if host_cores is not None
                        else torch.get_num_threads())
        self._caller_threads: int | None = None  # the calling thread's count before the steps; given back after
        self.torch_state = TorchState.current()  # torch's settings of every step (engine/torch_state.py)
        kv_bytes_per_token = kv_bytes_per_block(kv_cache.num_layers, 1, kv_cache.num_kv_heads, kv_cache.head_dim,
                                                kv_cache.dtype)
        self.decode_pool = pool.DecodePool(model, self.device, decode_pool and isinstance(model, torch.nn.Module),
                                           kv_bytes_per_token)
        self.pool_requested = decode_pool and self.device.type == "cpu"  # the same on every rank (_warm_up)
        # the C++ decoder reads the attention the CPU paged kernel's steps install, and nothing else
        self.native_decode = (native_decode and self.device.type == "cpu" and self.attention.name == "cpu"
                              and model.native_decode())
        self.launch_steps = launch_steps and self.native_decode and deployment.world_size == 1
        self.had_no_work = False  # in the last step: no group of the plan computed anything on this rank
        if run_words is None and deployment.world_size == 1:
            run_words = np.zeros(RUN_WORDS, dtype=np.int64)
        assert run_words is None or len(run_words) >= RUN_WORDS
        self.run_words = run_words
        # plans with multi-step runs or redrafting checks so far: each one's number, the same on every rank
        self._num_runs = 0
        if compile:
            model.compile_layouts()
            self._warm_up()
            model.seal_compiled()
        if self.device.type == "cuda":
            self._warm_up_attention()
        self.graphs = None
        if cuda_graphs:
            from torch_shift.attention.triton_paged import TritonBackend
            from torch_shift.engine.cuda_graphs import DecodeGraphs

            (layout,) = deployment.layouts
            assert isinstance(self.attention, TritonBackend) and layout.kv_width == 1 and self.device.type == "cuda"
            self.graphs = DecodeGraphs(model, layout, kv_cache, max_rows, max_model_len, sliding_window)
            self.graphs.capture()
            model.reset_counters()

    def pool_view(self, layout_name: str) -> tuple[KVCache, KVRegion | None]:
        """This rank's pool as `layout_name` views it, and what it holds of the whole KV cache then
        (None for a layout over several replicas, viewed by KV width)."""
        if layout_name not in self._kv_views:
            layout = self.deployment[layout_name]
            if layout.kv_width > 1:
                self._kv_views[layout_name] = (self.kv_cache.view(layout.kv_width), None)
            else:
                region = self.model.kv_region(layout)
                self._kv_views[layout_name] = (self.kv_cache.regroup(region.num_layers, region.num_heads), region)
        return self._kv_views[layout_name]

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile every layout this rank runs now, at start-up, instead of in the first steps that use them: a
        step of two tokens (or one for every SP rank) through each (attention returning zeros; nothing read from or
        written to the KV cache). The ranks of a layout run it together, in the deployment's order of layouts. The
        token count is dynamic in the compiled graphs: later steps of any size reuse them."""
        # at least a token for every SP rank: a rank without rows runs no forward (ShiftModule._attend_only)
        num_tokens = max([2] + [layout.sp for layout in self.deployment.layouts])
        run_without_kv(self.model, self.deployment, self.rank, self.device, num_tokens, 1)
        if self.host_cores is not None:
            # dynamo guards on the thread count: a layout that may run alone on borrowed cores is compiled for
            # those counts too (every rank of the layout does this, at its own count in each, in the deployment's
            # order of layouts)
            own = own_threads(self.host_cores, self.deployment.world_size)
            assert torch.get_num_threads() == own, "the runtime gave this rank its own share of the cores"
            for layout in self.deployment.layouts_of(self.rank):
                for counts in borrowed_thread_counts(self.deployment, layout, self.host_cores):
                    torch.set_num_threads(counts[self.rank])
                    run_without_kv(self.model, self.deployment, self.rank, self.device, num_tokens, 1,
                                   layouts=[layout])
                    torch.set_num_threads(own)
        # and a layout whose small steps may run on the decode pool, for torch's one thread there
        # (a layout of one rank by whether its weights allow the pool; one of several ranks, whose warm-up runs its
        # collectives, by the setting every rank shares), unless the C++ decoder runs those steps
        pooled = [layout for layout in self.deployment.layouts_of(self.rank) if self._max_threads(layout) > 1
                  and (self.decode_pool.enabled and not self._native(layout) if len(layout.ranks) == 1
                       else self.pool_requested)]
        threads = torch.get_num_threads()
        if pooled:  # a rank of one thread runs them too: their collectives need every rank of the layout
            if threads > 1:
                pool.hold_one_thread(threads)
            try:
                run_without_kv(self.model, self.deployment, self.rank, self.device, num_tokens, 1, layouts=pooled)
            finally:
                pool.end_step()
        self.model.reset_counters()

    @property
    def native_step_tokens(self) -> int:
        """The most tokens of a step that the C++ decoder runs whole, where one rank holds the whole model and runs
        its small steps there; else 0."""
        if self.deployment.world_size != 1 or not self._native(self.deployment.layouts[0]):
            return 0
        return self.model.native_decoder.max_tokens

    @property
    def staged_check_tokens(self) -> int:
        """The most tokens of a batch-1 check this rank's C++ decoder runs in two stages (GroupStep.first_stage): with
        one rank, one launched on the decode pool; 0 where none does (Speculator.staged_check_tokens)."""
        if not self.native_decode:
            return 0
        tokens = self.model.staged_check_tokens()
        return min(tokens, self.decode_pool.max_tokens) if self.launch_steps else tokens

    def _native(self, layout: Layout) -> bool:
        """Whether the C++ decoder runs `layout`'s small steps on this rank alone (a replica's own; a
        tensor-parallel layout's run it inside the model's forward_step, in step with the other ranks)."""
        return (self.native_decode and layout.kv_width == 1 and len(layout.ranks) == 1
                and getattr(self.model, "native_decoder", None) is not None)

    def _max_threads(self, layout: Layout) -> int:
        """The most threads a rank of `layout` runs its steps on (the same on every rank of it)."""
        if self.host_cores is None:
            return self.threads
        counts = borrowed_thread_counts(self.deployment, layout, self.host_cores)
        return max([own_threads(self.host_cores, self.deployment.world_size)]
                   + [threads for by_rank in counts for threads in by_rank.values()])

    def _replays(self, inputs: HostInputs) -> bool:
        """Whether a captured graph runs this step: decodes only (one token and one logits row per run), no more
        of them than the largest bucket."""
        if self.graphs is None:
            return False
        return (inputs.num_decodes == inputs.num_runs == len(inputs.input_ids) == len(inputs.logits_indices)
                and self.graphs.bucket(inputs.num_runs) is not None)

    @torch.inference_mode()
    def _warm_up_attention(self) -> None:
        """Run the attention kernels (Triton's compile at their first launch, a second or more each) at start-up,
        not in the first served steps: steps of one decode (its token in block 0) and one two-token prompt
        (block 1) through every layout of this rank, real attention included: one with the decode's context in
        one block and, for the Triton backend, one with the longest context, which it splits in chunks (its
        blocks all block 0, read only). Blocks 0 and 1 hold no request yet; what the steps write there is
        overwritten before anything reads it."""
        device = self.device
        columns = self.batch.block_table.shape[1]
        for layout in self.deployment.layouts_of(self.rank):
            kv, _ = self.pool_view(layout.name)
            tpb = kv.block_size
            prompt_block = 1 if kv.num_blocks > 1 else 0
            longest = self.batch.max_model_len - 1 if self.attention.name == "triton" else 1
            for cached in sorted({1, max(1, longest)}):
                table = np.zeros((2, columns), np.int32)
                table[1, 0] = prompt_block
                batch = AttentionBatch(
                    num_decodes=1, query_start=np.array([0, 1], np.int32), query_len=np.array([1, 2], np.int32),
                    num_computed=np.array([cached, 0], np.int32), block_table=table,
                    block_table_rows=np.array([0, 1], np.int32), tokens_per_block=tpb,
                    slot_mapping=torch.tensor([1, prompt_block * tpb, prompt_block * tpb + 1], device=device),
                    positions=torch.tensor([cached, 0, 1], device=device), sliding_window=self.batch.sliding_window)
                step = MicroBatch(torch.zeros(3, dtype=torch.long, device=device), batch.positions,
                                  self.attention.build(batch, kv), torch.tensor([0, 2], device=device))
                self.model.forward_step(layout, [step])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.model.reset_counters()

    @torch.inference_mode()
    def execute(self, plan: StepPlan, previous_tokens: torch.Tensor | None = None,
                launch: bool = False, draws: np.ndarray | None = None) -> StepResult | None:
        """Rank 0: the logits of every group in plan order, and where the step's time went; other ranks: None.
        `previous_tokens`: the last step's sampled tokens, still on the device, where the plan's placeholders take
        their ids (asynchronous scheduling, one rank); `launch`: a step the C++ decoder runs may be launched on its
        thread and return before its logits are written (asynchronous scheduling, `launch_steps`), its tokens drawn
        there with `draws` where given (Sampler.draws), else its rows' argmax. Its callers run it under
        `torch_state` (LLMEngine.step, Worker.follow)."""
        launch = launch and self._launches(plan)
        if not launch:
            self.wait_launched()
        swap_seconds = 0.0
        if self.swapper is not None:
            start = time.perf_counter()
            self.swapper.run(plan.swap_outs, plan.swap_ins)
            swap_seconds = time.perf_counter() - start
        delta = plan.deltas.get(self.replica)
        if delta is not None:
            self.batch.apply(delta)
        if self.copies_global_tree and plan.global_tree_outputs:
            for token_ids in plan.global_tree_outputs:
                self.suffix_global_tree.add(token_ids)
        if self._caller_threads is None:
            self._caller_threads = torch.get_num_threads()
        threads = self.threads
        if self.host_cores is not None:
            threads = step_threads(self.deployment, [(group.layout, group.num_tokens) for group in plan.groups],
                                   self.rank, self.host_cores) or threads
            if threads != torch.get_num_threads():
                torch.set_num_threads(threads)  # each count's compiled graphs were made at start-up (_warm_up)
        mine = [group for group in plan.groups if self.rank in self.deployment[group.layout].ranks]
        self.had_no_work = all(self.model.idle_in(self.deployment[group.layout], group.num_tokens) for group in mine)
        tokens = sum(group.num_tokens for group in mine)
        # the C++ decoder hands attention's items to the pool's threads; elsewhere attention runs on the step's one
        # thread, and a long context keeps its threads (decode_pool.KV_SHARE_OF_WEIGHTS)
        kv_tokens = 0 if all(self._native(self.deployment[group.layout]) for group in mine) else sum(
            group.num_kv_tokens for group in mine)
        pooled = self.decode_pool.step(tokens, kv_tokens, threads, asynchronous=launch,
                                       num_steps=max((group.num_steps for group in mine), default=1))
        if launch and pooled:
            return self._launch(plan, previous_tokens, draws)
        if launch:  # the pool does not run it now: it runs here, after those launched
            self.wait_launched()
        return self._run_groups(plan, previous_tokens, swap_seconds)

    def _launches(self, plan: StepPlan) -> bool:
        """Whether the step may be launched on the C++ decoder's thread: the replica's own group, of no more tokens
        than the decode pool takes (a launched step's GEMVs run there; the C++ decoder takes as many or more), and no
        copies to or from the host tier."""
        if not self.launch_steps or len(plan.groups) != 1 or plan.swap_outs or plan.swap_ins:
            return False
        group = plan.groups[0]
        assert group.num_steps == 1, "a multi-step run is not launched: it waits for its tokens"
        return self._native(self.deployment[group.layout]) and 0 < group.num_tokens <= self.decode_pool.max_tokens

    def _launch(self, plan: StepPlan, previous_tokens: torch.Tensor | None, draws: np.ndarray | None) -> StepResult:
        """Launch the step on the C++ decoder's thread. Input ids that the step launched before it sampled (still
        running) are read by that thread when the step starts."""
        (group,) = plan.groups
        # a check is launched with nothing in flight (it follows its proposals, made from tokens on the host), and
        # waited for; its proposed tokens written where `prepare` reads the step's ids (unwritten, a launched check
        # read stale ids: seeded tokens changed, docs/performance.md)
        assert group.num_spec is None or previous_tokens is None, "a check is not launched behind another step"
        self.batch.write_spec_tokens(group, 0)
        layout = self.deployment[group.layout]
        kv, _ = self.pool_view(group.layout)
        host = self.batch.prepare(group, 0, layout.kv_width)
        placeholders = None
        if host.placeholders is not None and self._sampled_by_launched(previous_tokens):
            placeholders, previous_tokens = (host.placeholders, host.placeholder_sources), None
        inputs = self.batch.to_device(host, previous_tokens)
        self._count_run(plan)
        redraft = self._redraft(group, layout, 0)
        step = MicroBatch(inputs.input_ids, inputs.positions, self.attention.build(inputs.attention, kv),
                          inputs.logits_indices, group.first_stage, redraft)
        logits, launched = self.model.launch_step(layout, step, placeholders, draws)
        return StepResult([logits], launched=launched, redraft_counts=None if redraft is None else redraft.counts)

    def _count_run(self, plan: StepPlan) -> None:
        """Every rank counts each plan with a multi-step run or a redrafting check alike (their runs' numbers)."""
        if any(group.num_steps > 1 or group.redraft is not None for group in plan.groups):
            self._num_runs += 1

    def _redraft(self, group: GroupStep, layout: Layout, member: int) -> Redraft | None:
        """What the C++ decoder drafts a batch-1 check's later stages from (GroupStep.redraft): the request's tokens
        up to the check's first input id, as this rank's batch holds them (every rank of the layout the same), and
        the run words through which rank 0 ends it after a stage (its number counted as a run's), and on the layout's
        first rank the global tree (its drafts reach the layout's other ranks: share_draft)."""
        if group.redraft is None:
            return None
        row = int(group.rows[member][0])
        history = self.batch.token_ids[row, :int(group.num_computed[0]) + 1]
        # None on another rank, or where the check's drafts look only in the request's own tokens
        tree = self.suffix_global_tree if group.redraft.global_tree and self.rank == min(layout.ranks) else None
        run = Run(group.redraft.max_stages, group.stop_token_ids, None, self.run_words,
                  limit_word(self.deployment.layouts.index(layout)), self._num_runs, self.rank == layout.ranks[0])
        return Redraft.of(history, group.stop_token_ids, *group.redraft, tree, run)

    def _sampled_by_launched(self, tokens: torch.Tensor | None) -> bool:
        """Whether `tokens` are the argmax rows of the last step launched; else any launched step is waited for,
        and they are read here."""
        launched = self.model.native_decoder.launched
        if tokens is not None and launched and tokens.data_ptr() == launched[-1].row_argmax.ctypes.data:
            return True
        self.wait_launched()
        return False

    def wait_launched(self) -> None:
        """Wait for the steps launched on the C++ decoder's thread (helping with their GEMVs)."""
        if self.launch_steps:
            self.model.wait_launched()

    def interrupt_runs(self) -> None:
        """Rank 0, from any thread: a multi-step run in progress ends after its current step (a request arrived or
        was aborted); until `clear_run_interrupt`. A no-op where the ranks share no memory."""
        if self.run_words is not None:
            interrupt(self.run_words)

    def clear_run_interrupt(self) -> None:
        if self.run_words is not None:
            clear_interrupt(self.run_words)

    def end_step(self) -> None:
        """The engine's step returns to its caller: the thread gets its OpenMP threads back (the pool stays armed)."""
        pool.end_step()
        self._give_threads_back()

    def idle(self) -> None:
        """Out of work: the thread gets its threads back and the decode pool's threads sleep."""
        self.wait_launched()
        pool.idle()
        self._give_threads_back()

    def _give_threads_back(self) -> None:
        """The calling thread's intra-op thread count as it was before this engine's steps."""
        caller, self._caller_threads = self._caller_threads, None
        if caller is not None and caller != torch.get_num_threads():
            torch.set_num_threads(caller)

    def close(self) -> None:
        """The engine closes: as `idle`, and the decode pool's threads end."""
        self.wait_launched()
        pool.stop()

    def _run_groups(self, plan: StepPlan, previous_tokens: torch.Tensor | None,
                    swap_seconds: float) -> StepResult | None:
        if self.interconnect_gbps is None:
            return self._run_groups_here(plan, previous_tokens, swap_seconds)
        with comm.emulated_link(self.interconnect_gbps):
            return self._run_groups_here(plan, previous_tokens, swap_seconds)

    def _run_groups_here(self, plan: StepPlan, previous_tokens: torch.Tensor | None,
                         swap_seconds: float) -> StepResult | None:
        resharded_before = self.model.reshard_seconds
        logits: list[torch.Tensor | None] = [None] * len(plan.groups)
        redraft_counts = None
        self._count_run(plan)
        for i, group in enumerate(plan.groups):
            layout = self.deployment[group.layout]
            if self.rank not in layout.ranks or self.model.idle_in(layout, group.num_tokens):
                assert self.rank not in layout.ranks or layout.logits_rank != self.rank
                continue
            kv, _ = self.pool_view(group.layout)
            member = layout.replicas.index(self.replica)
            if group.num_steps > 1:
                drawn = self._run_steps(group, layout, kv, member)
                if self.rank == 0:
                    logits[i] = drawn
                elif layout.logits_rank == self.rank:  # the steps a run that ended early did not run: -1
                    sent = torch.full((group.num_steps, drawn.shape[1]), -1, dtype=torch.long)
                    sent[:len(drawn)] = drawn
                    dist.send(sent, dst=0, tag=i)
                continue
            self.batch.write_spec_tokens(group, member)
            redraft = self._redraft(group, layout, member)
            micro_batches = []
            for piece in split_micro_batches(group):  # the group itself, unless a pipeline cuts it
                host = self.batch.prepare(piece, member, layout.kv_width)
                if self._replays(host):
                    break
                inputs = self.batch.to_device(host, previous_tokens)
                micro_batches.append(MicroBatch(inputs.input_ids, inputs.positions,
                                                self.attention.build(inputs.attention, kv), inputs.logits_indices,
                                                piece.first_stage, redraft))
            if micro_batches:
                out = self.model.forward_step(layout, micro_batches)
            else:
                out = self.graphs.replay(host, previous_tokens)
            if self.rank == 0:
                logits[i] = out
                redraft_counts = redraft_counts if redraft is None else redraft.counts
            elif layout.logits_rank == self.rank and group.num_logits:
                dist.send(out.contiguous(), dst=0, tag=i)
                if group.first_stage:  # its stages and their tokens (core._take_redrafted, _unrun_second_stages)
                    argmax = getattr(out, ROW_ARGMAX, None)  # none where the decoder declined the check
                    drawn = np.full(group.num_logits, -1, dtype=np.int64) if argmax is None else argmax
                    counts = redraft.counts if redraft is not None else np.array([argmax is not None], np.int64)
                    dist.send(torch.from_numpy(np.concatenate([counts, drawn])), dst=0, tag=len(plan.groups) + i)
        if self.rank != 0:
            return None
        for i, group in enumerate(plan.groups):
            leader = self.deployment[group.layout].logits_rank
            if leader != 0 and group.num_steps > 1:
                drawn = torch.empty(group.num_steps, group.num_logits, dtype=torch.long)
                dist.recv(drawn, src=leader, tag=i)
                logits[i] = drawn[:int((drawn[:, 0] >= 0).sum())]
            elif leader != 0 and group.num_logits:
                logits[i] = torch.empty(group.num_logits, self.vocab_size, dtype=self.dtype, device=self.device)
                dist.recv(logits[i], src=leader, tag=i)
                if group.first_stage:  # a check in stages: whether the decoder ran it so, then its rows' argmax
                    num_counts = 1 if group.redraft is None else redraft_counts_length(group.redraft.max_stages)
                    received = torch.empty(num_counts + group.num_logits, dtype=torch.long)
                    dist.recv(received, src=leader, tag=len(plan.groups) + i)
                    if group.redraft is not None:
                        redraft_counts = received[:num_counts].numpy()
                    if received[0] > 0:  # else the decoder declined it: its logits are a one-stage check's
                        setattr(logits[i], ROW_ARGMAX, received[num_counts:].numpy())
        return StepResult(logits, swap_seconds, self.model.reshard_seconds - resharded_before,
                          redraft_counts=redraft_counts)

    def _run_steps(self, group: GroupStep, layout: Layout, kv: KVCache, member: int) -> torch.Tensor:
        """The decode steps of a multi-step run (GroupStep.num_steps): in one call where the model's decoder runs them
        all (LayoutModel.forward_steps), else one by one, every rank of the layout that computes drawing each row's
        token as the sampler would from the logits it holds whole (the argmax, or the kernel's draw with the plan's
        `run_draws`, those the sampler would have drawn with) and writing it where the next step reads its input id.
        The run ends early after a step in which a row drew one of the group's stop tokens (every such rank draws the
        same), or after the step in which rank 0 interrupted it (`interrupt_runs`; torch_shift.parallel.runs).
        Returns the tokens drawn, [steps run, rows] (int64, on the host)."""
        rows = group.rows[member]
        run = Run(group.num_steps, group.stop_token_ids, group.run_draws, self.run_words,
                  limit_word(self.deployment.layouts.index(layout)), self._num_runs, self.rank == layout.ranks[0])
        step = copy.copy(group)  # advanced a position per step
        drawn = None
        for j in range(group.num_steps):
            inputs = self.batch.to_device(self.batch.prepare(step, member, layout.kv_width))
            batch = MicroBatch(inputs.input_ids, inputs.positions, self.attention.build(inputs.attention, kv),
                               inputs.logits_indices)
            if j == 0:
                drawn = self.model.forward_steps(layout, batch, run)
                if drawn is not None:
                    return torch.from_numpy(drawn)
                drawn = np.empty((group.num_steps, len(rows)), dtype=np.int64)
            run.begin_step(j)
            out = self.model.forward_step(layout, [batch])
            assert out is not None and out.shape[0] == len(rows) and out.shape[1] >= self.vocab_size, (
                f"a rank of {layout.name} computing a multi-step run lacks the step's logits")
            logits = out if out.shape[1] == self.vocab_size else out[:, :self.vocab_size]
            if run.draws is None:
                drawn[j] = argmax_list(logits)
            else:
                tokens = sample_rows(logits, run.draws[j])
                assert tokens is not None, "the run's rows sample where the CPU kernel draws (Scheduler.sampled_runs)"
                drawn[j] = tokens.numpy()
            if run.ends_after(j, drawn[j]):
                return torch.from_numpy(drawn[:j + 1])
            step.num_computed = step.num_computed + 1
            step.num_kv_tokens += len(rows)
            self.batch.write_drawn(rows, step.num_computed, drawn[j])
        raise AssertionError("a run ends with its last step")


def step_threads(deployment: Deployment, groups: Sequence[tuple[str, int]], rank: int, host_cores: int) -> int | None:
    """The intra-op threads of `rank` in a step of `groups` (each group's layout and token count): its own share of
    the host's cores (host_cores // world size), or, where one layout is the step's only one, the host's cores split
    over that layout's ranks with rows: a DP replica (or Flying's TP group) alone with work borrows the idle ranks'
    cores, so that a lone request runs as fast as the host allows, and so do the SP ranks that hold a step of fewer
    tokens than SP ranks. The other SP ranks only attend to those few tokens with their heads, on one thread: the
    lent cores run the decode pool's workers, which spin between their jobs. None when the rank has no work."""
    if not any(rank in deployment[name].ranks for name, _ in groups):
        return None
    own = own_threads(host_cores, deployment.world_size)
    if len(groups) > 1:
        return own
    ((name, num_tokens),) = groups
    working = deployment[name].working_ranks(num_tokens)
    if rank not in working:
        return 1
    return max(own, host_cores // len(working))


def borrowed_thread_counts(deployment: Deployment, layout: Layout, host_cores: int) -> list[dict[int, int]]:
    """The threads of each rank of `layout` in each kind of step it may run alone on borrowed cores, where some rank
    runs other than its own share (`step_threads`); the same list on every rank."""
    own = own_threads(host_cores, deployment.world_size)
    counts: list[dict[int, int]] = []
    for num_tokens in range(1, layout.sp + 1):
        by_rank = {rank: step_threads(deployment, [(layout.name, num_tokens)], rank, host_cores)
                   for rank in layout.ranks}
        if any(threads != own for threads in by_rank.values()) and by_rank not in counts:
            counts.append(by_rank)
    return counts


def _zero_attention(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    sinks: torch.Tensor | None = None, sliding_window: int | None = None) -> torch.Tensor:
    return torch.zeros_like(q)


def run_without_kv(model: LayoutModel, deployment: Deployment, rank: int, device: torch.device, num_tokens: int,
                   num_logits: int, max_model_len: int | None = None, layouts: list[Layout] | None = None) -> None:
    """A step of `num_tokens` tokens (`num_logits` of them through the LM head) through every layout of `rank`
    (or those of `layouts`), attention returning zeros, nothing read from or written to a KV cache: to compile
    the layouts, or to measure what a step holds on the device. Positions stay below `max_model_len` (the rotary
    table's length). The ranks of a layout run it together, in the deployment's order of layouts."""
    for layout in layouts if layouts is not None else deployment.layouts_of(rank):
        batch = MicroBatch(torch.zeros(num_tokens, dtype=torch.long, device=device),
                           torch.arange(num_tokens, device=device) % (max_model_len or num_tokens), _zero_attention,
                           torch.arange(num_tokens - num_logits, num_tokens, device=device))
        model.forward_step(layout, [batch])


@dataclass
class StepResult:
    """Rank 0's result of a step: per group its logits (None: no logits rows), and the time this rank spent
    in tier copies and in switching weights between layouts."""

    # (a multi-step run's group: the tokens each step drew, int64 [num_steps, rows]; GroupStep.num_steps)
    logits: list[torch.Tensor | None]
    swap_seconds: float = 0.0
    reshard_seconds: float = 0.0
    launched: LaunchedStep | None = None  # the step runs on the C++ decoder's thread: its logits are written after
    # a batch-1 check whose later stages the C++ decoder drafted (GroupStep.redraft): what it wrote of the stages it
    # ran, once it ran (Redraft.counts; from another layout's logits rank, received with its rows' argmax)
    redraft_counts: np.ndarray | None = None
