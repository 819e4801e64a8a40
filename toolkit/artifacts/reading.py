"""Reading a JSON file: a missing, unreadable or malformed one is one line naming it."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit.errors import SpecPrefetchError


def read_json(path: Path | str, what: str) -> Any:
    """Read a JSON file; a missing or malformed file is an error that names it."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SpecPrefetchError(f"{what} not found: {path}") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise SpecPrefetchError(f"{what} {path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecPrefetchError(f"{what} {path} is not valid JSON: {e}") from None
    except RecursionError:
        raise SpecPrefetchError(f"{what} {path} is not valid JSON: nested too deeply") from None
    except ValueError as e:   # e.g. an integer past Python's 4300-digit conversion limit
        raise SpecPrefetchError(f"{what} {path} is not valid JSON: {' '.join(str(e).split())[:160]}") from None
