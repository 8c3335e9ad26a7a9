"""Random Hugging Face checkpoints built with `transformers` (the numerical reference)."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from torch_shift import SamplingParams
from torch_shift.models.toy import build_tokenizer

VOCAB_SIZE = 512

# family -> (config class, extra config); all with 8 query and 2 KV heads
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "llama3": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    "llama_tied": ("LlamaConfig", {"tie_word_embeddings": True}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "mistral_window": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    # transformers' attention_bias: q, k, v and o projections with biases
    "llama_bias": ("LlamaConfig", {"attention_bias": True}),
    "qwen3_bias": ("Qwen3Config", {"head_dim": 16, "attention_bias": True}),
    # q/k/v and gate/up fused in the checkpoint, a window (tests/test_phi3.py: LongRoPE)
    "phi3": ("Phi3Config", {"sliding_window": 8}),
}


def build_hf_model(family: str, seed: int = 0, **overrides):
    config_cls, extra = FAMILIES[family]
    kwargs = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=VOCAB_SIZE, max_position_embeddings=256, initializer_range=0.5, rms_norm_eps=1e-6,
        bos_token_id=0, eos_token_id=1, pad_token_id=3,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [config_cls.replace("Config", "ForCausalLM")]
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def save_checkpoint(model, out_dir: Path, with_tokenizer: bool = True, max_shard_size: str | None = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    if with_tokenizer:
        build_tokenizer(out_dir, vocab_size=model.config.vocab_size)
    return out_dir


def rewrite_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def checkpoint_cache(tmp_path_factory, build):
    """name -> (transformers model `build(name)`, its checkpoint directory), each built once."""
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model = build(name)
            cache[name] = (model, save_checkpoint(model, tmp_path_factory.mktemp(name)))
        return cache[name]

    return get


@pytest.fixture(autouse=True)
def _library_log_restored():
    """`torch_shift.cli.main` shows the library's log on the stderr of its call (pytest's capture, closed after the
    test) and stops it propagating: put the "torch_shift" logger back, so that later tests' caplog sees it."""
    log = logging.getLogger("torch_shift")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    log.handlers[:] = handlers
    log.setLevel(level)
    log.propagate = propagate


class LogLines(logging.Handler):
    """The messages a logger emits at `level` or above while the block runs, caught on that logger itself (root's
    handlers, caplog's among them, miss what a logger that does not propagate keeps)."""

    def __init__(self, name: str, level: int = logging.INFO):
        super().__init__(level)
        self.logger, self.messages, self._level = logging.getLogger(name), [], level

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> LogLines:
        self._saved = self.logger.level
        self.logger.setLevel(self._level)
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._saved)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> (transformers model, checkpoint directory); built once per session."""
    return checkpoint_cache(tmp_path_factory, build_hf_model)


@pytest.fixture(scope="session")
def llama(checkpoints):
    return checkpoints("llama")


@pytest.fixture(scope="session")
def layers4(tmp_path_factory):
    """A Llama with 4 layers and 4 KV heads: DP-2, TP-2, TP-4, PP-2, PP-4 and Flying's groups are all possible."""
    model = build_hf_model("llama", num_key_value_heads=4, num_hidden_layers=4)
    return save_checkpoint(model, tmp_path_factory.mktemp("layers4"))


