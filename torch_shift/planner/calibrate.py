"""`torch-shift calibrate`: measure this machine into a hardware profile for the cost model.

A device is one CPU rank with `threads` intra-op threads, ranks talk over gloo; or (`device="cuda"`) one
GPU (several GPUs, NCCL collectives between them, are not measured yet: the GPU lent to this work was one).
Measured, each rate against the same ideal FLOP and byte counts the cost model uses
(`torch_shift.planner.shape`), with the GPU's sizes in brackets (on CPUs the device's rates again at each whole
multiple of its threads that divides the world: a layout alone with work borrows the idle ranks' cores):
  - matmul FLOP/s per dtype: a large matmul ([512, 2048] x [2048, 2048]; [2048, 2048] x [2048, 8192]);
  - weight-streaming bandwidth per dtype: matmuls over weights far beyond the last-level cache with
    1 to 64 rows of input (a decode step of 1 to 64 sequences reads its weights so), and with 1 row
    on every rank at once (-> node_bandwidth);
  - copy bandwidth: a plain copy of a 128 MB tensor (an elementwise kernel over 1 GiB);
  - attention: the engine's own backend (a decode batch over a paged KV cache: bandwidth; a 512-token
    prompt: FLOP/s; 64 x 2048 tokens of context and a 2,048-token prompt);
  - collectives on the engine's own functional collectives (`torch_shift.parallel.comm`) over gloo,
    for every group size that divides the world, each call after some compute as in a forward pass:
    alpha and beta fitted over a sweep of sizes;
  - the engine's per-step overhead: `LLMEngine.step` with a model whose forward does no work (as
    bench/bench_engine.py does), at several batch sizes; and the step plan's broadcast to the ranks.
On CPUs every measurement runs in ranks forked by `torch_shift.parallel.launch.run_ranks`, so the calling
process keeps its threads and state; a GPU is measured in the calling process (a forked process cannot use
CUDA once its parent has), its kernels replayed in CUDA graphs as the engine's decode steps are.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch

from torch_shift.planner.collectives import COLLECTIVE_OPS, CollectiveModel, fit_alpha_beta, wire_bytes
from torch_shift.planner.hardware import BORROWED_RATES, EngineOverhead, HardwareProfile
from torch_shift.planner.shape import ModelShape, Seq, attention

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLLECTIVE_SIZES = [1 << k for k in range(8, 21, 2)]  # elements of fp32: 1 KiB .. 4 MiB
MATMUL_ROWS = (1, 2, 4, 8, 16, 32, 64)  # past 64 rows a matmul here is compute-bound (measured)
OVERHEAD_BATCHES = (1, 16, 64)
PLAN_BATCHES = (1, 64)


def _best_time(fn: Callable[[], object], reps: int, warmup: int = 1, sync: Callable[[], None] | None = None) -> float:
    """The shortest of `reps` timed runs: other processes only ever slow a run down, so on a shared
    machine the best run is the nearest to the machine itself."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if sync is not None:
            sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _filled(shape: tuple[int, ...], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    # a constant fill: fast to make, and no denormals or NaNs that would slow the kernels
    return torch.full(shape, 0.01, dtype=dtype, device=device)


def _timed(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """`fn`, ending when its work on `device` has. On a GPU it runs captured in a CUDA graph, as the engine's
    decode steps run: on an H200, 16 matmuls over 512 MiB of weights streamed 1.3 TB/s launched one at a time
    from Python, 2.6 TB/s in a graph."""
    if device == "cpu":
        return fn
    fn()  # compiles and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return lambda: (graph.replay(), torch.cuda.synchronize())


# -- one device ---------------------------------------------------------------------------------------------
def _engine_matmul(weight: torch.Tensor):
    """x -> x @ weight.T as the engine's linear layers run it (packed where the machine allows)."""
    from torch_shift.models.linear import PackedWeight, linear, packing_supported

    packed = PackedWeight(weight) if packing_supported(weight.device, weight.dtype) else None
    return lambda x: linear(x, weight, None, packed)


def measure_matmul_flops(dtype: str, reps: int = 5, sync=None, device: str = "cpu") -> float:
    """A prompt chunk's matmul: 512 x 2048 x 2048 on a CPU; 2048 tokens through a 2048 -> 8192 projection on
    a GPU (a 1B model's MLP), where the CPU's shape takes microseconds."""
    m, k, n = (512, 2048, 2048) if device == "cpu" else (2048, 2048, 8192)
    a, w = _filled((m, k), TORCH_DTYPES[dtype], device), _filled((n, k), TORCH_DTYPES[dtype], device)
    matmul = _engine_matmul(w)
    return 2.0 * m * k * n / _best_time(_timed(lambda: matmul(a), device), reps, sync=sync)


def measure_weight_bandwidth(dtype: str, rows: int = 1, reps: int = 5, sync=None, device: str = "cpu") -> float:
    """Bytes/s of weights read by matmuls with `rows` rows of input (1: as a decode step of one sequence):
    4 weights of 4096 x 2048 (128 MiB in fp32), far beyond a CPU's last-level cache; on a GPU 16 of
    4096 x 4096 (512 MiB in bf16, beyond any GPU's L2)."""
    count, shape = (4, (4096, 2048)) if device == "cpu" else (16, (4096, 4096))
    weights = [_filled(shape, TORCH_DTYPES[dtype], device) for _ in range(count)]
    matmuls = [_engine_matmul(w) for w in weights]
    x = _filled((rows, shape[1]), TORCH_DTYPES[dtype], device)

    def run():
        for matmul in matmuls:
            matmul(x)

    nbytes = sum(w.numel() * w.element_size() for w in weights)
    return nbytes / _best_time(_timed(run, device), reps, sync=sync)


def measure_copy_bandwidth(reps: int = 5, sync=None, device: str = "cpu") -> float:
    """Bytes read plus written per second by a copy of 128 MB; on a GPU by an elementwise kernel over 1 GiB, the
    cost model's use of this rate (a plain copy is a memcpy node in a CUDA graph: 2.68 TB/s on an H200 whose
    kernels copied 4.1 TB/s)."""
    src = _filled((32 << 20,) if device == "cpu" else (256 << 20,), torch.float32, device)
    dst = torch.empty_like(src)
    copy = (lambda: dst.copy_(src)) if device == "cpu" else (lambda: torch.mul(src, 1.0, out=dst))
    return 2 * src.numel() * src.element_size() / _best_time(_timed(copy, device), reps, sync=sync)


def measure_host_link_bandwidth(reps: int = 5) -> float:
    """Bytes/s per direction between the GPU and pinned host memory (the host KV tier's swaps), the slower of
    the two directions, by copies of 256 MiB."""
    host = torch.empty(64 << 20, dtype=torch.float32, pin_memory=True)
    device = torch.empty_like(host, device="cuda")
    copies = (lambda: device.copy_(host, non_blocking=True), lambda: host.copy_(device, non_blocking=True))
    times = [_best_time(lambda copy=copy: (copy(), torch.cuda.synchronize()), reps, sync=torch.cuda.synchronize)
             for copy in copies]
    return host.numel() * host.element_size() / max(times)


def _attention_shape(dtype: str) -> ModelShape:
    return ModelShape(hidden_size=1024, intermediate_size=4096, num_layers=8, num_heads=16, num_kv_heads=4,
                      head_dim=64, vocab_size=1024, weight_dtype=dtype)


def measure_attention(dtype: str, reps: int = 3, device: str = "cpu") -> tuple[float, float]:
    """(bandwidth of a decode batch, FLOP/s of a prompt) of the engine's attention backend, against the
    ideal counts of shape.attention. Decode: 16 sequences of 512 tokens of context over 8 layers
    (134 MB of fp32 KV); prompt: 512 tokens from an empty cache. On a GPU: 64 sequences of 2048 tokens
    (1.07 GB of bf16 KV) and a prompt of 2048 tokens."""
    import numpy as np

    from torch_shift.attention import AttentionBatch, attention_backend
    from torch_shift.kv.cache import KVCache

    shape = _attention_shape(dtype)
    tdtype, layers, hq, hkv, d, block = TORCH_DTYPES[dtype], shape.num_layers, shape.num_heads, shape.num_kv_heads, \
        shape.head_dim, 16
    batch, context, prompt = (16, 512, 512) if device == "cpu" else (64, 2048, 2048)
    blocks_per_seq = max(context, prompt) // block + 1
    cache = KVCache(layers, batch * blocks_per_seq, block, hkv, d, tdtype, device=torch.device(device))
    for tensor in cache.k + cache.v:
        tensor.fill_(0.01)
    table = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    backend = attention_backend("auto", cache.device, tdtype)

    def step(runs: list[tuple[int, int]]) -> AttentionBatch:
        """(cached tokens, new tokens) per sequence, decodes first."""
        slots = np.concatenate([table[i, p // block].astype(np.int64) * block + p % block
                                for i, (c, n) in enumerate(runs) for p in [np.arange(c, c + n)]])
        lengths = np.array([n for _, n in runs], np.int32)
        return AttentionBatch(
            num_decodes=int((lengths == 1).sum()), query_start=(np.cumsum(lengths) - lengths).astype(np.int32),
            query_len=lengths, num_computed=np.array([c for c, _ in runs], np.int32), block_table=table,
            block_table_rows=np.arange(len(runs), dtype=np.int32), tokens_per_block=block,
            slot_mapping=torch.from_numpy(slots).to(device), positions=torch.from_numpy(slots).to(device),
            sliding_window=None)

    def filled(tokens: int, heads: int) -> torch.Tensor:
        return _filled((tokens, heads, d), tdtype, device)

    q, k, v = filled(batch, hq), filled(batch, hkv), filled(batch, hkv)
    run_decode = backend.build(step([(context, 1)] * batch), cache)
    decode_s = _best_time(_timed(lambda: [run_decode(i, q, k, v) for i in range(layers)], device), reps)
    decode_bytes = layers * attention(shape, [Seq(1, context)] * batch, hq, hkv).bytes

    q, k, v = filled(prompt, hq), filled(prompt, hkv), filled(prompt, hkv)
    run_prefill = backend.build(step([(0, prompt)]), cache)
    prefill_s = _best_time(_timed(lambda: [run_prefill(i, q, k, v) for i in range(layers)], device), reps)
    prefill_flops = layers * attention(shape, [Seq(prompt, 0)], hq, hkv).flops
    return decode_bytes / decode_s, prefill_flops / prefill_s


def _device_rank(rank: int, world: int, dtypes: list[str], device: str = "cpu") -> dict:
    result: dict = {"matmul_flops": {}, "matmul_bandwidth": {}, "attention_bandwidth": {}, "attention_flops": {},
                    "threads": torch.get_num_threads()}
    with torch.inference_mode():
        for dtype in dtypes:
            result["matmul_flops"][dtype] = measure_matmul_flops(dtype, device=device)
            result["matmul_bandwidth"][dtype] = [(rows, measure_weight_bandwidth(dtype, rows, reps=3, device=device))
                                                 for rows in MATMUL_ROWS]
            bandwidth, flops = measure_attention(dtype, device=device)
            result["attention_bandwidth"][dtype] = bandwidth
            result["attention_flops"][dtype] = flops
        result["copy_bandwidth"] = measure_copy_bandwidth(device=device)
    return result


# -- every rank at once: shared bandwidth, collectives, the step plan's broadcast ------------------------
def _collective_call(op: str, group, numel: int) -> Callable[[], object]:
    from torch_shift.parallel import comm

    n = group.size()
    x = _filled((n, max(1, numel // n)) if op == "all_to_all" else (numel,), torch.float32)
    fn = {"all_reduce": comm.all_reduce, "all_to_all": comm.all_to_all, "all_gather": comm.all_gather}[op]
    return lambda: fn(x, group)


def _send_recv_call(group_ranks: list[int], rank: int, numel: int) -> Callable[[], object]:
    """A ping-pong between the first two ranks of the group (one call = there and back)."""
    import torch.distributed as dist

    x = _filled((numel,), torch.float32)
    first, second = group_ranks[:2]

    def run():
        if rank == first:
            dist.send(x, second)
            dist.recv(x, second)
        elif rank == second:
            dist.recv(x, first)
            dist.send(x, first)

    return run


def _plan(num_seqs: int):
    """A decode step's plan as the engine broadcasts it: one sampled token per running row (deltas)."""
    import numpy as np

    from torch_shift.engine.step_plan import GroupStep, ReplicaDelta, StepPlan

    rows = np.arange(num_seqs, dtype=np.int32)
    ones = np.ones(num_seqs, dtype=np.int32)
    group = GroupStep("base", (rows,), ones, np.full(num_seqs, 500, dtype=np.int32), num_seqs, ones)
    return StepPlan({0: ReplicaDelta(token_rows=rows.tolist(), tokens=[1000 + i for i in range(num_seqs)])}, [group])


def _parallel_rank(rank: int, world: int, dtypes: list[str]) -> dict:
    import torch.distributed as dist

    from torch_shift.parallel import comm
    from torch_shift.parallel.shm import ShmCommunicator

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    # as ParallelRuntime runs them: the step plan and every group's collectives through shared memory where the
    # ranks share a host (torch_shift.parallel.shm), gloo elsewhere
    control = None
    try:
        control = ShmCommunicator.create(dist.group.WORLD, timeout_s=120)
        result: dict = {"matmul_flops": {}, "matmul_bandwidth": {}, "collectives": {}, "plan_broadcast_s": {},
                        "shared_memory": control is not None}
        with torch.inference_mode():
            for dtype in dtypes:  # every rank at once, started together
                result["matmul_flops"][dtype] = measure_matmul_flops(dtype, sync=dist.barrier)
                result["matmul_bandwidth"][dtype] = measure_weight_bandwidth(dtype, sync=dist.barrier)
            result["copy_bandwidth"] = measure_copy_bandwidth(sync=dist.barrier)

            for n in [n for n in range(2, world + 1) if world % n == 0]:
                # the world in consecutive groups of n ranks, all busy at once (as TP groups side by side)
                groups = [dist.new_group(list(range(g, g + n))) for g in range(0, world, n)]
                group_ranks = list(range(rank - rank % n, rank - rank % n + n))
                group = groups[rank // n]
                comm.share_memory(group, timeout_s=120)
                # Each collective follows some compute, as in a forward pass (a 1-row matmul over 16 MiB of
                # weights, about what a decode step computes between two collectives), and only the
                # collective is timed. On gloo here a call between computes took 1.2-1.5x one in a bare
                # burst and ~2x one timed alone after a barrier (measured): the peer is often still
                # computing when a rank arrives, and its communication thread must wait for a core.
                weight, x = _filled((4096, 1024), torch.float32), _filled((1, 1024), torch.float32)
                for op in COLLECTIVE_OPS:
                    if op == "send_recv" and n != 2:
                        continue  # point to point: one pair
                    points = []
                    for numel in COLLECTIVE_SIZES:
                        call = (_send_recv_call(group_ranks, rank, numel) if op == "send_recv"
                                else _collective_call(op, group, numel))
                        calls = max(4, min(16, (1 << 22) // (numel * 4)))
                        runs = []
                        for rep in range(5):
                            dist.barrier()
                            spent = 0.0
                            for _ in range(calls):
                                torch.nn.functional.linear(x, weight)
                                start = time.perf_counter()
                                call()
                                spent += time.perf_counter() - start
                            if rep:  # the first run warms up
                                runs.append(spent)
                        per_call = min(runs) / calls / (2 if op == "send_recv" else 1)
                        tensor_bytes = numel * 4 if op != "all_to_all" else n * max(1, numel // n) * 4
                        points.append((wire_bytes(op, n, tensor_bytes), per_call))
                    result["collectives"].setdefault(op, {})[n] = points
            for num_seqs in PLAN_BATCHES:  # the step plan, as ParallelRuntime.broadcast sends it
                plan = _plan(num_seqs)

                def broadcast():
                    if control is not None:
                        control.broadcast_object(plan if rank == 0 else None, src=0)
                    else:
                        dist.broadcast_object_list([plan if rank == 0 else None], src=0)

                result["plan_broadcast_s"][num_seqs] = _best_time(broadcast, reps=20, warmup=3, sync=dist.barrier)
        return result
    finally:
        comm.release_shared_memory()
        if control is not None:
            control.close()
        dist.destroy_process_group()


# -- the engine's own per-step cost -----------------------------------------------------------------------
class NullModel(torch.nn.Module):
    """Stands in for an engine's model: `forward_step(...)` does no work (zeros [logits rows, vocab]; no
    attention, no KV write), so that what is left of a step is the engine's own cost. `kv_region` is the
    replaced model's (how the runner views its KV pool)."""

    def __init__(self, vocab: int, max_tokens: int, model: torch.nn.Module, device: str = "cpu"):
        super().__init__()
        # Made under inference_mode like real activations: a view made in inference mode of a normal
        # tensor costs milliseconds to index outside it (PyTorch view bookkeeping), which is no engine cost.
        with torch.inference_mode():
            self.logits = torch.zeros(max_tokens, vocab, device=device)
        self.kv_region = model.kv_region
        self.reshard_seconds = 0.0

    def forward_step(self, layout, micro_batches):
        return self.logits[: sum(batch.logits_indices.shape[0] for batch in micro_batches)]

    def forward_steps(self, layout, batch, run):
        return None

    def idle_in(self, layout, num_tokens: int) -> bool:
        return False  # every rank of a step runs its (empty) forward, as the engine's collectives would have it


def _overhead_rank(rank: int, world: int, steps: int, device: str = "cpu") -> dict[int, float]:
    from torch_shift import LLM, SamplingParams
    from torch_shift.models.toy import tiny_llama_config, write_random_checkpoint

    vocab, prompt = 256, 16
    result = {}
    with tempfile.TemporaryDirectory(prefix="torch_shift_calibrate_") as tmp:
        model_dir = write_random_checkpoint(Path(tmp), tiny_llama_config(
            vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, head_dim=16, max_position_embeddings=4096))
        for n in OVERHEAD_BATCHES:
            # no CUDA graphs: a graph would replay the real model's kernels, not the null model; no C++ decoder,
            # which would run (and launch) the real model's small steps
            # a context of what the pool holds: a longer one would have the engine warn of its KV cache
            blocks = n * ((prompt + steps + 40) // 16 + 2)
            llm = LLM(str(model_dir), dtype="float32", max_num_seqs=n, max_num_batched_tokens=max(2048, n),
                      num_kv_blocks=blocks, max_model_len=min(4096, blocks * 16), enable_prefix_caching=False,
                      device=device, cuda_graphs=False, native_decode=False, num_scheduler_steps=1)
            engine = llm.engine
            engine.runner.model = NullModel(vocab, max(2048, n), engine.runner.model, device)
            params = SamplingParams(max_tokens=steps + 30, temperature=0.0, ignore_eos=True)
            for i in range(n):
                engine.add_request(f"r{i}", [3 + (i + j) % (vocab - 3) for j in range(prompt)], params)
            for _ in range(10):  # the prompts, then warm decode steps
                engine.step(final_only=True)
            assert len(engine.scheduler.running) == n
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step(final_only=True)
                times.append(time.perf_counter() - start)
            result[n] = statistics.median(times)
            llm.shutdown()
    return result


def _linear_fit(points: dict[int, float]) -> tuple[float, float]:
    """(intercept, slope) of a least-squares line through (x, y)."""
    xs, ys = list(points), list(points.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(0.0, my - slope * mx), max(0.0, slope)


# -- the profile ------------------------------------------------------------------------------------------
def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def cpu_seconds() -> tuple[float, float, float] | None:
    """(CPU seconds used on the whole machine, by this process and its finished children, wall clock);
    None where /proc/stat does not exist."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    busy = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    return busy, t.user + t.system + t.children_user + t.children_system, time.monotonic()


def other_cores(before: tuple[float, float, float] | None) -> float | None:
    """Cores that other processes kept busy since `before`."""
    after = cpu_seconds()
    if before is None or after is None:
        return None
    return max(0.0, (after[0] - before[0]) - (after[1] - before[1])) / (after[2] - before[2])


def _log_device(log: Callable[[str], None], what: str, solo: dict) -> None:
    log(f"  {what}: matmul " + ", ".join(f"{d} {r / 1e9:.1f} GFLOP/s" for d, r in solo["matmul_flops"].items())
        + "; weight streaming at 1/8/64 rows " + ", ".join(
            f"{d} " + "/".join(f"{r / 1e9:.1f}" for n, r in points if n in (1, 8, 64)) + " GB/s"
            for d, points in solo["matmul_bandwidth"].items())
        + f"; copy {solo['copy_bandwidth'] / 1e9:.1f} GB/s; attention decode "
        + ", ".join(f"{d} {r / 1e9:.1f} GB/s" for d, r in solo["attention_bandwidth"].items()) + ", prompt "
        + ", ".join(f"{d} {r / 1e9:.1f} GFLOP/s" for d, r in solo["attention_flops"].items()))


def _log_overhead(log: Callable[[str], None], steps: dict[int, float]) -> tuple[float, float]:
    step_s, seq_s = _linear_fit(steps)
    log("  engine step with a null model: " + ", ".join(f"{n} seqs {t * 1e3:.2f} ms" for n, t in steps.items())
        + f" -> {step_s * 1e3:.3f} ms + {seq_s * 1e6:.2f} us per sequence")
    return step_s, seq_s


def _calibrate_gpu(name: str | None, dtypes: tuple[str, ...], overhead_steps: int,
                   log: Callable[[str], None]) -> HardwareProfile:
    """One GPU, measured in this process (a forked rank cannot use CUDA once its parent has)."""
    start = time.perf_counter()
    gpu = torch.cuda.get_device_name()
    log(f"calibrate: one GPU ({gpu})")
    solo = _device_rank(0, 1, list(dtypes), "cuda")
    _log_device(log, "the GPU", solo)
    host_link = measure_host_link_bandwidth()
    log(f"  host link (pinned, per direction): {host_link / 1e9:.1f} GB/s")
    steps = _overhead_rank(0, 1, overhead_steps, "cuda")
    step_s, seq_s = _log_overhead(log, steps)
    wall = time.perf_counter() - start
    log(f"calibrate: done in {wall:.1f} s")
    return HardwareProfile(
        name=name or f"{gpu} (one GPU)", num_devices=1,
        device_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
        matmul_flops=solo["matmul_flops"], attention_flops=solo["attention_flops"],
        matmul_bandwidth=solo["matmul_bandwidth"], attention_bandwidth=solo["attention_bandwidth"],
        copy_bandwidth=solo["copy_bandwidth"], node_bandwidth=None, host_link_bandwidth=host_link,
        collectives=CollectiveModel({}),
        overhead=EngineOverhead(step_s, seq_s),
        source=(f"measured by torch-shift calibrate --device cuda: {gpu}, torch {torch.__version__}, "
                f"{platform.platform()}, {time.strftime('%Y-%m-%d')}"),
        measurements={"one_rank": solo, "engine_step_s": {str(n): t for n, t in steps.items()}, "wall_s": wall},
    )


def calibrate(world: int = 2, threads: int = 1, name: str | None = None, dtypes: tuple[str, ...] = ("fp32", "bf16"),
              overhead_steps: int = 40, log: Callable[[str], None] = print, device: str = "cpu") -> HardwareProfile:
    """Measure this machine (CPU ranks on gloo, or with `device="cuda"` one GPU) and return its profile."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if world < 1 or threads < 1:
        raise ValueError(f"world and threads must be >= 1, got world={world}, threads={threads}")
    unknown = [d for d in dtypes if d not in TORCH_DTYPES]
    if unknown:
        raise ValueError(f"dtypes {unknown} cannot be measured; use {', '.join(TORCH_DTYPES)}")
    if device == "cuda":
        if threads != 1:
            raise ValueError("threads sets a CPU rank's intra-op threads; a GPU is measured with its own")
        if world != 1:
            raise ValueError("calibrate measures one GPU (world=1): collectives between GPUs (NCCL) are not "
                             "measured yet")
        if not torch.cuda.is_available():
            raise ValueError("device='cuda': this machine has no CUDA GPU")
        return _calibrate_gpu(name, dtypes, overhead_steps, log)
    from torch_shift.parallel.launch import run_ranks

    cpus = os.cpu_count() or 1
    if world * threads > cpus:
        log(f"warning: {world} ranks x {threads} threads exceed this machine's {cpus} CPUs; rates will be low")
    start, cpu_start = time.perf_counter(), cpu_seconds()
    cpu = platform.processor() or platform.machine()
    log(f"calibrate: {world} rank(s) x {threads} thread(s) on {cpus} CPUs ({cpu})")
    solo = run_ranks(_device_rank, 1, list(dtypes), threads=threads)[0]
    _log_device(log, "one rank", solo)
    borrowed = {}  # a layout alone with work runs its ranks on the idle ranks' cores too (step_threads)
    for multiple in [m for m in range(2, world + 1) if world % m == 0 and threads * m <= cpus]:
        rates = run_ranks(_device_rank, 1, list(dtypes), threads=threads * multiple)[0]
        if rates["threads"] != threads * multiple:  # forked ranks keep one thread where OpenMP cannot be released
            log(f"  one rank on {threads * multiple} threads: not measured (the rank ran {rates['threads']})")
            break
        _log_device(log, f"one rank on {threads * multiple} threads (a layout alone borrows idle ranks' cores)", rates)
        borrowed[multiple] = {k: rates[k] for k in BORROWED_RATES}
    node_bandwidth = None
    collectives = CollectiveModel({})
    plan_step = plan_seq = 0.0
    ranks: list[dict] = []
    if world > 1:
        ranks = run_ranks(_parallel_rank, world, list(dtypes), threads=threads)
        # a parallel step waits for its slowest rank: the node streams world x the slowest rank's rate
        per_rank = [r["matmul_bandwidth"]["fp32" if "fp32" in dtypes else dtypes[0]] for r in ranks]
        node_bandwidth = world * min(per_rank)
        log(f"  {world} ranks at once: weight streaming " + ", ".join(f"{b / 1e9:.1f}" for b in per_rank)
            + f" GB/s per rank -> node {node_bandwidth / 1e9:.1f} GB/s (the slowest rank's x {world})")
        table = {}
        for op, by_size in ranks[0]["collectives"].items():
            table[op] = {}
            for n, points in by_size.items():
                fit = fit_alpha_beta([b for b, _ in points], [t for _, t in points])
                table[op][n] = fit
                log(f"  {op} over {n}: alpha {fit.alpha_s * 1e6:.1f} us, beta {fit.beta_bytes_per_s / 1e9:.2f} GB/s")
        collectives = CollectiveModel(table)
        plan_step, plan_seq = _linear_fit(ranks[0]["plan_broadcast_s"])
        log(f"  step plan broadcast: {plan_step * 1e6:.0f} us + {plan_seq * 1e6:.2f} us per sequence")
    steps = run_ranks(_overhead_rank, 1, overhead_steps, threads=threads)[0]
    step_s, seq_s = _log_overhead(log, steps)
    wall, others = time.perf_counter() - start, other_cores(cpu_start)
    log(f"calibrate: done in {wall:.1f} s" + ("" if others is None else
                                                f"; other processes kept {others:.2f} cores busy meanwhile"))
    if others is not None and others > 0.2:
        log("warning: this machine was not idle; its profile is slower than the machine (calibrate again when idle)")
    return HardwareProfile(
        name=name or f"{platform.node() or 'this machine'} ({world} x {threads} thread CPU ranks)",
        num_devices=world,
        device_memory_bytes=_memory_bytes() / world,
        matmul_flops=solo["matmul_flops"],
        attention_flops=solo["attention_flops"],
        matmul_bandwidth=solo["matmul_bandwidth"],
        attention_bandwidth=solo["attention_bandwidth"],
        copy_bandwidth=solo["copy_bandwidth"],
        node_bandwidth=node_bandwidth,
        borrowed=borrowed,
        collectives=collectives,
        overhead=EngineOverhead(step_s, seq_s, plan_step, plan_seq),
        source=(f"measured by torch-shift calibrate: {world} rank(s) x {threads} thread(s), torch {torch.__version__}, "
                f"{platform.platform()}, {time.strftime('%Y-%m-%d')}"),
        measurements={
            "one_rank": solo,
            "all_ranks": [{k: v for k, v in r.items() if k != "collectives"} for r in ranks],
            "collective_points": {op: {str(n): pts for n, pts in by_size.items()}
                                  for op, by_size in (ranks[0]["collectives"].items() if ranks else ())},
            "engine_step_s": {str(n): t for n, t in steps.items()},
            "wall_s": wall,
            "other_processes_cores": others,
        },
    )
