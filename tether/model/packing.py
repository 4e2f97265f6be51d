"""Padding-free forwards and token-budget micro-batches (trainer.packing, trainer.micro_batch_tokens).

A padded forward runs N rows of width P + T, the batch's longest prompt and completion, whatever each row holds.
A packed forward runs only the real tokens (prompts', completions', an environment's included), laid end to end:

    item       = a row's prompt and completion, or with trainer.share_prompts a distinct prompt once followed by the
                 completions of every row that has it (a group of samples)
    packed row = items placed first-fit decreasing in rows as wide as the largest item (sdpa, eager), or all of
                 them in one row (flash-attention)
    positions  = each token's position in its own sequence (a completion's continue its prompt's)
    attention  = a token attends to the earlier tokens of its own segment and of its group's shared prompt:
                 an explicit (rows, 1, W, W) block mask (sdpa: boolean; eager: additive); flash-attention gets no
                 mask and reads the sequence boundaries from the restarting position ids (the varlen kernel,
                 `transformers.masking_utils.find_packed_sequence_indices`), so it packs rows whole, unshared

A token therefore attends to exactly what it attends to in the padded forward, at the same positions, and the
hidden states are read back into the padded (N, T) completion layout (`PackPlan.read`) before the head: the
objective never sees packing, and log-probs, entropies and gradients equal the padded ones up to rounding
(tests/model/test_packing_is_exact.py: the update's gradient for every objective and aggregation, in float64).
Unshared, the arithmetic is the padded one's, row for row. Shared, a prompt's states carry its samples' gradients
summed in another order; Llama's RMSNorm computes in float32 even in a float64 model, so that agrees to float32
rounding (1e-6 of a gradient's norm), as trainer.share_prompts' KV-cache sharing does.

Why the width is the largest item's: the sdpa and eager kernels compute every (query, key) pair of a packed row,
masked or not, so attention costs width^2 per packed row; at the largest item's width that is never more than a
padded row's, while wider rows would fit more items for more attention. One item per row is then a padded forward
without the padding.

A one-off comparison with the padded forward on the first call (both forms) guards against a model whose attention
does not honour the mask or the restarts: the reason is then in `packing_reason` and the padded forward is used.
Packing applies to the fused head's path (`trainer.fused_logprobs`); a model whose head cannot be fused runs
padded, since its (N, T, V) logits are computed in the padded layout.

Token budgets. `token_batches` cuts rows into micro-batches of at most `budget` real tokens each (a row longer
than the budget alone), as few as the budget allows, balanced by longest-processing-time: the rows sorted by
length, each given to the least-loaded micro-batch, so that the last micro-batch is not a straggler. Balanced
micro-batches split groups; a shared prompt is then run once per micro-batch that holds its samples.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from .probes import Probed, disagreement

_PACK_PROBED = Probed()


class PackPlan(NamedTuple):
    """Where each real token of an (N, L) padded batch goes in a (bins, width) packed one, and what it attends to."""

    bins: int
    width: int
    src: torch.Tensor  # (R,) long: flat index into (N, L) of each placed token
    dst: torch.Tensor  # (R,) long: its flat index into (bins, width)
    seq: torch.Tensor  # (bins * width,) long: the segment each packed position belongs to (a tail pad: its own)
    owner: torch.Tensor  # (bins * width,) long: the segment's group (a shared prompt and its samples share one)
    prefix: torch.Tensor  # (bins * width,) bool: a shared prompt's position, read by its group's samples
    read: torch.Tensor  # (N, L) long: the packed position each padded cell's hidden state is read from (pad: -1)


def plan(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, start: int, share: bool = False, width: int = 0
) -> PackPlan:
    """The packing of an (N, L) batch whose first `start` columns are the (left-padded) prompt (module docstring):
    rows longest first, each completion into the first packed row that already holds its prompt and has room,
    else into the first with room for a copy of the prompt and it, else into a new row, in rows of `width` tokens
    (at least the longest row's; -1: everything in one row). The rows it takes are then balanced (the narrowest
    width that still takes as many) and cut to the fullest one's load. Without `share` every row is its own
    group. A `PackPlan`."""
    n, cols = attention_mask.shape
    real = attention_mask != 0
    if share:
        key = torch.cat([input_ids[:, :start] * real[:, :start], real[:, :start].long()], 1)
        group = torch.unique(key, dim=0, return_inverse=True)[1].tolist()
    else:
        group = list(range(n))
    p_len, c_len = real[:, :start].sum(1).tolist(), real[:, start:].sum(1).tolist()
    total = [p + c for p, c in zip(p_len, c_len)]
    cap = max(sum(total) if width < 0 else max(max(total), width), 1)
    placed = _place(group, p_len, c_len, cap)
    k = len(placed[0])
    if 0 <= width and k > 1:  # as many rows, but balanced: the narrowest width that still takes k rows
        w = max(max(total), -(-sum(placed[0]) // k))
        while w < cap and len((again := _place(group, p_len, c_len, w))[0]) > k:
            w = min(cap, w + max(1, w // 20))
        placed = again if w < cap else placed
    loads, copies, pieces = placed
    return _layout(real, start, max(loads), len(loads), copies, pieces)


def _place(group: list[int], p_len: list[int], c_len: list[int], width: int):
    """First-fit decreasing of the rows into packed rows of `width` (`plan`): (each packed row's load, the prompt
    copies as (row read from, packed row, offset), the completions as (row, its prompt's copy, packed row, offset))."""
    loads: list[int] = []
    prompts: list[dict[int, int]] = []  # per packed row: group -> the index of its prompt's copy there
    copies: list[tuple[int, int, int]] = []
    pieces: list[tuple[int, int, int, int]] = []
    for i in sorted(range(len(group)), key=lambda r: (-p_len[r] - c_len[r], r)):
        b = next((b for b in range(len(loads)) if group[i] in prompts[b] and loads[b] + c_len[i] <= width), None)
        if b is None:
            b = next((b for b in range(len(loads)) if loads[b] + p_len[i] + c_len[i] <= width), len(loads))
            if b == len(loads):
                loads.append(0)
                prompts.append({})
            prompts[b][group[i]] = len(copies)
            copies.append((i, b, loads[b]))
            loads[b] += p_len[i]
        pieces.append((i, prompts[b][group[i]], b, loads[b]))
        loads[b] += c_len[i]
    return loads, copies, pieces


def _layout(real: torch.Tensor, start: int, width: int, bins: int, copies: list, pieces: list) -> PackPlan:
    """The plan's index tensors from where each prompt copy and each completion sits."""
    n, cols = real.shape
    device = real.device
    col = torch.arange(cols, device=device)
    seq = -1 - torch.arange(bins * width, device=device)  # tail pads: a segment each
    owner, prefix = seq.clone(), torch.zeros(bins * width, dtype=torch.bool, device=device)
    read = torch.full((n, cols), -1, dtype=torch.long, device=device)
    src, dst, copy_dst = [], [], []
    for k, (i, b, offset) in enumerate(copies):
        p_cols = col[:start][real[i, :start]]
        at = b * width + offset + torch.arange(len(p_cols), device=device)
        src.append(i * cols + p_cols)
        dst.append(at)
        copy_dst.append(at)
        seq[at], owner[at], prefix[at] = k, k, True
    for i, k, b, offset in pieces:
        c_cols = col[start:][real[i, start:]]
        at = b * width + offset + torch.arange(len(c_cols), device=device)
        src.append(i * cols + c_cols)
        dst.append(at)
        seq[at], owner[at] = len(copies) + i, k
        read[i, col[:start][real[i, :start]]], read[i, c_cols] = copy_dst[k], at
    return PackPlan(bins, width, torch.cat(src), torch.cat(dst), seq, owner, prefix, read)


def attention_mask_4d(p: PackPlan, dtype: torch.dtype) -> torch.Tensor:
    """The packed rows' attention (bins, 1, width, width): a query attends to an earlier key of its own segment, or
    of its group's shared prompt; boolean (True: attend) for `dtype` bool, else additive (0 or dtype's minimum)."""
    seq, owner, prefix = (x.view(p.bins, p.width) for x in (p.seq, p.owner, p.prefix))
    causal = torch.ones(p.width, p.width, dtype=torch.bool, device=seq.device).tril()
    same = seq[:, :, None] == seq[:, None, :]
    shared = (owner[:, :, None] == owner[:, None, :]) & prefix[:, None, :]
    allowed = (causal & (same | shared))[:, None]
    if dtype == torch.bool:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=seq.device).masked_fill(~allowed, torch.finfo(dtype).min)


def packed_hidden(
    body: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    start: int,
    share: bool = False,
    width: int = 0,
) -> torch.Tensor:
    """The decoder body's final hidden states at columns start - 1 .. L - 1 (N, L - start + 1, H) from one packed
    forward of the rows' real tokens (module docstring); 0 at padding columns. `share`: each distinct prompt once,
    its samples attending to it (an explicit block mask; not with flash-attention, which packs rows whole)."""
    impl = str(getattr(getattr(body, "config", None), "_attn_implementation", "sdpa"))
    flash = "flash" in impl
    p = plan(input_ids, attention_mask, start, share=share and not flash, width=-1 if flash else width)
    ids = input_ids.new_zeros(p.bins * p.width)
    pos = position_ids.new_zeros(p.bins * p.width)  # the tail: each pad token a sequence of its own
    ids[p.dst] = input_ids.flatten()[p.src]
    pos[p.dst] = position_ids.flatten()[p.src]
    mask = None  # flash-attention: sequence boundaries from the restarting position ids (varlen)
    if not flash:
        mask = attention_mask_4d(p, torch.bool if impl == "sdpa" else body.dtype)
    out = body(
        input_ids=ids.view(p.bins, p.width),
        position_ids=pos.view(p.bins, p.width),
        attention_mask=mask,
        use_cache=False,
    ).last_hidden_state
    h = out.reshape(p.bins * p.width, -1)
    h = torch.cat([h, h.new_zeros(1, h.shape[-1])])  # row -1: padding reads zeros
    return h[p.read[:, start - 1 :]]


def packing_reason(model: Any) -> str:
    """Why this model runs padded although packing is on, or "" when it packs (or has not run yet)."""
    return _PACK_PROBED.reason(model)


@torch.no_grad()
def probe(model: Any, body: Any, input_ids, attention_mask, position_ids, start: int) -> str:
    """Compare the packed and padded forward on the first rows of a batch (once per model); returns the reason
    packing is off for this model ("" when the two agree)."""

    def compare() -> str:
        sub = [x[:6] for x in (input_ids, attention_mask, position_ids)]
        was_training = model.training
        model.eval()
        try:
            ours = [packed_hidden(body, *sub, start, share, width) for share, width in ((False, 0), (True, 4096))]
            plain = body(input_ids=sub[0], attention_mask=sub[1], position_ids=sub[2], use_cache=False)
            plain = plain.last_hidden_state[:, start - 1 :]
        finally:
            model.train(was_training)
        keep = sub[1][:, start - 1 :].bool()
        for h in ours:  # unshared, then shared
            reason = disagreement(h, plain, keep, plain.dtype, "the packed forward differs from the padded one")
            if reason:
                return reason
        return ""

    return _PACK_PROBED.once(model, compare)


def token_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices cut into micro-batches of at most `budget` tokens each (`lengths[i]`: row i's real tokens; a row
    over the budget alone), as few as the budget allows and balanced (module docstring); rows in order within
    each, micro-batches in order of their first row."""
    n = len(lengths)
    order = sorted(range(n), key=lambda r: (-lengths[r], r))
    k = max(1, -(-sum(lengths) // max(budget, 1)))
    while True:
        parts: list[list[int]] = [[] for _ in range(k)]
        loads = [0] * k
        for i in order:
            b = min(range(k), key=lambda j: (loads[j], j))
            parts[b].append(i)
            loads[b] += lengths[i]
        if all(load <= budget or len(part) == 1 for load, part in zip(loads, parts)) or k >= n:
            break
        k += 1
    return sorted((sorted(part) for part in parts if part), key=lambda part: part[0])


def padding_share(
    tokens: Any,
    forwards: "int | Sequence[torch.Tensor]",
    share_prompts: bool = True,
    pack: bool = False,
    width: int = 0,
) -> float:
    """The share of the positions a log-prob or update pass computes that are padding, over its forwards (`forwards`:
    the rows of each, or a row count for consecutive runs of that many; `forward_rows`). Padded, a forward computes
    its distinct prompts (each distinct prompt once with `share_prompts`, every row's otherwise) at the batch's
    prompt width P and every row's completion at width T; packed (`pack`), its packed rows at their width (`plan` at
    `width`, each distinct prompt once per packed row with `share_prompts`). The real positions are the prompts'
    and the completions' tokens (an environment's included: the model reads them). docs/performance.md."""
    n, p = tokens.input_ids.shape[0], tokens.prompt_len
    if isinstance(forwards, int):
        forwards = [torch.arange(i, min(i + forwards, n)) for i in range(0, n, forwards)]
    computed = real = 0
    for rows in forwards:
        rows = rows.to(tokens.input_ids.device)
        ids, attention = tokens.input_ids[rows], tokens.attention_mask[rows]
        if pack:
            packed = plan(ids, attention, p, share=share_prompts, width=width)
            computed += packed.bins * packed.width
            real += len(packed.dst)
            continue
        prompts = torch.unique(torch.cat([ids[:, :p], attention[:, :p]], 1), dim=0) if share_prompts else None
        distinct = prompts[:, p:] if prompts is not None else attention[:, :p]
        computed += distinct.shape[0] * p + attention.shape[0] * (attention.shape[1] - p)
        real += int(distinct.sum()) + int(attention[:, p:].sum())
    return 1.0 - real / max(computed, 1)


def forward_rows(tokens: Any, settings: Any) -> list[torch.Tensor]:
    """The rows of each forward of a log-prob pass: consecutive runs of `settings.micro_batch_size` rows, or with
    `settings.micro_batch_tokens` balanced micro-batches of at most that many real tokens (`packing.token_batches`)."""
    n, device = tokens.input_ids.shape[0], tokens.input_ids.device
    if settings.micro_batch_tokens <= 0:
        step = settings.micro_batch_size
        return [torch.arange(i, min(i + step, n), device=device) for i in range(0, n, step)]
    parts = token_batches(tokens.attention_mask.sum(1).tolist(), settings.micro_batch_tokens)
    return [torch.tensor(part, device=device) for part in parts]
