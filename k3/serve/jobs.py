"""A request's sequences as the app awaits them (`Job`): the engine's callbacks, on its own thread, fill an
asyncio queue on the request's event loop; `events` streams the new text of every choice, `collect` waits
for the whole of it and cancels the sequences of a client that went away (`ClientGone`)."""

from __future__ import annotations

import asyncio

from .engine import Engine, Sequence
from .text import TextStream


class ClientGone(Exception):
    pass


FINISH = {"length": "length", "stop": "stop", "cancelled": "abort"}


class Job:
    """The sequences of one request and the queue their engine callbacks fill, on the request's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue = loop, asyncio.Queue()
        self.sequences: list[Sequence] = []
        self.streams: list[TextStream] = []
        self.reasons: list[str | None] = []
        self.counts: list[int] = []  # tokens each choice has passed on so far

    def add(self, sequence: Sequence, stream: TextStream) -> None:
        index = len(self.sequences)
        sequence.on_token = lambda token: self._put((index, "token", token))
        sequence.on_finish = lambda reason: self._put((index, "finish", reason))
        self.sequences.append(sequence)
        self.streams.append(stream)
        self.reasons.append(None)
        self.counts.append(0)

    def _put(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the event loop has closed (the server is gone)
            pass

    def cancel(self, engine: Engine) -> None:
        for sequence in self.sequences:
            if sequence.finish_reason is None:
                engine.cancel(sequence)

    async def batches(self, engine: Engine):
        """Lists of (index, new text, finish reason or None): what the sequences did since the last list
        (everything queued by then, so that a slow reader gets fewer, larger lists), until all have finished."""
        while any(r is None for r in self.reasons):
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            out = []
            for index, kind, value in items:
                if self.reasons[index] is not None:
                    continue
                stream = self.streams[index]
                if kind == "token":
                    self.counts[index] += 1
                    text = stream.push(value)
                    if stream.stopped:  # a stop string: this choice is done
                        engine.cancel(self.sequences[index])
                        self.reasons[index] = "stop"
                    out.append((index, text, self.reasons[index]))
                else:
                    reason = value if value.startswith("error") else FINISH.get(value, value)
                    self.reasons[index] = reason
                    out.append((index, stream.finish(), reason))
            if out:
                yield out

    async def events(self, engine: Engine):
        """(index, new text, finish reason or None) as the sequences advance, until all have finished."""
        async for batch in self.batches(engine):
            for item in batch:
                yield item

    async def collect(self, engine: Engine, request) -> list[str]:
        """Every choice's whole text; ClientGone (its sequences cancelled) if the client disconnects first."""
        texts = [""] * len(self.sequences)

        async def gather():
            async for index, text, reason in self.events(engine):
                texts[index] += text

        task = asyncio.ensure_future(gather())
        try:
            while not task.done():
                done, _ = await asyncio.wait({task}, timeout=0.25)
                if not done and await request.is_disconnected():
                    task.cancel()
                    raise ClientGone
            task.result()
        finally:
            if not task.done():
                task.cancel()
            self.cancel(engine)
        return texts
