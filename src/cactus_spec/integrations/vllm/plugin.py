"""The vLLM plugin: cactus-spec's rules inside vLLM's rejection sampling, per request.

vLLM loads ``register`` (entry point ``vllm.general_plugins``) in its main process, its
engine core and every worker. ``register`` checks the vLLM version and every patch target,
failing loudly when one is missing, then:

- wraps ``SamplingParams._verify_extra_args`` so that a bad ``cactus_*`` value is refused
  when the request is made (a 400 from the OpenAI server, a ValueError from ``LLM``),
  never inside the engine;
- wraps the V1 runner's ``_sample`` to tell the sampler which spec each row asks for
  (``requests``, handed over in ``calls``), and its ``_update_states`` to close the meter
  of finished requests;
- replaces V1's ``rejection_sample`` with the rule-aware one (``sampler``);
- the same in Model Runner V2 (vLLM's GPU default): its runner's ``add_requests`` reads each
  request's spec once, ``finish_requests`` closes the meter, ``RejectionSampler.__call__``
  tells ``sampler_v2`` the batch's requests (``calls``), and MRV2's ``rejection_sample``
  becomes the rule-aware one;
- applies ``cpu_fixes`` on the versions that need them;
- gives the meter its Prometheus counters (``COUNTERS``), on one worker per request: under
  tensor parallelism every rank samples every request, so only rank 0 meters (with MRV2's
  batch-sharded sampling each rank samples, and meters, its own requests).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

from cactus_spec.core.spec import DecodeSpec
from cactus_spec.integrations.vllm import cpu_fixes, sampler, sampler_v2
from cactus_spec.integrations.vllm.calls import calling
from cactus_spec.integrations.vllm.meter import Meter, Tally, logger
from cactus_spec.integrations.vllm.requests import PREFIX, default_spec, request_spec

#: vLLM releases whose V1 sampler and runner this plugin was read against: [low, high).
SUPPORTED = ((0, 32), (0, 34))
SAMPLER = "vllm.v1.sample.rejection_sampler"
RUNNER = "vllm.v1.worker.gpu_model_runner"
V2_SAMPLER = "vllm.v1.worker.gpu.spec_decode.rejection_sampler"
V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
V2_KERNELS = "vllm.v1.worker.gpu.spec_decode.rejection_sampler_utils"
#: Every attribute the plugin reads or replaces, checked before anything is patched.
TARGETS = (
    ("vllm.sampling_params", "SamplingParams._verify_extra_args"),
    ("vllm.exceptions", "VLLMValidationError"),
    (RUNNER, "GPUModelRunner._sample"),
    (RUNNER, "GPUModelRunner._update_states"),
    (SAMPLER, "rejection_sample"),
    (SAMPLER, "generate_uniform_probs"),
    (SAMPLER, "sample_recovered_tokens"),
    (SAMPLER, "_rejection_greedy_sample"),
    (SAMPLER, "_rejection_random_sample"),
    (SAMPLER, "PLACEHOLDER_TOKEN_ID"),
    (SAMPLER, "GREEDY_TEMPERATURE"),
    (V2_SAMPLER, "rejection_sample"),
    (V2_SAMPLER, "RejectionSampler.__call__"),
    (V2_RUNNER, "GPUModelRunner.add_requests"),
    (V2_RUNNER, "GPUModelRunner.finish_requests"),
    (V2_KERNELS, "rejection_sample"),
    ("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank"),
    *cpu_fixes.TARGETS,
)
METER = Meter()
#: The meter's Prometheus counters, by method: they reach vLLM's /metrics from the worker
#: when PROMETHEUS_MULTIPROC_DIR names a directory (prometheus_client's multiprocess mode).
COUNTERS = (
    ("cactus_spec:requests", "requests decoded with a cactus-spec rule", None),
    ("cactus_spec:drafted_tokens", "drafted tokens verified", "drafted"),
    ("cactus_spec:accepted_tokens", "drafted tokens accepted", "accepted"),
    ("cactus_spec:kl_nats", "exact KL(law || q) spent, in nats (bounded, measured)", "kl_nats"),
)
_registered: list[bool] = []


def register() -> None:
    """vLLM's entry point: check, then patch (once per process)."""
    if _registered:
        return
    import vllm

    release = check_version(vllm.__version__)
    resolve_all(TARGETS)
    METER.export = _prometheus_export()
    _patch_requests()
    _patch_runner()
    _patch_sampler()
    _patch_v2()
    cpu_fixes.apply(release)
    _registered.append(True)


