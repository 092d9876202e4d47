"""A server's first requests against its later ones: AR, streamed then whole, twice.

    CACTUS_SPEC_ISA=avx2 python benchmarks/report/policy-trace-avx2/first_requests.py

Starts ``cactus-spec serve`` (int8 verifier, 16 rows) and sends the first four HumanEval
chat prompts (96 new tokens, seeded, the paper's sampling) four times over: streamed, whole,
streamed, whole; prints each request's tokens, wall time and (streamed) inter-token latency.
"""

import socket
import subprocess
import sys
import time
import urllib.request

import openai

from cactus_spec.bench.tasks import humaneval_items


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "cactus_spec", "serve", "--verifier-quant", "int8",
               "--max-batch", "16", "--port", str(port), "--served-model-name", "b"]  # fmt: skip
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            break
        except OSError:
            time.sleep(1)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    prompts = [item.prompt for item in humaneval_items(4)]
    try:
        for _ in range(2):
            for stream in (True, False):
                runs = [request(client, p, stream, seed) for seed, p in enumerate(prompts)]
                print("stream" if stream else "whole ", runs, flush=True)
    finally:
        server.terminate()
        server.wait()


def request(client: openai.OpenAI, prompt: str, stream: bool, seed: int) -> str:
    sent = time.perf_counter()
    kwargs = {
        "model": "b",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 96,
        "temperature": 0.6,
        "top_p": 0.95,
        "seed": seed,
        "extra_body": {"top_k": 20, "speculative": {"method": "ar"}},
    }
    if not stream:
        tokens = client.chat.completions.create(**kwargs).usage.completion_tokens
        return f"{tokens} tok {time.perf_counter() - sent:.2f}s"
    first, tokens = None, 0
    chunks = client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs
    )
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return f"{tokens} tok {end - sent:.2f}s itl {1000 * (end - first) / (tokens - 1):.0f}ms"


if __name__ == "__main__":
    main()
