"""Grammar engines for structured outputs under speculative decoding: xgrammar, llguidance
and outlines-core, measured on the default verifier's tokenizer (Qwen2.5, 151,936 tokens).

    python benchmarks/grammar_engines.py --tokenizer DIR \\
        --out benchmarks/report/grammar-engines --reps 3

DIR holds the tokenizer files: the dense directory that ``cactus-spec models fetch
qwen-coder-1.5b`` prints third. The engines are not dependencies of the project; run this
from a scratch environment (``pip install torch transformers xgrammar llguidance
outlines-core``). An engine that fails to import is skipped with a note.

For each engine and each grammar (a JSON schema, compiled to compact JSON by every engine so
that the three accept the same language; an ISO-date regex; an arithmetic GBNF grammar, which
outlines-core cannot compile: it takes regexes and JSON schemas only) it measures:

- the tokenizer step (ms) where the engine has one, and the grammar compile (ms);
- the per-token mask: a valid document, tokenized by the tokenizer, is walked token by token,
  and at each position the full bitmask over the vocabulary is computed and timed (µs: median,
  p95 and max over positions and repetitions); advancing the matcher is timed too;
- rollback: from each position, advance over 8 tokens, roll back 5, assert that the mask equals
  the one the walk computed at that position, roll back the other 3 and assert again;
- one verify step's K+1 masks along a drafted chain of K=10 tokens: by the engine's own draft
  API where it has one, and by a loop of mask, advance and a final rollback;
- applying an [11, vocabulary] bitmask (the verifier's K+1 rows) to float32 logits with the
  engine's helpers (the first call, which may compile, timed apart, with torch.compile's cache
  in a fresh directory), beside torch's ``masked_fill_`` on a bool mask;
- forcing: the jump-forward string at each position, whether the final state accepts, whether
  EOS is allowed there, where else it is (no proper prefix of the JSON or date document is
  complete; the arithmetic one has complete prefixes), and whether the matcher takes EOS;
- agreement: the allowed-token counts of the engines at each position, with examples of the
  tokens on which two engines' masks differ.

It writes results.json and summary.md to --out, and exits non-zero (after writing them) when a
rollback or draft check failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

VOCAB = 151_936  # the verifier's logits width (Qwen2.5), padded tokens included
WORDS = (VOCAB + 31) // 32
DRAFT, BACK = 8, 5  # rollback check: advance over DRAFT tokens, roll back BACK
ROWS = 11  # the verifier's K+1 rows, K = 10 drafted tokens
APPLY_CALLS = 50  # apply-to-logits calls per repetition

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
DOCUMENT: dict[str, Any] = {
    "name": "Ada Lovelace",
    "age": 36,
    "role": "admin",
    "tags": ["math", "analytical engines"],
}
DATE_REGEX = r"\d{4}-\d{2}-\d{2}"
DATE_TEXT = "2024-05-17"
ARITHMETIC_GBNF = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""
ARITHMETIC_TEXT = "(12+345)*(6-78)/(9+10)-11"


@dataclass(frozen=True)
class Grammar:
    name: str
    kind: str  # "json_schema", "regex" or "gbnf"
    source: str
    text: str  # a valid instance, walked token by token


GRAMMARS = (
    Grammar("json", "json_schema", json.dumps(SCHEMA), json.dumps(DOCUMENT, separators=(",", ":"))),
    Grammar("regex", "regex", DATE_REGEX, DATE_TEXT),
    Grammar("gbnf", "gbnf", ARITHMETIC_GBNF, ARITHMETIC_TEXT),
)


Applier = Callable[[torch.Tensor, torch.Tensor], None]  # (logits, bitmask), in place


class Matcher(Protocol):
    """One matcher state, as the benchmark drives it."""

    def fill(self, bitmask: torch.Tensor) -> None: ...  # bitmask: [1, WORDS] int32, CPU
    def accept(self, token: int) -> bool: ...
    def rollback(self, count: int) -> bool: ...
    def accepting(self) -> bool: ...
    def forced(self) -> str | None: ...  # None: the engine has no jump-forward API
    def draft(self, tokens: list[int], out: torch.Tensor) -> bool: ...  # False: no own API


class Engine(Protocol):
    name: str
    package: str
    rollback_api: str
    draft_api: str

    def prepare(self, tokenizer: Any, eos: int) -> None: ...
    def compile(self, grammar: Grammar) -> Any: ...
    def matcher(self, compiled: Any) -> Matcher: ...
    def appliers(self) -> dict[str, Applier]: ...  # the engine's helpers to mask logits


# --- xgrammar -------------------------------------------------------------------------------


class XGrammarMatcher:
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.m = xgrammar.GrammarMatcher(compiled)

    def fill(self, bitmask: torch.Tensor) -> None:
        self.m.fill_next_token_bitmask(bitmask)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def rollback(self, count: int) -> bool:
        self.m.rollback(count)
        return True

    def accepting(self) -> bool:
        return bool(self.m.is_completed())

    def forced(self) -> str | None:
        return self.m.find_jump_forward_string()

    def draft(self, tokens: list[int], out: torch.Tensor) -> bool:
        """traverse_draft_tree on a chain: node 0 is the current state, node i follows token i."""
        n = len(tokens) + 1
        nexts = torch.tensor([*range(1, n), -1], dtype=torch.int64)
        siblings = torch.full((n,), -1, dtype=torch.int64)
        drafted = torch.tensor([0, *tokens], dtype=torch.int64)
        return bool(self.m.traverse_draft_tree(nexts, siblings, drafted, out))


class XGrammar:
    name, package = "xgrammar", "xgrammar"
    rollback_api = "GrammarMatcher.rollback(n), unlimited"
    draft_api = "GrammarMatcher.traverse_draft_tree"

    def __init__(self) -> None:
        import xgrammar

        self.xgr = xgrammar

    def prepare(self, tokenizer: Any, eos: int) -> None:
        info = self.xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=VOCAB, stop_token_ids=[eos]
        )
        # No cache, so each repetition compiles; two threads: the machine's cores.
        self.compiler = self.xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)

    def compile(self, grammar: Grammar) -> Any:
        if grammar.kind == "regex":
            return self.compiler.compile_regex(grammar.source)
        if grammar.kind == "gbnf":
            return self.compiler.compile_grammar(self.xgr.Grammar.from_ebnf(grammar.source))
        return self.compiler.compile_json_schema(
            grammar.source, any_whitespace=False, separators=(",", ":")
        )

    def matcher(self, compiled: Any) -> Matcher:
        return XGrammarMatcher(compiled)

    def appliers(self) -> dict[str, Applier]:
        apply = self.xgr.apply_token_bitmask_inplace
        return {
            "xgrammar.apply_token_bitmask_inplace (auto: native CPU kernel)": apply,
            "same, backend='torch_compile'": lambda logits, bitmask: apply(
                logits, bitmask, backend="torch_compile"
            ),
        }


# --- llguidance -----------------------------------------------------------------------------


class LLGuidanceMatcher:
    def __init__(self, matcher: Any, executor: Any) -> None:
        self.m, self.executor = matcher, executor

    def fill(self, bitmask: torch.Tensor) -> None:
        self.m.unsafe_compute_mask_ptr(bitmask.data_ptr(), WORDS * 4)

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token))

    def rollback(self, count: int) -> bool:
        return bool(self.m.rollback(count))

    def accepting(self) -> bool:
        return bool(self.m.is_accepting())

    def forced(self) -> str | None:
        return self.m.compute_ff_bytes().decode("utf-8", "replace")

    def draft(self, tokens: list[int], out: torch.Tensor) -> bool:
        self.executor.unsafe_compute_mask_ptr_with_draft_token(
            [(self.m, 0, tokens)], out.data_ptr(), WORDS * 4, out.shape[0]
        )
        return True


class LLGuidance:
    name, package = "llguidance", "llguidance"
    rollback_api = "LLMatcher.rollback(n)"
    draft_api = "LLExecutor.unsafe_compute_mask_ptr_with_draft_token"

    def __init__(self) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.executor = llguidance.LLExecutor(num_threads=1)  # one matcher: one thread

    def prepare(self, tokenizer: Any, eos: int) -> None:
        self.tokenizer = self.llg.hf.from_tokenizer(tokenizer, n_vocab=VOCAB, eos_token=eos)

    def compile(self, grammar: Grammar) -> Any:
        llm = self.llg.LLMatcher
        if grammar.kind == "regex":
            text = llm.grammar_from_regex(grammar.source)
        elif grammar.kind == "gbnf":
            text = self.llg.grammar_from("gbnf", grammar.source)
        else:
            text = llm.grammar_from_json_schema(
                grammar.source, overrides={"whitespace_flexible": False}
            )
        matcher = llm(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Matcher:
        return LLGuidanceMatcher(compiled.deep_copy(), self.executor)

    def appliers(self) -> dict[str, Applier]:
        return {
            "llguidance.torch.apply_token_bitmask_inplace (torch.compile)": (
                self.llg.torch.apply_token_bitmask_inplace
            )
        }


# --- outlines-core --------------------------------------------------------------------------


def byte_decoder() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table (byte-level BPE token text to bytes)."""
    kept = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = dict(zip(kept, kept, strict=True)), 0
    for byte in range(256):
        if byte not in chars:
            chars[byte], extra = 256 + extra, extra + 1
    return {chr(code): byte for byte, code in chars.items()}


