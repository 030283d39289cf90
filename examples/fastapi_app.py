"""A FastAPI endpoint whose updates are serialized per segment.

``PUT /segments/{seg_id}`` saves a stage of a segment with a simulated write
latency; ``@serialized(key="seg_id")`` makes concurrent requests for one
segment save in arrival order, while other segments proceed concurrently.
Needs the ``examples`` extra:  pip install "keyserial[examples]"

Run it:  uvicorn examples.fastapi_app:app   (or: python examples/fastapi_app.py)
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from pydantic import BaseModel

from keyserial import KeyedSerialQueue, serialized

app = FastAPI(title="segments")
segments: dict[str, str] = {}
segment_queue = KeyedSerialQueue(max_pending=1000)


class Update(BaseModel):
    stage: str
    text: str
    latency: float = 0.0  # simulated write time, seconds


@serialized(key="seg_id", queue=segment_queue)
async def save_segment(seg_id: str, update: Update) -> dict[str, str]:
    await asyncio.sleep(update.latency)
    segments[seg_id] = f"{update.stage}: {update.text}"
    return {"seg_id": seg_id, "saved": segments[seg_id]}


@app.put("/segments/{seg_id}")
async def put_segment(seg_id: str, update: Update) -> dict[str, str]:
    return await save_segment(seg_id, update)


@app.get("/segments/{seg_id}")
async def get_segment(seg_id: str) -> dict[str, str]:
    return {"seg_id": seg_id, "saved": segments.get(seg_id, "")}


async def demo() -> dict[str, str]:
    """Send a slow partial and a fast final for three segments, concurrently, in-process."""
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://segments") as client:
        requests = []
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
