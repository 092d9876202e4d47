"""Soak benchmark: many clients with a seeded mix of good, bad and abandoned requests, for minutes.

    python benchmarks/soak.py --out bench-out/soak [--minutes 10] [--clients 32]
        [--verifier smollm2-135m] [--drafter ngram] [--draft smollm2-135m]
        [--max-batch 4] [--max-queue 16] [--seed 0]

Starts ``cactus-spec serve`` in its own process and session (Ctrl-C reaches only this
script) on a free loopback port, its output in ``server.log`` (``--draft`` goes to it only
with a drafter that needs a draft model, as the drafter registry says: ``--drafter`` takes
its names), then runs ``--clients`` client threads until the time is up. Each loops over
behaviours drawn from its own seeded generator, every draw made before the request is sent,
so a rerun sends each client the same requests in the same order:

- ``stream``: a streamed chat completion of 16-96 tokens: time to first token (TTFT),
  inter-token latency per request ((last chunk - first chunk) / (chunks - 1)) and every gap
  between consecutive chunks;
- ``whole``: a chat completion or a completion, not streamed;
- ``disconnect``: a stream closed after its first 1-3 chunks, or a request not streamed
  whose connection is closed after 0.5 s;
- ``bad``: invalid JSON, a string max_tokens, an unknown model, temperature -1 or n = 1000,
  each of which must get a 4xx;
- ``hostile``: a request that plants a marker (``SOAK-MARKER-...``) and is unsound (a schema
  that only refers to itself, a regex whose lexer blows up, a lone surrogate: each must get a
  400) or valid but unusual (TAS, a draft tree, structured output on each verification kind;
  trees only with a drafter that drafts trees: 200, else 400); a marker in any other answer is a
  cross-request leak (must be none);
- ``multi_turn``: a chat of 3-4 streamed turns over a ~300-token system prompt shared by
  all clients, each turn resending the whole history; TTFT of turn 1 and of later turns
  apart (a prefix cache shows as later turns starting sooner).

The official ``openai`` client sends the valid requests, ``httpx2`` (the HTTP client it is
built on) the bad and the abandoned ones. A 429 (queue full) is its own outcome, not an
error, and the client backs off 0.2-0.5 s. The server's RSS and ``GET /metrics`` are sampled
at the start, every 30 s and at the end (appended to ``samples.jsonl``). When the time is up
or at Ctrl-C (or SIGTERM) the clients finish what they are sending (up to 60 s), the server
gets SIGTERM (how long it takes to exit and its exit code are recorded), and
``results.json`` and ``summary.md`` are written: requests by outcome, 4xx by kind, 5xx (must
be none), other client errors, RSS, TTFT, ITL, tokens/s, the prefix cache's hit rate and
tokens saved.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import re
import signal
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx2
import openai
import psutil
from launcher import Server, free_port, launched

from cactus_spec.core.drafters import DRAFTERS
from cactus_spec.files import write_text_atomic

#: The model id the server answers to.
MODEL = "soak"
#: name -> weight in each client's mix.
BEHAVIOURS = {"stream": 3, "whole": 2, "disconnect": 2, "bad": 1, "hostile": 2, "multi_turn": 2}
#: What a hostile request plants in its body; no other answer may ever contain it.
MARKER = "SOAK-MARKER"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
TEMPERATURE = 0.7
REQUEST_TIMEOUT_S = 120.0
#: A request not streamed is abandoned after this long without an answer.
ABANDON_AFTER_S = 0.5
SAMPLE_EVERY_S = 30.0
#: Once the time is up, how long the clients may take to finish their requests.
DRAIN_S = 60.0
#: How long the server may take to exit after SIGTERM (its own grace is 30 s) before SIGKILL.
EXIT_WAIT_S = 90.0

PROMPTS = (
    "Explain what a hash table is and when to use one.",
    "Write a short poem about the sea at night.",
    "What are three tips for writing readable Python code?",
    "Describe how a bicycle gear system works.",
    "Give me a recipe for a simple tomato soup.",
    "Why is the sky blue? Answer briefly.",
    "List some differences between TCP and UDP.",
    "Summarise the plot of a heist movie you would like to watch.",
)
FOLLOW_UPS = (
    "Can you go into more detail?",
    "Summarise that in one sentence.",
    "Give me an example.",
    "What is a common mistake people make here?",
    "Now explain it to a ten-year-old.",
)
#: The system prompt of every multi-turn chat (about 300 tokens), the same for all clients.
SYSTEM_PROMPT = (
    "You are Cactus, a patient and careful assistant working for a small technical support "
    "team. Your job is to answer questions from customers and colleagues clearly, briefly "
    "and correctly. Follow these rules in every answer. First, read the whole question "
    "before answering, and if it is ambiguous, say which reading you chose. Second, prefer "
    "short paragraphs and plain words over jargon; when a technical term is needed, explain "
    "it the first time you use it. Third, when you give steps, number them, and keep each "
    "step to a single action the reader can check. Fourth, never invent facts, version "
    "numbers, prices or names: if you do not know something, say so and suggest where the "
    "reader could find it. Fifth, be kind: the person asking may be tired, stressed or new to "
    "the subject, so do not make them feel foolish for asking. Sixth, keep answers focused "
    "on what was asked; mention related problems only when they are likely to bite the "
    "reader soon. Seventh, when code is involved, show the smallest example that works, and "
    "say which language and version it assumes. Eighth, if a question touches on safety, "
    "health, money or the law, give general information only and suggest asking a qualified "
    "professional. Ninth, when the conversation goes on for several turns, remember what was "
    "said before and do not repeat yourself unless asked to. Tenth, end with a short summary "
    "when the answer is longer than a few sentences. The team values accuracy over speed, "
    "clarity over cleverness, and honesty over sounding confident. Thank you for helping."
)
#: A valid chat body; each bad request spoils it in one way (or is not JSON at all).
VALID_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
BAD_REQUESTS: dict[str, bytes | dict] = {
    "invalid_json": b'{"model": "soak", "messages": [',
    "wrong_type": {"max_tokens": "5"},
    "unknown_model": {"model": "no-such-model"},
    "negative_temperature": {"temperature": -1},
    "oversized_n": {"n": 1000},
}


def hostile_requests(marker: str, trees: bool) -> dict[str, tuple[dict | bytes, int]]:
    """name -> (body or raw bytes, the status it must get): unsound ones a 400, the valid
    ones a 200 (trees need a drafter that drafts them: without one, a 400)."""

    def schema(s: dict) -> dict:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}

    ask = VALID_BODY | {"messages": [_user(f"{marker} Tell me about a person.")], "max_tokens": 16}
    surrogate = json.dumps(ask).replace(marker, f"{marker} \\ud800").encode()
    tree = 200 if trees else 400
    requests: dict[str, tuple[dict | bytes, int]] = {
        "self_ref_schema": (ask | {"response_format": schema({"$ref": "#", "title": marker})}, 400),
        "regex_blowup": (
            ask | {"response_format": {"type": "regex", "regex": "(a{1000}){1000}"}},
            400,
        ),
        "surrogate": (surrogate, 400),
        "tas": (ask | {"speculative": {"method": "tas"}}, 200),
        "tree": (
            ask | {"speculative": {"method": "sps", "verification": "tree", "branches": 2}},
            tree,
        ),
    }
    for kind in ("chain", "block", "tree", "traversal"):
        branched = kind in ("tree", "traversal")
        spec = {"method": "cactus", "verification": kind} | ({"branches": 2} if branched else {})
        status = tree if branched else 200
        requests[f"structured_{kind}"] = (
            ask | {"response_format": schema(PERSON), "speculative": spec},
            status,
        )
    return requests


_METRIC = re.compile(r"^(cactus_spec_[^{\s]*(?:\{.*\})?)\s+(\S+)")


class Tally:
    """What the clients saw, shared by their threads. ``counts`` keys are ``sent``,
    ``tokens``, ``429``, ``conversations``, ``completed:KIND``, ``cancelled:KIND``,
    ``bad:KIND:STATUS`` and ``error:BEHAVIOUR:WHAT``; ``series`` holds TTFT and ITL samples."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()
        self.series: defaultdict[str, list[float]] = defaultdict(list)
        self.server_errors: list[str] = []
        self.planted: set[str] = set()  # every hostile request's marker
        self.leaks: list[str] = []  # answers holding another request's marker

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def extend(self, key: str, values: list[float]) -> None:
        with self.lock:
            self.series[key].extend(values)

    def leaked(self, text: str) -> None:
        with self.lock:
            self.counts["cross_request_leaks"] += 1
            self.leaks.append(text[:300])

    def plant(self, marker: str) -> None:
        with self.lock:
            self.planted.add(marker)

    def was_planted(self, marker: str) -> bool:
        with self.lock:
            return marker in self.planted

    def server_error(self, what: str) -> None:
        with self.lock:
            self.server_errors.append(what)

    def snapshot(self) -> tuple[Counter[str], dict[str, list[float]], list[str]]:
        with self.lock:
            return (
                Counter(self.counts),
                {k: list(v) for k, v in self.series.items()},
                list(self.server_errors),
            )


