"""A step's token draws and log probabilities, graph-safe, a row spread over many programs.

torch's sampler walks a row of a large vocabulary with one thread block per reduction
(softmax, log-softmax, argmax: about 30 µs each for 152k logits at one row on an H200)
and sorts the whole row for top-p (radix sort and scans, about 45 µs); one program per
row doing all of it is no better (one SM: about 100 µs a pass over 152k logits with the
hash, measured). Here each of ``CHUNK`` logits of a row has a program, and a short kernel
per row combines the programs' results, as ``kernels.argmax`` does:

- ``sample_rows``: each chunk's max and softmax sum of ``z`` (the logits, with a
  penalized step's bias and penalties applied in that same first kernel, over the
  temperature) and the winner of its Gumbel race, ``z + G`` with ``G`` drawn from the
  row's key by ``sampler.seeded_races``' hash; combined, the race's winner is a draw
  from ``softmax(z)``. Top-p: while the mass strictly above the winner's ``z`` reaches
  ``top_p`` the winner is outside the nucleus, and the race's winner among the tokens
  above it (the same draws) is the next candidate. The candidate that stops it is the
  race's winner over the nucleus (every token above it is in the nucleus), a draw from
  it. ``ROUNDS`` such checks run spread out (a row that is done skips them), each the
  mass above the candidate first and the race above it only where the candidate is
  outside (the hash bounds a pass, and most candidates are inside); a row still not
  done then finishes in one program. No sort.
- ``row_logprobs``: each chunk's max, softmax sum and largest entry; then the ``k``
  largest of the ``k`` chunks of largest maxima (the only ones that can hold the row's
  ``k`` largest), combined per row.

Temperature 0 rows take the first maximum, as ``torch.argmax`` does.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ostinato.engine.kernels.argmax import (
    EMPTY,
    count_token,
    entry_keys,
    key_value,
    packed_max,
    unpacked,
)
from ostinato.engine.kernels.launch import launch
from ostinato.engine.kernels.penalize import penalized_block

CHUNK = 2048  # logits a program reads: 75 programs for a row of a 152k vocabulary
WARPS = 4
ROUNDS = 2  # top-p checks spread over the chunks before a row finishes alone
FINISH_BLOCK = 4096
MAX_CHUNKS = 1 << 14  # the combining programs hold a row's chunk results in one tile
GOLDEN = tl.constexpr(0x9E3779B1)
MIX = tl.constexpr(0x45D9F3B)


if os.environ.get("TRITON_INTERPRET") == "1":  # (no libdevice in Triton's interpreter)

    @triton.jit
    def _ln(x):
        return tl.log(x)

else:

    @triton.jit
    def _ln(x):
        """The natural log from the hardware's approximate log2 (about 2**-22 relative):
        the accurate ``tl.log`` made the hash's two logs cost as much as the rest of a
        sampling pass (H200, 64 rows of 128k: 28 against 16.5 µs for hash and race)."""
        return libdevice.fast_logf(x)


@triton.jit
def _gumbel(key, cols):
    """``-log(E)`` for ``sampler.seeded_races``' ``E`` of (``key``, ``cols``). The hash
    in uint32, whose products wrap as the reference's ``& _MASK`` does: the same bits as
    its int64 arithmetic in fewer instructions (a 64-bit product is several 32-bit ones);
    the logs ``_ln``'s (so a draw can part from the reference's at a near-tie)."""
    x = key.to(tl.uint32) + cols.to(tl.uint32) * tl.full((), GOLDEN, tl.uint32)
    x = ((x >> 16) ^ x) * tl.full((), MIX, tl.uint32)
    x = ((x >> 16) ^ x) * tl.full((), MIX, tl.uint32)
    x = (x >> 16) ^ x
    u = ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
    return -_ln(-_ln(u))


@triton.jit
def _scaled(logits_ptr, row, stride, cols, live, inv_t):
    """The logits of ``cols`` over the temperature (``-inf`` past the row)."""
    x = tl.load(logits_ptr + row * stride + cols, mask=live, other=float("-inf"))
    return x.to(tl.float32) * inv_t


@triton.jit
def _row_values(row, temps_ptr):
    """A row's 1 / temperature (1 for greedy rows) and whether it is greedy."""
    t = tl.load(temps_ptr + row)
    greedy = t <= 0.0
    return 1.0 / tl.where(greedy, 1.0, t), greedy


