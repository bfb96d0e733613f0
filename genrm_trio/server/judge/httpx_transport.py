"""The httpx2 transport (``judge.transport: httpx``, and every test that hands in an
``httpx2.MockTransport``). The only file of genrm-trio that imports ``httpx2``.

Each endpoint gets client shards of ``judge.max_connections_per_client`` connections, at most
``ceil(judge_max_concurrency / per_client)`` of them, created on demand; a call goes to the
shard with the fewest calls in flight.
"""

from __future__ import annotations

import math
import ssl
from collections.abc import Sequence

import httpx2

from genrm_trio.config import Config
from genrm_trio.server.judge.attempt import AttemptFailed, AttemptFatal
from genrm_trio.server.judge.endpoints import Endpoint
from genrm_trio.server.judge.transport import Answer

#: What tests may hand to :func:`~genrm_trio.server.judge.open_judge` instead of the network.
HttpxBaseTransport = httpx2.AsyncBaseTransport


class _Shard:
    __slots__ = ("client", "in_flight")

    def __init__(self, client: httpx2.AsyncClient) -> None:
        self.client = client
        self.in_flight = 0


class HttpxTransport:
    """httpx2 client shards per endpoint; errors translated into attempt errors here."""

    def __init__(self, cfg: Config, ssl_context: ssl.SSLContext, headers: dict[str, str],
                 transport: httpx2.AsyncBaseTransport | None) -> None:
        self._ssl = ssl_context
        self._headers = headers
        self._transport = transport
        self._per_client = max(1, cfg.judge.max_connections_per_client)
        self._max_shards = max(1, math.ceil(max(1, cfg.judge_max_concurrency) / self._per_client))
        self._shards: dict[Endpoint, list[_Shard]] = {}

    def _choose_shard(self, endpoint: Endpoint) -> _Shard:
        shards = self._shards.setdefault(endpoint, [])
        best = min(shards, key=lambda s: s.in_flight, default=None)
        if best is not None and (
            best.in_flight < self._per_client or len(shards) >= self._max_shards
        ):
            return best
        client = httpx2.AsyncClient(
            verify=self._ssl,
            transport=self._transport,
            limits=httpx2.Limits(
                max_connections=self._per_client, max_keepalive_connections=self._per_client
            ),
            # The per-request trio deadline rules; httpx timeouts apply per read only.
            timeout=httpx2.Timeout(None),
            trust_env=False,
        )
        shard = _Shard(client)
        shards.append(shard)
        return shard

    async def post(self, endpoint: Endpoint, content: bytes,
                   headers: Sequence[tuple[str, str]] = ()) -> Answer:
        shard = self._choose_shard(endpoint)
        shard.in_flight += 1
        try:
            response = await shard.client.post(
                endpoint.url, content=content,
                headers={**self._headers, **dict(headers)} if headers else self._headers)
        except (httpx2.UnsupportedProtocol, httpx2.InvalidURL) as exc:
            raise AttemptFatal("config", f"judge {endpoint.display}: {exc}") from exc
        except (httpx2.RequestError, httpx2.StreamError) as exc:
            detail = str(exc) or type(exc).__name__
            raise AttemptFailed(
                "transport", f"judge {endpoint.display}: {type(exc).__name__}: {detail}"
            ) from exc
        finally:
            shard.in_flight -= 1
        return Answer(response.status_code, response.headers, response.content)

    def clients(self, endpoint: Endpoint) -> int:
        return len(self._shards.get(endpoint, ()))

    async def aclose(self) -> None:
        """Close every client shard. Blocks while connections close; the caller bounds it."""
        shards, self._shards = self._shards, {}
        for endpoint_shards in shards.values():
            for shard in endpoint_shards:
                await shard.client.aclose()
