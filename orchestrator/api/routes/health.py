from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(tags=["operations"])


@router.get("/health", summary="Liveness: answers without touching the database")
async def health() -> dict[str, str]:
    return {"status": "ok"}