def token_bytes(text: str, decoder: dict[str, int]) -> bytes:
    try:
        return bytes(decoder[c] for c in text)
    except KeyError:  # not byte-level text: keep it as UTF-8
        return text.encode()


class OutlinesMatcher:
    def __init__(self, guide: Any) -> None:
        self.g = guide

    def fill(self, bitmask: torch.Tensor) -> None:
        self.g.write_mask_into(bitmask.data_ptr(), WORDS, 4)

    def accept(self, token: int) -> bool:
        try:
            self.g.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def rollback(self, count: int) -> bool:
        try:
            self.g.rollback_state(count)
        except ValueError:
            return False
        return True

    def accepting(self) -> bool:
        return bool(self.g.is_finished())

    def forced(self) -> str | None:
        return None

    def draft(self, tokens: list[int], out: torch.Tensor) -> bool:
        return False


class OutlinesCore:
    name, package = "outlines-core", "outlines_core"
    rollback_api = "Guide.rollback_state(n), up to max_rollback (32 here)"
    draft_api = "none (mask, advance, rollback_state)"

    def __init__(self) -> None:
        import outlines_core
        import outlines_core.kernels.torch

        self.oc = outlines_core

    def prepare(self, tokenizer: Any, eos: int) -> None:
        """Vocabulary.from_pretrained reaches the hub; this builds the same from local files:
        tokens as bytes, special added tokens and EOS left out."""
        backend = tokenizer.backend_tokenizer
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        decoder, tokens = byte_decoder(), {}
        for text, token in backend.get_vocab(with_added_tokens=False).items():
            if token not in special and token != eos:
                tokens.setdefault(token_bytes(text, decoder), []).append(token)
        self.vocabulary = self.oc.Vocabulary(eos, tokens)

    def compile(self, grammar: Grammar) -> Any:
        if grammar.kind == "gbnf":
            raise NotImplementedError("outlines-core compiles regexes and JSON schemas only")
        regex = grammar.source
        if grammar.kind == "json_schema":
            regex = self.oc.json_schema.build_regex_from_schema(grammar.source, "")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Matcher:
        return OutlinesMatcher(self.oc.Guide(compiled, max_rollback=32))

    def appliers(self) -> dict[str, Applier]:
        return {
            "outlines_core.kernels.torch.apply_token_bitmask_inplace (torch.compile)": (
                self.oc.kernels.torch.apply_token_bitmask_inplace
            )
        }