@triton.jit
def _chunk_kernel(
    logits_ptr, stride, temps_ptr, keys_ptr, stats_ptr, races_ptr, vocab, chunks, bias_ptr,
    table_ptr, rows_ptr, presence_ptr, frequency_ptr, adjusted_ptr, CHUNK: tl.constexpr,
    PENALIZED: tl.constexpr, HAS_BIAS: tl.constexpr,
):  # fmt: skip
    """A chunk's max and softmax sum of z and the winner of its race (argmax if greedy).
    PENALIZED: the logits get ``penalized_block``'s bias and penalties first, and that
    float32 sum goes to ``adjusted`` (``[rows, vocab]``) for the later kernels to read."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    inv_t, greedy = _row_values(row, temps_ptr)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    live = cols < vocab
    if PENALIZED:
        x = tl.load(logits_ptr + row * stride + cols, mask=live, other=float("-inf"))
        x = penalized_block(
            x.to(tl.float32), row, cols, live, bias_ptr, table_ptr, rows_ptr, presence_ptr,
            frequency_ptr, vocab, HAS_BIAS,
        )  # fmt: skip
        tl.store(adjusted_ptr + row * vocab + cols, x, mask=live)
        z = x * inv_t
    else:
        z = _scaled(logits_ptr, row, stride, cols, live, inv_t)
    if greedy:  # (no hash for a greedy row's program)
        g = z
    else:
        g = z + _gumbel(tl.load(keys_ptr + row), cols)
    g = tl.where(live, g, float("-inf"))
    at = row * chunks + chunk
    _store_stats(stats_ptr, at, z)
    tl.store(races_ptr + at, packed_max(g, cols, live, vocab))


@triton.jit
def _store_stats(stats_ptr, at, z):
    """A chunk's max of ``z`` and its softmax sum relative to it (to the max 0 where
    every entry is -inf), at pair ``at`` of ``stats``; ``_combined`` reads them."""
    m = tl.max(z, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    tl.store(stats_ptr + 2 * at, m)
    tl.store(stats_ptr + 2 * at + 1, tl.sum(tl.exp(z - shift), axis=0))


@triton.jit
def _combined(stats_ptr, row, c, here, chunks):
    """A row's max (0 where every logit is -inf) and softmax sum relative to it, from its
    chunks' ``(max, sum)`` pairs."""
    ms = tl.load(stats_ptr + 2 * (row * chunks + c), mask=here, other=float("-inf"))
    totals = tl.load(stats_ptr + 2 * (row * chunks + c) + 1, mask=here, other=0.0)
    m = tl.max(ms, axis=0)
    shift = tl.where(m == float("-inf"), 0.0, m)
    return shift, tl.sum(totals * tl.exp(ms - shift), axis=0)


@triton.jit
def _pick_kernel(temps_ptr, top_p_ptr, stats_ptr, races_ptr, rowstate_ptr, done_ptr, out_ptr,
                 chunks, CHUNKS: tl.constexpr):  # fmt: skip
    """A row's max and softmax sum over its chunks and the race's winner; done where
    greedy or top-p is 1."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    here = c < chunks
    shift, total = _combined(stats_ptr, row, c, here, chunks)
    best = tl.max(tl.load(races_ptr + row * chunks + c, mask=here, other=EMPTY), axis=0)
    tl.store(out_ptr + row, unpacked(best))
    tl.store(rowstate_ptr + 2 * row, shift)
    tl.store(rowstate_ptr + 2 * row + 1, total)
    done = (tl.load(temps_ptr + row) <= 0.0) | (tl.load(top_p_ptr + row) >= 1.0)
    tl.store(done_ptr + row, done.to(tl.int32))


@triton.jit
def _candidate_z(logits_ptr, stride, temps_ptr, out_ptr, row, cols, vocab):
    """A row's z of ``cols`` and its candidate's (``out``)."""
    inv_t, greedy = _row_values(row, temps_ptr)
    s = tl.load(out_ptr + row)
    z_s = _scaled(logits_ptr, row, stride, s, s < vocab, inv_t)
    return _scaled(logits_ptr, row, stride, cols, cols < vocab, inv_t), z_s


@triton.jit
def _above_kernel(
    logits_ptr, stride, temps_ptr, stats_ptr, rowstate_ptr, done_ptr, out_ptr, vocab, chunks,
    CHUNK: tl.constexpr,
):  # fmt: skip
    """For a row not done: a chunk's mass above its candidate's z. No hash: most rows'
    candidates are inside the nucleus, and only the others race (``_race_kernel``)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(done_ptr + row) != 0:
        return
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    z, z_s = _candidate_z(logits_ptr, stride, temps_ptr, out_ptr, row, cols, vocab)
    up = (cols < vocab) & (z > z_s)
    m = tl.load(rowstate_ptr + 2 * row)
    above = tl.sum(tl.where(up, tl.exp(z - m), 0.0), axis=0)
    tl.store(stats_ptr + 2 * (row * chunks + chunk) + 1, above)