@dataclass
class Streamed:
    """One streamed answer: when it was sent, when each content chunk came, its text."""

    sent: float
    stamps: list[float] = field(default_factory=list)
    text: str = ""
    tokens: int = 0
    cut: bool = False  # closed by the client before the end


class Client:
    """One client thread: a seeded loop over ``BEHAVIOURS`` until ``stop``. Each behaviour
    makes all its draws before it sends anything, so the mix does not depend on answers."""

    def __init__(
        self, url: str, seed: str, tally: Tally, stop: threading.Event, trees: bool = False
    ) -> None:
        self.url = url
        self.trees = trees  # the server's drafter drafts trees: draft trees are served
        self.rng = random.Random(seed)
        self.backoff = random.Random(f"{seed} backoff")
        self.tally = tally
        self.stop = stop
        self.api = openai.OpenAI(
            base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT_S
        )
        self.http = httpx2.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)

    def run(self) -> None:
        names, weights = list(BEHAVIOURS), list(BEHAVIOURS.values())
        while not self.stop.is_set():
            self.attempt(self.rng.choices(names, weights)[0])

    def attempt(self, name: str) -> None:
        """Run one behaviour, filing what went wrong."""
        try:
            getattr(self, name)()
        except openai.APIStatusError as err:
            self.status(name, err.status_code, err.message)
        except (openai.APIConnectionError, httpx2.HTTPError) as err:
            self.tally.count(f"error:{name}:{type(err).__name__}")
            self.pause()
        except openai.APIError as err:  # an error event inside a stream
            body = err.body if isinstance(err.body, dict) else {}
            if body.get("type") == "server_error":
                self.tally.server_error(f"{name}: in the stream: {err.message}")
            else:
                self.tally.count(f"error:{name}:stream error event")

    def status(self, name: str, status: int, message: str) -> None:
        """File an answer that is not 200 to a valid request."""
        if status == 429:
            self.tally.count("429")
            self.pause()
        elif status >= 500:
            self.tally.server_error(f"{name}: HTTP {status}: {message}")
        else:
            self.tally.count(f"error:{name}:HTTP {status}")

    def pause(self) -> None:
        """Back off after a 429 or a connection that failed."""
        self.stop.wait(self.backoff.uniform(0.2, 0.5))

    def stream(self) -> None:
        messages = [_user(self.rng.choice(PROMPTS))]
        self.record("stream", self.streamed(messages, self.rng.randint(16, 96), self.seed()))

    def whole(self) -> None:
        chat, prompt = self.rng.random() < 0.5, self.rng.choice(PROMPTS)
        options = {"max_tokens": self.rng.randint(16, 96), "seed": self.seed()}
        options |= {"model": MODEL, "temperature": TEMPERATURE}
        self.tally.count("sent")
        if chat:
            answer = self.api.chat.completions.create(messages=[_user(prompt)], **options)
        else:
            answer = self.api.completions.create(prompt=prompt, **options)
        self.tally.count("completed:chat" if chat else "completed:completion")
        self.tally.count("tokens", answer.usage.completion_tokens)
        self.leaks(answer.choices[0].message.content if chat else answer.choices[0].text)

    def disconnect(self) -> None:
        in_stream, cut = self.rng.random() < 0.5, self.rng.randint(1, 3)
        messages = [_user(self.rng.choice(PROMPTS))]
        max_tokens, seed = self.rng.randint(64, 96), self.seed()
        if in_stream:
            self.record("disconnect_stream", self.streamed(messages, max_tokens, seed, cut))
        else:
            self.abandon(messages, max_tokens, seed)

    def abandon(self, messages: list[dict], max_tokens: int, seed: int) -> None:
        """A request not streamed whose connection is closed after ``ABANDON_AFTER_S``."""
        body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "seed": seed}
        timeout = httpx2.Timeout(REQUEST_TIMEOUT_S, read=ABANDON_AFTER_S)
        self.tally.count("sent")
        try:
            answer = httpx2.post(f"{self.url}/v1/chat/completions", json=body, timeout=timeout)
        except httpx2.ReadTimeout:
            self.tally.count("cancelled:disconnect_whole")
            return
        if answer.status_code != 200:
            self.status("disconnect", answer.status_code, answer.text)
            return
        self.tally.count("completed:disconnect_whole")  # answered within the time
        self.tally.count("tokens", answer.json()["usage"]["completion_tokens"])

    def bad(self) -> None:
        kind = self.rng.choice(list(BAD_REQUESTS))
        spoiled = BAD_REQUESTS[kind]
        content = spoiled if isinstance(spoiled, bytes) else json.dumps(VALID_BODY | spoiled)
        headers = {"content-type": "application/json"}
        self.tally.count("sent")
        answer = self.http.post("/v1/chat/completions", content=content, headers=headers)
        self.tally.count(f"bad:{kind}:{answer.status_code}")
        if answer.status_code >= 500:
            self.tally.server_error(f"bad {kind}: HTTP {answer.status_code}: {answer.text}")

    def hostile(self) -> None:
        marker = f"{MARKER}-{self.rng.randrange(10**9)}"
        self.tally.plant(marker)
        requests = hostile_requests(marker, self.trees)
        kind = self.rng.choice(list(requests))
        body, expected = requests[kind]
        content = body if isinstance(body, bytes) else json.dumps(body)
        self.tally.count("sent")
        answer = self.http.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        self.tally.count(f"hostile:{kind}:{answer.status_code}")
        if answer.status_code != expected:
            self.tally.count(f"hostile_unexpected:{kind}:{answer.status_code}")
        if answer.status_code >= 500:
            self.tally.server_error(
                f"hostile {kind}: HTTP {answer.status_code}: {answer.text[:300]}"
            )
        if answer.status_code == 200:
            self.leaks(answer.json()["choices"][0]["message"]["content"] or "", marker)

    def leaks(self, text: str, own: str = "") -> None:
        """Count another request's marker in an answer (a request may echo its own, whole
        or in part); keep the answer's text for the summary."""
        for found in re.findall(rf"{MARKER}-(\d+)", text):
            planted = f"{MARKER}-{found}"
            if planted != own and self.tally.was_planted(planted):
                self.tally.leaked(text)

    def multi_turn(self) -> None:
        texts = [self.rng.choice(PROMPTS), *self.rng.sample(FOLLOW_UPS, self.rng.randint(2, 3))]
        turns = [(text, self.rng.randint(16, 96), self.seed()) for text in texts]
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for i, (text, max_tokens, seed) in enumerate(turns):
            if self.stop.is_set():
                return
            messages.append(_user(text))
            answer = self.streamed(messages, max_tokens, seed)
            self.record("turn", answer, "ttft:turn1" if i == 0 else "ttft:later")
            messages.append({"role": "assistant", "content": answer.text})
        self.tally.count("conversations")

    def streamed(
        self, messages: list[dict], max_tokens: int, seed: int, cut: int | None = None
    ) -> Streamed:
        """Stream one chat completion, closing it after ``cut`` content chunks if given."""
        self.tally.count("sent")
        answer = Streamed(time.perf_counter())
        pieces = []
        stream = self.api.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=max_tokens,
            seed=seed,
            temperature=TEMPERATURE,
            stream=True,
            stream_options={"include_usage": True},
        )
        with stream:
            for chunk in stream:
                piece = chunk.choices[0].delta.content if chunk.choices else None
                if piece:
                    answer.stamps.append(time.perf_counter())
                    pieces.append(piece)
                    if len(answer.stamps) == cut:
                        answer.cut = True
                        break
                if chunk.usage is not None:
                    answer.tokens = chunk.usage.completion_tokens
        answer.text = "".join(pieces)
        self.leaks(answer.text)
        return answer

    def record(self, kind: str, answer: Streamed, ttft_key: str | None = None) -> None:
        """TTFT of any stream that got a chunk; ITL and tokens of those that finished."""
        stamps = answer.stamps
        if stamps:
            ttft = [stamps[0] - answer.sent]
            self.tally.extend("ttft:all", ttft)
            if ttft_key:
                self.tally.extend(ttft_key, ttft)
        if answer.cut:
            self.tally.count(f"cancelled:{kind}")
            return
        self.tally.count(f"completed:{kind}")
        self.tally.count("tokens", answer.tokens)
        if len(stamps) > 1:
            self.tally.extend("itl:request", [(stamps[-1] - stamps[0]) / (len(stamps) - 1)])
            self.tally.extend("itl:gap", [b - a for a, b in itertools.pairwise(stamps)])

    def seed(self) -> int:
        return self.rng.randrange(2**31)


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


