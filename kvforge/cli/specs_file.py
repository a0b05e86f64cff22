"""``kvforge plan --vllm-specs FILE``: the file read, checked and turned into backends, or one
line naming the file (and the layer, the field and the value where there is one).

:func:`read_specs_file` needs no vLLM: it refuses a file that cannot be read (missing, a
directory, a device or pipe, larger than :data:`MAX_FILE_BYTES`), is not UTF-8 (the byte
offset), is not JSON (line and column), nests deeper than a dump does (:data:`MAX_DEPTH`),
holds an integer past a signed 64-bit count (:data:`MAX_INT`), a number too large for a float,
``NaN`` or ``Infinity``, more vLLM layers than kvforge plans (``MAX_LAYERS``), an overlong layer
name, or a field value that vLLM's constructors would turn into a raw error (a
``tokens_per_state`` such as ``"1/0"``, a ``{"multiple_of": 0}``, ``shapes`` and ``dtypes`` of
different lengths). :func:`vllm_backends` then has vLLM build the specs
(:func:`~kvforge.integrations.vllm.specs.load_vllm_specs`), checks every layer's page
(``page_size_padded`` at least the real page, every page a 64-bit byte count) and returns
:func:`~kvforge.integrations.vllm.specs.from_vllm_specs`'s backends.

Every refusal is a :class:`~kvforge.cli.formatting.UsageError`: the CLI prints it as one line
and exits 2, before planning anything.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from kvforge.cli.formatting import UsageError
from kvforge.models.base import MAX_LAYERS, short_repr

__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_INT",
    "MAX_NAME_CHARS",
    "read_specs_file",
    "vllm_backends",
]

#: a dump of a few thousand layers is a few MB
MAX_FILE_BYTES = 64 << 20
#: a dump nests 5 levels: the file, ``layers``, a layer, ``shapes``, a shape
MAX_DEPTH = 5
#: every integer of a dump (counts, sizes, byte counts) and every page fits a signed 64-bit int
MAX_INT = 2**63 - 1
#: vLLM layer names are dotted module paths such as ``model.layers.0.self_attn.attn``
MAX_NAME_CHARS = 512
#: the longest message a refusal prints (a value quoted in full could be megabytes)
MAX_MESSAGE_CHARS = 1000

_FRACTION = re.compile(r"^(\d{1,19})(?:/(\d{1,19}))?$")
_PYDANTIC_NOISE = re.compile(r"\s*\[type=[^\]]*\]|\s*For further information visit \S+")


class _BadLiteral(ValueError):
    """A JSON literal kvforge refuses (raised from the parser's hooks)."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > 19 or abs(int(text)) > MAX_INT:
        shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} digits)"
        raise _BadLiteral(f"the integer {shown} is out of range (at most {MAX_INT})")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _BadLiteral(f"the number {text[:40]} is out of range for a float")
    return value


def _parse_constant(text: str) -> Any:
    raise _BadLiteral(f"{text} is not a JSON number")


def _clip(message: str) -> str:
    message = _PYDANTIC_NOISE.sub("", message)
    message = " ".join(line.strip() for line in message.splitlines() if line.strip())
    if len(message) > MAX_MESSAGE_CHARS:
        message = f"{message[:MAX_MESSAGE_CHARS]}... ({len(message)} characters)"
    return message


