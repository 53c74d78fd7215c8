"""Plans stored as YAML (or JSON) files: ``{module pattern: style}``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType


def load_plan_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a plan file; YAML (``.yaml``/``.yml``) or JSON, same keys and styles as a dict plan.

    A top-level ``tp_plan:`` key is accepted too, so a file can carry other settings.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is malformed or not a mapping of strings to strings
            (the message names the file and the offending key).
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"plan file {file} does not exist")
    text = file.read_text()
    try:
        is_yaml = file.suffix in (".yaml", ".yml")
        data = _yaml().safe_load(text) if is_yaml else json.loads(text)
    except ImportError:
        raise
    except Exception as err:  # yaml.YAMLError / JSONDecodeError: report the file
        raise ValueError(f"plan file {file} is not valid {file.suffix.lstrip('.') or 'JSON'}: "
                         f"{err}") from err
    if isinstance(data, dict) and isinstance(data.get("tp_plan"), dict):
        data = data["tp_plan"]
    if not isinstance(data, dict):
        raise ValueError(f"plan file {file} must hold a mapping of module pattern -> style, "
                         f"got {type(data).__name__}")
    for key, value in data.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise ValueError(f"plan file {file}: entry {key!r}: {value!r} must map a module "
                             "pattern (string) to a style name (string)")
    return data


def _yaml() -> ModuleType:
    try:
        import yaml
    except ImportError as err:
        raise ImportError("YAML plan files need PyYAML: pip install pyyaml "
                          "(or pip install 'torchtp[hf]')") from err
    return yaml
