"""The attention mask of the global sequence, for any slice of queries and keys.

Under context parallelism no rank holds the whole sequence, so the mask the
model would build from its local tokens is wrong. torchtp builds it from what
every rank knows of the whole batch (:class:`SequenceMeta`, computed on every
rank from the same full batch) and the global indices of the queries and keys
at hand: causal order, the sliding window, document boundaries of packed
sequences and padded keys. Every rule is by *sequence index*, as
transformers' masks are (``q_idx``, ``kv_idx``), never by position id (which
restarts in each packed document).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceMeta:
    """What every rank knows of the full batch: one entry per token of the full sequence.

    Attributes:
        documents: ``(B, T)`` document id of each token (packed sequences: a
            new document where the position ids do not go up by one); all
            zeros for one document per row.
        keys_valid: ``(B, T)`` whether a token may be attended to (the
            attention mask's ones; padding is ``False``).
    """

    documents: torch.Tensor
    keys_valid: torch.Tensor


@dataclass(frozen=True)
class MaskRule:
    """The mask's shape rules of one attention layer.

    Attributes:
        causal: Keys after the query are masked.
        window: Sliding window (Mistral, GPT-OSS's sliding layers): a key at
            least ``window`` tokens before the query is masked; ``None``: none.
    """

    causal: bool = True
    window: int | None = None


def allowed(meta: SequenceMeta, rule: MaskRule, q_idx: torch.Tensor,
            k_idx: torch.Tensor) -> torch.Tensor:
    """Which query-key pairs may attend: ``(B, 1, Tq, Tk)`` bool.

    Args:
        meta: The full batch's documents and padding.
        rule: Causal and sliding-window rules.
        q_idx: ``(Tq,)`` sequence indices of the queries.
        k_idx: ``(Tk,)`` sequence indices of the keys.

    A query may be left with no key at all (a padded query before any valid
    token): its row is all ``False``, and its output is 0, as transformers'
    SDPA attention gives it (:func:`~torchtp.cp.attention.attend`).
    """
    q, k = q_idx[:, None], k_idx[None, :]  # (Tq, 1), (1, Tk)
    ok = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
    if rule.causal:
        ok &= k <= q
    if rule.window is not None:
        ok &= q - k < rule.window
    docs = meta.documents
    same_doc = docs[:, q_idx][:, :, None] == docs[:, k_idx][:, None, :]  # (B, Tq, Tk)
    ok = ok & same_doc & meta.keys_valid[:, k_idx][:, None, :]
    return ok[:, None]  # (B, 1, Tq, Tk)
