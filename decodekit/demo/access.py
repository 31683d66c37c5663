"""Who may use the demo: sign-in accounts read from a file, and whether an address is reachable from elsewhere."""

from __future__ import annotations

import ipaddress
from pathlib import Path

LOOPBACK_NAMES = ("localhost",)


def read_auth_file(path: str | Path) -> list[tuple[str, str]]:
    """The ``(user, password)`` accounts of an auth file: one ``user:password`` a line; blank lines and
    lines starting with ``#`` are skipped. The password may contain ``:``; the user may not.

    A missing file, an unreadable one, a malformed line (named by its number, never echoed) or a file
    without an account raises ValueError.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as file:
        ...     _ = file.write("# demo accounts\\nada:s3cret:with:colons\\n\\nbob:hunter2\\n")
        >>> read_auth_file(file.name)
        [('ada', 's3cret:with:colons'), ('bob', 'hunter2')]
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--auth-file {str(path)!r} cannot be read: {error}") from None
    accounts = []
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, colon, password = line.partition(":")
        if not colon or not user.strip() or not password:
            raise ValueError(
                f"--auth-file {str(path)!r}, line {number}: expected user:password with both parts non-empty"
            )
        accounts.append((user.strip(), password))
    if not accounts:
        raise ValueError(f"--auth-file {str(path)!r} has no user:password line")
    return accounts


def is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost).

    Example:
        >>> is_loopback("127.0.0.1"), is_loopback("localhost"), is_loopback("0.0.0.0"), is_loopback("::")
        (True, True, False, False)
    """
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False
