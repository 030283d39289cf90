"""The optional extras: a backend imported without its driver says which extra to install."""

from __future__ import annotations

import importlib


def require_extra(backend: str, extra: str, *modules: str) -> None:
    """Import ``modules``, or fail naming the extra that installs them.

    Raises:
        ImportError: one of ``modules`` is not installed; the message gives the
            ``pip install`` command for ``extra``.
    """
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(
                f"{backend} needs the {module!r} package, which is not installed: "
                f"pip install 'keyserial[{extra}]'",
                name=module,
            ) from exc
