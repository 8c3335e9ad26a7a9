"""Figures for docs/reliability.md: a real `torch-shift serve` (the embedded default model) under hostile clients
and faults, on 127.0.0.1. Each probe is bounded in time; it prints one line of figures per probe.

    python bench/hostile_probes.py [--body-mb 50] [--json bench/results/hostile.json]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPT = "And God said"


class Server:
    def __init__(self, *args: str):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "torch_shift", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not come up")
            time.sleep(0.1)
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        self.workers = [int(pid) for pid in children]

    def kb(self, field: str) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def greedy_latency(url: str) -> float:
    t0 = time.monotonic()
    response = httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                          timeout=120)
    assert response.status_code == 200, response.text
    return time.monotonic() - t0


def chunked_body(server: Server, body_mb: int) -> dict:
    hwm, rss = server.kb("VmHWM"), server.kb("VmRSS")
    chunk = b"x" * (64 << 10)
    latency = concurrent.futures.ThreadPoolExecutor(1)
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        beside = latency.submit(greedy_latency, server.url)
        sent = 0
        while sent < body_mb << 20 and not select.select([sock], [], [], 0.002)[0]:
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                break
            sent += len(chunk)
        status = sock.recv(100).split(b" ")[1].decode()
    answered_s = time.monotonic() - t0
    return {"status": status, "sent_before_answer_kb": sent >> 10, "answer_s": round(answered_s, 3),
            "peak_rss_growth_mb": round((server.kb("VmHWM") - hwm) / 1024, 1),
            "rss_growth_mb": round((server.kb("VmRSS") - rss) / 1024, 1),
            "greedy_beside_s": round(beside.result(), 3), "greedy_alone_s": round(greedy_latency(server.url), 3)}


def huge_n(server: Server) -> dict:
    async def probe():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            t0 = time.monotonic()
            huge = await http.post("/v1/completions", json={"prompt": PROMPT, "n": 60000, "max_tokens": 1})
            huge_s = time.monotonic() - t0
            big = asyncio.ensure_future(http.post("/v1/completions", json={
                "prompt": [PROMPT] * 16, "n": 8, "max_tokens": 400, "ignore_eos": True}))
            await asyncio.sleep(0.5)
            t0 = time.monotonic()
            normal = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
            normal_s = time.monotonic() - t0
            big.cancel()
            return huge.status_code, huge_s, normal.status_code, normal_s

    huge_status, huge_s, normal_status, normal_s = asyncio.run(probe())
    time.sleep(1)
    return {"n_60000_status": huge_status, "n_60000_answer_s": round(huge_s, 3), "normal_status": normal_status,
            "normal_beside_128_seqs_s": round(normal_s, 3)}


def disconnects(server: Server, clients: int = 10, max_tokens: int = 500) -> dict:
    before = server.metric("vllm:generation_tokens_total")

    async def give_up():
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(30, read=0.5)) as http:
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
            await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(clients)),
                                 return_exceptions=True)

    t0 = time.monotonic()
    asyncio.run(give_up())
    while server.metric("vllm:num_requests_running") > 0:
        time.sleep(0.05)
    return {"clients": clients, "max_tokens": max_tokens, "generated": int(
        server.metric("vllm:generation_tokens_total") - before), "idle_after_s": round(time.monotonic() - t0, 3)}


def _stream(url: str, started: list) -> tuple[float, str]:
    with httpx.stream("POST", url + "/v1/completions", timeout=180,
                      json={"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                started.append(time.monotonic())
                event = json.loads(line[6:])
                if "error" in event:
                    return time.monotonic(), event["error"]["message"]
    return time.monotonic(), "no error"


def fault(kind: str, deadline_s: float) -> dict:
    server = Server("--sp", "2", "--step-deadline-s", str(deadline_s))
    try:
        pool = concurrent.futures.ThreadPoolExecutor(1)
        started: list = []
        stream = pool.submit(_stream, server.url, started)
        while not started:
            time.sleep(0.01)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(server.workers[0], signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        if kind == "sigterm":
            server.proc.send_signal(signal.SIGTERM)
        health_503_s = None
        while kind == "stop" and health_503_s is None and time.monotonic() - t0 < 30:
            if httpx.get(server.url + "/health", timeout=5).status_code == 503:
                health_503_s = time.monotonic() - t0
            time.sleep(0.02)
        error_at, message = stream.result(timeout=180)
        code = server.proc.wait(timeout=180)
        exited_s = time.monotonic() - t0
        return {"fault": kind, "step_deadline_s": deadline_s, "client_error_s": round(error_at - t0, 3),
                "client_error": message, "health_503_s": health_503_s and round(health_503_s, 3),
                "exit_code": code, "exited_s": round(exited_s, 3)}
    finally:
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--body-mb", type=int, default=50)
    parser.add_argument("--deadline-s", type=float, default=5.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = {}
    server = Server("--num-kv-blocks", "4096")
    try:
        results["chunked_body"] = chunked_body(server, args.body_mb)
        print("chunked body:", results["chunked_body"], flush=True)
        results["huge_n"] = huge_n(server)
        print("huge n:", results["huge_n"], flush=True)
        results["disconnects"] = disconnects(server)
        print("disconnects:", results["disconnects"], flush=True)
    finally:
        server.close()
    for kind in ("kill", "stop", "sigterm"):
        results[kind] = fault(kind, args.deadline_s)
        print(f"{kind}:", results[kind], flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
