"""Token sampling from a batch of logits, in plain torch: the reference and the CPU path, and
``argmax``, the greedy choice.

``sample_from_logits`` draws one token per row under per-row temperature, top-k, top-p and min-p,
and sorts the vocabulary only when it has to:

- Greedy rows (temperature below ``GREEDY_TEMPERATURE``) take the argmax.
- Plain temperature rows draw by exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` drawn
  independently per token is an exact sample of ``p`` (it is the Gumbel-max trick on
  probabilities), with one random number per token and no sort or cumsum. Min-p is a threshold
  on ``p`` relative to its maximum, so it needs no sort either.
- Top-k rows take ``torch.topk`` (k candidates, sorted), and top-p is applied inside those k,
  on their renormalized probabilities. Only a row with top-p and no top-k needs the whole
  vocabulary sorted.

``sample_rows`` is the same math for the engine: the caller says on the host which filters apply
(so nothing is read back from the device) and may pass each row's noise (drawn from the row's own
seeded generator), which it races in vocabulary order.

``triton_sampling`` has both with the same semantics; it draws greedy and plain rows in one fused
Triton kernel and sends only filtered rows here.

>>> logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
>>> sample_from_logits(logits, temperatures=torch.tensor([0.0, 1.0]),
...                    top_ks=torch.tensor([0, 1]), top_ps=torch.tensor([1.0, 1.0]))
tensor([1, 1])
"""
from __future__ import annotations

import torch


def argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum of each row of ``[R, V]`` (NaN counts as the largest)."""
    return x.argmax(dim=-1)


# Temperatures below this are greedy: dividing logits by them would overflow to inf.
GREEDY_TEMPERATURE = 1e-5


def sample_from_logits(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    generator: torch.Generator | None = None,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw one token id per row of ``logits`` ``[B, V]``; returns int64 ``[B]``.

    All per-row parameters are ``[B]`` tensors on the logits' device:

    - ``temperatures``: logits are divided by it; below ``GREEDY_TEMPERATURE`` the row is greedy
      (argmax, lowest index on ties) and its other parameters are ignored.
    - ``top_ks``: keep the k most likely tokens; 0, negative, or at least V keeps all.
    - ``top_ps`` in (0, 1]: then keep the most likely tokens until their probability mass
      reaches top_p (a token is dropped once the mass of the tokens before it reaches top_p; the
      most likely token is always kept); 1 keeps all.
    - ``min_ps`` in [0, 1] (optional): then drop tokens less likely than min_p times the most
      likely one.

    ``generator`` supplies all randomness, so one generator state gives one result.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    >>> sample_from_logits(logits, torch.tensor([0.7]), torch.tensor([2]), torch.tensor([0.9]),
    ...                    torch.Generator().manual_seed(0)).shape
    torch.Size([1])
    """
    logits = logits.float()
    vocab_size = logits.shape[-1]
    tokens = logits.argmax(dim=-1)
    is_greedy = temperatures < GREEDY_TEMPERATURE
    needs_top_k_top_p = _needs_top_k_top_p(top_ks, top_ps, vocab_size)
    scaled = logits / torch.where(is_greedy, 1.0, temperatures.float())[:, None]

    plain_rows = (~is_greedy & ~needs_top_k_top_p).nonzero().squeeze(1)
    if plain_rows.numel():
        probs = torch.softmax(scaled[plain_rows], dim=-1)
        if min_ps is not None:
            probs = _apply_min_p(probs, min_ps[plain_rows])
        tokens[plain_rows] = _exponential_race(probs, generator)

    filtered_rows = (~is_greedy & needs_top_k_top_p).nonzero().squeeze(1)
    if filtered_rows.numel():
        tokens[filtered_rows] = _sample_top_k_top_p(
            scaled[filtered_rows], top_ks[filtered_rows], top_ps[filtered_rows],
            None if min_ps is None else min_ps[filtered_rows], generator,
        )
    return tokens


