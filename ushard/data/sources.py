"""Document sources: the Python standard library's own .py files (the embedded default), text, JSONL
and Parquet. (Pre-tokenized token files need no tokenizer: corpus.py reads them.)

A source yields `(name, content)` pairs in a fixed order (the globs of data.paths in their order, each
glob's files sorted, then record order), so the corpus, and with it every batch, is the same on every
process and every run. The globs are the components of a weighted mixture (data.weights).
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
        raise UserError(f"data.source='stdlib' found no .py files under {root}; use data.source='text' with "
                        "data.paths.")
    return sorted(files, key=lambda p: os.path.relpath(p, root))


def path_patterns(patterns: str) -> list[str]:
    """The globs of data.paths, in order: each is one component of a mixture (data.weights)."""
    return [p.strip() for p in patterns.split(",") if p.strip()]


def glob_files(patterns: str, key: str) -> list[str]:
    files = []
    for pattern in path_patterns(patterns):
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


def component_documents(data_cfg):
    """Yields (component, name, bytes or str): component i is the i-th glob of data.paths (stdlib: 0)."""
    if data_cfg.source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        for path in stdlib_files():
            yield 0, os.path.relpath(path, root), read_bytes(path)
        return
    read = {"text": lambda path: [(path, read_bytes(path))],
            "jsonl": lambda path: jsonl_records(path, data_cfg.jsonl_field),
            "parquet": lambda path: parquet_records(path, data_cfg.parquet_column)}[data_cfg.source]
    for component, pattern in enumerate(path_patterns(data_cfg.paths)):
        for path in glob_files(pattern, "data.paths"):
            for name, content in read(path):
                yield component, name, content


def jsonl_records(path: str, field: str):
    # utf-8-sig: a byte order mark (as some Windows editors write) is not part of the first record.
    # Records end at "\n" only: str.splitlines() would also split at a U+2028 that JSON allows
    # inside a string. A "\r" before the "\n" is whitespace to json.loads.
    content = read_bytes(path).decode("utf-8-sig", errors="replace")
    for lineno, line in enumerate(content.split("\n"), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record[field]
            if not isinstance(text, str):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(
                f"{path}:{lineno} is not a JSON object with a string {field!r} field "
                f"(data.jsonl_field names the field holding the text)."
            ) from None
        yield f"{path}:{lineno}", text


def parquet_records(path: str, column: str):
    """(path:row, text) for each row of one string column, read a row group at a time; null rows are skipped."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("data.source='parquet' needs pyarrow; pip install 'ushard[data]'.") from None
    try:
        file = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {path} as Parquet: {' '.join(str(e).split()).rstrip('.')}.") from None
    schema = file.schema_arrow
    if column not in schema.names:
        raise UserError(f"{path} has no column {column!r} (data.parquet_column names the text column); "
                        f"its columns: {', '.join(schema.names)}.")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"{path}: column {column!r} holds {kind}, not text; set data.parquet_column to a string "
                        "column.")
    row = 0
    for group in range(file.num_row_groups):
        for text in file.read_row_group(group, columns=[column]).column(0).to_pylist():
            if text is not None:
                yield f"{path}:{row}", text
            row += 1