def _read_text(path: str, origin: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise UsageError(f"{origin}: no such file") from None
    except OSError as exc:
        raise UsageError(f"{origin}: cannot read it: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise UsageError(
                f"{origin}: it is a directory; give the JSON file specs were dumped to"
            )
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{origin}: not a regular file")
        if info.st_size > MAX_FILE_BYTES:
            raise UsageError(
                f"{origin}: {info.st_size:,} bytes is more than a specs dump "
                f"({MAX_FILE_BYTES:,} bytes at most)"
            )
        with os.fdopen(fd, "rb", closefd=False) as fh:
            raw = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{origin}: cannot read it: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(raw) > MAX_FILE_BYTES:
        raise UsageError(f"{origin}: more than a specs dump ({MAX_FILE_BYTES:,} bytes at most)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(
            f"{origin} is not UTF-8 text: byte {exc.start} is {raw[exc.start : exc.start + 1]!r}"
        ) from None


def _check_depth(data: Any, origin: str) -> None:
    """Refuse nesting past :data:`MAX_DEPTH`, walked without recursion."""
    stack: list[tuple[Any, int, str]] = [(data, 1, "")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, dict):
            items: Any = ((f"{where}[{short_repr(k)}]", v) for k, v in value.items())
        elif isinstance(value, list):
            items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
        else:
            continue
        if depth > MAX_DEPTH:
            raise UsageError(
                f"{origin}: nests JSON arrays or objects {depth} levels deep at {where[:200]}; "
                f"a specs dump nests {MAX_DEPTH} at most"
            )
        stack.extend((v, depth + 1, w) for w, v in items)


def _check_layer(name: Any, entry: Any, origin: str) -> None:
    """What vLLM's constructors would turn into a raw error, refused by field and value."""
    if isinstance(name, str) and len(name) > MAX_NAME_CHARS:
        raise UsageError(
            f"{origin}: layer name {short_repr(name)} has {len(name):,} characters; "
            f"vLLM layer names have at most {MAX_NAME_CHARS}"
        )
    if not isinstance(entry, Mapping):
        return  # load_vllm_specs names the layer and the value
    where = f"{origin}: layer {name!r}"
    ratio = entry.get("tokens_per_state")
    if isinstance(ratio, str):
        match = _FRACTION.match(ratio)
        if match is None or int(match[1]) == 0 or (match[2] is not None and int(match[2]) == 0):
            raise UsageError(
                f"{where}: field 'tokens_per_state' must be a positive int or a fraction "
                f"string such as '1/4', got {short_repr(ratio)}"
            )
    alignment = entry.get("block_stride_alignment")
    if isinstance(alignment, dict) and "multiple_of" in alignment:
        base = alignment["multiple_of"]
        if type(base) is int and base < 1:
            raise UsageError(
                f"{where}: field 'block_stride_alignment' must be a positive int or "
                f'{{"multiple_of": positive int}}, got {short_repr(alignment)}'
            )
    shapes, dtypes = entry.get("shapes"), entry.get("dtypes")
    if isinstance(shapes, list) and isinstance(dtypes, list) and len(shapes) != len(dtypes):
        raise UsageError(
            f"{where}: fields 'shapes' and 'dtypes' must have one entry per state tensor, got "
            f"{len(shapes)} shapes and {len(dtypes)} dtypes"
        )


def read_specs_file(path: str) -> Any:
    """The JSON of a specs file, checked as far as it can be without vLLM (see the module).

    Raises:
        UsageError: one line naming ``--vllm-specs`` and ``path``.
    """
    origin = f"--vllm-specs {path!r}"
    text = _read_text(path, origin)
    try:
        data = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{origin} is not JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except _BadLiteral as exc:
        raise UsageError(f"{origin}: {exc}") from None
    except RecursionError:
        # json's decoder recurses once per nesting level
        raise UsageError(
            f"{origin}: nests JSON arrays or objects too deeply to be a specs dump "
            f"({MAX_DEPTH} levels at most)"
        ) from None
    except ValueError as exc:  # anything else the decoder refuses
        raise UsageError(f"{origin} is not JSON: {_clip(str(exc))}") from None
    _check_depth(data, origin)
    layers = data.get("layers") if isinstance(data, dict) else None
    if isinstance(layers, dict):
        if len(layers) > MAX_LAYERS:
            raise UsageError(
                f"{origin}: {len(layers):,} layers; kvforge plans at most {MAX_LAYERS} cache "
                "layers per model (MAX_LAYERS)"
            )
        for name, entry in layers.items():
            _check_layer(name, entry, origin)
    return data


def _check_pages(specs: Mapping[str, Any], origin: str) -> None:
    """Every layer's page as vLLM sizes it: padded at least the real page, both 64-bit."""
    for name, spec in specs.items():
        where = f"{origin}: layer {name!r}"
        try:
            real = int(spec.real_page_size_bytes)
        except (ArithmeticError, AssertionError, TypeError, ValueError) as exc:
            message = _clip(str(exc)) or type(exc).__name__
            raise UsageError(f"{where}: vLLM cannot size its page: {message}") from None
        padded = getattr(spec, "page_size_padded", None)
        if padded is not None and padded < real:
            raise UsageError(
                f"{where}: field 'page_size_padded' must be at least the layer's real page "
                f"of {real:,} bytes, got {padded:,}"
            )
        page = real if padded is None else padded
        if page > MAX_INT:
            raise UsageError(
                f"{where}: its page of {page:,} bytes is more than a 64-bit byte count "
                f"holds ({MAX_INT:,})"
            )


def vllm_backends(path: str) -> Any:
    """The :class:`~kvforge.integrations.vllm.specs.VllmSpecBackends` of a specs file.

    Raises:
        UsageError: the file is refused (see the module), vLLM is not installed, or vLLM or
            kvforge refuses a layer: one line naming the file and the layer.
    """
    origin = f"--vllm-specs {path!r}"
    data = read_specs_file(path)
    try:
        from kvforge.integrations.vllm.specs import from_vllm_specs, load_vllm_specs
    except ImportError as exc:
        raise UsageError(
            "--vllm-specs needs vLLM: install the extra kvforge[vllm] "
            f"(pip install 'kvforge[vllm]'); importing it failed: {exc}"
        ) from None
    try:
        specs = load_vllm_specs(data)
        _check_pages(specs, origin)
        return from_vllm_specs(specs)
    except UsageError:
        raise
    except (ValueError, AssertionError, ArithmeticError) as exc:
        # ValueError: kvforge's ArgumentError and pydantic's errors, naming the layer; the
        # others: vLLM's own checks of a spec (its asserts), which name nothing
        message = _clip(str(exc)) or type(exc).__name__
        raise UsageError(f"{origin}: {message}") from None