def rows_needing_filtering(
    temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, vocab_size: int,
    min_ps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Which sampled (not greedy) rows have top-k, top-p or min-p to apply, as a bool ``[B]``."""
    needs = _needs_top_k_top_p(top_ks, top_ps, vocab_size)
    if min_ps is not None:
        needs = needs | (min_ps > 0)
    return needs & (temperatures >= GREEDY_TEMPERATURE)


def _needs_top_k_top_p(top_ks: torch.Tensor, top_ps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return ((top_ks > 0) & (top_ks < vocab_size)) | (top_ps < 1.0)


def _effective_top_ks(top_ks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    return torch.where((top_ks > 0) & (top_ks < vocab_size), top_ks, vocab_size)


def _sample_top_k_top_p(
    scaled_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
    min_ps: torch.Tensor | None, generator: torch.Generator | None,
) -> torch.Tensor:
    # One topk for the batch, as wide as its widest row; rows with top-p alone make it the vocabulary.
    num_candidates = int(_effective_top_ks(top_ks, scaled_logits.shape[-1]).max())
    probs, candidate_ids = _top_k_top_p_candidates(scaled_logits, top_ks, top_ps, num_candidates)
    if min_ps is not None:
        probs = _apply_min_p(probs, min_ps)
    choice = _exponential_race(probs, generator)
    return candidate_ids.gather(1, choice[:, None]).squeeze(1)


def _top_k_top_p_candidates(scaled_logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor,
                            num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``num_candidates`` most likely tokens of each row, as (probabilities renormalized over the
    row's top k, zero where top-k or top-p drops them; their token ids)."""
    ks = _effective_top_ks(top_ks, scaled_logits.shape[-1])
    candidate_logits, candidate_ids = scaled_logits.topk(num_candidates, dim=-1)
    ranks = torch.arange(candidate_logits.shape[-1], device=scaled_logits.device)
    is_in_top_k = ranks[None, :] < ks[:, None]
    probs = torch.softmax(candidate_logits.masked_fill(~is_in_top_k, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 must keep every candidate even where a rounded cumsum reaches 1 early.
    is_kept = is_in_top_k & ((mass_before < top_ps[:, None]) | (top_ps[:, None] >= 1.0))
    is_kept[:, 0] = True
    return probs * is_kept, candidate_ids


def _apply_min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    threshold = min_ps[:, None].to(probs.dtype) * probs.max(dim=-1, keepdim=True).values
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_race(probs: torch.Tensor, generator: torch.Generator | None, noise: torch.Tensor | None = None,
                      argmax=argmax) -> torch.Tensor:
    """Index of ``argmax(p / E)``, ``E ~ Exp(1)`` per entry: a sample of each row's (unnormalized) p.
    ``noise`` is E when the caller drew it; otherwise it is drawn from ``generator``."""
    # An exponential draw of exactly 0 would make 0 / 0 = NaN, which argmax would pick.
    if noise is None:
        noise = torch.empty_like(probs).exponential_(generator=generator).clamp_(min=torch.finfo(probs.dtype).tiny)
    else:
        noise = noise.clamp(min=torch.finfo(noise.dtype).tiny)
    return argmax(probs / noise)


def sample_rows(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    top_ks: torch.Tensor | None = None,
    top_ps: torch.Tensor | None = None,
    min_ps: torch.Tensor | None = None,
    num_candidates: int | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    argmax=argmax,
) -> torch.Tensor:
    """Draw one token per row of ``logits`` ``[B, V]``, every row sampled (none greedy), without
    reading anything back from the device: which filters apply is the caller's host-side
    knowledge, so an engine can queue the next step before this one's tokens exist.

    - ``num_candidates`` None: temperature (and min-p) only. An int: top-k (``top_ks``, 0 = all)
      then top-p (``top_ps``) over each row's ``num_candidates`` most likely tokens, which must be
      at least every row's k (V for a row with top-p and no top-k).
    - ``noise``: the rows' Exp(1) draws ``[B, V]``, one per vocabulary token, for callers that
      draw each row from its own seeded generator; a row's token then depends on its logits and
      its noise alone (not on the batch). Without it, ``generator`` draws.

    Semantics as :func:`sample_from_logits`; ``argmax`` is the routine for ``[B, V]`` rows.

    >>> logits = torch.tensor([[0.0, 9.0, 0.0]])
    >>> sample_rows(logits, torch.tensor([1.0]), top_ks=torch.tensor([1]), top_ps=torch.tensor([1.0]),
    ...             num_candidates=1).tolist()
    [1]
    """
    scaled = logits.float() / temperatures.float()[:, None]
    if num_candidates is None:
        probs, candidate_ids = torch.softmax(scaled, dim=-1), None
    else:
        probs, candidate_ids = _top_k_top_p_candidates(scaled, top_ks, top_ps, num_candidates)
        if noise is not None:
            # Race in vocabulary order, so each token meets the noise drawn for it.
            probs, candidate_ids = torch.zeros_like(scaled).scatter_(1, candidate_ids, probs), None
    if min_ps is not None:
        probs = _apply_min_p(probs, min_ps)
    choice = _exponential_race(probs, generator, noise, argmax)
    return choice if candidate_ids is None else candidate_ids.gather(1, choice[:, None]).squeeze(1)