def check_version(version: str) -> tuple[int, ...]:
    """``version``'s (major, minor); RuntimeError unless it lies in ``SUPPORTED``."""
    parts = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    low, high = SUPPORTED
    if len(parts) != 2 or not low <= parts < high:
        raise RuntimeError(
            f"cactus-spec's vLLM plugin supports vLLM {low[0]}.{low[1]} up to (not including) "
            f"{high[0]}.{high[1]}, found {version}; uninstall cactus-spec from this "
            "environment or install a supported vLLM"
        )
    return parts


def resolve(module: str, path: str) -> object:
    """``module``'s attribute ``path`` ("Class.method"); RuntimeError naming it if missing."""
    try:
        value: object = importlib.import_module(module)
        for name in path.split("."):
            value = getattr(value, name)
    except (ImportError, AttributeError) as error:
        raise RuntimeError(
            f"cactus-spec's vLLM plugin cannot find {module}.{path} in this vLLM ({error}); "
            "nothing was patched"
        ) from error
    return value


def resolve_all(targets: tuple[tuple[str, str], ...]) -> None:
    for module, path in targets:
        resolve(module, path)


def _prometheus_export() -> Callable[[Tally], None]:
    """Add each finished request's tally to the counters (a KL that is NaN, not measured, or
    infinite, a law off q's support, is not added: the totals stay finite)."""
    from prometheus_client import Counter

    counters = [(Counter(name, text, ["method"]), field) for name, text, field in COUNTERS]

    def export(tally: Tally) -> None:
        for counter, field in counters:
            value = 1.0 if field is None else float(getattr(tally, field))
            if math.isfinite(value):
                counter.labels(method=tally.method).inc(value)

    return export


def _patch_requests() -> None:
    params = importlib.import_module("vllm.sampling_params").SamplingParams
    invalid = resolve("vllm.exceptions", "VLLMValidationError")
    original = params._verify_extra_args

    def _verify_extra_args(self) -> None:
        original(self)
        try:
            request_spec(self.extra_args, None)
        except ValueError as error:
            raise invalid(str(error), parameter="extra_args") from None

    params._verify_extra_args = _verify_extra_args


@dataclass
class _RunnerSpecs:
    """The specs of one runner's requests: the server's default and each request's."""

    default: DecodeSpec | None
    by_request: dict[str, DecodeSpec | None]

    def of(self, request_id: str, extra_args: dict | None) -> DecodeSpec | None:
        if request_id not in self.by_request:
            try:
                self.by_request[request_id] = request_spec(extra_args, self.default)
            except ValueError as error:  # refused at the request; reached only without it
                logger.error(
                    "cactus-spec request %s: %s; decoding it with vLLM's standard "
                    "speculative sampling",
                    request_id,
                    error,
                )
                self.by_request[request_id] = None
        return self.by_request[request_id]


def _specs(runner) -> _RunnerSpecs:
    specs = runner.__dict__.get("_cactus_specs")
    if specs is None:
        config = runner.vllm_config.additional_config
        specs = _RunnerSpecs(default_spec(config), {})
        runner.__dict__["_cactus_specs"] = specs
    return specs


