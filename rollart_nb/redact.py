"""Keep secrets out of output: reprs, error messages, failure reasons, stats and log files.

Users hand the library secrets in endpoint URLs (``https://user:pass@host/x``,
``?api_key=...``), in bearer tokens (read from ``token_env``) and in headers. Everything the
library prints or records about a URL or a foreign exception goes through :func:`redact`.

Example:
    >>> redact_url("https://user:pw@host:8443/score?api_key=SECRET&x=1")
    'https://***@host:8443/score?api_key=***&x=***'
    >>> redact("POST http://h/x?token=abc failed; Authorization: Bearer abc.123")
    'POST http://h/x?token=*** failed; Authorization: Bearer ***'
"""

from __future__ import annotations

import logging
import re
import threading

__all__ = ["MASK", "RedactingFilter", "redact", "redact_url", "register_secret"]

MASK = "***"
"""What every hidden value becomes."""

_MIN_SECRET = 6  # shorter literals would mask ordinary words and numbers

_secrets: frozenset[str] = frozenset()
_secrets_lock = threading.Lock()

# A cheap first look: text with none of these holds nothing to redact (unless a registered
# secret, checked separately).
_HINT = re.compile(r"://|bearer|authori|token|key|pass|pwd|secret", re.IGNORECASE)
# Stops at whitespace, quotes and angle brackets, so a URL inside a repr or an httpx message
# ("for url 'http://...'") ends where its quote does.
_URL = re.compile(r"""\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s'"<>`]+""")
_AUTH = re.compile(r"""(?i)(authorization['"]?\s*[:=]\s*['"]?)(?:(bearer|basic|token|digest)\s+)?([^\s'",;}]+)""")
# A "Bearer <x>" outside a header: <x> must look like a token (a digit, an uppercase letter
# after the first character, punctuation, or 16+ characters), so prose ("a bearer token") stays.
_BEARER = re.compile(r"(?i)\b(bearer\s+)(?!\*\*\*)([A-Za-z0-9\-._~+/]+=*)")
_PAIR = re.compile(
    r"""(?i)(?<![A-Za-z0-9])([A-Za-z0-9_\-]*(?:token|api[_-]?key|apikey|password|passwd|pwd|secret)['"]?"""
    r"""\s*[:=]\s*['"]?)(?!\*\*\*)(?=[^\s'"&,;)}\]]*[A-Za-z0-9])([^\s'"&,;)}\]]+)"""
)
_QUERY_ITEM = re.compile(r"[^&;]+")
_TRAILING = ".,;:!?"
_CLOSERS = {")": "(", "]": "[", "}": "{"}


def register_secret(value: str) -> None:
    """Mask every later occurrence of ``value`` in :func:`redact`'s output (this process only).

    Values shorter than 6 characters are ignored: masking them would garble ordinary output.
    """
    global _secrets
    if not isinstance(value, str) or len(value) < _MIN_SECRET or value in _secrets:
        return
    with _secrets_lock:
        _secrets = _secrets | {value}


def redact_url(url: str) -> str:
    """``url`` with its userinfo, every query value and its fragment replaced by ``***``.

    Scheme, host, port, path and query keys stay. ``https://u:p@h:1/x?k=v#f`` becomes
    ``https://***@h:1/x?k=***#***``; a query item without ``=`` becomes ``***``.
    """
    if not isinstance(url, str):
        return url
    rest, hash_, frag = url.partition("#")
    rest, q, query = rest.partition("?")
    scheme, sep, tail = rest.partition("://")
    if sep:
        netloc, slash, path = tail.partition("/")
        if "@" in netloc:
            netloc = MASK + "@" + netloc.rpartition("@")[2]
        rest = scheme + sep + netloc + slash + path
    if q:
        query = _QUERY_ITEM.sub(_redact_query_item, query)
    return rest + q + query + (hash_ + MASK if frag else "")


def _redact_query_item(m: re.Match[str]) -> str:
    key, eq, _ = m.group().partition("=")
    return key + eq + MASK if eq else MASK  # a bare item may be the secret itself


def _redact_url_match(m: re.Match[str]) -> str:
    url, tail = m.group(), ""
    # Punctuation after a URL in prose belongs to the sentence; so does an unbalanced closer.
    while url and (url[-1] in _TRAILING or (url[-1] in _CLOSERS and url.count(_CLOSERS[url[-1]]) < url.count(url[-1]))):
        url, tail = url[:-1], url[-1] + tail
    return redact_url(url) + tail


def _redact_bearer(m: re.Match[str]) -> str:
    tok = m.group(2)
    looks_like_token = len(tok) >= 16 or any(c.isdigit() or not c.isalnum() for c in tok) or tok[1:] != tok[1:].lower()
    return m.group(1) + MASK if looks_like_token else m.group()


def redact(text: str) -> str:
    """``text`` with secrets masked: URLs anywhere in it (through :func:`redact_url`),
    ``Authorization:`` values, ``Bearer <token>``, ``token=`` / ``api_key=`` / ``password=`` /
    ``secret=`` style pairs, and every value given to :func:`register_secret`.

    Cheap when nothing matches (one regex scan and a substring test per registered secret).
    """
    if not isinstance(text, str) or not text:
        return text
    secrets = _secrets
    if _HINT.search(text) is not None:
        if "://" in text:
            text = _URL.sub(_redact_url_match, text)
        text = _AUTH.sub(lambda m: m.group(1) + (m.group(2) + " " if m.group(2) else "") + MASK, text)
        text = _BEARER.sub(_redact_bearer, text)
        text = _PAIR.sub(lambda m: m.group(1) + MASK, text)
    for s in sorted((s for s in secrets if s in text), key=len, reverse=True):
        text = text.replace(s, MASK)
    return text


class RedactingFilter(logging.Filter):
    """A :class:`logging.Filter` that masks secrets (:func:`redact`) in a record's final message,
    its traceback text and its stack info. Install it on a handler to cover every logger whose
    records reach that handler::

        handler.addFilter(RedactingFilter())
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()  # formats %-args first: a secret may sit in an argument
        except Exception:  # a bad format string: keep the bare message (the args may hold secrets)
            record.args = None
            msg = str(record.msg)
        clean = redact(msg)
        if clean != msg or record.args:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True
