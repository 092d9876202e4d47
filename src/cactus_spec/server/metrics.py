"""``GET /metrics``: the scheduler's counters and gauges in Prometheus' text format."""

from __future__ import annotations

from collections.abc import Mapping

from cactus_spec.runtime.scheduler import Scheduler

_PREFIX = "cactus_spec"


def prometheus_text(scheduler: Scheduler, invalid: int = 0, unanswered: int = 0) -> str:
    """Requests by outcome (``invalid``: refused with a 4xx before decoding; ``rejected``:
    429, the queue was full; ``failed``: decoding ended with an error, or its answer could
    not be sent, ``unanswered`` of those decoded to the end), tokens, acceptance, divergence
    (finite totals; requests whose divergence is unbounded counted apart), prefix caching,
    throughput, queue length and batch size."""
    c = scheduler.counters
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: Mapping[str, float]) -> None:
        lines.append(f"# HELP {_PREFIX}_{name} {help_text}")
        lines.append(f"# TYPE {_PREFIX}_{name} {kind}")
        for labels, value in samples.items():
            lines.append(f"{_PREFIX}_{name}{labels} {value:g}")

    outcomes = {
        '{outcome="finished"}': c.requests_finished - unanswered,
        '{outcome="cancelled"}': c.requests_cancelled,
        '{outcome="rejected"}': c.requests_rejected,
        '{outcome="invalid"}': invalid,
        '{outcome="failed"}': c.requests_failed + unanswered,
    }
    metric("requests_total", "counter", "Requests by outcome.", outcomes)
    metric("generated_tokens_total", "counter", "Tokens generated.", {"": c.tokens})
    metric("drafted_tokens_total", "counter", "Draft tokens proposed.", {"": c.drafted})
    metric("accepted_tokens_total", "counter", "Draft tokens accepted.", {"": c.accepted})
    rate = c.accepted / c.drafted if c.drafted else 0.0
    metric("acceptance_ratio", "gauge", "Accepted / drafted since start.", {"": rate})
    kl = c.kl_nats / c.kl_tokens if c.kl_tokens else 0.0
    metric(
        "kl_nats_total",
        "counter",
        "Divergence meter, nats (sum over requests whose divergence is finite).",
        {"": c.kl_nats},
    )
    metric(
        "kl_nats_per_token",
        "gauge",
        "Divergence meter per token of those requests.",
        {"": kl},
    )
    metric(
        "kl_unbounded_requests_total",
        "counter",
        "Requests whose rule's law left the verifier's support (infinite divergence).",
        {"": c.kl_unbounded},
    )
    metric(
        "prompt_tokens_total",
        "counter",
        "Prompt tokens of started requests.",
        {"": c.prompt_tokens},
    )
    metric(
        "prompt_read_tokens_total",
        "counter",
        "Prompt tokens read before decoding (not cached).",
        {"": c.read_prompt_tokens},
    )
    metric(
        "prompt_read_seconds_total",
        "counter",
        "Wall time reading those prompt tokens.",
        {"": c.time_prompt_s},
    )
    prompt_rate = c.read_prompt_tokens / c.time_prompt_s if c.time_prompt_s else 0.0
    metric(
        "prompt_tokens_per_second",
        "gauge",
        "Prompt tokens read per second of reading since start.",
        {"": prompt_rate},
    )
    metric(
        "prefix_cache_queries_total",
        "counter",
        "Started requests (each looks for a cached prefix).",
        {"": c.prefix_queries},
    )
    metric(
        "prefix_cache_hits_total",
        "counter",
        "Started requests whose row held a prefix of the prompt.",
        {"": c.prefix_hits},
    )
    cached = {f'{{model="{model}"}}': n for model, n in c.cached_tokens.items()}
    metric("prefix_cache_tokens_total", "counter", "Prompt tokens not read again.", cached)
    metric("iterations_total", "counter", "Decode iterations.", {"": c.iterations})
    metric("tokens_per_second", "gauge", "Tokens per second, last 10 s.", {"": c.tokens_per_s()})
    metric("queue_length", "gauge", "Requests waiting for a row.", {"": scheduler.queue_length})
    metric("batch_size", "gauge", "Rows decoding now.", {"": scheduler.batch_size})
    return "\n".join(lines) + "\n"
