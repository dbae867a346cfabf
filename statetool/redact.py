"""Masking of secrets in URLs, command lines and free text (SPEC §7: no password in any output).

Three layers, all applied by :func:`redact_text`:

* a pattern that masks the userinfo of any ``scheme://user:password@host`` (the user is
  kept when the userinfo is unambiguous, everything up to the LAST ``@`` is masked when it
  is not) and any ``password=...`` pair, wherever it appears;
* the literal passwords of the URLs this process was given (:func:`remember_secrets`):
  the whole userinfo, the password, both percent-decoded, and each piece of 4 or more
  characters between the URL delimiters, so that a malformed URL, or a parser or driver
  message that echoes a piece of a password in its own words, is masked too;
* :func:`redact_argv` for command lines, one argument at a time, so a password holding a
  space is masked whole before the arguments are joined (audit rows, lease holders).

A URL whose userinfo cannot be told apart from its host for sure is found by
:func:`userinfo_problem`; the resolver and the state key refuse it (docs/decisions.md,
"URLs and secrets").
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

MASK = "***"

#: A URL's scheme, tried only where a run of scheme characters starts (its leading digits,
#: ``+``, ``.`` or ``-`` taken along into ``head``): tried at every letter of a long word, a
#: search of a 1 MiB CDC position for a URL took minutes (quadratic), now one pass.
_SCHEME = r"(?<![A-Za-z0-9+.\-])[0-9+.\-]*[A-Za-z][A-Za-z0-9+.\-]*:/+"
_URL_USERINFO = re.compile(rf"(?P<head>{_SCHEME})(?P<ui>\S*)@")
_KV_PASSWORD = re.compile(r"(?i)(?P<head>\b(?:sslpassword|password|passwd|pwd|pass)\s*=\s*)(?P<pw>'[^']*'|\"[^\"]*\"|[^\s&;]+)")
_LOOSE_USERINFO = re.compile(r"[^\s:/@]*:(?P<pw>[^\s@/][^\s@]*)@")
#: What ends the userinfo of a URL (RFC 3986): inside a password each must be percent-encoded.
_RESERVED = {"/": "%2F", "?": "%3F", "#": "%23", "@": "%40"}
_PIECE_SPLIT = re.compile(r"[/#?@:&=+%\s]+")
_MIN_PIECE = 4
#: An argument that is (or whose ``--opt=`` value is) a URL, also misspelt ``scheme:/x`` or ``scheme//x``.
_URL_LIKE = re.compile(r"(?:-{1,2}[\w-]+=)?[A-Za-z][A-Za-z0-9+.\-]*(?::/*|//)|.*://")
_PASSWORD_OPTION = re.compile(r"(?i)-{1,2}(?:password|passwd|pwd|pass)")
_PASSWORD_OPTION_VALUE = re.compile(r"(?i)(-{0,2}(?:password|passwd|pwd|pass)=)")

_secrets: set[str] = set()


def _userinfo_bounds(text: str) -> tuple[int, int] | None:
    """``(start, end)`` of what stands between the first ``://`` (or, without one, the
    scheme's ``:``) and the LAST ``@`` of ``text``: the userinfo, read as widely as it
    could be. None without an ``@``."""
    at = text.rfind("@")
    if at < 0:
        return None
    sep = text.find("://")
    if 0 <= sep < at:
        return sep + 3, at
    scheme = re.match(r"[A-Za-z][A-Za-z0-9+.\-]*(?::/*|/+)", text)  # postgresql:/x, postgresql//x
    start = scheme.end() if scheme and scheme.end() <= at else 0
    return start, at


def _mask_userinfo_text(userinfo: str) -> str:
    """``user:***`` for an unambiguous userinfo with a password, the userinfo itself
    without a password, ``***`` when its user cannot be told from its password."""
    if _problem_chars(userinfo):
        return MASK
    if ":" not in userinfo:
        return userinfo
    return f"{userinfo.split(':', 1)[0]}:{MASK}"


def _problem_chars(userinfo: str) -> list[str]:
    return sorted({ch for ch in userinfo if ch in _RESERVED or ch.isspace()})


def userinfo_problem(url: str) -> str | None:
    """Why the userinfo of ``url`` (``scheme://…@host``) is ambiguous, or None.

    Ambiguous: between ``://`` and the last ``@`` stands a raw ``/``, ``?``, ``#``, ``@``
    or whitespace, so parsers disagree on where the password ends and the host begins
    (``u:p/x@h`` has host ``u`` to urllib, ``h`` to a reader). Percent-encoded userinfo
    is never ambiguous. The text names the characters and their encodings, never the URL.
    """
    if "://" not in url:
        return None
    bounds = _userinfo_bounds(url)
    if bounds is None:
        return None
    bad = _problem_chars(url[bounds[0]:bounds[1]])
    if not bad:
        return None
    names = ", ".join("whitespace (a space is %20)" if ch.isspace() else f"'{ch}' ({_RESERVED[ch]})"
                      for ch in dict.fromkeys("\x20" if ch.isspace() else ch for ch in bad))
    return (f"its user or password (before the last '@') holds a raw {names}, so where the password ends "
            "and the host begins is ambiguous; percent-encode those characters in the password (an '@' "
            "after the host, in the path or query, must be %40 too)")


def mask_userinfo(url: str) -> str:
    """``url`` with everything between ``://`` and its last ``@`` masked as ``***`` (the
    user kept when the userinfo is unambiguous): the form in which a URL that does not
    parse, or is refused, may be named in a message."""
    bounds = _userinfo_bounds(url)
    if bounds is None:
        return url
    start, end = bounds
    return url[:start] + _mask_userinfo_text(url[start:end]) + url[end:]


def has_password(url: str) -> bool:
    """True when ``url`` carries a password: in its userinfo (ambiguous userinfo counts),
    or as a ``password=``/``sslpassword=`` parameter."""
    if _KV_PASSWORD.search(url):  # ?password= and libpq's ?sslpassword=
        return True
    bounds = _userinfo_bounds(url) if "://" in url else None
    if bounds is None:
        return False
    userinfo = url[bounds[0]:bounds[1]]
    return bool(_problem_chars(userinfo)) or bool(userinfo.partition(":")[2])


def remember_secrets(raw: str | None) -> None:
    """Record the password(s) found in ``raw`` (a URL, well-formed or not) for masking.

    Called by the resolver, the config loader and the command line on every URL they
    read, before any message can quote it.
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
    bounds = _userinfo_bounds(raw)
    if bounds is not None:
        userinfo = raw[bounds[0]:bounds[1]]
        user, _, password = userinfo.partition(":")
        if _problem_chars(user):  # no telling where the user ends: all of it is secret
            password = userinfo
        if password:
            candidates.update({password, unquote(password)})
            if _problem_chars(userinfo):
                candidates.update({userinfo, unquote(userinfo)})
            for piece in _PIECE_SPLIT.split(password) + _PIECE_SPLIT.split(unquote(password)):
                if len(piece) >= _MIN_PIECE:
                    candidates.add(piece)
    for match in _LOOSE_USERINFO.finditer(raw):
        candidates.add(match["pw"])
        candidates.add(unquote(match["pw"]))
    for match in _KV_PASSWORD.finditer(raw):
        candidates.add(match["pw"].strip("'\""))
    _secrets.update(c for c in candidates if len(c) >= 2 and not c.isspace())


