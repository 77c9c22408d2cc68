"""Log probabilities of a step's tokens (``SamplingParams.logprobs``): computed on the
device from the step's raw logits, copied back with its tokens, and turned into one
``TokenLogprob`` per request that asked, once the host has them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import starmap

import torch

from ostinato.engine.core.logprob import TokenLogprob
from ostinato.engine.core.params import SamplingParams


@dataclass(frozen=True)
class StepLogprobs:
    """Per row of a step: ``chosen``, its token's log probability (``[rows]``), and
    ``top_ids`` / ``top_values``, its ``k`` most likely tokens' (``[rows, k]``, k the
    most any request of the step asked for; a graph's may have more columns, of which
    the first ``k`` are these), on the device or, after ``to_host``, on the host."""

    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_values: torch.Tensor

    @staticmethod
    def of(
        logits: torch.Tensor, tokens: torch.Tensor, k: int, live_k: torch.Tensor | None = None
    ) -> StepLogprobs:
        """From ``logits`` (``[rows, vocab]``, any float dtype: log-softmax in float32)
        and each row's chosen token (``[rows]``); on CUDA two kernels
        (``kernels.sampling.row_logprobs``, the smaller id first among tied values), which
        with ``live_k`` (a device int64 ``[1]``, at most ``k``) write only that many
        alternatives, as many as it holds when they run; elsewhere all ``k``."""
        if logits.is_cuda:
            from ostinato.engine.kernels.sampling import row_logprobs

            return StepLogprobs(*row_logprobs(logits, tokens, k, live_k))
        logp = torch.log_softmax(logits.float(), dim=-1)
        chosen = logp.gather(1, tokens.long()[:, None]).squeeze(1)
        top = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], logp[:, :0].long())
        return StepLogprobs(chosen, top[1], top[0])

    def to_host(self, into: StepLogprobs | None = None) -> StepLogprobs:
        """A host copy (asynchronous from CUDA: read it after the step's copy event);
        ``into`` (``landing``'s, where it ``fits``): into its leading rows, pinned memory
        made once, instead of three host tensors allocated a step."""
        if self.chosen.device.type != "cuda":
            return StepLogprobs(*(t.to("cpu", copy=True) for t in self._tensors()))
        if into is None or not into.fits(self):
            return StepLogprobs(*(t.to("cpu", non_blocking=True) for t in self._tensors()))
        n = self.chosen.shape[0]
        out = StepLogprobs(into.chosen[:n], into.top_ids[:n], into.top_values[:n])
        for host, device in zip(out._tensors(), self._tensors(), strict=True):
            host.copy_(device, non_blocking=True)
        return out

    def landing(self, rows: int) -> StepLogprobs:
        """Pinned host tensors of ``rows`` rows shaped as these are, for ``to_host``."""
        return StepLogprobs(
            *(
                torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)
                for t in self._tensors()
            )
        )

    def fits(self, other: StepLogprobs) -> bool:
        """Whether ``other`` copies into these (``landing``'s): as many columns, the same
        types, no more rows."""
        return all(
            a.dtype == b.dtype and a.shape[1:] == b.shape[1:] and a.shape[0] >= b.shape[0]
            for a, b in zip(self._tensors(), other._tensors(), strict=True)
        )

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.chosen, self.top_ids, self.top_values

    def entries(
        self, params: Sequence[SamplingParams], tokens: Sequence[int]
    ) -> list[TokenLogprob | None]:
        """Per row (host copies), the request's ``TokenLogprob`` where it asked, else None."""
        most = wanted(params)
        if most is None:
            return [None] * len(params)
        # Only the columns some request asked for become Python numbers: a graph's copy
        # holds ``MAX_LOGPROBS`` of them (64 rows asking 5 of 20: 38-46 against 75-96 µs a
        # step on the development CPU, benchmarks/results/logprobs_host_cpu).
        # (through numpy: a torch slice and its ``tolist`` cost a few µs more each)
        ids = self.top_ids.numpy()[:, :most].tolist()
        values = self.top_values.numpy()[:, :most].tolist()
        chosen_all = self.chosen.numpy().tolist()
        if all(p.logprobs == most for p in params):  # (the usual step: one pass in C)
            alike = zip(tokens, chosen_all, map(tuple, ids), map(tuple, values), strict=True)
            return list(starmap(TokenLogprob, alike))
        rows = zip(params, tokens, chosen_all, ids, values, strict=True)
        out: list[TokenLogprob | None] = []
        for p, token, chosen, row_ids, row_values in rows:
            k = p.logprobs
            if k is None:
                out.append(None)
            elif k < most:  # (a request asking fewer than the step's most)
                out.append(TokenLogprob(token, chosen, tuple(row_ids[:k]), tuple(row_values[:k])))
            else:
                out.append(TokenLogprob(token, chosen, tuple(row_ids), tuple(row_values)))
        return out


def wanted(params: Sequence[SamplingParams]) -> int | None:
    """The most alternatives a request of the step asked for; None where none asked."""
    asked = [p.logprobs for p in params if p.logprobs is not None]
    return max(asked) if asked else None