@contextlib.contextmanager
def served(args: argparse.Namespace, log: Path) -> Iterator[Server]:
    """``cactus-spec serve`` in its own process and session, until it answers /health; at
    the end, SIGTERM and the time it takes to exit (``Server.exit``)."""
    port = free_port()
    draft = ["--draft", args.draft] if DRAFTERS[args.drafter].needs_draft_model else []
    command = [
        sys.executable, "-m", "cactus_spec", "serve", "--verifier", args.verifier,
        "--drafter", args.drafter, *draft, "--max-batch", str(args.max_batch),
        "--max-queue", str(args.max_queue), "--port", str(port), "--served-model-name", MODEL,
    ]  # fmt: skip
    with launched(command, port, log, new_session=True, exit_wait_s=EXIT_WAIT_S) as server:
        yield server


class Monitor(threading.Thread):
    """The server's RSS and metrics every ``SAMPLE_EVERY_S`` until ``finish`` (which takes
    one more), each appended to ``path`` and printed in short with the clients' counts."""

    def __init__(self, server: Server, tally: Tally, path: Path) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.tally = tally
        self.path = path
        self.start_time = time.perf_counter()
        self.samples: list[dict] = []
        self.done = threading.Event()
        path.write_text("")

    def run(self) -> None:
        while not self.done.wait(SAMPLE_EVERY_S):
            self.sample()

    def finish(self) -> None:
        self.done.set()
        self.join()
        self.sample()

    def sample(self) -> None:
        row = {"t_s": time.perf_counter() - self.start_time, **read_server(self.server)}
        self.samples.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        counts, _, server_errors = self.tally.snapshot()
        rss = f"RSS {row['rss_mb']:.0f} MB" if "rss_mb" in row else row["error"]
        print(
            f"[{row['t_s']:5.0f} s] {rss}, sent {counts['sent']}, completed "
            f"{sum(_under(counts, 'completed').values())}, 429 {counts['429']}, "
            f"5xx {len(server_errors)}",
            flush=True,
        )


