"""Files over HTTP: presigned upload targets for producers, and a GPU worker's file URLs for the job it holds.

The bytes never pass through the server: it signs URLs, the client talks to object storage. A producer asks
`POST /v1/queues/{queue}/uploads` for a target, PUTs the file there, and enqueues the returned reference (checked
at enqueue by `file_refs.check_input_refs`). A GPU worker holding a lease asks for a GET URL of one of its job's
input files, or for a PUT URL under its job's output prefix; the references it then returns are checked at
complete. Signed URLs need S3 storage: the local directory backend answers 400 saying so.
"""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field

from offload.errors import InvalidJob, JobNotFound, StaleLease
from offload.files import reference
from offload.queue.keyspace import QUEUES_KEY, new_job_id, queue_of, uploads, validate_queue
from offload.server.auth import GuardedRoute, Principal, guard, produce_path_queue
from offload.server.file_refs import input_keys
from offload.server.routes_workers import _job_for, _work_path_job
from offload.server.state import ServerState, get_state
from offload.storage.inputs import file_key, inputs_prefix, outputs_prefix

router = APIRouter(tags=["files"], route_class=GuardedRoute)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class UploadRequest(_Request):
    name: str = Field(..., min_length=1, max_length=255, description="The file's name (kept, made safe).")
    size: int = Field(..., ge=0, description="Exact size in bytes: the signed PUT accepts this length only.")
    content_type: str = Field("application/octet-stream", min_length=1, max_length=255)
    job_id: str | None = Field(None, max_length=200, description="Another file for a job id an upload returned.")


class UploadReply(BaseModel):
    job_id: str = Field(..., description="The id the job gets when it is enqueued with this file.")
    method: str = "PUT"
    url: str
    headers: dict[str, str] = Field(..., description="Send exactly these with the PUT.")
    expires_s: int
    reference: dict[str, Any] = Field(..., description="Put this in the job input where the file belongs.")


class WorkerFileRequest(_Request):
    token: str = Field(..., min_length=1, max_length=512)
    key: str = Field(..., min_length=1, max_length=1024)


class WorkerUploadRequest(_Request):
    token: str = Field(..., min_length=1, max_length=512)
    index: int = Field(..., ge=0, le=100_000)
    name: str = Field(..., min_length=1, max_length=255)
    size: int = Field(..., ge=0)
    content_type: str = Field("application/octet-stream", min_length=1, max_length=255)


class UrlReply(BaseModel):
    key: str
    url: str
    headers: dict[str, str] = {}


SINGLE_PUT_MAX = 5 * 1024**3  # S3 refuses a single PUT above 5 GiB; these targets are single PUTs


def _limit(state: ServerState, size: int) -> None:
    limit = state.options.settings.storage.max_input_file_bytes
    if size > limit:
        raise HTTPException(413, f"file of {size} bytes is over the limit of {limit} (storage.max_input_file_bytes)")
    if size > SINGLE_PUT_MAX:
        raise HTTPException(413, f"file of {size} bytes is over S3's 5 GiB single-PUT limit: use the Python client")


async def _put_url(state: ServerState, key: str, content_type: str, size: int) -> tuple[str, int]:
    expires = state.options.presign_expires_s
    url = await state.storage.presigned_put_url(key, expires, content_type, size)
    if url is None:
        raise HTTPException(400, "files over HTTP need S3 storage (storage.kind: s3); this server stores locally")
    return url, expires


@router.post(
    "/v1/queues/{queue}/uploads",
    status_code=201,
    response_model=UploadReply,
    summary="A presigned PUT for one input file, and the reference to enqueue in its place",
)
@guard(produce_path_queue)
async def create_upload(request: Request, queue: str, body: UploadRequest, key: Principal) -> UploadReply:
    state = get_state(request)
    validate_queue(queue)  # like an enqueue, the first upload may name a queue nothing was sent to yet
    _limit(state, body.size)
    job_id = body.job_id or new_job_id(queue)
    try:
        if queue_of(job_id) != queue:
            raise InvalidJob(f"job id {job_id!r} is not of queue {queue!r}")
        prefix = inputs_prefix(job_id)
    except (InvalidJob, ValueError) as exc:
        raise HTTPException(422, f"job_id: {exc}") from None
    if body.job_id is not None:
        try:
            await state.store.get(job_id)
        except JobNotFound:
            pass
        else:
            raise HTTPException(409, f"job {job_id} exists already: its files cannot change")
    await state.redis.sadd(QUEUES_KEY, queue)  # a queue with files is one the sweep must visit, enqueued or not
    object_key = file_key(prefix, secrets.randbelow(10**9), body.name)
    url, expires = await _put_url(state, object_key, body.content_type, body.size)
    await _count_upload(state, uploads(queue, job_id), object_key, body.size)
    ref = reference(object_key, body.size, "", body.content_type)
    del ref["sha256"]  # the server never sees the bytes; a client that hashed them may add it
    return UploadReply(
        job_id=job_id,
        url=url,
        headers={"Content-Type": body.content_type, "Content-Length": str(body.size)},
        expires_s=expires,
        reference=ref,
    )


