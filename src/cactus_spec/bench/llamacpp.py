"""llama.cpp as a peer, through llama-cpp-python, on the same GGUF file as the verifier.

- ``llamacpp``: plain decoding of the (Q4_K_M) GGUF, what people run on a laptop CPU today.
- ``llamacpp_lookup``: llama.cpp's prompt-lookup speculative decoding
  (``LlamaPromptLookupDecoding(num_pred_tokens=N)``).

Same prompt ids, temperature, top-k and top-p as the engine (min-p and repetition penalties
off; temperature 0: greedy); generation stops at the model's EOS or the budget; the wall time
includes the prompt, as the engine's does. Installed by the optional extra
``pip install 'cactus-spec[peers]'`` (built from source); without it these methods fail with
one line saying so.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from cactus_spec.backends.ggml import INSTALL_HINT
from cactus_spec.bench.grid import Config
from cactus_spec.bench.peers import PeerResult
from cactus_spec.core.sampling import SamplingConfig
from cactus_spec.loading.models import LoadedModel

METHODS = ("llamacpp", "llamacpp_lookup")


def missing_reason() -> str | None:
    """Why the llama.cpp peers cannot run here, or None when they can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return f"llama-cpp-python is not installed; {INSTALL_HINT}"
    return None


def gguf_of(verifier: LoadedModel) -> Path:
    """The GGUF file the verifier was loaded from; ValueError if it came from elsewhere."""
    path = Path(verifier.identity)
    if path.suffix != ".gguf" or not path.is_file():
        raise ValueError(
            f"the llama.cpp peers need the verifier as a GGUF file, got {verifier.identity}"
        )
    return path


class LlamaCppPeers:
    """One llama.cpp context per configuration over the verifier's GGUF, loaded on first use."""

    def __init__(self, gguf: Path, context_length: int, threads: int) -> None:
        reason = missing_reason()
        if reason is not None:
            raise ValueError(f"methods {', '.join(METHODS)}: {reason}")
        self.gguf, self.context_length, self.threads = gguf, context_length, threads
        self._models: dict[str, object] = {}

    def _model(self, config: Config):
        if config.id not in self._models:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = None
            if config.method == "llamacpp_lookup":
                lookahead = dict(config.params)["num_pred_tokens"]
                assert isinstance(lookahead, int)  # the grid reads it as a count
                draft = LlamaPromptLookupDecoding(num_pred_tokens=lookahead)
            self._models[config.id] = Llama(
                model_path=str(self.gguf),
                n_ctx=self.context_length,
                n_threads=self.threads,
                n_threads_batch=self.threads,
                draft_model=draft,
                verbose=False,
            )
        return self._models[config.id]

    def generate(
        self,
        config: Config,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingConfig,
        seed: int,
    ) -> PeerResult:
        """Run one llama.cpp configuration on one prompt."""
        model = self._model(config)
        model.set_seed(seed % 2**32)
        eos = model.token_eos()
        greedy = sampling.greedy
        tokens: list[int] = []
        start = time.perf_counter()
        stream = model.generate(
            list(prompt_ids),
            top_k=1 if greedy else sampling.top_k,
            top_p=1.0 if greedy else sampling.top_p,
            min_p=0.0,
            temp=0.0 if greedy else sampling.temperature,
            repeat_penalty=1.0,
            reset=True,
        )
        for token in stream:
            tokens.append(int(token))
            if token == eos or len(tokens) >= max_new_tokens:
                break
        stream.close()
        return PeerResult(tokens, time.perf_counter() - start)