def redact_url(url: str) -> str:
    """Return ``url`` with any password replaced by ``***`` (user, host and path kept)."""
    return redact_text(url)


def redact_argv(argv: Iterable[str]) -> list[str]:
    """Each argument redacted on its own (a URL's userinfo masked up to its last ``@``,
    ``--opt=URL`` too; the whole value of ``--password=…`` and of the argument after
    ``--password``), its secrets remembered for later messages. For command lines
    recorded in audit rows and lease holders (SPEC §7)."""
    out: list[str] = []
    secret_next = False
    for arg in argv:
        if secret_next:  # the value of a separate --password option
            arg, secret_next = MASK, False
        elif _PASSWORD_OPTION.fullmatch(arg):
            secret_next = True
        elif (option := _PASSWORD_OPTION_VALUE.match(arg)) is not None:
            arg = option[1] + MASK  # --password=a b: the whole value, spaces and all
        elif "@" in arg and _URL_LIKE.match(arg):
            remember_secrets(arg)
            arg = mask_userinfo(arg)
        out.append(redact_text(arg))
    return out


def redact_values(value: Any) -> Any:
    """``value`` (JSON-like: dicts, lists, strings, numbers) with every string redacted,
    keys too: for documents written into the state (audit detail, tombstones). Redacting
    the values rather than the serialised text keeps the JSON valid."""
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {redact_values(k): redact_values(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_values(v) for v in value]
    return value


def command_line(argv: Iterable[str]) -> str:
    """The redacted command line of ``argv``, shell-quoted (:func:`redact_argv`)."""
    return shlex.join(redact_argv(argv))


def redact_text(text: str) -> str:
    """Mask every password in ``text``: URL userinfo, ``password=`` pairs, remembered secrets."""
    text = _URL_USERINFO.sub(lambda m: f"{m['head']}{_mask_userinfo_text(m['ui'])}@", text)
    text = _KV_PASSWORD.sub(lambda m: f"{m['head']}{MASK}", text)
    for secret in sorted(_secrets, key=len, reverse=True):
        # Only where the secret stands as a token of its own: a password "postgres" must
        # not turn "postgresql://" into "***ql://" (its own occurrences are still masked).
        text = re.sub(rf"(?<![A-Za-z0-9_]){re.escape(secret)}(?![A-Za-z0-9_])", MASK, text)
    return text