def read_server(server: Server) -> dict:
    """The server's RSS (MB) and its ``cactus_spec_*`` metrics, or what kept them."""
    try:
        rss = psutil.Process(server.process.pid).memory_info().rss / 2**20
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as answer:
            text = answer.read().decode()
    except (OSError, psutil.Error) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    return {"rss_mb": rss, "metrics": parse_metrics(text)}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for every ``cactus_spec_*`` sample."""
    samples = {}
    for line in text.splitlines():
        match = _METRIC.match(line)
        if match:
            samples[match[1]] = float(match[2])
    return samples


def run_clients(url: str, args: argparse.Namespace, tally: Tally) -> tuple[float, int]:
    """``args.clients`` threads for ``args.minutes`` (or until Ctrl-C), then up to
    ``DRAIN_S`` for them to finish: the wall time and how many were still busy."""
    stop = threading.Event()
    trees = DRAFTERS[args.drafter].drafts_trees
    clients = [Client(url, f"{args.seed} {i}", tally, stop, trees) for i in range(args.clients)]
    threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
    start = time.perf_counter()
    for t in threads:
        t.start()
    try:
        stop.wait(args.minutes * 60)
    except KeyboardInterrupt:
        print("interrupted: finishing the requests under way", flush=True)
    stop.set()
    deadline = time.monotonic() + DRAIN_S
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C stops waiting
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    return time.perf_counter() - start, sum(t.is_alive() for t in threads)


def summarise(tally: Tally, samples: list[dict], wall_s: float, busy: int, server: dict) -> dict:
    """Everything the summary shows, from the clients' tally and the server's samples."""
    counts, series, server_errors = tally.snapshot()
    bad: defaultdict[str, dict[str, int]] = defaultdict(dict)
    for key, n in _under(counts, "bad").items():
        kind, status = key.split(":")
        bad[kind][status] = n
    read = [s for s in samples if "rss_mb" in s]
    first, last = (read[0], read[-1]) if read else ({}, {})
    return {
        "wall_s": wall_s,
        "clients_busy_at_end": busy,
        "requests": {
            "sent": counts["sent"],
            "completed": _under(counts, "completed"),
            "conversations": counts["conversations"],
            "cancelled_by_client": _under(counts, "cancelled"),
            "rejected_429": counts["429"],
            "bad": dict(bad),
            "hostile": _under(counts, "hostile"),
            "hostile_unexpected": _under(counts, "hostile_unexpected"),
            "cross_request_leaks": counts["cross_request_leaks"],
            "cross_request_answers": list(tally.leaks),
            "server_errors": server_errors,
            "client_errors": _under(counts, "error"),
        },
        "rss_mb": {
            "start": first.get("rss_mb"),
            "end": last.get("rss_mb"),
            "peak": max((s["rss_mb"] for s in read), default=None),
        },
        "ttft_s": {
            key: _spread(series.get(f"ttft:{key}", [])) for key in ("all", "turn1", "later")
        },
        "itl_s": {key: _spread(series.get(f"itl:{key}", [])) for key in ("request", "gap")},
        "tokens_per_s": counts["tokens"] / wall_s,
        "server_tokens_per_s": _server_rate(first, last),
        "prefix_cache": _prefix_cache(last.get("metrics", {})),
        "server": {**server, "end": _server_end(last.get("metrics", {}))},
    }


def _under(counts: Counter[str], prefix: str) -> dict[str, int]:
    """The counts keyed ``prefix:REST``, keyed REST."""
    start = f"{prefix}:"
    return {k.removeprefix(start): n for k, n in sorted(counts.items()) if k.startswith(start)}


def _spread(values: list[float]) -> dict:
    return {"n": len(values), "p50": percentile(values, 50), "p95": percentile(values, 95)}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _server_rate(first: dict, last: dict) -> float | None:
    """Tokens the server generated per second between two samples (cancelled ones too)."""
    name = "cactus_spec_generated_tokens_total"
    if name not in first.get("metrics", {}) or name not in last.get("metrics", {}):
        return None
    seconds = last["t_s"] - first["t_s"]
    return (last["metrics"][name] - first["metrics"][name]) / seconds if seconds else None


def _metric(metrics: dict[str, float], name: str) -> float | None:
    """A sample without labels, else the verifier's."""
    return metrics.get(
        f"cactus_spec_{name}", metrics.get(f'cactus_spec_{name}{{model="verifier"}}')
    )


