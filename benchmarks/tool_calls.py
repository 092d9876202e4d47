"""Forced tool calls on the default pair, end to end through the server: does every method
answer ``tool_choice: "required"`` (and a named function) with a call that parses and whose
arguments validate?

    python benchmarks/tool_calls.py --out benchmarks/report/tool-calls [--seeds 3]

Serves the default pair in this process (as ``cactus-spec serve`` loads it: bf16 verifier
where the CPU has fast bf16, else float32; int8 draft; K = 10; fixed policy), then asks the
official ``openai`` client for a forced call of a weather function with AR, SpS and
Cactus(delta = 1), each with seeds 0.. ``--seeds`` - 1, once with ``required`` and once
naming the function. Each answer appends a line to ``OUT/results.jsonl``; ``OUT/summary.md``
counts per method the answers that were a 200, parsed into ``tool_calls`` and validated.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jsonschema_rs
import openai

from cactus_spec import isa
from cactus_spec.bench.provenance import cpu_name
from cactus_spec.core.spec import DecodeSpec
from cactus_spec.loading.catalog import DEFAULT_PAIR
from cactus_spec.runtime.engine import SpeculativeDecoder
from cactus_spec.server.app import ServerConfig, create_app
from cactus_spec.server.run import BackgroundServer, start_scheduler

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather like in Lisbon today?"}]
METHODS = {
    "ar": {"method": "ar"},
    "sps": {"method": "sps", "num_draft_tokens": 10},
    "cactus": {"method": "cactus", "delta": 1.0, "num_draft_tokens": 10},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = DecodeSpec.of("sps", num_draft_tokens=10)
    engine = SpeculativeDecoder(*DEFAULT_PAIR, spec, max_batch=1)
    scheduler = start_scheduler(engine, "fixed", 4)
    rows = []
    validator = jsonschema_rs.validator_for(PARAMETERS)
    with BackgroundServer(create_app(scheduler, ServerConfig("default", None, 64))) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        for name, speculative in METHODS.items():
            for choice in ("required", NAMED):
                for seed in range(args.seeds):
                    rows.append(_ask(client, name, speculative, choice, seed, validator))
                    with (out / "results.jsonl").open("a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
                    print(rows[-1], flush=True)
    scheduler.stop()
    (out / "summary.md").write_text(_summary(rows))
    print(_summary(rows))


def _ask(client, name: str, speculative: dict, choice, seed: int, validator) -> dict:
    row = {"method": name, "choice": choice if isinstance(choice, str) else "named", "seed": seed}
    try:
        answer = client.chat.completions.create(
            model="default", messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=64,
            seed=seed, extra_body={"speculative": speculative},
        )  # fmt: skip
    except openai.APIStatusError as err:
        return row | {"status": err.status_code, "error": err.message}
    calls = answer.choices[0].message.tool_calls or []
    arguments = [json.loads(c.function.arguments) for c in calls]
    valid = bool(calls) and all(validator.is_valid(a) for a in arguments)
    return row | {"status": 200, "calls": len(calls), "valid": valid, "arguments": arguments}


def _summary(rows: list[dict]) -> str:
    lines = [f"Forced tool calls on the default pair ({_machine()})", ""]
    lines += [
        "| method | answers | 200 | parsed calls | valid arguments |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in METHODS:
        mine = [r for r in rows if r["method"] == name]
        ok = [r for r in mine if r["status"] == 200]
        parsed = [r for r in ok if r["calls"]]
        valid = [r for r in parsed if r["valid"]]
        lines.append(f"| {name} | {len(mine)} | {len(ok)} | {len(parsed)} | {len(valid)} |")
    return "\n".join(lines) + "\n"


def _machine() -> str:
    """The CPU's name and the instruction set the run was held to (``isa``)."""
    return f"{cpu_name()}, {isa.level()}"


if __name__ == "__main__":
    main()
