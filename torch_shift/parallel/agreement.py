"""Ranks of one program (torchrun) agreeing on what they build: every rank calls `parallelize`, `LLM(...)` or a
parallelized module's forward with the same arguments, and a rank whose arguments differ made the others fail
deep inside a collective (gloo aborts the process on a size mismatch) or, worse, run on silently. Each such call
compares digests of its arguments across the ranks first and raises the same ValueError on every rank, naming what
differs."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import numbers
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import PurePath
from typing import Any

import torch
import torch.distributed as dist


def value_digest(value: Any) -> str:
    """A value's contents as a digest that processes compare: numbers by value, arrays by their elements, dicts
    and sets by sorted keys, dataclasses by their fields, dtypes, devices, enums and paths by their names,
    functions by their qualified names, other objects by their type (their repr may hold an address that differs
    between processes)."""
    digest = hashlib.blake2b(digest_size=16)

    def feed(value) -> None:
        if not isinstance(value, numbers.Number) and callable(getattr(value, "tolist", None)):
            value = value.tolist()  # an array or tensor of token ids: its elements
        if value is None or isinstance(value, (bool, str, bytes)):
            digest.update(repr(value).encode())
        elif isinstance(value, numbers.Integral):  # numpy's integers too
            digest.update(b"i%d" % int(value))
        elif isinstance(value, numbers.Real):
            digest.update(repr(float(value)).encode())
        elif isinstance(value, (list, tuple)):
            digest.update(b"[%d" % len(value))
            for item in value:
                feed(item)
        elif isinstance(value, (dict, set, frozenset)):  # in an order that no process's hash seed decides
            items = sorted(value.items() if isinstance(value, dict) else ((item, None) for item in value),
                           key=lambda pair: repr(pair[0]))
            digest.update(b"{%d" % len(items))
            for key, item in items:
                feed(key)
                feed(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            digest.update(type(value).__qualname__.encode())
            for field in dataclasses.fields(value):
                feed(getattr(value, field.name))
        elif isinstance(value, (torch.dtype, torch.device, enum.Enum, PurePath)):
            digest.update(f"{type(value).__qualname__}:{value}".encode())
        else:
            digest.update(getattr(value, "__qualname__", type(value).__qualname__).encode())
        digest.update(b";")

    feed(value)
    return digest.hexdigest()


def tensor_digest(tensor: Any) -> Any:
    """A tensor by its shape, dtype and bytes (a batch of token ids: cheaper than `value_digest`'s elements); any
    other value as it is."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    data = tensor.detach().cpu().contiguous()
    contents = hashlib.blake2b(data.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=8).hexdigest()
    return {"shape": tuple(data.shape), "dtype": data.dtype, "contents": contents}


def check_ranks_agree(fields: Mapping[str, Any], what: str, group: dist.ProcessGroup | None = None,
                      timeout_s: float | None = None) -> None:
    """Every rank of `group` (None: the default group) calls this with the same field names, in one order; where a
    field's value differs between ranks, every rank raises the same ValueError naming it and each rank's value
    (for a mapping, the keys whose values differ). `what`: the call, for the message. `timeout_s`: a TimeoutError
    if not every rank calls this in time (gloo; NCCL's collectives end through the group's own watchdog)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    names = list(fields)
    digests = torch.tensor([int(value_digest(fields[name])[:15], 16) for name in names], dtype=torch.int64)
    if dist.get_backend(group) == "nccl":
        digests = digests.to(torch.device("cuda", torch.cuda.current_device()))
    gathered = [torch.empty_like(digests) for _ in range(world)]
    work = dist.all_gather(gathered, digests, group=group, async_op=True)
    if timeout_s is not None and dist.get_backend(group) == "gloo":
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise TimeoutError(str(e)) from None
    else:
        work.wait()
    table = torch.stack(gathered).cpu()
    differ = [name for i, name in enumerate(names) if not bool((table[:, i] == table[0, i]).all())]
    if not differ:
        return
    shown = {name: _shown(fields[name]) for name in differ}
    every = [None] * world
    dist.all_gather_object(every, shown, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    lines = []
    for name in differ:
        values = [rank_values[name] for rank_values in every]
        if not all(isinstance(v, dict) for v in values):
            lines.append(_line(name, ranks, values))
            continue
        keys = [k for k in values[0] | {k: None for v in values[1:] for k in v}
                if any(v.get(k) != values[0].get(k) for v in values)]
        lines += [_line(f"{name}.{k}", ranks, [v.get(k, "absent") for v in values]) for k in keys[:2]]
        if len(keys) > 2:
            lines.append(f"{len(keys) - 2} more of {name}")
        elif not keys:  # values that differ beyond what their reprs show
            lines.append(name)
    more = f"; and {len(lines) - 4} more" if len(lines) > 4 else ""
    raise ValueError(f"{what}: the ranks differ in {'; '.join(lines[:4])}{more}. Under torchrun every rank runs the "
                     "same program and makes this call with the same arguments")


def warn_where_ranks_differ(values: Mapping[str, Any], what: str, group: dist.ProcessGroup | None = None) -> None:
    """Every rank of `group` (None: the default group) calls this once with what it built under some names (a name
    a rank lacks is not compared there); where the ranks that hold a name differ in its value, the group's first rank
    warns with `what` and each rank's values of those names. For what ranks may differ in and still compute the
    same bits, only slower: which steps the C++ decoder runs (a rank without it runs them in Python while its peers
    wait for it; a bfloat16 weight of zeros once took another layout on one TP-2 rank: its steps 1.4x as long)."""
    if group is None and not dist.is_initialized():  # one process
        return
    world = dist.get_world_size(group)
    if world == 1:
        return
    every: list[dict | None] = [None] * world
    dist.all_gather_object(every, dict(values), group=group)
    if dist.get_rank(group) != 0:
        return
    differ = sorted({name for held in every for name in held
                     if len({repr(other[name]) for other in every if name in other}) > 1})
    if differ:
        ranks = [dist.get_global_rank(group, index) for index in range(world)] if group is not None else range(world)
        by_rank = {rank: {name: held[name] for name in differ if name in held} for rank, held in zip(ranks, every)}
        warnings.warn(f"{what}: the ranks differ ({by_rank}, by rank)", RuntimeWarning, stacklevel=3)


def _line(label: str, ranks: list[int], values: list) -> str:
    return f"{label}: " + ", ".join(f"rank {rank} {value}" for rank, value in zip(ranks, values))


def _shown(value: Any) -> Any:
    """What a message shows of a value: its repr, shortened; a mapping's (or a dataclass's) per key."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _shown_leaf(v) for k, v in value.items()}
    return _shown_leaf(value)


def _shown_leaf(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
