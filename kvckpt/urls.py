"""Store URLs and names: parsing, query options, password masking, and the rule for names that
go into keys (checkpoint ids, prefixes).

The bottom of the package: engines parse their URLs with these helpers, and nothing here
imports an engine. Which engine a URL opens is ``kvckpt.stores`` (``open_store``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import SplitResult, parse_qsl, urlsplit

from .errors import InvalidCheckpointIdError, InvalidURLError, KVCheckpointError

DEFAULT_PREFIX = "kvckpt"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=-]*$")


def mask_url(url: str) -> str:
    """The URL with its password (and any ``password=`` query value) replaced by ``***``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    if parts.scheme and not parts.netloc and "@" in parts.path:
        # "redis:user:pw@host" (no "//"): no netloc is parsed, but a password is there all the
        # same: mask it as if the "//" were present.
        head, rest = url.split(":", 1)
        slashes = len(rest) - len(rest.lstrip("/"))
        masked = mask_url(f"{head}://{rest[slashes:]}")
        return f"{head}:{'/' * slashes}" + masked.split("://", 1)[1]
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        if ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:***@{hostport}"
        elif userinfo:
            # redis://secret@host: a lone userinfo is taken as the password by redis-py.
            netloc = f"***@{hostport}"
    query = re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query)
    if netloc == parts.netloc and query == parts.query:
        return url
    return f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")


def split_options(url: str) -> tuple[SplitResult, dict[str, str]]:
    """Parse ``url`` and return it with its query options as a dict (last value wins)."""
    try:
        parts = urlsplit(url)
    except ValueError as e:
        raise InvalidURLError(f"cannot parse store URL {mask_url(url)!r}: {e}") from None
    return parts, dict(parse_qsl(parts.query, keep_blank_values=True))


def validate_name(name: str, what: str = "checkpoint id", max_len: int = 200) -> str:
    """Return ``name`` if it is safe to embed in keys, else raise with the rule."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or len(name) > max_len:
        raise InvalidCheckpointIdError(
            f"invalid {what} {name!r}: use 1-{max_len} characters from letters, digits and "
            "'.', '_', '=', '-', starting with a letter or digit (characters such as '/', "
            "'{', '}', '*', '?' or spaces would break kvckpt's key schema)"
        )
    return name


def validate_prefix(prefix: str) -> str:
    return validate_name(prefix, "prefix", 128)


def take_option(
    options: dict[str, str], name: str, url: str, convert: Callable[[str], Any], default: Any
) -> Any:
    """Pop one query option and convert it, raising an error that names the URL on bad values."""
    if name not in options:
        return default
    raw = options.pop(name)
    try:
        return convert(raw)
    except (TypeError, ValueError) as e:
        why = f": {e}" if isinstance(e, KVCheckpointError) else ""
        raise InvalidURLError(
            f"bad value {raw!r} for option {name!r} in store URL {mask_url(url)}{why}"
        ) from None


def reject_unknown_options(
    options: Iterable[str], url: str, what: str, valid: Iterable[str], note: str = ""
) -> None:
    """Raise ``InvalidURLError`` naming each option of ``options`` (what is left of a URL's
    query once the engine took the ones it knows), the closest valid name to each, and every
    valid option of ``what`` (e.g. "LMDB URL"), then ``note``."""
    unknown = sorted(options)
    if not unknown:
        return
    known = sorted(set(valid))
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hints.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    plural = "s" if len(unknown) > 1 else ""
    raise InvalidURLError(
        f"unknown option{plural} {', '.join(hints)} in {what} {mask_url(url)}; valid options: "
        f"{', '.join(known)}{note}"
    )


def parse_bool(raw: str) -> bool:
    low = raw.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def parse_size(raw: str) -> int:
    """``1048576``, ``64MiB``, ``1GiB``, ``512KB``... -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMGT]?)(i?B)?\s*", raw, re.IGNORECASE)
    if not m:
        raise ValueError(raw)
    number, unit = int(m.group(1)), m.group(2).upper()
    base = 1024 if (m.group(3) or "").lower() == "ib" or not m.group(3) else 1000
    return number * base ** "_KMGT".index(unit or "_")