ENGINES: tuple[Callable[[], Engine], ...] = (XGrammar, LLGuidance, OutlinesCore)


# --- measurements ---------------------------------------------------------------------------


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn's result and its wall time in microseconds."""
    start = time.perf_counter_ns()
    result = fn()
    return result, (time.perf_counter_ns() - start) / 1e3


def stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return {"median": statistics.median(ordered), "p95": p95, "max": ordered[-1], "n": len(ordered)}


def new_bitmask(rows: int = 1) -> torch.Tensor:
    return torch.full((rows, WORDS), -1, dtype=torch.int32)


def allowed(bitmask: np.ndarray) -> np.ndarray:
    """A packed int32 bitmask (bit j of word w is token 32w + j) as bools over the vocabulary."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), bitorder="little")
    return bits[:VOCAB].astype(bool)


def compile_times(engine: Engine, grammar: Grammar, reps: int) -> tuple[Any, list[float]]:
    times, compiled = [], None
    for _ in range(reps):
        compiled, us = timed(lambda: engine.compile(grammar))
        times.append(us / 1e3)
    return compiled, times


def walk(engine: Engine, compiled: Any, tokens: list[int], reps: int, eos: int) -> dict[str, Any]:
    """Mask at every position of the document (and after it), advancing token by token."""
    masks: list[np.ndarray] = []
    forced: list[str | None] = []
    mask_us, accept_us, first_us, rejected = [], [], [], []
    for rep in range(reps):
        matcher, bitmask = engine.matcher(compiled), new_bitmask()
        for pos in range(len(tokens) + 1):
            _, us = timed(lambda m=matcher, b=bitmask: m.fill(b))
            mask_us.append(us)
            if pos == 0:
                first_us.append(us)
            if rep == 0:
                masks.append(bitmask[0].numpy().copy())
                forced.append(matcher.forced())
            if pos < len(tokens):
                ok, us = timed(lambda m=matcher, t=tokens[pos]: m.accept(t))
                accept_us.append(us)
                if not ok:
                    rejected.append(pos)
    end = allowed(masks[-1])
    eos_early = [p for p, mask in enumerate(masks[:-1]) if allowed(mask)[eos]]
    return {
        "masks": masks,
        "mask_us": stats(mask_us),
        "first_mask_us": stats(first_us),
        "accept_us": stats(accept_us),
        "rejected_positions": rejected,
        "forced": forced,
        "final_accepting": matcher.accepting(),
        "eos_allowed_at_end": bool(end[eos]),
        "eos_only_at_end": int(end.sum()) == 1 and bool(end[eos]),
        "eos_allowed_before_end": eos_early,
        "matcher_takes_eos": matcher.accept(eos),
    }


def same(bitmask: torch.Tensor, expected: np.ndarray) -> bool:
    """Whether a one-row bitmask equals a mask the walk kept."""
    return bool(np.array_equal(bitmask.numpy().reshape(-1), expected))


def rollbacks(
    engine: Engine, compiled: Any, tokens: list[int], masks: list[np.ndarray], reps: int
) -> dict[str, Any]:
    """From each position p: advance DRAFT tokens, roll back BACK (mask must equal the walk's
    at p + DRAFT - BACK), roll back the rest (mask must equal the walk's at p), take token p."""
    times, failures, checks = [], [], 0
    for _ in range(reps):
        matcher, bitmask = engine.matcher(compiled), new_bitmask()
        for p in range(len(tokens) - DRAFT + 1):
            for token in tokens[p : p + DRAFT]:
                matcher.accept(token)
            ok, us = timed(lambda m=matcher: m.rollback(BACK))
            times.append(us)
            matcher.fill(bitmask)
            if not (ok and same(bitmask, masks[p + DRAFT - BACK])):
                failures.append(f"p={p}: +{DRAFT} -{BACK}")
            ok = matcher.rollback(DRAFT - BACK)
            matcher.fill(bitmask)
            if not (ok and same(bitmask, masks[p])):
                failures.append(f"p={p}: +{DRAFT} -{DRAFT}")
            checks += 2
            matcher.accept(tokens[p])
    return {"rollback_us": stats(times) if times else None, "checks": checks, "failures": failures}


def chain_by_loop(matcher: Matcher, tokens: list[int], out: torch.Tensor) -> None:
    """The K+1 masks along a drafted chain by mask, advance, ..., mask, rollback K."""
    for row, token in enumerate(tokens):
        matcher.fill(out[row : row + 1])
        matcher.accept(token)
    matcher.fill(out[len(tokens) : len(tokens) + 1])
    matcher.rollback(len(tokens))


def chain_once(
    matcher: Matcher, how: str, chain: list[int], expected: np.ndarray, start: np.ndarray
) -> tuple[float | None, list[str]]:
    """Time one chain of masks (how: "loop" or "own"); None when the engine has no own API."""
    out = new_bitmask(ROWS)
    if how == "loop":
        _, us = timed(lambda: chain_by_loop(matcher, chain, out))
    else:
        done, us = timed(lambda: matcher.draft(chain, out))
        if not done:
            return None, []
    problems = [] if np.array_equal(out.numpy(), expected) else [f"{how}: masks differ"]
    check = new_bitmask()
    matcher.fill(check)
    return us, problems if same(check, start) else [*problems, f"{how}: state moved"]


def chains(
    engine: Engine, compiled: Any, tokens: list[int], masks: list[np.ndarray], reps: int
) -> dict[str, Any]:
    """One verify step's ROWS masks from each position p along tokens[p : p + ROWS - 1]."""
    drafted = ROWS - 1
    times: dict[str, list[float]] = {"loop": [], "own": []}
    failures: list[str] = []
    for _ in range(reps):
        matcher = engine.matcher(compiled)
        for p in range(len(tokens) - drafted + 1):
            chain, expected = tokens[p : p + drafted], np.stack(masks[p : p + ROWS])
            for how in times:
                us, problems = chain_once(matcher, how, chain, expected, masks[p])
                if us is not None:
                    times[how].append(us)
                failures += [f"p={p} {problem}" for problem in problems]
            matcher.accept(tokens[p])
    return {
        "draft_tokens": drafted,
        "loop_us": stats(times["loop"]) if times["loop"] else None,
        "own_api_us": stats(times["own"]) if times["own"] else None,
        "failures": failures,
    }


def apply_cost(apply: Applier, masks: list[np.ndarray], reps: int) -> dict[str, Any]:
    """Apply the first ROWS walk masks to [ROWS, VOCAB] float32 logits: first call, then
    APPLY_CALLS * reps timed calls; the result must be -inf exactly where a token is barred."""
    bitmask = torch.from_numpy(np.stack(masks[:ROWS]))
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(0))
    barred = torch.from_numpy(~np.stack([allowed(m) for m in masks[:ROWS]]))
    try:
        probe = logits.clone()
        _, first_us = timed(lambda: apply(probe, bitmask))
    except Exception as error:  # a helper that cannot run here (no compiler, ...)
        return {"error": f"{type(error).__name__}: {error}"}
    correct = bool(torch.isneginf(probe).eq(barred).all())
    times = [timed(lambda: apply(logits, bitmask))[1] for _ in range(APPLY_CALLS * reps)]
    return {"first_call_ms": first_us / 1e3, "apply_us": stats(times), "correct": correct}