def _prefix_cache(metrics: dict[str, float]) -> dict:
    """Hit rate (hits / queries) and tokens saved (cached / prompt tokens), None if absent."""
    queries = _metric(metrics, "prefix_cache_queries_total")
    hits = _metric(metrics, "prefix_cache_hits_total")
    cached = _metric(metrics, "prefix_cache_tokens_total")
    prompt = _metric(metrics, "prompt_tokens_total")
    return {
        "hit_rate": hits / queries if queries and hits is not None else None,
        "tokens_saved": cached / prompt if prompt and cached is not None else None,
    }


def _server_end(metrics: dict[str, float]) -> dict:
    """The server's request outcomes, batch and queue at the last sample."""
    outcomes = ("finished", "cancelled", "rejected", "invalid", "failed")
    end = {o: metrics.get(f'cactus_spec_requests_total{{outcome="{o}"}}') for o in outcomes}
    end |= {g: metrics.get(f"cactus_spec_{g}") for g in ("batch_size", "queue_length")}
    return end


def render(result: dict, settings: dict) -> str:
    """``summary.md``."""
    r, rss, srv = result["requests"], result["rss_mb"], result["server"]
    ttft, itl = result["ttft_s"], result["itl_s"]
    bad = [f"{kind} {s} x{n}" for kind, by in r["bad"].items() for s, n in by.items()]
    not_4xx = sum(n for by in r["bad"].values() for s, n in by.items() if not s.startswith("4"))
    cache = result["prefix_cache"]
    end = srv["end"]
    rows = [
        ("requests sent", r["sent"]),
        ("completed", _counted(r["completed"])),
        ("conversations finished (3-4 turns)", r["conversations"]),
        ("cancelled by the client", _counted(r["cancelled_by_client"])),
        ("429 (queue full)", r["rejected_429"]),
        ("bad requests by kind and status", ", ".join(bad) or "none"),
        ("bad requests not answered 4xx", not_4xx),
        ("hostile requests by kind and status", _counted(r["hostile"])),
        ("hostile requests not answered as expected", _counted(r["hostile_unexpected"])),
        ("cross-request content (a marker in another answer)", r["cross_request_leaks"]),
        ("5xx", len(r["server_errors"])),
        ("other client errors", _counted(r["client_errors"])),
        ("clients still busy at the end", result["clients_busy_at_end"]),
        (
            "server RSS start / end / peak (MB)",
            _joined(rss["start"], rss["end"], rss["peak"], digits=0),
        ),
        ("TTFT p50 / p95, all streams (s)", _ps(ttft["all"])),
        ("TTFT p50 / p95, turn 1 of chats (s)", _ps(ttft["turn1"])),
        ("TTFT p50 / p95, later turns (s)", _ps(ttft["later"])),
        ("ITL p50 / p95 per request (ms)", _ps(itl["request"], 1000)),
        ("ITL p50 / p95 per gap (ms)", _ps(itl["gap"], 1000)),
        ("tokens/s (completed answers)", _joined(result["tokens_per_s"])),
        ("tokens/s (server, cancelled too)", _joined(result["server_tokens_per_s"])),
        ("prefix cache hit rate", _share(cache["hit_rate"])),
        ("prefix cache tokens saved", _share(cache["tokens_saved"])),
        (
            "server finished / cancelled / rejected / invalid / failed",
            _joined(
                *(end[o] for o in ("finished", "cancelled", "rejected", "invalid", "failed")),
                digits=0,
            ),
        ),
        (
            "server batch / queue at the end",
            _joined(end["batch_size"], end["queue_length"], digits=0),
        ),
        ("tracebacks in server.log", srv["tracebacks"]),
        ("SIGTERM to exit (s), exit code", f"{srv['seconds']:.1f}, {srv['code']}"),
    ]
    lines = [f"Soak: {settings}", "", f"Ran {result['wall_s']:.0f} s.", "", "| | |"]
    lines += ["| --- | ---: |", *(f"| {name} | {value} |" for name, value in rows)]
    if srv["killed"] or srv["died_before"] is not None:
        lines += ["", f"The server: {srv}"]
    if r["cross_request_answers"]:
        lines += ["", "Answers with another request's marker:"]
        lines += [f"- {text!r}" for text in r["cross_request_answers"]]
    if r["server_errors"]:
        lines += ["", "5xx:", *(f"- {e}" for e in r["server_errors"])]
    return "\n".join(lines) + "\n"