@contextlib.contextmanager
def interrupted_at_random(engine, seed: int = 0):
    """Rank 0's interrupt of multi-step runs and redrafting checks (a request arriving at a server:
    LLMEngine.interrupt_run) set and cleared at random moments by a thread while the body runs."""
    done = threading.Event()

    def toggle():
        rng = random.Random(seed)
        while not done.is_set():
            (engine.interrupt_run if rng.random() < 0.5 else engine.clear_run_interrupt)()
            time.sleep(rng.random() * 2e-3)

    thread = threading.Thread(target=toggle)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def random_prompts(num: int, lengths: list[int] | None = None, seed: int = 0, vocab: int = VOCAB_SIZE) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [3, 17, 40, 1, 9, 64, 33, 5][:num]
    # avoid the special ids 0..5 so that no prompt holds an eos
    return [torch.randint(6, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=3)
    return out[0, len(prompt):].tolist()


def hf_greedy_logprobs(hf_model, prompts: list[list[int]], max_tokens: int) -> tuple[list, list[torch.Tensor]]:
    """transformers' greedy outputs of `prompts` and the log-probabilities [max_tokens, vocab] of each output's
    positions."""
    refs = [hf_greedy(hf_model, p, max_tokens) for p in prompts]
    with torch.no_grad():
        logprobs = [torch.log_softmax(hf_model(torch.tensor([p + r])).logits[0].float(), -1)[len(p) - 1:-1]
                    for p, r in zip(prompts, refs)]
    return refs, logprobs


def assert_outputs_match_transformers(outputs, refs: list, ref_logprobs: list[torch.Tensor], atol: float,
                                      num_logprobs: int = 3) -> None:
    """Greedy tokens those of transformers, each position's returned logprobs (the token and the `num_logprobs`
    top ones) the tokens transformers ranks there, within `atol` of its values."""
    assert [o.outputs[0].token_ids for o in outputs] == refs
    for out, ref in zip(outputs, ref_logprobs):
        assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
        for position, (token, top) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
            assert set(top) == {token, *ref[position].topk(num_logprobs).indices.tolist()}
            for t, logprob in top.items():
                assert abs(logprob.logprob - ref[position, t].item()) <= atol


def assert_converted_and_handed_off_alike(hf_model, model_dir: Path, out_dir: Path) -> None:
    """`torch-shift convert` of the checkpoint gives the same logits, and transformers' module handed over in
    memory the checkpoint's greedy tokens."""
    from torch_shift import LLM, LLMEngine
    from torch_shift.engine.llm_engine import EngineArgs
    from torch_shift.handoff import handoff
    from torch_shift.models.convert import convert_checkpoint

    prompt = random_prompts(1, [30], seed=5)[0]
    ref = engine_logits(LLMEngine(EngineArgs(str(model_dir))), prompt)
    converted = convert_checkpoint(model_dir, out_dir, progress=False)
    torch.testing.assert_close(engine_logits(LLMEngine(EngineArgs(str(converted), tokenizer=str(model_dir))), prompt),
                               ref, atol=0, rtol=0)
    prompts = random_prompts(3, [4, 19, 1], seed=7)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    expected = [o.outputs[0].token_ids for o in LLM(str(model_dir)).generate(prompts, greedy, use_tqdm=False)]
    got = handoff(hf_model, None, tokenizer=model_dir).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected


def engine_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits at every prompt position, through the paged-attention runner (chunked as scheduled)."""
    engine.add_request("probe", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    rows = []
    while True:
        output = engine.scheduler.schedule()
        _, (logits,) = engine.execute(output)  # the chunk's every position (prompt logprobs)
        rows.append(logits)
        sample = output.scheduled[0].sample
        engine.scheduler.update_from_output(output, {"probe": [7]} if sample else {})
        if sample:
            break
    engine.abort_request("probe")
    return torch.cat(rows)


def assert_lm_head_rows_alone(model_dir, compiled: bool = False, exact: bool = True) -> None:
    """forward(..., logits_indices): those rows of the whole forward's hidden states, bit for bit (`exact`; a sparse
    MLP's experts multiply the rows routed to them together, so there a row's sums depend on the others), the last
    layer's output projection and MLP run on them alone; on no rows too (a step of prompt chunks only); compiled
    alike."""
    from torch_shift.compilation import CompiledForward
    from torch_shift.models import load_model
    from torch_shift.models.batch import CausalAttention
    from torch_shift.models.linear import prepare_linears

    model = load_model(model_dir)
    prepare_linears(model)  # as the engine runs them: a float32 row's sums do not depend on the rows beside it
    lengths = [30, 17]
    ids = torch.tensor(sum(random_prompts(2, lengths), []))
    positions = torch.cat([torch.arange(n) for n in lengths])
    attention = CausalAttention(lengths)
    mlp_rows = []
    model.layers[-1].mlp.register_forward_pre_hook(lambda module, args: mlp_rows.append(args[0].shape[0]))
    indices = torch.tensor([29, 46])
    with torch.no_grad():
        whole = model(ids, positions, attention)
        rows = model(ids, positions, attention, indices)
        none = model(ids, positions, attention, indices[:0])
    assert mlp_rows == [47, 2, 0]
    torch.testing.assert_close(rows, whole[indices], atol=0 if exact else 1e-6, rtol=0 if exact else 1e-5)
    assert none.shape == (0, whole.shape[1])
    if compiled:
        forward = CompiledForward(model)
        with torch.no_grad():
            torch.testing.assert_close(forward(ids, positions, attention, indices), rows, atol=0, rtol=0)
            torch.testing.assert_close(forward(ids[:30], positions[:30], CausalAttention([30]), indices[:1]),
                                       whole[29:30], atol=0, rtol=0)


def refuse_python_ulysses(monkeypatch):
    """UlyssesAttention's Python path raises in a serving step (the start-up warm-up, whose attention is no paged
    step, keeps it): forked ranks inherit the patch."""
    from torch_shift.attention.cpu import CpuPagedAttention
    from torch_shift.parallel.ulysses import UlyssesAttention

    python_call = UlyssesAttention.__call__

    def refusing(self, *args, **kwargs):
        assert not isinstance(self.inner, CpuPagedAttention), "a serving step ran Ulysses in Python"
        return python_call(self, *args, **kwargs)

    monkeypatch.setattr(UlyssesAttention, "__call__", refusing)


# A test past these (the slowest runs for about two minutes on 2 cores): the stacks of its processes, then the
# run ended (tests/hang_watch.py; pytest-timeout, at 900 s in `make test`, acts only on a test hung in Python)
HANG_DUMP_AFTER_S = float(os.environ.get("TORCH_SHIFT_TEST_DUMP_AFTER_S", 600))
HANG_KILL_AFTER_S = float(os.environ.get("TORCH_SHIFT_TEST_KILL_AFTER_S", 1200))
_hang_watch: subprocess.Popen | None = None


def _allow_ptrace() -> None:
    """Let gdb (run by the watchdog, not this process's descendant) attach where Yama's ptrace_scope is 1."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(0x59616D61, ctypes.c_ulong(-1), 0, 0, 0)  # PR_SET_PTRACER, _ANY
    except (OSError, AttributeError):
        pass


def pytest_configure(config):
    """Started after pytest suspended its initial capture: file descriptor 2 is the run's own standard error, which
    the watchdog and faulthandler's SIGUSR1 dumps (in this process and in ranks forked from it) write to. Not under
    --pdb or --trace, whose sessions may last."""
    global _hang_watch
    if config.getoption("usepdb", False) or config.getoption("trace", False):
        return
    stderr = os.fdopen(os.dup(2), "w")
    faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True)
    _allow_ptrace()
    os.register_at_fork(after_in_child=_allow_ptrace)
    # a session of its own: a Ctrl+C of the run does not end it before the run has reported
    _hang_watch = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("hang_watch.py")), str(os.getpid()), str(HANG_DUMP_AFTER_S),
         str(HANG_KILL_AFTER_S)], stdin=subprocess.PIPE, stdout=stderr, stderr=stderr, start_new_session=True)


def _tell_hang_watch(line: str) -> None:
    global _hang_watch
    if _hang_watch is None:
        return
    try:
        _hang_watch.stdin.write(f"{line}\n".encode())
        _hang_watch.stdin.flush()
    except OSError:  # the watchdog ended (killed): the run goes on unwatched
        _hang_watch = None


def pytest_unconfigure(config):
    """The interpreter's exit (engines' finalizers, atexit) watched too: the watchdog ends when this process does."""
    _tell_hang_watch("start the test process's exit")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _tell_hang_watch(f"start {item.nodeid}")
    yield
    _tell_hang_watch("end")
