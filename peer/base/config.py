"""Reading TOML configuration files (rosters, round settings, scenarios) with errors that name
the key *and the line* at fault.

``tomllib`` reports the line and column of a syntax error but knows nothing of lines once the
file is parsed, so semantic errors ("epochs must be a positive integer") would otherwise say
only the key. :func:`key_line` finds where a key is written by scanning the text: it follows
``[table]`` and ``[[array-of-tables]]`` headers (counting array elements), bare, quoted and
dotted keys, and falls back to the nearest enclosing definition (the line of an inline table
or of a table header) when the key itself is written inside an inline table.

:class:`Section` wraps one parsed table together with its key path and the source text; its
getters check type and range and raise :class:`ConfigError` naming ``file, line N: key``.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from peer.base.errors import InvalidArgument, NotFound

__all__ = ["ConfigError", "Section", "key_line", "load_toml", "parse_toml"]

Key = tuple  # of str (table keys) and int (array indices)

_HEADER = re.compile(r"^\s*\[(?P<array>\[)?\s*(?P<name>[^\[\]]+?)\s*\]\]?\s*(?:#.*)?$")
_PART = r"(?:\"[^\"]*\"|'[^']*'|[A-Za-z0-9_-]+)"
_KEYLINE = re.compile(rf"^\s*(?P<key>{_PART}(?:\s*\.\s*{_PART})*)\s*=")


def dotted(key: Sequence[str | int]) -> str:
    """A key path as people write it: ``sites.hospital-a.alpha``, ``round.epsilons[2]``."""
    out = ""
    for part in key:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            text = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else f'"{part}"'
            out += text if not out else f".{text}"
    return out


def _split(name: str) -> list[str]:
    return [a or b or c for a, b, c in re.findall(r"\"([^\"]*)\"|'([^']*)'|([A-Za-z0-9_-]+)", name)]


def key_line(text: str, key: Sequence[str | int]) -> int | None:
    """The 1-based line where ``key`` (or, failing that, the closest enclosing table or inline
    table) is defined in TOML ``text``; None if nothing on the path is written in the file."""
    want = list(key)
    best_len, best_line = 0, None
    table: list[str | int] = []
    counts: dict[tuple, int] = {}
    in_multiline = False
    for no, raw in enumerate(text.splitlines(), start=1):
        # skip the insides of multi-line strings: they may look like keys
        if raw.count('"""') % 2 == 1 or raw.count("'''") % 2 == 1:
            in_multiline = not in_multiline
            continue
        if in_multiline:
            continue
        m = _HEADER.match(raw)
        if m:
            parts: list[str | int] = list(_split(m.group("name")))
            if m.group("array"):
                index = counts.get(tuple(parts), 0)
                counts[tuple(parts)] = index + 1
                parts.append(index)
            table = parts
            defined = table
        else:
            k = _KEYLINE.match(raw)
            if not k:
                continue
            defined = table + _split(k.group("key"))
        n = len(defined)
        if n <= len(want) and defined == want[:n] and n > best_len:
            best_len, best_line = n, no
    return best_line


class ConfigError(InvalidArgument):
    """A bad configuration value: names the file, the line (when it can be found) and the key."""

    def __init__(self, key: Sequence[str | int] | str, rule: str, line: int | None = None, source: str | None = None):
        self.key = key if isinstance(key, str) else dotted(key)
        self.line = line
        self.source = source
        where = ", ".join(p for p in (source, f"line {line}" if line else None) if p)
        super().__init__(f"{self.key} ({where})" if where else self.key, rule)