def masked_fill(masks: list[np.ndarray]) -> Applier:
    """The reference: ``logits.masked_fill_(~mask, -inf)`` on a bool mask (bitmask ignored)."""
    mask = torch.from_numpy(np.stack([allowed(m) for m in masks[:ROWS]]))

    def apply(logits: torch.Tensor, _bitmask: torch.Tensor) -> None:
        logits.masked_fill_(~mask, float("-inf"))

    return apply


# --- agreement ------------------------------------------------------------------------------


def token_label(tokenizer: Any, token: int) -> str:
    return f"{token}:{tokenizer.convert_ids_to_tokens(token)!r}"


def disagreement(tokenizer: Any, a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    only_a, only_b = np.nonzero(a & ~b)[0], np.nonzero(b & ~a)[0]
    return {
        "only_first": int(only_a.size),
        "only_second": int(only_b.size),
        "examples_first": [token_label(tokenizer, int(t)) for t in only_a[:6]],
        "examples_second": [token_label(tokenizer, int(t)) for t in only_b[:6]],
    }


def agreement(tokenizer: Any, tokens: list[int], masks: dict[str, list]) -> list[dict[str, Any]]:
    """Per position: each engine's allowed-token count and, for each pair that differs, how."""
    names, rows = list(masks), []
    for pos in range(len(tokens) + 1):
        bools = {name: allowed(masks[name][pos]) for name in names}
        row: dict[str, Any] = {
            "position": pos,
            "next_token": token_label(tokenizer, tokens[pos]) if pos < len(tokens) else "(end)",
            "counts": {name: int(b.sum()) for name, b in bools.items()},
            "differences": {},
        }
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                if not np.array_equal(bools[first], bools[second]):
                    diff = disagreement(tokenizer, bools[first], bools[second])
                    row["differences"][f"{first} vs {second}"] = diff
        rows.append(row)
    return rows


# --- driver ---------------------------------------------------------------------------------


def license_of(package: str) -> str:
    meta = importlib.metadata.metadata(package)
    if meta.get("License-Expression"):
        return meta["License-Expression"]
    if meta.get("License"):
        return meta["License"]
    found = [c.split("::")[-1].strip() for c in meta.get_all("Classifier") or [] if "Lic" in c]
    return ", ".join(found) or "unknown"


def load_engines() -> tuple[list[Engine], dict[str, str]]:
    engines, skipped = [], {}
    for make in ENGINES:
        try:
            engines.append(make())
        except Exception as error:
            skipped[make.name] = f"{type(error).__name__}: {error}"
    return engines, skipped


def measure_grammar(
    engine: Engine, grammar: Grammar, tokens: list[int], reps: int, eos: int
) -> dict[str, Any]:
    compiled, compile_ms = compile_times(engine, grammar, reps)
    _, matcher_us = timed(lambda: engine.matcher(compiled))
    result = walk(engine, compiled, tokens, reps, eos)
    result["compile_ms"] = {"median": statistics.median(compile_ms), "all": compile_ms}
    result["matcher_us"] = matcher_us
    result["rollback"] = rollbacks(engine, compiled, tokens, result["masks"], reps)
    result["chain"] = chains(engine, compiled, tokens, result["masks"], reps)
    return result


def measure_engine(
    engine: Engine, tokenizer: Any, documents: dict[str, list[int]], reps: int
) -> dict[str, Any]:
    eos = tokenizer.eos_token_id
    prepare_ms = [timed(lambda: engine.prepare(tokenizer, eos))[1] / 1e3 for _ in range(reps)]
    result: dict[str, Any] = {
        "version": importlib.metadata.version(engine.package),
        "license": license_of(engine.package),
        "rollback_api": engine.rollback_api,
        "draft_api": engine.draft_api,
        "tokenizer_step_ms": {"median": statistics.median(prepare_ms), "all": prepare_ms},
        "grammars": {},
    }
    for grammar in GRAMMARS:
        print(f"  {engine.name}: {grammar.name}", flush=True)
        try:
            found = measure_grammar(engine, grammar, documents[grammar.name], reps, eos)
        except Exception as error:
            found = {"error": f"{type(error).__name__}: {error}"}
        result["grammars"][grammar.name] = found
    json_masks = result["grammars"]["json"].get("masks")
    if json_masks:
        result["apply"] = {
            api: apply_cost(fn, json_masks, reps) for api, fn in engine.appliers().items()
        }
    return result


def environment() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    models = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers"),
        "torch_threads": torch.get_num_threads(),
        "cpu": models[0] if models else "unknown",
    }


