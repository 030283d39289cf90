"""A FastAPI endpoint whose updates are serialized per segment, with the queue's errors as HTTP.

``PUT /segments/{seg_id}`` saves a stage of a segment with a simulated write latency;
``@serialized(key="seg_id")`` makes concurrent requests for one segment save in arrival
order, while other segments proceed concurrently. ``PUT /segments/{seg_id}/partial``
coalesces: of the partial results waiting for one segment, only the newest is saved.

What a client sees when the queue says no:

* ``429 Too Many Requests`` (with ``Retry-After``): the segment already has ``MAX_PENDING``
  requests queued (``QueueFull``);
* ``503 Service Unavailable`` (with ``Retry-After``): the turn did not come within
  ``WAIT`` seconds (``TimeoutError``), or the request reached a closed queue
  (``QueueClosed``);
* ``409 Conflict``: a newer partial of the same segment replaced this one (``Superseded``).

The app closes the queue when its lifespan ends, and waits for the updates still queued.
Under uvicorn, shutdown stops taking connections and lets the requests in flight (queued
ones included) finish before the lifespan ends, so a client does not see the 503 of a
closed queue there; an ASGI server that still routes requests to the app after its lifespan
ended gets it (the tests show that by running the lifespan directly).
Needs the ``examples`` extra:  pip install ".[examples]"

Run it:  python examples/fastapi_app.py   (or, with uvicorn installed:
uvicorn examples.fastapi_app:app)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from keyserial import KeyedSerialQueue, QueueClosed, QueueFull, Superseded, serialized

MAX_PENDING = 100  # requests per segment, running plus waiting
WAIT = 2.0  # seconds a request waits for its segment's turn
RETRY_AFTER = "1"  # seconds, for 429 and 503

segments: dict[str, str] = {}
segment_queue = KeyedSerialQueue(max_pending=MAX_PENDING)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncGenerator[None, None]:
    yield
    await segment_queue.aclose()  # refuse new work, wait for the queued updates


app = FastAPI(title="segments", lifespan=lifespan)


def _refused(status: int, reason: str, retry: bool) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER} if retry else None
    return JSONResponse({"detail": reason}, status_code=status, headers=headers)


@app.exception_handler(QueueFull)
async def too_many_requests(request: Request, error: QueueFull) -> JSONResponse:
    return _refused(429, f"too many updates queued for segment {error.key!r}", retry=True)


@app.exception_handler(TimeoutError)
async def turn_timed_out(request: Request, error: TimeoutError) -> JSONResponse:
    return _refused(503, "the segment is busy; its turn did not come in time", retry=True)


@app.exception_handler(QueueClosed)
async def shutting_down(request: Request, error: QueueClosed) -> JSONResponse:
    return _refused(503, "shutting down", retry=True)


@app.exception_handler(Superseded)
async def superseded(request: Request, error: Superseded) -> JSONResponse:
    return _refused(409, "a newer update of this segment replaced this one", retry=False)


class Update(BaseModel):
    stage: str
    text: str
    latency: float = 0.0  # simulated write time, seconds


@serialized(key="seg_id", queue=segment_queue, timeout=WAIT)
async def save_segment(seg_id: str, update: Update) -> dict[str, str]:
    await asyncio.sleep(update.latency)
    segments[seg_id] = f"{update.stage}: {update.text}"
    return {"seg_id": seg_id, "saved": segments[seg_id]}


@serialized(key="seg_id", queue=segment_queue, timeout=WAIT, coalesce=True)
async def save_partial(seg_id: str, update: Update) -> dict[str, str]:
    return await save_segment(seg_id, update)  # the same task holds the key: runs inline


@app.put("/segments/{seg_id}")
async def put_segment(seg_id: str, update: Update) -> dict[str, str]:
    return await save_segment(seg_id, update)


@app.put("/segments/{seg_id}/partial")
async def put_partial(seg_id: str, update: Update) -> dict[str, str]:
    return await save_partial(seg_id, update)


@app.get("/segments/{seg_id}")
async def get_segment(seg_id: str) -> dict[str, str]:
    return {"seg_id": seg_id, "saved": segments.get(seg_id, "")}


async def demo() -> dict[str, str]:
    """Send a slow partial and a fast final for three segments, concurrently, in-process."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://segments") as client:
        requests: list[asyncio.Task[httpx.Response]] = []
        for seg_id in ("a", "b", "c"):
            partial = {"stage": "partial", "text": "helo", "latency": 0.05}
            requests.append(asyncio.create_task(client.put(f"/segments/{seg_id}", json=partial)))
            # A few loop steps until the partial's request reaches the queue: the queue itself
            # is the only witness of that moment, so there is no event to wait on.
            while segment_queue.pending(seg_id) == 0:  # noqa: ASYNC110
                await asyncio.sleep(0)
            final = {"stage": "final", "text": "hello", "latency": 0.0}
            requests.append(asyncio.create_task(client.put(f"/segments/{seg_id}", json=final)))
        await asyncio.gather(*requests)
        return {s: (await client.get(f"/segments/{s}")).json()["saved"] for s in ("a", "b", "c")}


if __name__ == "__main__":
    for seg_id, saved in asyncio.run(demo()).items():
        print(f"segment {seg_id}: {saved}")