def load_toml(path: str | Path, what: str) -> tuple[dict, str]:
    """Parse a TOML file; syntax errors carry tomllib's line and column."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise NotFound(f"{what} {str(p)!r}: {e.strerror}") from None
    return parse_toml(text, str(p), what), text


def parse_toml(text: str, source: str, what: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        m = re.search(r"line (\d+)", str(e))
        raise ConfigError(what, f"is not valid TOML: {e}", int(m.group(1)) if m else None, source) from None


class Section:
    """One table of a parsed file, with where it sits (for errors that name key and line)."""

    def __init__(self, data: Any, key: Sequence[str | int], text: str, source: str):
        self.key: Key = tuple(key)
        self.text = text
        self.source = source
        if not isinstance(data, Mapping):
            self.fail((), f"must be a table, got {_kind(data)}")
        self.data: Mapping[str, Any] = data

    # ---- errors ---------------------------------------------------------------------------------

    def fail(self, sub: Sequence[str | int] | str, rule: str) -> None:
        path = self.key + ((sub,) if isinstance(sub, str) else tuple(sub))
        raise ConfigError(path, rule, key_line(self.text, path), self.source)

    def known(self, allowed: Iterable[str]) -> None:
        allowed = list(allowed)
        for k in self.data:
            if k not in allowed:
                self.fail(k, f"unknown key; expected one of {allowed}")

    # ---- getters --------------------------------------------------------------------------------

    def __contains__(self, name: str) -> bool:
        return name in self.data

    def section(self, name: str, required: bool = False) -> Section:
        if name not in self.data:
            if required:
                self.fail(name, "is required (a table)")
            return Section({}, (*self.key, name), self.text, self.source)
        return Section(self.data[name], (*self.key, name), self.text, self.source)

    def sections(self, name: str) -> dict[str, Section]:
        """A table of tables (``[sites.a]``, ``[sites.b]``) as name → Section, in file order."""
        outer = self.section(name)
        return {k: Section(v, (*outer.key, k), self.text, self.source) for k, v in outer.data.items()}

    def raw(self, name: str, default: Any = ...) -> Any:
        """The value as written (required unless a default is given), unchecked."""
        if name not in self.data:
            if default is ...:
                self.fail(name, "is required")
            return default
        return self.data[name]

    def string(self, name: str, default: Any = ..., choices: Sequence[str] | None = None) -> Any:
        v = self.raw(name, default)
        if name not in self.data:
            return v
        if not isinstance(v, str) or not v:
            self.fail(name, f"must be a non-empty string, got {v!r}")
        if choices is not None and v not in choices:
            self.fail(name, f"must be one of {list(choices)}, got {v!r}")
        return v

    def boolean(self, name: str, default: Any = ...) -> Any:
        v = self.raw(name, default)
        if name in self.data and not isinstance(v, bool):
            self.fail(name, f"must be true or false, got {v!r}")
        return v

    def integer(self, name: str, default: Any = ..., minimum: int | None = None, maximum: int | None = None) -> Any:
        v = self.raw(name, default)
        if name not in self.data:
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            self.fail(name, f"must be an integer, got {v!r}")
        if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
            self.fail(name, f"must be {_range(minimum, maximum)}, got {v!r}")
        return v

    def number(
        self,
        name: str,
        default: Any = ...,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        exclusive_minimum: float | None = None,
        exclusive_maximum: float | None = None,
    ) -> Any:
        v = self.raw(name, default)
        if name not in self.data:
            return v
        return self._check_number(name, v, minimum, maximum, exclusive_minimum, exclusive_maximum)

    def _check_number(
        self, sub, v, minimum=None, maximum=None, exclusive_minimum=None, exclusive_maximum=None
    ) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            self.fail(sub, f"must be a finite number, got {v!r}")
        ok = (
            (minimum is None or v >= minimum)
            and (maximum is None or v <= maximum)
            and (exclusive_minimum is None or v > exclusive_minimum)
            and (exclusive_maximum is None or v < exclusive_maximum)
        )
        if not ok:
            lo = (
                f"> {exclusive_minimum:g}"
                if exclusive_minimum is not None
                else (f">= {minimum:g}" if minimum is not None else "")
            )
            hi = (
                f"< {exclusive_maximum:g}"
                if exclusive_maximum is not None
                else (f"<= {maximum:g}" if maximum is not None else "")
            )
            self.fail(sub, f"must be {' and '.join(p for p in (lo, hi) if p)}, got {v!r}")
        return float(v)

    def numbers(
        self, name: str, default: Any = ..., *, length: int | None = None, min_length: int = 1, **bounds: float
    ) -> Any:
        v = self.raw(name, default)
        if name not in self.data:
            return v
        if not isinstance(v, list) or len(v) < min_length or (length is not None and len(v) != length):
            size = f"{length}" if length is not None else f"at least {min_length}"
            self.fail(name, f"must be an array of {size} numbers, got {v!r}")
        return [self._check_number((name, i), x, **bounds) for i, x in enumerate(v)]

    def interval(self, name: str, default: Any = ...) -> Any:
        """``[low, high]`` with low < high."""
        v = self.numbers(name, default, length=2)
        if name in self.data and not v[0] < v[1]:
            self.fail(name, f"must be [low, high] with low < high, got {self.data[name]!r}")
        return v if name not in self.data else (v[0], v[1])

    def path(self, name: str, base: Path, default: Any = ...) -> Any:
        v = self.string(name, default)
        return v if name not in self.data else (base / v)


def _range(lo, hi) -> str:
    if lo is not None and hi is not None:
        return f"between {lo} and {hi}"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def _kind(v: Any) -> str:
    return {
        dict: "a table",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
    }.get(type(v), type(v).__name__)