def _patch_runner() -> None:
    runner = importlib.import_module(RUNNER).GPUModelRunner
    sample, update_states = runner._sample, runner._update_states

    def _sample(self, logits, spec_decode_metadata):
        if spec_decode_metadata is None:
            return sample(self, logits, spec_decode_metadata)
        specs = _specs(self)
        _claim_meter(self)
        ids = list(self.input_batch.req_ids[: self.input_batch.num_reqs])
        extra = [self.requests[i].sampling_params.extra_args for i in ids]
        asked = [(i, specs.of(i, e)) for i, e in zip(ids, extra, strict=True)]
        with calling(dict(enumerate(asked))):
            return sample(self, logits, spec_decode_metadata)

    def _update_states(self, scheduler_output):
        _finish(_specs(self), scheduler_output.finished_req_ids)
        return update_states(self, scheduler_output)

    runner._sample, runner._update_states = _sample, _update_states


def _patch_sampler() -> None:
    module = importlib.import_module(SAMPLER)
    module.rejection_sample = sampler.make_rejection_sample(module, METER)


def _finish(specs: _RunnerSpecs, finished: set[str]) -> None:
    """Forget finished requests' specs and close their meters."""
    for request_id in finished:
        specs.by_request.pop(request_id, None)
        try:
            METER.finish(request_id)
        except Exception:  # the meter must never take the engine down
            logger.exception("cactus-spec: closing the meter of %s failed", request_id)


def _claim_meter(runner) -> None:
    """Decide once per worker whether it meters: rank 0 of its tensor-parallel group, or
    every rank when each samples only its own requests (MRV2's batch-sharded sampling)."""
    if "_cactus_meter" in runner.__dict__:
        return
    rank = resolve("vllm.distributed.parallel_state", "get_tensor_model_parallel_rank")()
    METER.active = getattr(runner, "batch_sharder", None) is not None or rank == 0
    runner.__dict__["_cactus_meter"] = METER.active


def _patch_v2() -> None:
    """Model Runner V2: specs read when requests arrive, the batch's requests handed to
    ``sampler_v2`` around each verification, MRV2's ``rejection_sample`` replaced."""
    runner = importlib.import_module(V2_RUNNER).GPUModelRunner
    module = importlib.import_module(V2_SAMPLER)
    add_requests, finish_requests = runner.add_requests, runner.finish_requests
    call = module.RejectionSampler.__call__

    def add(self, scheduler_output) -> None:
        add_requests(self, scheduler_output)
        specs = _specs(self)
        _claim_meter(self)
        for new in scheduler_output.scheduled_new_reqs:
            if new.sampling_params is not None:
                specs.of(new.req_id, new.sampling_params.extra_args)
        if self.rejection_sampler is not None:
            self.rejection_sampler.__dict__["_cactus_specs"] = specs

    def finish(self, scheduler_output) -> None:
        _finish(_specs(self), scheduler_output.finished_req_ids)
        finish_requests(self, scheduler_output)

    def __call__(self, logits, input_batch, *args, **kwargs):
        specs = self.__dict__.get("_cactus_specs")
        if specs is None:
            return call(self, logits, input_batch, *args, **kwargs)
        states = input_batch.idx_mapping_np.tolist()
        ids = input_batch.req_ids[: input_batch.num_reqs]
        requests = {
            state: (i, specs.by_request.get(i)) for i, state in zip(ids, states, strict=False)
        }
        with calling(requests):
            return call(self, logits, input_batch, *args, **kwargs)

    runner.add_requests, runner.finish_requests = add, finish
    module.RejectionSampler.__call__ = __call__
    module.rejection_sample = sampler_v2.make_rejection_sample(module.rejection_sample, METER)


def extra_args(method: str, **params: object) -> dict[str, object]:
    """The ``extra_args`` (``vllm_xargs``) that ask for ``method`` with ``params``, checked:
    ``extra_args("cactus", delta=0.5)`` -> ``{"cactus_method": "cactus", "cactus_delta": 0.5}``."""
    values = {f"{PREFIX}method": method, **{PREFIX + k: v for k, v in params.items()}}
    request_spec(values, None)
    return values
