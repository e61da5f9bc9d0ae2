"""Reading a request body within the server's limits, shared by both protocols' routes:
the size limit checked as the body streams in (before the rest is read), a deadline for
its arrival, ambiguous framing refused, and gzip/deflate inflated up to the same limit."""
from __future__ import annotations

import asyncio
import zlib

from starlette.requests import Request

from kiln.errors import BadRequestError, BodyTimeoutError, BodyTooLargeError


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The request body, refused (:class:`BodyTooLargeError`) as soon as it passes ``limit``
    bytes, before the rest is read, and (:class:`BodyTimeoutError`) when it takes longer than
    ``timeout``."""
    length = request.headers.get("content-length")
    if length is not None and "transfer-encoding" in request.headers:
        # RFC 9112 6.1: ambiguous framing (a request-smuggling pattern); refuse, do not guess
        raise BadRequestError("a request must not have both Content-Length and Transfer-Encoding")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLargeError(f"request body of {length} bytes is over the limit of {limit} bytes")
    chunks: list = []
    size = 0

    async def receive():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise BodyTooLargeError(f"request body is over the limit of {limit} bytes")
            chunks.append(chunk)
    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise BodyTimeoutError(f"the request body did not arrive within {timeout:g} s "
                               f"({size} bytes received)") from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """Decompress a request body, refusing one that inflates past ``limit`` (a zip bomb)."""
    d = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    out = d.decompress(body, limit + 1)
    if len(out) > limit or d.unconsumed_tail:
        raise BadRequestError(f"the {encoding} body inflates past the limit of {limit} bytes")
    if not d.eof:
        raise BadRequestError(f"the {encoding} body is truncated")
    return out
