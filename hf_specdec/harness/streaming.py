"""The one streamer every mode runs with, and incremental decoding of what it streamed.

``RoundStreamer`` is a transformers streamer (``put`` / ``end``). The first ``put`` is the prompt; every later
one is one round's new tokens. hf_specdec calls ``on_round(num_accepted_draft_tokens, num_emitted)`` just
before each round's ``put`` (docs/CONTRACT.md); transformers' own loops do not, and for them the count is
inferred as ``len(chunk) - 1``, which is exact: plain decoding puts one token per step (0 accepted) and
assisted decoding and prompt lookup put ``n_matches + 1`` (the accepted candidates, then the target's token).
hf_specdec also calls ``on_round_paths(num_guesses, num_paths)`` before ``on_round``: how many guesses the
target verified and on how many paths (1 a chain, more a tree); None for a round no one reported.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

# called once per round with (new token ids, how many of them came from accepted draft tokens, perf_counter time,
# paths verified: 0 a plain step, 1 a chain, more a tree, None where the loop did not say)
ChunkCallback = Callable[[list[int], int, float, "int | None"], None]


class GenerationCancelled(RuntimeError):
    """Raised from the streamer to stop a ``generate`` call nobody is watching any more."""


class RoundStreamer:
    """Times the first token, records (accepted draft tokens, emitted) per round, forwards each round.

    ``sync``: called before the first token's clock read (``torch.cuda.synchronize`` on a GPU);
    ``on_chunk(ids, accepted, t)``: called with every round (the demo queues it for the UI, the CLI prints it);
    ``cancel()``: the next ``put`` raises :class:`GenerationCancelled`, which ends the ``generate`` call.
    """

    def __init__(self, on_chunk: ChunkCallback | None = None, sync: Callable[[], None] | None = None):
        self._on_chunk = on_chunk
        self._sync = sync
        self._prompt_seen = False
        self._pending_accepted: int | None = None
        self._pending_paths: int | None = None
        self._cancelled = threading.Event()
        self.t_first: float | None = None  # perf_counter time of the first new token
        self.streamed_tokens = 0
        self.rounds: list[tuple[int, int]] = []  # (accepted draft tokens, emitted) per round, reported or inferred
        self.round_log: list[tuple[int, int]] = []  # only what on_round reported (hf_specdec's loops)
        self.paths: list[int | None] = []  # per round: paths verified (on_round_paths), None where not reported

    def cancel(self) -> None:
        self._cancelled.set()

    def on_round(self, num_accepted_draft_tokens: int, num_emitted: int) -> None:
        self._pending_accepted = int(num_accepted_draft_tokens)
        self.round_log.append((int(num_accepted_draft_tokens), int(num_emitted)))

    def on_round_paths(self, num_guesses: int, num_paths: int) -> None:
        self._pending_paths = int(num_paths)

    def put(self, value: torch.Tensor) -> None:  # value: [1, n] or [n] token ids
        if self._cancelled.is_set():
            raise GenerationCancelled("the generation was cancelled (nobody is watching it any more)")
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        if self.t_first is None:
            if self._sync is not None:
                self._sync()
            self.t_first = time.perf_counter()
        ids = [int(t) for t in value.reshape(-1).tolist()]
        accepted = self._pending_accepted if self._pending_accepted is not None else len(ids) - 1
        accepted = max(0, min(accepted, len(ids)))
        paths, self._pending_accepted, self._pending_paths = self._pending_paths, None, None
        self.streamed_tokens += len(ids)
        self.rounds.append((accepted, len(ids)))
        self.paths.append(paths)
        if self._on_chunk is not None:
            self._on_chunk(ids, accepted, time.perf_counter(), paths)

    def end(self) -> None:
        pass


class IncrementalText:
    """Text of a growing token sequence, handed out piece by piece.

    ``append(ids)`` returns the text the new ids add: the decoded sequence past what was handed out before
    (as transformers' ``TextStreamer`` does, so a tokenizer whose decoding of earlier tokens shifts a little
    later never stalls the stream). A trailing replacement character (a multi-byte character whose bytes have
    not all arrived) is held back until the next piece completes it; ``flush()`` returns what is held back.
    """

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.ids: list[int] = []
        self.text = ""  # what has been handed out

    def append(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        piece = self._decode(self.ids).rstrip("\ufffd")[len(self.text):]
        self.text += piece
        return piece

    def flush(self) -> str:
        piece = self._decode(self.ids)[len(self.text):]
        self.text += piece
        return piece