@triton.jit
def _race_kernel(
    logits_ptr, stride, temps_ptr, top_p_ptr, keys_ptr, stats_ptr, races_ptr, rowstate_ptr,
    done_ptr, out_ptr, vocab, chunks, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
):  # fmt: skip
    """For a row not done: done if the mass above its candidate is below top_p (every
    program of the row finds the same from the chunks' masses; the first records it),
    else the winner of the chunk's race among the tokens above the candidate."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(done_ptr + row) != 0:
        return
    chunk = tl.program_id(1)
    c = tl.arange(0, CHUNKS)
    masses = tl.load(stats_ptr + 2 * (row * chunks + c) + 1, mask=c < chunks, other=0.0)
    above = tl.sum(masses, axis=0)
    # (outside, not "not inside": a NaN sum keeps the candidate, a column of the row; and
    # with nothing above it, a row of -inf's zero total too)
    limit = tl.load(top_p_ptr + row) * tl.load(rowstate_ptr + 2 * row + 1)
    if not ((above > 0.0) & (above >= limit)):
        if chunk == 0:
            tl.store(done_ptr + row, 1)
        return
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    z, z_s = _candidate_z(logits_ptr, stride, temps_ptr, out_ptr, row, cols, vocab)
    up = (cols < vocab) & (z > z_s)
    at = row * chunks + chunk
    if tl.max(up.to(tl.int32), axis=0) == 0:  # (nothing above here: no hash)
        tl.store(races_ptr + at, EMPTY)
        return
    g = tl.where(up, z + _gumbel(tl.load(keys_ptr + row), cols), float("-inf"))
    tl.store(races_ptr + at, packed_max(g, cols, up, vocab))


@triton.jit
def _next_kernel(races_ptr, done_ptr, out_ptr, chunks, CHUNKS: tl.constexpr):
    """For a row not done (its candidate outside the nucleus): the race's winner above
    the candidate is the next candidate."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(done_ptr + row) != 0:
        return
    c = tl.arange(0, CHUNKS)
    best = tl.max(tl.load(races_ptr + row * chunks + c, mask=c < chunks, other=EMPTY), axis=0)
    tl.store(out_ptr + row, unpacked(best))