# --- report ---------------------------------------------------------------------------------


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def triple(found: dict[str, float] | None) -> str:
    if not found:
        return "n/a"
    return f"{fmt(found['median'])} / {fmt(found['p95'])} / {fmt(found['max'])}"


def rollback_cell(found: dict[str, Any]) -> str:
    rollback = found["rollback"]
    state = "ok" if not rollback["failures"] else f"WRONG ({len(rollback['failures'])})"
    median = rollback["rollback_us"]["median"] if rollback["rollback_us"] else None
    return f"yes, {state} ({rollback['checks']} checks), {fmt(median)}"


def chain_cell(found: dict[str, Any]) -> str:
    chain = found["chain"]
    own = chain["own_api_us"]["median"] if chain["own_api_us"] else None
    loop = chain["loop_us"]["median"] if chain["loop_us"] else None
    state = "" if not chain["failures"] else f" WRONG ({len(chain['failures'])})"
    return f"{fmt(own)} / {fmt(loop)}{state}"


def end_cell(found: dict[str, Any]) -> str:
    def yn(flag: bool) -> str:
        return "yes" if flag else "no"

    early = found["eos_allowed_before_end"]
    early_text = f", EOS also at {early}" if early else ""
    return (
        f"{yn(found['final_accepting'])} / {yn(found['eos_allowed_at_end'])}"
        f" ({'only EOS' if found['eos_only_at_end'] else 'with others'})"
        f" / {yn(found['matcher_takes_eos'])}{early_text}"
    )


