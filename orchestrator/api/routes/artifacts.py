from __future__ import annotations

from fastapi import APIRouter, HTTPException, Request, Response
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.api.binary_bodies import CACHE_CONTROL, IMMUTABLE
from orchestrator.api.deps import SessionFactoryDep, run_db
from orchestrator.api.schemas import binary, refusals
from orchestrator.db import Artifact

router = APIRouter(prefix="/v1/artifacts", tags=["devices"])
_ETAG = {"ETag": {"description": "the sha256, quoted", "schema": {"type": "string"}}}


def _artifact(factory: sessionmaker[Session], sha256: str) -> bytes | None:
    with factory() as session:
        found = session.get(Artifact, sha256.lower())
        return None if found is None else found.content


@router.get(
    "/{sha256}",
    summary="A model file by its sha256 (immutable)",
    description="The `.tflite` file whose sha256 is the path; no token: a model is public to the "
    "population's devices and addressed by its content. Immutable: cached for a year.",
    response_class=Response,
    responses={
        **binary("the model file (.tflite)", {**CACHE_CONTROL, **_ETAG}),
        **refusals({404: "no artifact with that sha256"}),
    },
)
async def artifact(sha256: str, request: Request, factory: SessionFactoryDep) -> Response:
    content = await run_db(request.app, _artifact, factory, sha256)
    if content is None:
        raise HTTPException(404, f"no artifact {sha256!r}")
    return Response(
        content=content,
        media_type="application/octet-stream",
        headers={"Cache-Control": IMMUTABLE, "ETag": f'"{sha256.lower()}"'},
    )