@triton.jit
def _finish_kernel(
    logits_ptr, stride, temps_ptr, top_p_ptr, keys_ptr, rowstate_ptr, done_ptr, out_ptr, vocab,
    table_ptr, counts_rows_ptr, BLOCK: tl.constexpr, COUNT: tl.constexpr,
):  # fmt: skip
    """For a row still not done: the checks of ``_above_kernel`` and ``_race_kernel``
    in one program, until its candidate is inside the nucleus. COUNT: then adds one to
    the row's count of its token (``argmax.count_token``)."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.load(out_ptr + row)
    if tl.load(done_ptr + row) == 0:
        s = _finished(logits_ptr, stride, temps_ptr, top_p_ptr, keys_ptr, rowstate_ptr, s, row,
                      vocab, BLOCK)  # fmt: skip
        tl.store(out_ptr + row, s)
    if COUNT:
        count_token(table_ptr, counts_rows_ptr, row, s, vocab)


@triton.jit
def _finished(logits_ptr, stride, temps_ptr, top_p_ptr, keys_ptr, rowstate_ptr, s, row, vocab,
              BLOCK: tl.constexpr):  # fmt: skip
    """Row ``row``'s token from its candidate ``s``: the next candidate while the mass
    above it reaches top-p."""
    inv_t, greedy = _row_values(row, temps_ptr)
    m, total = tl.load(rowstate_ptr + 2 * row), tl.load(rowstate_ptr + 2 * row + 1)
    limit = tl.load(top_p_ptr + row) * total
    key = tl.load(keys_ptr + row)
    cut = tl.full((), 1, tl.int1)
    while cut:
        z_s = _scaled(logits_ptr, row, stride, s, s < vocab, inv_t)
        above = tl.full((), 0.0, tl.float32)
        best = tl.full((), EMPTY, tl.int64)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK).to(tl.int64)
            live = cols < vocab
            z = _scaled(logits_ptr, row, stride, cols, live, inv_t)
            up = live & (z > z_s)
            above += tl.sum(tl.where(up, tl.exp(z - m), 0.0), axis=0)
            g = tl.where(up, z + _gumbel(key, cols), float("-inf"))
            best = tl.maximum(best, packed_max(g, cols, up, vocab))
        cut = (above > 0.0) & (above >= limit)  # (``_race_kernel``'s test)
        s = tl.where(cut, unpacked(best), s)
    return s


def sample_rows(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    keys: torch.Tensor,
    penalties: tuple[torch.Tensor | None, ...] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` (``[rows, vocab]`` CUDA floats): temperature 0
    rows the first maximum, others a draw from the softmax at their temperature over the
    smallest set of most likely tokens whose mass reaches top_p (tokens tied with its
    least likely one kept too), made from ``keys`` (int64 ``[rows]``, below 2**32) alone.
    ``temperatures`` and ``top_ps``: float32 ``[rows]``, top_p in (0, 1]. ``penalties``
    (``penalize_rows``' operands after the logits: bias or None, presence, frequency,
    table, rows): draws from ``penalize_rows(logits, *penalties)`` instead, the same
    tokens, its arithmetic done in the first kernel, and counts each row's token in
    ``table`` at its row (``adjust.count_tokens``' count, in the last kernel). ``out``:
    the tokens' home, if given."""
    rows, vocab = logits.shape
    device = logits.device
    out = _tokens_out(out, rows, device)
    chunks = triton.cdiv(vocab, CHUNK)
    if rows == 0:
        return out
    if chunks > MAX_CHUNKS:
        raise ValueError(f"sample_rows: at most {MAX_CHUNKS * CHUNK} columns, got {vocab}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    # (the kernels read one value per row at stride 1; no copy where that holds already)
    temperatures, top_ps = temperatures.float().contiguous(), top_ps.float().contiguous()
    keys = keys.long().contiguous()
    # Scratch: per chunk (max or mass above, sum) and race key; per row (max, sum), done.
    stats = torch.empty((rows, chunks, 2), dtype=torch.float32, device=device)
    races = torch.empty((rows, chunks), dtype=torch.int64, device=device)
    rowstate = torch.empty((rows, 2), dtype=torch.float32, device=device)
    done = torch.empty(rows, dtype=torch.int32, device=device)
    first = (logits, logits.stride(0), temperatures, keys, stats, races, vocab, chunks)
    operands, logits = _penalty_operands(logits, penalties)
    row_args = (logits, logits.stride(0), temperatures)
    spread = {"CHUNK": CHUNK, "num_warps": WARPS}
    combine = {"CHUNKS": triton.next_power_of_2(chunks), "num_warps": WARPS}
    launch(
        _chunk_kernel, (rows, chunks), *first, *operands, PENALIZED=penalties is not None,
        HAS_BIAS=penalties is not None and penalties[0] is not None, **spread,
    )  # fmt: skip
    launch(
        _pick_kernel, (rows,), temperatures, top_ps, stats, races, rowstate, done, out, chunks,
        **combine,
    )  # fmt: skip
    for _ in range(ROUNDS):
        _top_p_round(row_args, top_ps, keys, stats, races, rowstate, done, out, vocab, chunks)
    counted = (operands[1], operands[2]) if penalties is not None else (out, out)
    launch(
        _finish_kernel, (rows,), *row_args, top_ps, keys, rowstate, done, out, vocab, *counted,
        BLOCK=min(FINISH_BLOCK, triton.next_power_of_2(vocab)), COUNT=penalties is not None,
        num_warps=16,
    )  # fmt: skip
    return out


def _top_p_round(
    row_args: tuple, top_ps: torch.Tensor, keys: torch.Tensor, stats: torch.Tensor,
    races: torch.Tensor, rowstate: torch.Tensor, done: torch.Tensor, out: torch.Tensor,
    vocab: int, chunks: int,
) -> None:  # fmt: skip
    """One check of each row's candidate against its nucleus, spread over the chunks:
    the mass above it, then (rows outside only) the race above it and its winner."""
    spread = {"CHUNK": CHUNK, "num_warps": WARPS}
    combine = {"CHUNKS": triton.next_power_of_2(chunks), "num_warps": WARPS}
    rows = out.shape[0]
    launch(
        _above_kernel, (rows, chunks), *row_args, stats, rowstate, done, out,
        vocab, chunks, **spread,
    )  # fmt: skip
    launch(
        _race_kernel, (rows, chunks), *row_args, top_ps, keys, stats, races, rowstate, done, out,
        vocab, chunks, **spread, CHUNKS=combine["CHUNKS"],
    )  # fmt: skip
    launch(_next_kernel, (rows,), races, done, out, chunks, **combine)


def _tokens_out(out: torch.Tensor | None, rows: int, device: torch.device) -> torch.Tensor:
    """``sample_rows``' ``out`` (int64 ``[rows]``, contiguous: where a graph's next kernels
    may read the tokens), checked; a new one where None."""
    if out is None:
        return torch.empty(rows, dtype=torch.int64, device=device)
    if out.shape != (rows,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"sample_rows: out must be contiguous int64 [{rows}], got {out.shape}")
    return out


def _penalty_operands(
    logits: torch.Tensor, penalties: tuple[torch.Tensor | None, ...] | None
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``_chunk_kernel``'s penalty operands (bias, table, rows, presence, frequency, and
    the adjusted logits it writes) and the logits the later kernels read: with
    ``penalties``, that new float32 buffer; without, ``logits`` in every place (unread)."""
    if penalties is None:
        return (logits,) * 6, logits
    adjusted = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    bias, presence, frequency, table, counts_rows = penalties
    bias = bias if bias is not None else adjusted  # (not read)
    return (bias, table, counts_rows, presence, frequency, adjusted), adjusted


@triton.jit
def _logprob_chunk_kernel(logits_ptr, stride, stats_ptr, best_ptr, vocab, chunks,
                          CHUNK: tl.constexpr):  # fmt: skip
    """A chunk's max and softmax sum of the raw logits and its largest entry's key
    (``entry_keys``: the value, then the smaller column; past the row, ``EMPTY``)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    live = cols < vocab
    x = tl.load(logits_ptr + row * stride + cols, mask=live, other=float("-inf"))
    x = x.to(tl.float32)
    at = row * chunks + chunk
    _store_stats(stats_ptr, at, x)
    tl.store(best_ptr + at, tl.max(tl.where(live, entry_keys(x, cols), EMPTY), axis=0))


@triton.jit
def _logprob_top_kernel(logits_ptr, stride, best_ptr, ids_ptr, values_ptr, vocab, chunks, k,
                        k_ptr, K, CHUNK: tl.constexpr, CHUNKS: tl.constexpr,
                        LIVE_K: tl.constexpr):  # fmt: skip
    """Program ``(row, j)``: the ``k`` largest entries (LIVE_K: as many as ``k_ptr``
    holds) of the chunk whose largest entry ranks ``j``-th among the row's chunks, at
    slot ``j``, each column once (one reduction of ``entry_keys`` per alternative; no
    such chunk, or past its live columns: ``vocab`` at ``-inf``). A row's ``k`` largest
    entries lie in its ``k`` chunks of largest maxima (were one elsewhere, those ``k``
    maxima would all rank above it), so only those chunks are walked ``k`` times."""
    if LIVE_K:
        k = tl.minimum(tl.load(k_ptr), k)
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    if j >= k:
        return
    c = tl.arange(0, CHUNKS)
    maxima = tl.load(best_ptr + row * chunks + c, mask=c < chunks, other=EMPTY)
    for _ in range(j):  # (the j larger maxima out)
        maxima = tl.where(maxima == tl.max(maxima, axis=0), EMPTY, maxima)
    top = tl.max(maxima, axis=0)
    at = (row * K + j) * K
    if top == EMPTY:  # (fewer chunks than j + 1)
        for i in range(k):
            tl.store(ids_ptr + at + i, vocab)
            tl.store(values_ptr + at + i, float("-inf"))
        return
    cols = (unpacked(top) // CHUNK) * CHUNK + tl.arange(0, CHUNK)
    live = cols < vocab
    x = tl.load(logits_ptr + row * stride + cols, mask=live, other=float("-inf"))
    keys = tl.where(live, entry_keys(x.to(tl.float32), cols), EMPTY)
    for i in range(k):
        best = tl.max(keys, axis=0)
        none = best == EMPTY
        tl.store(ids_ptr + at + i, tl.where(none, vocab, unpacked(best)))
        tl.store(values_ptr + at + i, tl.where(none, float("-inf"), key_value(best)))
        keys = tl.where(keys == best, EMPTY, keys)


@triton.jit
def _logprob_row_kernel(
    logits_ptr, stride, tokens_ptr, stats_ptr, ids_ptr, values_ptr, chosen_ptr, top_ids_ptr,
    top_values_ptr, chunks, k, k_ptr, K, CHUNKS: tl.constexpr, CANDIDATES: tl.constexpr,
    LIVE_K: tl.constexpr,
):  # fmt: skip
    """A row's log-sum-exp over its chunks, its token's log probability and the ``k``
    largest of ``_logprob_top_kernel``'s candidates (LIVE_K: as many as ``k_ptr``
    holds), in its order: (value, then the smaller id), each id once."""
    live_k = k  # (``k`` stays the outputs' row stride)
    if LIVE_K:
        live_k = tl.minimum(tl.load(k_ptr), k)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS)
    shift, total = _combined(stats_ptr, row, c, c < chunks, chunks)
    lse = shift + tl.log(total)
    token = tl.load(tokens_ptr + row)
    tl.store(chosen_ptr + row, tl.load(logits_ptr + row * stride + token).to(tl.float32) - lse)
    n = tl.arange(0, CANDIDATES)
    valid = (n < K * K) & ((n // K) < live_k) & ((n % K) < live_k)
    v = tl.load(values_ptr + row * K * K + n, mask=valid, other=float("-inf"))
    ids = tl.load(ids_ptr + row * K * K + n, mask=valid, other=0)
    keys = tl.where(valid, entry_keys(v, ids), EMPTY)
    for j in range(live_k):
        best = tl.max(keys, axis=0)
        tl.store(top_ids_ptr + row * k + j, unpacked(best))
        tl.store(top_values_ptr + row * k + j, key_value(best) - lse)
        keys = tl.where(keys == best, EMPTY, keys)


def row_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, k: int, live_k: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of ``logits`` (``[rows, vocab]`` CUDA floats): the log probability of
    ``tokens``' entry (``[rows]``), and the ``k`` most likely tokens' ids and log
    probabilities (``[rows, k]``, most likely first, the smaller id first on ties), from
    a float32 log-softmax. ``live_k`` (a one-element int64 tensor on the device, read
    when the kernels run: a graph's replay reads its value then): only its value's
    first columns (at most ``k``) are written, the rest left as they were; the top-k is a pass
    over each of ``live_k`` chunks per alternative, so a step pays for the alternatives it
    asked for."""
    rows, vocab = logits.shape
    device = logits.device
    chosen = torch.empty(rows, dtype=torch.float32, device=device)
    top_ids = torch.empty((rows, k), dtype=torch.int64, device=device)
    top_values = torch.empty((rows, k), dtype=torch.float32, device=device)
    chunks = triton.cdiv(vocab, CHUNK)
    if rows == 0:
        return chosen, top_ids, top_values
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    tokens = tokens.long().contiguous()
    big_k = max(1, k)  # (a chunk's candidates: k of them, at least one slot)
    stats = torch.empty((rows, chunks, 2), dtype=torch.float32, device=device)
    best = torch.empty((rows, chunks), dtype=torch.int64, device=device)
    ids = torch.empty((rows, big_k, big_k), dtype=torch.int64, device=device)
    values = torch.empty((rows, big_k, big_k), dtype=torch.float32, device=device)
    live = {"LIVE_K": live_k is not None}
    k_ptr = live_k if live_k is not None else chosen  # (not read without LIVE_K)
    rowwise = {"CHUNKS": triton.next_power_of_2(chunks)}
    launch(
        _logprob_chunk_kernel, (rows, chunks), logits, logits.stride(0), stats, best, vocab,
        chunks, CHUNK=CHUNK, num_warps=WARPS,
    )  # fmt: skip
    launch(
        _logprob_top_kernel, (rows, big_k), logits, logits.stride(0), best, ids, values, vocab,
        chunks, k, k_ptr, big_k, CHUNK=CHUNK, num_warps=WARPS, **rowwise, **live,
    )  # fmt: skip
    launch(
        _logprob_row_kernel, (rows,), logits, logits.stride(0), tokens, stats, ids, values,
        chosen, top_ids, top_values, chunks, k, k_ptr, big_k,
        CANDIDATES=triton.next_power_of_2(big_k * big_k), num_warps=8, **rowwise, **live,
    )  # fmt: skip
    return chosen, top_ids, top_values