def forced_cell(found: dict[str, Any]) -> str:
    start = found["forced"][0]
    return "no API" if start is None else f"`{start!r}`"


def engine_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for name, engine in results["engines"].items():
        for grammar, found in engine["grammars"].items():
            if "error" in found:
                head = f"| {name} | {engine['version']} | {engine['license']} | {grammar} |"
                rows.append(f"{head} error: {found['error']} |" + " |" * 8)
                continue
            rows.append(
                f"| {name} | {engine['version']} | {engine['license']} | {grammar} "
                f"| {fmt(engine['tokenizer_step_ms']['median'], 0)} "
                f"| {fmt(found['compile_ms']['median'], 2)}"
                f" / {fmt(found['first_mask_us']['median'])} | {triple(found['mask_us'])} "
                f"| {fmt(found['accept_us']['median'])} | {rollback_cell(found)} "
                f"| {chain_cell(found)} | {end_cell(found)} | {forced_cell(found)} |"
            )
    return rows


def apply_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    engines = results["engines"].items()
    entries = [(n, api, found) for n, e in engines for api, found in e.get("apply", {}).items()]
    entries.append(("reference", "torch masked_fill_(~bool_mask, -inf)", results["masked_fill"]))
    for name, api, found in entries:
        if not found or "error" in found:
            rows.append(f"| {name} | {api} | {(found or {}).get('error', 'n/a')} | | |")
            continue
        rows.append(
            f"| {name} | {api} | {triple(found['apply_us'])} "
            f"| {fmt(found['first_call_ms'], 1)} | {'yes' if found['correct'] else 'NO'} |"
        )
    return rows


