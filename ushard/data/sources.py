"""Document sources: the Python standard library's own .py files (the embedded default), text, JSONL
and Parquet, and for fine-tuning chat JSONL and prompt / completion records (made into tokens by
chat.py). (Pre-tokenized token files need no tokenizer: corpus.py reads them.)

A source yields `(name, content)` pairs in a fixed order (the globs of data.paths in their order, each
glob's files sorted, then record order), so the corpus, and with it every batch, is the same on every
process and every run. The globs are the components of a weighted mixture (data.weights).
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig

from ushard.errors import UserError, install_hint


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


def has_prompt_completion(data_cfg) -> bool:
    """jsonl / parquet records of a prompt and a completion (data.prompt_field, data.completion_field)."""
    return data_cfg.source in ("jsonl", "parquet") and bool(data_cfg.prompt_field)


def packs_whole(data_cfg) -> bool:
    """Fine-tuning examples, packed whole into windows with a mask of the tokens that count (chat.py)."""
    return data_cfg.source == "chat" or has_prompt_completion(data_cfg)


def component_documents(data_cfg):
    """Yields (component, name, content): component i is the i-th glob of data.paths (stdlib: 0); the
    content is bytes or text, a (prompt, completion) pair of texts, or a chat's list of messages."""
    if data_cfg.source == "stdlib":
        root = sysconfig.get_paths()["stdlib"]
        for path in stdlib_files():
            yield 0, os.path.relpath(path, root), read_bytes(path)
        return
    pair = (data_cfg.prompt_field, data_cfg.completion_field) if has_prompt_completion(data_cfg) else ()
    read = {"text": lambda path: [(path, read_bytes(path))],
            "jsonl": lambda path: jsonl_records(path, *(pair or (data_cfg.jsonl_field,))),
            "parquet": lambda path: parquet_records(path, *(pair or (data_cfg.parquet_column,))),
            "chat": read_conversations}[data_cfg.source]
    for component, pattern in enumerate(path_patterns(data_cfg.paths)):
        for path in glob_files(pattern, "data.paths"):
            empty = True
            for name, content in read(path):
                empty = False
                yield component, name, content
            if empty and packs_whole(data_cfg):  # a fine-tuning file is examples, all of it
                what = "conversation" if data_cfg.source == "chat" else "prompt / completion record"
                raise UserError(f"{path} holds no {what}; remove it from data.paths or fill it.")


def jsonl_lines(path: str):
    """(path:line, the line's text) for each non-blank line of a JSONL file."""
    # utf-8-sig: a byte order mark (as some Windows editors write) is not part of the first record.
    # Records end at "\n" only: str.splitlines() would also split at a U+2028 that JSON allows
    # inside a string. A "\r" before the "\n" is whitespace to json.loads.
    content = read_bytes(path).decode("utf-8-sig", errors="replace")
    for lineno, line in enumerate(content.split("\n"), 1):
        if line.strip():
            yield f"{path}:{lineno}", line


def jsonl_records(path: str, *fields: str):
    """(path:line, text) for each record, or (path:line, (text, ...)) when several fields are named."""
    for name, line in jsonl_lines(path):
        try:
            record = json.loads(line)
            texts = tuple(record[field] for field in fields)
            if not all(isinstance(text, str) for text in texts):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{name} is not a JSON object with {_field_phrase(fields)}.") from None
        yield name, texts if len(fields) > 1 else texts[0]


def _field_phrase(fields: tuple[str, ...]) -> str:
    if len(fields) == 1:
        return f"a string {fields[0]!r} field (data.jsonl_field names the field holding the text)"
    return (f"string {fields[0]!r} and {fields[1]!r} fields (data.prompt_field and data.completion_field name "
            f"the fields holding the prompt and the completion)")


ROLES = ("system", "user", "assistant", "tool")  # of a chat message


def read_conversations(path: str):
    """(path:line, messages) for each non-blank line of a chat JSONL file, checked."""
    for name, line in jsonl_lines(path):
        try:
            messages = json.loads(line)["messages"]
            if not isinstance(messages, list) or not messages:
                raise TypeError
            for m in messages:
                if not (isinstance(m, dict) and isinstance(m["role"], str) and isinstance(m["content"], str)):
                    raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UserError(f"{name} is not a JSON object with a non-empty \"messages\" list of "
                            f"{{\"role\": ..., \"content\": ...}} objects with string values.") from None
        for k, m in enumerate(messages):
            if m["role"] not in ROLES:
                raise UserError(f"{name}: message {k + 1} has role {m['role']!r}; the roles are "
                                f"{', '.join(ROLES[:-1])} and {ROLES[-1]}.")
        yield name, messages


def open_parquet(path: str, what: str):
    """(pyarrow, the opened ParquetFile) of `path`, or a sentence: pyarrow missing (`what` needs it),
    or a file that is not Parquet."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{what} needs pyarrow; {install_hint('data')}.") from None
    try:
        return pa, pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as e:
        raise UserError(f"cannot read {path} as Parquet: {' '.join(str(e).split()).rstrip('.')}.") from None


def parquet_records(path: str, *columns: str):
    """(path:row, text) for each row of string columns, read a row group at a time (several columns:
    (path:row, (text, ...))); rows with a null among them are skipped."""
    pa, file = open_parquet(path, "data.source='parquet'")
    schema = file.schema_arrow
    key = "data.parquet_column names the text column" if len(columns) == 1 else \
        "data.prompt_field and data.completion_field name its columns"
    for column in columns:
        if column not in schema.names:
            raise UserError(f"{path} has no column {column!r} ({key}); its columns: {', '.join(schema.names)}.")
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise UserError(f"{path}: column {column!r} holds {kind}, not text ({key}); name a string column.")
    row = 0
    for group in range(file.num_row_groups):
        table = file.read_row_group(group, columns=list(columns))
        for texts in zip(*(table.column(i).to_pylist() for i in range(len(columns)))):
            if None not in texts:
                yield f"{path}:{row}", texts if len(columns) > 1 else texts[0]
            row += 1
