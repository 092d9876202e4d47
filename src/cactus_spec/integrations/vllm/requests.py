"""Which rule a vLLM request asks for: its ``cactus_*`` extra args over the server's default.

A request names its method and the method's parameters in ``SamplingParams.extra_args``
(the OpenAI server's ``vllm_xargs``), each key prefixed ``cactus_``, for example
``{"cactus_method": "cactus", "cactus_delta": 0.5}``: flat keys because ``vllm_xargs``
holds only strings, numbers and lists. Values may be text ("0.5", "true"). The server-wide
default is ``additional_config={"cactus_spec": {"method": "cactus", "delta": 0.5}}``
(``vllm serve --additional-config``). Both are read by ``core.spec.parse_spec``, the parser
of the command line and cactus-spec's own server. K and the drafter are vLLM's own
(``--speculative-config``), so they are refused here, as is ``ar``. vLLM drafts one chain
per request, so ``verification`` is ``chain`` or ``block`` (``sampler``), never a tree.
"""

from __future__ import annotations

from collections.abc import Mapping

from cactus_spec.core.spec import BUDGET_KEYS, SPEC_KEYS, DecodeSpec, parse_spec

PREFIX = "cactus_"
DEFAULT_KEY = "cactus_spec"
#: Spec keys vLLM owns: K is num_speculative_tokens, the drafter its method.
_VLLM_OWNED = ("num_draft_tokens", "drafter")
#: The verifications of one drafted chain, the only shape vLLM drafts.
VERIFICATIONS = ("chain", "block")


def default_spec(additional_config: Mapping | None) -> DecodeSpec | None:
    """The server-wide spec from vLLM's ``additional_config``; None when it names none."""
    values = (additional_config or {}).get(DEFAULT_KEY)
    if values is None:
        return None
    where = f"additional_config.{DEFAULT_KEY}."
    if not isinstance(values, Mapping):
        raise ValueError(f"{where[:-1]} must be an object, got {values!r}")
    return _parse(values, None, where)


def request_spec(extra_args: Mapping | None, default: DecodeSpec | None) -> DecodeSpec | None:
    """The spec a request decodes with: its ``cactus_*`` keys over ``default``; None (vLLM's
    standard speculative sampling) when neither names one. ValueError names the key."""
    ours = {k[len(PREFIX) :]: v for k, v in (extra_args or {}).items() if k.startswith(PREFIX)}
    if not ours:
        return default
    return _parse(ours, default, PREFIX)


def _parse(values: Mapping, base: DecodeSpec | None, prefix: str) -> DecodeSpec:
    """``parse_spec`` with keys named ``prefix + key``, K, the drafter and ``ar`` refused."""
    for key in _VLLM_OWNED:
        if key in values:
            raise ValueError(
                f"{prefix}{key} does not apply in vLLM: the draft length and the drafter are "
                "the server's --speculative-config"
            )
    if "branches" in values:
        raise ValueError(f"{prefix}branches does not apply in vLLM: it drafts one chain")
    for key in BUDGET_KEYS:
        if key in values:
            raise ValueError(
                f"{prefix}{key} does not apply in vLLM: the plugin spends delta per position; "
                "an answer's budget is cactus-spec's own engine and server (DESIGN says why)"
            )
    allowed = [key for key in SPEC_KEYS if key not in (*_VLLM_OWNED, "branches", *BUDGET_KEYS)]
    unknown = [key for key in values if key not in allowed]
    if unknown:
        names = ", ".join(prefix + key for key in allowed)
        raise ValueError(f"unknown key {prefix}{unknown[0]}; the keys are {names}")
    base = base if base is not None else DecodeSpec.of("sps")
    try:
        spec = parse_spec(values, base=base, text=True, label=lambda key: prefix + key)
    except ValueError as error:  # the rules' own messages name the bare parameter
        message = str(error)
        raise ValueError(message if message.startswith(prefix) else prefix + message) from None
    if spec.verification is not None and spec.verification not in VERIFICATIONS:
        raise ValueError(
            f"{prefix}verification {spec.verification} does not apply in vLLM: it drafts one "
            f"chain; the values are {', '.join(VERIFICATIONS)}"
        )
    if not spec.drafts:
        raise ValueError(
            f"{prefix}method ar does not apply in vLLM: leave out --speculative-config instead"
        )
    return spec
