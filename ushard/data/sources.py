"""Document sources: the Python standard library's own .py files (the embedded default), text and JSONL.

A source yields `(name, content)` pairs in a fixed order (sorted paths, then line order), so the corpus,
and with it every batch, is the same on every process and every run.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig

from ushard.errors import UserError


def stdlib_files() -> list[str]:
    """Every .py file of the running Python's standard library, third-party packages excluded."""
    root = sysconfig.get_paths()["stdlib"]
    skip = ("site-packages", "dist-packages")
    files = [
        path for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True)
        if not any(part in skip for part in path[len(root):].split(os.sep))
    ]
    if not files:
        raise UserError(f"data.source='stdlib' found no .py files under {root}; use data.source='text' with data.paths.")
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def glob_files(patterns: str, key: str) -> list[str]:
    files = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matched = sorted(f for f in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(f))
        if not matched:
            raise UserError(f"{key}={pattern!r} matched no files; give a glob of existing files.")
        files.extend(matched)
    return files


def read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise UserError(f"cannot read data file {path}: {e.strerror}.") from None


def documents(data_cfg):
    """Yields (name, bytes or str) for each document of the configured source."""
    if data_cfg.source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        for path in stdlib_files():
            yield os.path.relpath(path, root), read_bytes(path)
    elif data_cfg.source == "text":
        for path in glob_files(data_cfg.paths, "data.paths"):
            yield path, read_bytes(path)
    elif data_cfg.source == "jsonl":
        for path in glob_files(data_cfg.paths, "data.paths"):
            # utf-8-sig: a byte order mark (as some Windows editors write) is not part of the first record.
            # Records end at "\n" only: str.splitlines() would also split at a U+2028 that JSON allows
            # inside a string. A "\r" before the "\n" is whitespace to json.loads.
            content = read_bytes(path).decode("utf-8-sig", errors="replace")
            for lineno, line in enumerate(content.split("\n"), 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    text = record[data_cfg.jsonl_field]
                    if not isinstance(text, str):
                        raise TypeError
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(
                        f"{path}:{lineno} is not a JSON object with a string {data_cfg.jsonl_field!r} field "
                        f"(data.jsonl_field names the field holding the text)."
                    ) from None
                yield f"{path}:{lineno}", text
