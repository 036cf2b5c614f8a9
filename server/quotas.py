"""Per-API-key quotas: requests and tokens per minute over a sliding 60-second window. A request
over its key's quota is refused at once (429 with ``Retry-After``), as OpenAI's API does; unlike
the server's ``rate_limit``, which makes a request wait for room.

>>> key = APIKey("sk-team-a", requests_per_minute=60, tokens_per_minute=40_000)
>>> quotas = KeyQuotas({"key-0": key})
>>> headers = quotas.admit("key-0")          # raises QuotaExceededError when over
>>> quotas.charge("key-0", 1234)             # the request's prompt + completion tokens, when known

Tokens are counted when a request ends (its usage: prompt and completion tokens); a stream the
client leaves is charged the tokens it was sent. A request is admitted while its key has used
less than its tokens per minute, so a key can pass its quota by at most the requests it has in
flight: the engine cannot know how long an answer will be before it is written.
"""
from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class APIKey:
    """An API key and its quotas (None: no limit).

    >>> APIKey.parse("sk-a:60:40000")
    APIKey(key='sk-a', requests_per_minute=60, tokens_per_minute=40000)
    >>> APIKey.parse("sk-b::40000").requests_per_minute is None
    True
    """

    key: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValueError("api key must be a non-empty string")
        for name in ("requests_per_minute", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")

    @property
    def has_quota(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    @classmethod
    def parse(cls, spec: str) -> APIKey:
        """``KEY``, ``KEY:RPM`` or ``KEY:RPM:TPM``; an empty RPM or TPM means no limit."""
        key, *limits = spec.strip().split(":")
        if len(limits) > 2:
            raise ValueError(f"api key {_masked(key)!r}: expected KEY[:RPM[:TPM]], got {len(limits) + 1} fields")
        values = []
        for name, text in zip(("requests per minute", "tokens per minute"), limits):
            if text.strip() and not text.strip().isdigit():
                raise ValueError(f"api key {_masked(key)!r}: {name} must be a positive integer, got {text!r}")
            values.append(int(text) if text.strip() else None)
        return cls(key, *values)


def read_keys_file(path: str) -> list[APIKey]:
    """One ``KEY[:RPM[:TPM]]`` per line; blank lines and ``#`` comments skipped. A file keeps the
    keys out of the process list, where ``--api-key`` puts them."""
    keys = []
    with open(path, encoding="utf-8") as source:
        for number, line in enumerate(source, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                keys.append(APIKey.parse(line))
            except ValueError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    if not keys:
        raise ValueError(f"{path}: no API keys in it")
    return keys


class QuotaExceededError(Exception):
    """A key is over its ``kind`` ("requests" or "tokens") per minute; ``retry_after`` seconds until room."""

    def __init__(self, kind: str, limit: int, used: int, retry_after: float, headers: dict[str, str]):
        per_minute = "RPM" if kind == "requests" else "TPM"
        super().__init__(f"Rate limit reached for {kind} per min ({per_minute}): Limit {limit}, Used {used}. "
                         f"Please try again in {retry_after:.1f}s.")
        self.kind = kind
        self.retry_after = retry_after
        self.headers = headers


class KeyQuotas:
    """Each tenant's (a key's) requests and tokens in the last 60 s, against its :class:`APIKey` quotas.
    Thread-safe; tenants without quotas pass untouched."""

    def __init__(self, limits: Mapping[str, APIKey], window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self._limits = {tenant: key for tenant, key in limits.items() if key.has_quota}
        self._window_s = window_s
        self._clock = clock
        self._requests: dict[str, deque[float]] = {tenant: deque() for tenant in self._limits}
        self._tokens: dict[str, deque[tuple[float, int]]] = {tenant: deque() for tenant in self._limits}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._limits)

    def admit(self, tenant: str) -> dict[str, str]:
        """Count one request for ``tenant``, or raise :class:`QuotaExceededError`; the
        ``x-ratelimit-*`` headers (OpenAI's names) for its response."""
        limits = self._limits.get(tenant)
        if limits is None:
            return {}
        with self._lock:
            now = self._clock()
            requests, tokens = self._expire(tenant, now)
            used_tokens = sum(count for _, count in tokens)
            rpm, tpm = limits.requests_per_minute, limits.tokens_per_minute
            if rpm is not None and len(requests) >= rpm:
                wait = requests[len(requests) - rpm] + self._window_s - now
                raise QuotaExceededError("requests", rpm, len(requests), wait,
                                         self._headers(limits, len(requests), used_tokens, wait))
            if tpm is not None and used_tokens >= tpm:
                wait = self._token_wait(tokens, used_tokens - tpm + 1, now)
                raise QuotaExceededError("tokens", tpm, used_tokens, wait,
                                         self._headers(limits, len(requests), used_tokens, wait))
            requests.append(now)
            return self._headers(limits, len(requests), used_tokens, None)

    def charge(self, tenant: str, num_tokens: int) -> None:
        """Count ``num_tokens`` (prompt + completion) against ``tenant``'s tokens per minute."""
        if tenant in self._limits and num_tokens > 0:
            with self._lock:
                self._tokens[tenant].append((self._clock(), num_tokens))

    def _expire(self, tenant: str, now: float) -> tuple[deque[float], deque[tuple[float, int]]]:
        requests, tokens = self._requests[tenant], self._tokens[tenant]
        while requests and requests[0] <= now - self._window_s:
            requests.popleft()
        while tokens and tokens[0][0] <= now - self._window_s:
            tokens.popleft()
        return requests, tokens

    def _token_wait(self, tokens: deque[tuple[float, int]], num_to_free: int, now: float) -> float:
        """Seconds until ``num_to_free`` of the window's tokens have aged out."""
        freed = 0
        for when, count in tokens:
            freed += count
            if freed >= num_to_free:
                return when + self._window_s - now
        return self._window_s

    def _headers(self, limits: APIKey, num_requests: int, num_tokens: int, wait: float | None) -> dict[str, str]:
        headers = {}
        if limits.requests_per_minute is not None:
            headers["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
            headers["x-ratelimit-remaining-requests"] = str(max(0, limits.requests_per_minute - num_requests))
        if limits.tokens_per_minute is not None:
            headers["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
            headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tokens_per_minute - num_tokens))
        if wait is not None:
            headers["Retry-After"] = str(max(1, math.ceil(wait)))  # whole seconds, as the header is read
        return headers


def _masked(key: str) -> str:
    return key[:3] + "..." if len(key) > 6 else "..."