def agreement_lines(grammar: str, rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    names = list(rows[0]["counts"])
    lines = [
        f"### {grammar}: allowed tokens per position",
        "",
        "| pos | next token | " + " | ".join(names) + " | differs |",
        "|---|---|" + "---|" * len(names) + "---|",
    ]
    for row in rows:
        counts = " | ".join(f"{row['counts'][n]:,}" for n in names)
        differs = "; ".join(
            f"{pair}: +{d['only_first']}/+{d['only_second']}"
            for pair, d in row["differences"].items()
        )
        lines.append(f"| {row['position']} | `{row['next_token']}` | {counts} | {differs} |")
    return [*lines, "", "Example differing tokens (repeats dropped):", "", *example_lines(rows), ""]


def example_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines, seen = [], set()
    for row in rows:
        for pair, d in row["differences"].items():
            key = (pair, tuple(d["examples_first"]), tuple(d["examples_second"]))
            if key not in seen:
                seen.add(key)
                lines.append(
                    f"- pos {row['position']}, {pair}: only first {d['examples_first']},"
                    f" only second {d['examples_second']}"
                )
    return lines


def grammar_lines(results: dict[str, Any]) -> list[str]:
    lines = []
    for grammar in GRAMMARS:
        source = " ".join(grammar.source.split())
        lines.append(
            f"- {grammar.name} ({grammar.kind} `{source}`): the document `{grammar.text}`,"
            f" {len(results['documents'][grammar.name])} tokens."
        )
    lines.append("- Every engine compiles the schema to compact JSON (no whitespace, `,` `:`).")
    return lines


def summary(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# Grammar engines for structured outputs",
        "",
        f"Tokenizer: {results['tokenizer']} (vocabulary {VOCAB:,}); reps {results['reps']};"
        f" CPU {env['cpu']}, torch {env['torch']} ({env['torch_threads']} threads),"
        f" Python {env['python']}.",
        *grammar_lines(results),
        "",
        "Mask: one full bitmask over the vocabulary per position of the document. Advance: one"
        f" token. Rollback: +{DRAFT} tokens then rollback({BACK}), its mask checked against the"
        f" walk's (and again after rolling back the other {DRAFT - BACK}). Chain: the {ROWS}"
        f" masks of one verify step along {ROWS - 1} drafted tokens. Forced: the jump-forward"
        " string at the start.",
        "",
        "| engine | version | license | grammar | tokenizer step ms | compile ms / first mask µs"
        " | mask µs median / p95 / max | advance µs | rollback: support, check, µs"
        f" | {ROWS} chain masks µs: own API / loop | final accepting / EOS allowed / takes EOS"
        " | forced at start |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *engine_rows(results),
        "",
        f"Apply a [{ROWS}, {VOCAB:,}] bitmask to float32 logits:",
        "",
        "| engine | helper | µs median / p95 / max | first call ms | correct |",
        "|---|---|---|---|---|",
        *apply_rows(results),
        "",
    ]
    if results["skipped"]:
        lines += ["Skipped: " + "; ".join(f"{k} ({v})" for k, v in results["skipped"].items()), ""]
    for grammar, rows in results["agreement"].items():
        lines += agreement_lines(grammar, rows)
    return "\n".join(lines) + "\n"


def strip_masks(results: dict[str, Any]) -> dict[str, Any]:
    for engine in results["engines"].values():
        for found in engine["grammars"].values():
            found.pop("masks", None)
    return results


def failures(results: dict[str, Any]) -> list[str]:
    found = []
    for name, engine in results["engines"].items():
        for grammar, result in engine["grammars"].items():
            for part in ("rollback", "chain"):
                for failure in result.get(part, {}).get("failures", []):
                    found.append(f"{name} {grammar} {part}: {failure}")
            if result.get("rejected_positions"):
                found.append(f"{name} {grammar}: rejected {result['rejected_positions']}")
    return found


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", required=True, help="directory with the tokenizer files")
    parser.add_argument("--out", required=True, help="directory for results.json and summary.md")
    parser.add_argument("--reps", type=int, default=3, help="repetitions of each measurement")
    return parser.parse_args()


def walk_masks(results: dict[str, Any], grammar: str) -> dict[str, list[np.ndarray]]:
    engines = results["engines"].items()
    return {
        n: e["grammars"][grammar]["masks"] for n, e in engines if "masks" in e["grammars"][grammar]
    }


def main() -> None:
    args = parse_args()
    # A fresh cache, so that a helper's first call pays its whole torch.compile.
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="grammar-engines-inductor-")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
    documents = {g.name: tokenizer.encode(g.text, add_special_tokens=False) for g in GRAMMARS}
    engines, skipped = load_engines()
    for name, why in skipped.items():
        print(f"skipping {name}: {why}")
    results: dict[str, Any] = {
        "tokenizer": args.tokenizer,
        "reps": args.reps,
        "environment": environment(),
        "documents": documents,
        "grammars": {
            g.name: {"kind": g.kind, "source": g.source, "text": g.text} for g in GRAMMARS
        },
        "skipped": skipped,
        "engines": {e.name: measure_engine(e, tokenizer, documents, args.reps) for e in engines},
    }
    results["agreement"] = {
        g.name: agreement(tokenizer, documents[g.name], walk_masks(results, g.name))
        for g in GRAMMARS
    }
    masks = next(iter(walk_masks(results, "json").values()), None)
    results["masked_fill"] = apply_cost(masked_fill(masks), masks, args.reps) if masks else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    strip_masks(results)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "summary.md").write_text(summary(results))
    print(summary(results))
    problems = failures(results)
    assert not problems, "checks failed: " + "; ".join(problems)


if __name__ == "__main__":
    main()
