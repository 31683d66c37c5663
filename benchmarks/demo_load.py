"""The demo under load, a disconnect and a Stop, measured from outside as a visitor sees it.

    python benchmarks/demo_load.py [--clients 16] [--requests 3] [--max-new-tokens 32] [--model DIR]

Starts ``decodekit demo`` on a free loopback port in its own process, then:
  1. N clients x M requests across the presets (greedy, min-p, beam 4 gnmt, greedy with a KV
     budget), each client its own session; prints completed / failed, p50 / p95 latency.
  2. a client process killed mid-stream: prints the server's CPU use in each second after the kill
     (target: back to idle, under 10% of a core, within 2 s).
  3. a client pressing Stop mid-stream: how long until its request ends.
  4. the server's threads and RSS before the load, after each round, and at the end, each count
     taken after one request and 15 s idle (target: threads back to the starting count).
Linux only (reads the server process through psutil). Bounded: every request has a time limit.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import psutil

PRESETS = ("greedy", "min-p 0.1, T=1.0", "beam 4, gnmt", "greedy, KV budget 64")
IDLE_CPU = 10.0  # percent of one core
LONG_RUN = """
import sys, time
from gradio_client import Client
Client(sys.argv[1], verbose=False).submit(
    prompt="Tell me a long story about the sea.", max_new_tokens=256, api_name="/generate"
)
time.sleep(600)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(port: int, model: str | None) -> subprocess.Popen:
    command = [sys.executable, "-m", "decodekit", "demo", "--port", str(port)]
    if model:
        command += ["--model", model]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2)
            return server
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the demo exited with status {server.returncode}") from None
            time.sleep(0.5)
    server.kill()
    raise SystemExit("the demo did not start within 300 s")


def footprint(process: psutil.Process) -> str:
    return f"threads {process.num_threads()}, RSS {process.memory_info().rss / 2**20:.0f} MiB"


def cpu_per_second(process: psutil.Process, seconds: int) -> list[float]:
    """The server's CPU use (percent of one core) in each of the next ``seconds`` seconds."""
    process.cpu_percent(None)
    samples = []
    for _ in range(seconds):
        time.sleep(1.0)
        samples.append(process.cpu_percent(None))
    return samples


def run_load(url: str, clients: int, requests: int, max_new_tokens: int, timeout: float):
    from gradio_client import Client

    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def visitor(index: int) -> None:
        try:
            client = Client(url, verbose=False)
        except Exception as error:
            with lock:
                failures.extend([f"client {index}: {error}"] * requests)
            return
        for request in range(requests):
            preset = PRESETS[(index + request) % len(PRESETS)]
            started = time.monotonic()
            try:
                job = client.submit(prompt=f"Request {index}.{request}: tell me about the sea.",
                                    max_new_tokens=max_new_tokens, preset=preset, api_name="/generate")  # fmt: skip
                job.result(timeout=timeout)
                with lock:
                    latencies.append(time.monotonic() - started)
            except Exception as error:
                with lock:
                    failures.append(f"{preset}: {type(error).__name__}: {error}")

    threads = [threading.Thread(target=visitor, args=(index,)) for index in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=3, help="per client")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", default=None, help="model for the demo (default: the embedded default)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds one request may take")
    parser.add_argument("--idle-wait", type=float, default=15, help="seconds idle before each thread count")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the load this many times (RSS per round)")
    args = parser.parse_args()
    from gradio_client import Client

    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    server = start_server(port, args.model)
    process = psutil.Process(server.pid)
    try:
        Client(url, verbose=False).predict(prompt="Hi", max_new_tokens=2, api_name="/generate")  # warm up
        time.sleep(args.idle_wait)  # the same idle time as before the last count
        before = footprint(process)
        start_threads = process.num_threads()
        print(f"server before the load, after {args.idle_wait:.0f} s idle: {before}")

        total = args.clients * args.requests
        for round_ in range(1, args.rounds + 1):
            started = time.monotonic()
            latencies, failures = run_load(url, args.clients, args.requests, args.max_new_tokens, args.timeout)
            print(
                f"1. load round {round_}: {args.clients} clients x {args.requests} requests "
                f"({', '.join(PRESETS)}), {args.max_new_tokens} new tokens, {time.monotonic() - started:.0f} s"
            )
            print(f"   completed {len(latencies)} / {total}, failed {len(failures)}   (target: 0 failed)")
            for failure in failures[:5]:
                print(f"   failure: {failure}")
            if latencies:
                p95 = statistics.quantiles(latencies, n=20)[-1] if len(latencies) > 1 else latencies[0]
                print(f"   latency p50 {statistics.median(latencies):.1f} s, p95 {p95:.1f} s")
            print(f"   server after round {round_}: {footprint(process)}")

        client = subprocess.Popen([sys.executable, "-c", LONG_RUN, url])
        time.sleep(8)  # the run is streaming by now
        busy = cpu_per_second(process, 1)[0]
        client.kill()
        client.wait()
        after = cpu_per_second(process, 5)
        idle_at = next((second for second, cpu in enumerate(after, start=1) if cpu < IDLE_CPU), None)
        print(f"2. client killed mid-stream: server CPU {busy:.0f}% of a core before the kill; "
              f"each second after: {', '.join(f'{cpu:.0f}%' for cpu in after)}")  # fmt: skip
        verdict = "met" if idle_at is not None and idle_at <= 2 else "missed"
        print(f"   idle (< {IDLE_CPU:.0f}%) after {idle_at} s   (target: <= 2 s: {verdict})")

        stopper = Client(url, verbose=False)
        job = stopper.submit(prompt="Tell me a long story about the sea.", max_new_tokens=256, api_name="/generate")
        time.sleep(5)
        pressed = time.monotonic()
        stopper.predict(api_name="/stop")
        while not job.done() and time.monotonic() - pressed < 30:
            time.sleep(0.02)
        print(f"3. Stop pressed mid-stream: the request ended {time.monotonic() - pressed:.2f} s later; "
              f"server CPU the next 2 s: {', '.join(f'{cpu:.0f}%' for cpu in cpu_per_second(process, 2))}")  # fmt: skip

        # Measured as at the start: one request, then the idle wait. AnyIO keeps idle worker threads
        # for reuse and retires those idle for 10 s when the next request comes.
        Client(url, verbose=False).predict(prompt="Hi", max_new_tokens=2, api_name="/generate")
        time.sleep(args.idle_wait)
        end_threads = process.num_threads()
        print(f"4. server after {args.idle_wait:.0f} s idle: {footprint(process)} (before the load: {before}); "
              f"threads back to the start: {end_threads <= start_threads}")  # fmt: skip
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    main()
