"""The shared-memory communicator against gloo's collectives in the same forked local ranks.

`python tests/test_shm.py` prints the latency of all_reduce through shared memory and through gloo at world 2.
"""

from __future__ import annotations

import os
import pickle
import platform
import queue
import random
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist

from torch_shift.parallel import groups as process_groups
from torch_shift.parallel.launch import LocalRanks, free_port, run_ranks
from torch_shift.parallel.shm import SEGMENT_PREFIX, ShmCommunicator

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]
SLOT_BYTES = 512  # small, so that most messages here go in chunks
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 5e-2), torch.float16: (2e-3, 5e-3)}


def _random(shape, dtype, generator) -> torch.Tensor:
    shape = (shape,) if isinstance(shape, int) else shape
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=generator, dtype=dtype)


def _unequal_splits(world: int, seed: int) -> list[list[int]]:
    """[sender][receiver] row counts, zeros included; the same on every rank."""
    rng = random.Random(seed)
    return [[rng.choice([0, 0, 1, 3, 9]) for _ in range(world)] for _ in range(world)]


def _match_gloo_rank(rank, world):
    dist.init_process_group("gloo")
    comm = ShmCommunicator.create(dist.group.WORLD, timeout_s=30.0, slot_bytes=SLOT_BYTES)
    assert comm is not None and (comm.rank, comm.world_size) == (rank, world)
    generator = torch.Generator().manual_seed(rank)
    for dtype in DTYPES:
        for numel in (1, 7, 128, 1000):  # 1000 float32: 4000 bytes, 8 chunks of the slot
            for x in (_random(numel, dtype, generator), _random((3, numel), dtype, generator)[1:].t()):
                expected = x.clone()
                dist.all_reduce(expected)
                got = comm.all_reduce(x)
                assert got.shape == x.shape and got.dtype == dtype
                if dtype.is_floating_point:
                    rtol, atol = TOLERANCE[dtype]
                    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
                else:
                    assert torch.equal(got, expected)
                gathered = [torch.empty_like(x) for _ in range(world)]
                dist.all_gather(gathered, x.contiguous())
                assert torch.equal(comm.all_gather(x), torch.stack(gathered))
        for rows in (world, 4 * world, 64 * world):  # the last: larger than a slot
            x = _random((rows, 5), dtype, generator)
            expected = torch.empty_like(x)
            dist.all_to_all_single(expected, x)
            assert torch.equal(comm.all_to_all(x), expected)
        # the last case: every rank but the last sends and receives equal parts, the last does not
        mixed = [[1] * (world - 1) + [1 if p < world - 1 else 5] for p in range(world)]
        for case in range(5):
            splits = _unequal_splits(world, case * 10 + 1 + (100 if dtype == torch.int64 else 0))
            if case == 3:
                splits = [[20 * n for n in row] for row in splits]  # larger than a slot
            elif case == 4:
                splits = mixed
            in_rows, out_rows = splits[rank], [splits[p][rank] for p in range(world)]
            x = _random((sum(in_rows), 3), dtype, generator)
            expected = torch.empty((sum(out_rows), 3), dtype=dtype)
            dist.all_to_all_single(expected, x, out_rows, in_rows)
            assert torch.equal(comm.all_to_all(x, in_rows, out_rows), expected)
    for src in range(world):
        for size in (10, 5 * SLOT_BYTES + 3):
            obj = {"from": src, "payload": bytes(range(256)) * (size // 256) + b"x" * (size % 256)}
            box = [obj if rank == src else None]
            dist.broadcast_object_list(box, src=src)
            assert comm.broadcast_object(obj if rank == src else None, src=src) == box[0] == obj
    comm.barrier()
    # every rank returns the same bytes
    x = torch.randn(3000, generator=generator)
    results = [comm.all_reduce(x).numpy().tobytes(), comm.all_reduce(x[:100]).numpy().tobytes(),
               comm.all_reduce(x.to(torch.bfloat16)).view(torch.int16).numpy().tobytes()]
    comm.close()
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_match_gloo_and_all_reduce_is_bit_identical_on_every_rank(world):
    results = run_ranks(_match_gloo_rank, world, timeout_s=120)
    assert all(r == results[0] for r in results)


def _input(step: int, group_rank: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Small integers (exact in every dtype here, also summed over 4 ranks): every rank can compute any rank's."""
    numel = 1
    for n in shape:
        numel *= n
    return ((torch.arange(numel) * (group_rank + 1) + step) % 31).to(dtype).view(shape)


def _interleaved_rank(rank, world, num_ops, unsorted_as_torch_2_11):
    dist.init_process_group("gloo")
    custom_order = [3, 1, 0, 2]
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    make_group = process_groups._new_group_unsorted if unsorted_as_torch_2_11 else process_groups.new_group_in_order
    custom = make_group(custom_order)
    members = {"world": list(range(world)), "pair": [rank - rank % 2, rank - rank % 2 + 1], "custom": custom_order}
    groups = {"world": dist.group.WORLD, "pair": pairs[rank // 2], "custom": custom}
    comms = {name: ShmCommunicator.create(group, timeout_s=30.0, slot_bytes=SLOT_BYTES)
             for name, group in groups.items()}
    assert comms["custom"].rank == custom_order.index(rank) and comms["pair"].world_size == 2
    # the custom order is the group's rank order, as gloo's
    x = torch.tensor([float(rank)])
    gathered = [torch.empty(1) for _ in custom_order]
    dist.all_gather(gathered, x, group=custom)
    assert torch.equal(comms["custom"].all_gather(x), torch.stack(gathered))
    assert comms["custom"].all_gather(x).flatten().tolist() == [float(r) for r in custom_order]

    rng = random.Random(0)  # the same choices on every rank
    for step in range(num_ops):
        name = rng.choice(list(comms))
        comm, n, me = comms[name], len(members[name]), comms[name].rank
        op = rng.choice(["all_reduce", "all_gather", "all_to_all", "all_to_all_v", "broadcast", "barrier"])
        dtype = rng.choice(DTYPES)
        shape = rng.choice([(), (1,), (5, 3), (40,), (300,), (2, 150)])
        if op == "all_reduce":
            expected = sum(_input(step, r, shape, torch.float64) for r in range(n)).to(dtype)
            assert torch.equal(comm.all_reduce(_input(step, me, shape, dtype)), expected), (step, name, op)
        elif op == "all_gather":
            expected = torch.stack([_input(step, r, shape, dtype) for r in range(n)])
            assert torch.equal(comm.all_gather(_input(step, me, shape, dtype)), expected), (step, name, op)
        elif op == "all_to_all":
            rows = rng.choice([1, 3, 50])
            parts = [_input(step, r, (n * rows, 2), dtype).chunk(n) for r in range(n)]
            expected = torch.cat([parts[r][me] for r in range(n)])
            assert torch.equal(comm.all_to_all(_input(step, me, (n * rows, 2), dtype)), expected), (step, name, op)
        elif op == "all_to_all_v":
            splits = _unequal_splits(n, step)
            parts = [_input(step, r, (sum(splits[r]), 2), dtype).split(splits[r]) for r in range(n)]
            expected = torch.cat([parts[r][me] for r in range(n)])
            got = comm.all_to_all(_input(step, me, (sum(splits[me]), 2), dtype), splits[me],
                                  [splits[r][me] for r in range(n)])
            assert torch.equal(got, expected), (step, name, op)
        elif op == "broadcast":
            src = rng.randrange(n)
            obj = (step, "x" * rng.choice([0, 10, 3000]))
            assert comm.broadcast_object(obj if me == src else None, src=src) == obj, (step, name, op)
        else:
            comm.barrier()
    for comm in comms.values():
        comm.close()
    return num_ops


@pytest.mark.parametrize("unsorted_as_torch_2_11", [False, True])
def test_several_communicators_interleaved_back_to_back(unsorted_as_torch_2_11):
    """A world of 4, its two pairs and a custom rank order, used in one random sequence of collectives of
    every kind, dtype and size (many in chunks), each result checked. The custom order's group as this torch
    makes it (new_group's sort_ranks=False where it has it) and as groups.py makes it on torch 2.11, which lacks it."""
    assert run_ranks(_interleaved_rank, 4, 300, unsorted_as_torch_2_11, timeout_s=120) == [300] * 4


def _die_inside_rank(rank, world, victim, op):
    dist.init_process_group("gloo")
    comm = ShmCommunicator.create(dist.group.WORLD, timeout_s=10.0, slot_bytes=SLOT_BYTES)
    comm.all_reduce(torch.ones(4))
    if rank == victim:
        time.sleep(0.3)  # the others are waiting inside the collective
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        if op == "broadcast_object":
            comm.broadcast_object(None, src=victim, timeout_s=None)  # a worker idling for the next step
        else:
            comm.all_reduce(torch.ones(1000))  # in chunks
    except RuntimeError as e:
        error, elapsed = str(e), time.monotonic() - start
    else:
        raise AssertionError("the collective ended although a rank died")
    with pytest.raises(RuntimeError, match="failed earlier"):
        comm.barrier()
    return error, elapsed


@pytest.mark.parametrize("victim,op", [(1, "all_reduce"), (0, "broadcast_object")])
def test_a_rank_killed_inside_a_collective_ends_every_other_rank_with_an_error(victim, op):
    world = 3
    ranks = LocalRanks(_die_inside_rank, world, list(range(world)), victim, op, port=free_port())
    try:
        outputs = {}
        while len(outputs) < world - 1:
            rank, status, value = ranks.results.get(timeout=30)
            assert status == "ok", value
            outputs[rank] = pickle.loads(value)
        ranks.procs[victim].join(5)
        assert ranks.procs[victim].exitcode == -signal.SIGKILL
    except queue.Empty:
        pytest.fail(f"the surviving ranks did not end: {ranks.failed()}")
    finally:
        ranks.stop(grace_s=1.0)
    assert victim not in outputs
    for error, elapsed in outputs.values():
        assert f"rank {victim} (pid {ranks.procs[victim].pid}) died during {op} #2" in error
        assert elapsed < 3.0  # the timeout is 10 s


def _stall_rank(rank, world):
    dist.init_process_group("gloo")
    idle = ShmCommunicator.create(dist.group.WORLD, timeout_s=0.2)
    stalled = ShmCommunicator.create(dist.group.WORLD, timeout_s=1.0)
    closing = ShmCommunicator.create(dist.group.WORLD, timeout_s=10.0)
    if rank == 1:
        time.sleep(1.0)
        idle.broadcast_object("next step", src=1)
        time.sleep(2.5)  # instead of joining the all_reduce
        closing.close()
        return None
    # a worker waiting for its next message without a deadline, longer than the communicator's timeout
    cpu_start = time.process_time()
    assert idle.broadcast_object(src=1, timeout_s=None) == "next step"
    idle_cpu_s = time.process_time() - cpu_start
    errors = []
    for comm in (stalled, closing):
        start = time.monotonic()
        with pytest.raises(RuntimeError) as error:
            comm.all_reduce(torch.ones(3))
        errors.append((str(error.value), time.monotonic() - start))
    return idle_cpu_s, errors


def test_a_stalled_rank_ends_the_others_at_the_timeout_and_a_closed_one_at_once():
    idle_cpu_s, [(stall, stall_s), (closed, closed_s)] = run_ranks(_stall_rank, 2)[0]
    assert idle_cpu_s < 0.25  # of the 1 s it waited: it sleeps after a short spin
    assert stall == "rank 1 did not reach all_reduce #1 within 1 s"
    assert 1.0 <= stall_s < 2.0  # (slack for a loaded machine)
    assert closed == "rank 1 closed the communicator before all_reduce #1"
    assert closed_s < 2.5  # rank 1 closes about 1.5 s into it


def _wake_rank(rank, world):
    """A rank asleep on its peer's counter (its sleeps bounded by a minute here, not 10 ms) is woken by the peer's
    next step, published from Python (a broadcast, an all-reduce) and from C++ (the operator of compiled forwards)."""
    from torch_shift.kernels import cpu_ops
    from torch_shift.parallel import comm as parallel_comm
    from torch_shift.parallel import shm

    shm._MAX_SLEEP_S = shm._LIVENESS_INTERVAL_S = 60.0
    dist.init_process_group("gloo")
    assert parallel_comm.share_memory(dist.group.WORLD, timeout_s=120.0)
    communicator_id = parallel_comm._shared_id(dist.group.WORLD)
    comm = parallel_comm._shared_by_id[communicator_id]
    native = cpu_ops() is not None and comm.native_id == communicator_id
    steps = [lambda: comm.broadcast_object("plan" if rank == 1 else None, src=1, timeout_s=None),
             lambda: comm.all_reduce(torch.ones(4))]
    if native:
        steps.append(lambda: torch.ops.torch_shift.shm_all_reduce(torch.ones(4), communicator_id))
    waits = []
    for step in steps:
        dist.barrier()
        if rank == 1:
            time.sleep(0.6)  # rank 0 spins 1 ms, then sleeps on rank 1's counter
        sleeps, cpu_start, start = comm.sleeps, time.process_time(), time.monotonic()
        result = step()
        waits.append((time.monotonic() - start, time.process_time() - cpu_start, comm.sleeps - sleeps))
        assert result == "plan" if isinstance(result, str) else torch.equal(result, torch.full((4,), 2.0))
        assert comm._header[comm._my_row + shm._SLEEPING] == 0
    parallel_comm.release_shared_memory()
    return native, waits


def test_a_sleeping_rank_is_woken_by_its_peer_s_next_step():
    (native, waits), _ = run_ranks(_wake_rank, 2)
    assert len(waits) == (3 if native else 2)
    for wall_s, cpu_s, sleeps in waits:
        assert 0.3 < wall_s < 10.0, waits  # woken, not at its one-minute bound (0.3 s of slack for either rank)
        assert sleeps >= 1 and cpu_s < 0.1, waits  # asleep in the kernel, not spinning


def _nap_rank(rank, world):
    """Rank 0 waits for rank 1's broadcast in naps (a worker without work in the last step: Worker.follow): it gets
    the message, asleep between its looks and unannounced, and rank 1 publishes without a futex wake; a wait
    longer than the naps' bound (a server idling) sleeps until woken."""
    from torch_shift.parallel import shm

    shm._NAPS_FOR_S = 1.0  # a tenth of a second's hiccup on a loaded machine outlasted 0.1 s of naps
    dist.init_process_group("gloo")
    comm = ShmCommunicator.create(dist.group.WORLD, timeout_s=30.0, slot_bytes=SLOT_BYTES)
    wakes = []
    futex = shm._futex

    def counted_futex(address, op, *args):
        if op == shm._FUTEX_WAKE:
            wakes.append(address)
        return futex(address, op, *args)

    shm._futex = counted_futex
    results = []
    # the second in several chunks of slots; the third after the naps' bound
    for message, delay_s in (("plan", 0.05), ({"step": 2, "tokens": list(range(300))}, 0.05), ("later", 1.5)):
        dist.barrier()
        if rank == 1:
            time.sleep(delay_s)
        sleeps, cpu_start, start = comm.sleeps, time.process_time(), time.monotonic()
        got = comm.broadcast_object(message if rank == 1 else None, src=1, timeout_s=None,
                                    nap_s=0.002 if rank == 0 else None)
        results.append((got == message, time.monotonic() - start, time.process_time() - cpu_start,
                        comm.sleeps - sleeps))
    wakes = list(wakes)  # those of the three broadcasts, not of close's own wait
    comm.close()
    return results, wakes


def test_a_napping_rank_gets_the_broadcast_without_a_wake_up_call():
    (napped, _), (sent, wakes) = run_ranks(_nap_rank, 2)
    assert all(received for received, *_ in napped + sent)
    for _, wall_s, cpu_s, sleeps in napped[:2]:
        assert 0.04 < wall_s < 5.0 and sleeps == 0 and cpu_s < 0.03, napped  # in naps: never on the futex
    assert len(wakes) == 1  # rank 1 woke rank 0 only for the third, which it slept for past the naps' bound
    _, wall_s, cpu_s, sleeps = napped[2]
    assert 1.2 < wall_s < 6.0 and sleeps >= 1 and cpu_s < 0.2, napped


def _native_all_reduce_rank(rank, world):
    """The all-reduce operator of compiled forwards, in C++ (kernels/cpu_ops.cpp), between the communicator's
    Python collectives: the same sums on every rank as gloo's; a peer late by more than its spin (the rest waited
    in Python), one that sent another size (an error on both), one that died (an error within the timeout)."""
    from torch_shift.kernels import cpu_ops
    from torch_shift.parallel import comm as parallel_comm

    dist.init_process_group("gloo")
    if not cpu_ops():
        return None
    assert parallel_comm.share_memory(dist.group.WORLD, timeout_s=5.0)
    communicator_id = parallel_comm._shared_id(dist.group.WORLD)
    comm = parallel_comm._shared_by_id[communicator_id]
    assert comm._native_id == communicator_id
    assert torch._C._dispatch_has_kernel_for_dispatch_key("torch_shift::shm_all_reduce", "CPU")
    op = torch.ops.torch_shift.shm_all_reduce
    generator = torch.Generator().manual_seed(rank)
    sums = []
    cases = [((1, 1024), torch.float32), ((7, 1024), torch.bfloat16), ((0, 16), torch.float32), ((3000,), torch.float32),
             ((2, 5), torch.float16), ((4 << 20,), torch.float32)]  # the last two: Python's (float16, chunks)
    for i, (shape, dtype) in enumerate(cases):
        x = _random(shape, dtype, generator)
        if rank == 1 and i == 1:
            time.sleep(0.05)  # rank 0 hands this one to Python
        expected = x.clone()
        dist.all_reduce(expected)
        got = op(x, communicator_id)
        assert got.shape == x.shape and got.dtype == dtype
        if dtype.is_floating_point:
            rtol, atol = TOLERANCE[dtype]
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol)
        sums.append(got.view(torch.uint8).numpy().tobytes() if got.numel() else b"")
        assert comm.broadcast_object({"step": i} if rank == 0 else None) == {"step": i}  # Python's steps between
    assert comm._collectives == 12
    with pytest.raises(ValueError, match="different collectives, or with different sizes"):
        op(torch.ones(3 + rank), communicator_id)
    with pytest.raises(RuntimeError, match="failed earlier"):
        op(torch.ones(3), communicator_id)
    parallel_comm.release_shared_memory()
    # a peer that dies before the operator's all-reduce
    assert parallel_comm.share_memory(dist.group.WORLD, timeout_s=5.0)
    communicator_id = parallel_comm._shared_id(dist.group.WORLD)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) died during all_reduce #1"):
        op(torch.ones(3), communicator_id)
    return sums, time.monotonic() - start


def test_the_cpp_all_reduce_operator_matches_gloo_and_ends_on_errors():
    ranks = LocalRanks(_native_all_reduce_rank, 2, [0, 1], port=free_port())
    try:
        rank, status, value = ranks.results.get(timeout=60)
        assert (rank, status) == (0, "ok"), value
        result = pickle.loads(value)
    finally:
        ranks.stop(grace_s=1.0)
    if result is None:
        pytest.skip("the C++ operator library does not build here")
    sums, elapsed = result
    assert len(sums) == 6 and elapsed < 3.0


def _segment_mappings() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if SEGMENT_PREFIX in line]


def _segments() -> set[str]:
    """The shared-memory segment files this process maps (a forked rank also maps those its parent did)."""
    return {line.split()[-2] for line in _segment_mappings()}


def _setup_and_misuse_rank(rank, world):
    inherited = _segments()  # from communicators of the test process that forked this one
    dist.init_process_group("gloo")
    singletons = [dist.new_group([r]) for r in range(world)]
    assert ShmCommunicator.create(singletons[rank], timeout_s=5.0) is None
    # ranks that see different hosts, or a machine whose memory model the protocol does not rely on: gloo stays
    gethostname, machine = socket.gethostname, platform.machine
    if rank == 1:
        socket.gethostname = lambda: "elsewhere"
    assert ShmCommunicator.create(dist.group.WORLD, timeout_s=5.0) is None
    socket.gethostname = gethostname
    if rank == 0:
        platform.machine = lambda: "aarch64"
    assert ShmCommunicator.create(dist.group.WORLD, timeout_s=5.0) is None
    platform.machine = machine
    with pytest.raises(ValueError, match="multiple of 64"):
        ShmCommunicator.create(dist.group.WORLD, timeout_s=5.0, slot_bytes=1000)

    comm = ShmCommunicator.create(dist.group.WORLD, timeout_s=5.0, slot_bytes=SLOT_BYTES)
    # the file is gone once every rank has mapped it (rank 0 removes it as it leaves create); the mapping lives
    dist.barrier()
    # one new file, removed; the kernel may list its mapping as more than one range (seen on CI)
    (segment,) = _segments() - inherited
    assert all(line.endswith("(deleted)") for line in _segment_mappings() if segment in line)
    with pytest.raises(ValueError, match="CPU"):
        comm.all_reduce(torch.ones(3, device="meta"))
    with pytest.raises(TypeError):
        comm.all_gather([1.0, 2.0])
    with pytest.raises(ValueError, match="input_split_sizes"):
        comm.all_to_all(torch.ones(5), [1, 1], [1, 1])
    with pytest.raises(ValueError, match="equal parts"):
        comm.all_to_all(torch.ones(5))
    with pytest.raises(ValueError, match="src"):
        comm.broadcast_object(1, src=world)
    with pytest.raises(TypeError, match="cannot sum"):
        comm.all_reduce(torch.zeros(3, dtype=torch.uint16))
    assert torch.equal(comm.all_gather(torch.zeros(3, dtype=torch.uint16)), torch.zeros(world, 3, dtype=torch.uint16))
    assert torch.equal(comm.all_reduce(torch.ones(3)), torch.full((3,), float(world)))  # still usable
    # inside and outside inference mode, the same shape (its cached views) both ways; an input requiring grad
    with torch.inference_mode():
        assert torch.equal(comm.all_reduce(torch.ones(2, 2)), torch.full((2, 2), float(world)))
        assert torch.equal(comm.all_gather(torch.ones(2)), torch.ones(world, 2))
    assert torch.equal(comm.all_reduce(torch.ones(2, 2)), torch.full((2, 2), float(world)))
    assert torch.equal(comm.all_gather(torch.ones(2, requires_grad=True)), torch.ones(world, 2))
    # the ranks disagree: every rank says so, and the communicator is done
    with pytest.raises(ValueError, match="different collectives"):
        comm.all_reduce(torch.ones(4 + rank))
    with pytest.raises(RuntimeError, match="failed earlier"):
        comm.barrier()
    comm.close()
    comm.close()
    assert _segments() == inherited
    with pytest.raises(RuntimeError, match="closed"):
        comm.all_reduce(torch.ones(3))
    return True


def test_setup_where_shared_memory_cannot_serve_and_a_caller_s_mistakes():
    assert run_ranks(_setup_and_misuse_rank, 2) == [True, True]


def _latency_rank(rank, world, sizes, repeats):
    dist.init_process_group("gloo")
    comm = ShmCommunicator.create(dist.group.WORLD, timeout_s=60.0)
    rows = []
    for nbytes in sizes:
        x = torch.randn(nbytes // 4)
        calls = max(10, min(repeats, (64 << 20) // nbytes))
        timings = {}
        for name, call in (("shm", lambda x=x: comm.all_reduce(x)), ("gloo", lambda x=x: dist.all_reduce(x.clone()))):
            for _ in range(3):
                call()
            best = float("inf")
            for _ in range(5):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                best = min(best, (time.perf_counter() - start) / calls)
            timings[name] = best
        rows.append((nbytes, timings["shm"], timings["gloo"]))
    comm.close()
    return rows


def print_latency_table(world: int = 2) -> None:
    """all_reduce of float32 at world 2, one intra-op thread per rank: the best of 5 runs of back-to-back calls
    (the gloo calls include a clone, as all_reduce here returns a new tensor)."""
    sizes = [4 << 10, 64 << 10, 1 << 20, 8 << 20]
    rows = run_ranks(_latency_rank, world, sizes, 2000, timeout_s=600)[0]
    print(f"all_reduce float32, world {world}, {os.cpu_count()} cores")
    print(f"{'bytes':>10} {'shm us':>10} {'gloo us':>10} {'speed-up':>9}")
    for nbytes, shm_s, gloo_s in rows:
        print(f"{nbytes:>10} {shm_s * 1e6:>10.1f} {gloo_s * 1e6:>10.1f} {gloo_s / shm_s:>8.1f}x")


if __name__ == "__main__":
    print_latency_table()
