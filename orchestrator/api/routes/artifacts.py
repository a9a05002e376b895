from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response

from orchestrator.api.deps import SessionDep
from orchestrator.db import Artifact

router = APIRouter(prefix="/v1/artifacts", tags=["devices"])


@router.get("/{sha256}", summary="A model file by its sha256 (immutable)")
def artifact(sha256: str, session: SessionDep) -> Response:
    found = session.get(Artifact, sha256.lower())
    if found is None:
        raise HTTPException(404, f"no artifact {sha256!r}")
    return Response(
        content=found.content,
        media_type="application/octet-stream",
        headers={"Cache-Control": "public, max-age=31536000, immutable", "ETag": f'"{found.sha256}"'},
    )