async def _count_upload(state: ServerState, counter: str, object_key: str, size: int) -> None:
    """413 past the limits on one job's uploads (storage.max_files_per_job, storage.max_upload_bytes_per_job): a
    producer's for the job's input, or a GPU worker's for one run of it. Each issued upload is a field of the
    counter (so a request repeated for the same object counts once), added first and taken back when over, so
    concurrent requests never get past the limits between them. The counter lives as long as an upload issued
    now can still land and stay unswept without a job."""
    limits = state.options.settings.storage
    pipe = state.redis.pipeline(transaction=False)
    pipe.hset(counter, object_key, size)
    pipe.hvals(counter)
    pipe.pexpire(counter, int((state.options.presign_expires_s + limits.upload_grace_s) * 1000))
    added, sizes, _ = await pipe.execute()
    total = sum(int(v) for v in sizes)
    if not int(added) or (len(sizes) <= limits.max_files_per_job and total <= limits.max_upload_bytes_per_job):
        return
    await state.redis.hdel(counter, object_key)
    if len(sizes) > limits.max_files_per_job:
        raise HTTPException(
            413, f"over the limit of {limits.max_files_per_job} uploads per job (storage.max_files_per_job)"
        )
    raise HTTPException(
        413,
        f"uploads of {total} bytes for one job: over the limit of {limits.max_upload_bytes_per_job} "
        "(storage.max_upload_bytes_per_job)",
    )


async def _leased(request: Request, key: Any, worker_id: str, job_id: str, token: str) -> tuple[ServerState, Any]:
    state = await _job_for(request, key, worker_id, job_id, token)
    job = await state.store.get(job_id)
    if job.lease_token != token or job.state.terminal:
        raise StaleLease(f"job {job_id}: lease token is stale (another worker owns it or it finished)")
    return state, job


@router.post(
    "/v1/workers/{worker_id}/jobs/{job_id}/files/url",
    response_model=UrlReply,
    summary="A presigned GET of one of the leased job's input files",
)
@guard(_work_path_job)
async def worker_file_url(
    request: Request, worker_id: str, job_id: str, body: WorkerFileRequest, key: Principal
) -> UrlReply:
    state, job = await _leased(request, key, worker_id, job_id, body.token)
    if body.key not in await input_keys(job):
        raise HTTPException(403, f"{body.key[:200]!r} is not an input file of job {job_id}")
    expires = state.options.settings.storage.input_url_expires_s
    return UrlReply(key=body.key, url=await state.storage.presigned_url(body.key, expires))


@router.post(
    "/v1/workers/{worker_id}/jobs/{job_id}/files/upload",
    response_model=UrlReply,
    summary="A presigned PUT under the leased job's output prefix, for one file its handler returned",
)
@guard(_work_path_job)
async def worker_upload(
    request: Request, worker_id: str, job_id: str, body: WorkerUploadRequest, key: Principal
) -> UrlReply:
    state, job = await _leased(request, key, worker_id, job_id, body.token)
    _limit(state, body.size)
    object_key = file_key(f"{outputs_prefix(job_id)}{max(job.attempts, 1)}/", body.index, body.name)
    url, _ = await _put_url(state, object_key, body.content_type, body.size)
    await _count_upload(state, uploads(queue_of(job_id), job_id, max(job.attempts, 1)), object_key, body.size)
    headers = {"Content-Type": body.content_type, "Content-Length": str(body.size)}
    return UrlReply(key=object_key, url=url, headers=headers)