def _counted(by: dict[str, int]) -> str:
    return f"{sum(by.values())} ({', '.join(f'{k} {n}' for k, n in by.items())})" if by else "0"


def _ps(spread: dict, scale: float = 1.0) -> str:
    if spread["p50"] is None:
        return "n/a"
    return f"{_joined(scale * spread['p50'], scale * spread['p95'])} (n={spread['n']})"


def _joined(*values: float | None, digits: int = 2) -> str:
    return " / ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def arguments() -> argparse.ArgumentParser:
    """The command line; ``--drafter`` takes the drafter registry's names."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--verifier", default="smollm2-135m")
    parser.add_argument("--drafter", default="ngram", choices=list(DRAFTERS))
    parser.add_argument(
        "--draft", default="smollm2-135m", help="with a drafter that needs a draft model"
    )
    parser.add_argument("--max-batch", type=int, default=4)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main() -> None:
    args = arguments().parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    if not DRAFTERS[args.drafter].needs_draft_model:
        del settings["draft"]
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # ends the run as Ctrl-C does
    tally = Tally()
    with served(args, out / "server.log") as server:
        monitor = Monitor(server, tally, out / "samples.jsonl")
        monitor.sample()
        monitor.start()
        wall_s, busy = run_clients(server.url, args, tally)
        monitor.finish()
    tracebacks = server.log.read_text(errors="replace").count("Traceback")
    result = summarise(
        tally, monitor.samples, wall_s, busy, server.exit | {"tracebacks": tracebacks}
    )
    write_text_atomic(
        out / "results.json",
        json.dumps({"settings": settings, **result, "samples": monitor.samples}, indent=1) + "\n",
    )
    write_text_atomic(out / "summary.md", render(result, settings))
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    main()
