"""Masking of secrets in URLs and free text (SPEC §7: no password in any output).

Two layers, both applied by :func:`redact_text`:

* a pattern that masks the userinfo password of any ``scheme://user:password@host`` and
  any ``password=...`` pair, wherever it appears;
* the literal passwords of the URLs this process was given (:func:`remember_secrets`),
  so that a malformed URL, or a driver message that echoes a password in its own words,
  is masked too.
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

MASK = "***"

_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*:/+[^:/?#@\s]*:)(?P<pw>\S*)(?P<at>@)")
_KV_PASSWORD = re.compile(r"(?i)(?P<head>\b(?:password|passwd|pwd|pass)\s*=\s*)(?P<pw>'[^']*'|\"[^\"]*\"|[^\s&;]+)")
_LOOSE_USERINFO = re.compile(r"[^\s:/@]*:(?P<pw>[^\s@/][^\s@]*)@")

_secrets: set[str] = set()


def remember_secrets(raw: str | None) -> None:
    """Record the password(s) found in ``raw`` (a URL, well-formed or not) for masking.

    Called by the resolver and the config loader on every URL they read, before any
    message can quote it.
    """
    if not raw:
        return
    candidates: set[str] = set()
    try:
        parts = urlsplit(raw)
        if parts.password:
            candidates.update({parts.password, unquote(parts.password)})
    except ValueError:
        pass
    for match in _LOOSE_USERINFO.finditer(raw):
        candidates.add(match["pw"])
        candidates.add(unquote(match["pw"]))
    for match in _KV_PASSWORD.finditer(raw):
        candidates.add(match["pw"].strip("'\""))
    _secrets.update(c for c in candidates if len(c) >= 2)


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (user, host and path kept)."""
    return redact_text(url)


def redact_text(text: str) -> str:
    """Mask every password in ``text``: URL userinfo, ``password=`` pairs, remembered secrets."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}{MASK}{m['at']}", text)
    text = _KV_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", text)
    for secret in sorted(_secrets, key=len, reverse=True):
        # Only where the secret stands as a token of its own: a password "postgres" must
        # not turn "postgresql://" into "***ql://" (its own occurrences are still masked).
        text = re.sub(rf"(?<![A-Za-z0-9_]){re.escape(secret)}(?![A-Za-z0-9_])", MASK, text)
    return text
