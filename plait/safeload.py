"""Loading files that someone else may have written: data, never code.

Every pickle plait reads (CUDA memory snapshots, anything a profile folder names, a reward
worker's replies) goes through `load_pickle` or `loads_plain`: an unpickler that builds only plain
data (dicts, lists, tuples, strings, bytes, numbers, booleans, None, sets) and refuses any other
class or function with one line naming the file and what it asked for, before anything of it runs. Checkpoint tensors go through
`load_tensors` (torch's `weights_only` loader), whose failures become one line naming the file.
A sharded (torch.distributed.checkpoint) checkpoint's `.metadata` is a pickle that torch loads
without restriction: `check_dcp_metadata` reads it first with an unpickler that allows only DCP's
own metadata classes and torch's size/dtype/layout names, and checks that every shard it names is a
file of that folder. The shards' byte items (non-tensor state such as an optimizer's lr) are
pickles too, which DCP's default planner loads unrestricted: `loads_tensors` is their loader.
Left out: a "trust this file" switch; a file that needs code to load is not an artifact plait reads.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import yaml


class UnsafeFileError(ValueError):
    """A file plait would not (or could not) load; the message is one line naming it."""


# Globals a plain-data pickle may need: protocols 0-2 spell sets, bytes and bytearrays as calls
# (bytes as _codecs.encode(str, "latin1"), a pure function, as torch's weights_only loader allows).
PLAIN_GLOBALS = {("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "bytes"),
                 ("builtins", "complex"), ("collections", "OrderedDict"), ("_codecs", "encode"),
                 ("__builtin__", "set"), ("__builtin__", "frozenset"), ("__builtin__", "bytearray")}


class _PlainUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in PLAIN_GLOBALS:
            return super().find_class(module, name)
        raise UnsafeFileError(f"{self.path}: refused to load: it asks for {module}.{name}, and plait reads "
                              "only plain data (dicts, lists, strings, numbers) from pickles; nothing in it ran")

    def persistent_load(self, pid):
        raise UnsafeFileError(f"{self.path}: refused to load: it holds a persistent reference, and plait "
                              "reads only plain data from pickles; nothing in it ran")


def load_pickle(path: str) -> Any:
    """The plain data in the pickle at `path`; UnsafeFileError (one line) for anything else."""
    try:
        with open(path, "rb") as f:
            return _PlainUnpickler(f, path).load()
    except UnsafeFileError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as err:
        raise UnsafeFileError(f"{path}: not a readable pickle ({type(err).__name__}: {first_line(err)})") from None


def loads_plain(data: bytes, what: str) -> Any:
    """The plain data in pickled bytes (`what` names their source in the message)."""
    import io
    try:
        return _PlainUnpickler(io.BytesIO(data), what).load()
    except UnsafeFileError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError) as err:
        raise UnsafeFileError(f"{what}: not a readable pickle ({type(err).__name__}: {first_line(err)})") from None


def load_tensors(path: str, map_location: Any = None) -> Any:
    """torch.load(path, weights_only=True): tensors and plain containers only. Any failure (a
    missing, truncated or corrupt file, or a pickle that asks for code) is one UnsafeFileError line."""
    import torch
    if not os.path.isfile(path):
        raise UnsafeFileError(f"{path}: missing")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, UnpicklingError, EOFError, ...
        raise UnsafeFileError(f"{path}: does not load as tensors ({type(err).__name__}: {torch_reason(err)})") from None


def loads_tensors(data, what: str) -> Any:
    """torch.load of an in-memory file (a DCP shard's byte item) with weights_only=True; `what` names
    its source in the one-line UnsafeFileError."""
    import torch
    try:
        return torch.load(data, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - as in load_tensors
        raise UnsafeFileError(f"{what}: does not load as tensors ({type(err).__name__}: {torch_reason(err)})") from None


def torch_reason(err: BaseException) -> str:
    """The line of torch's (multi-paragraph) load error that says what is wrong. Its advice to
    retry with weights_only=False is left out on purpose: that would run the file's code."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for line in lines:
        if "Unsupported global" in line or "Unsupported operand" in line:
            return line.split(". ")[0]
    return first_line(err)


def outside_text(text: str, max_chars: int) -> str:
    """Text from user code or a service (a tool's answer, an interaction's user turn, an error message)
    as a tokenizer takes it: lone surrogates (a JSON escape or a bad decode's leftovers; the tokenizer
    raises on them) become U+FFFD, a valid pair written as two code points one character, and the text
    is cut to `max_chars` characters, so a 20 MiB answer never reaches the trainer whole."""
    text = text[:max_chars]
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def first_line(err: BaseException, limit: int = 200) -> str:
    """An error's first line; with the next one when the first only introduces it ("...:")."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    text = f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return text if len(text) <= limit else text[:limit - 3] + "..."


# What DCP's .metadata pickle names: its metadata dataclasses, the storage index, torch's
# Size, dtypes, layouts and memory formats (attributes of the torch module, no callables).
DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
DCP_GLOBALS = {("torch.serialization", "_get_layout"),  # a layout's name -> the layout, as weights_only allows
               ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")}  # the checkpoint id: a path from strings
TORCH_NAMES = ("Size", "strided", "sparse_coo", "contiguous_format", "preserve_format", "channels_last")


class _DcpMetadataUnpickler(_PlainUnpickler):
    def find_class(self, module: str, name: str):
        import torch
        if module in DCP_MODULES and isinstance(getattr(__import__(module, fromlist=[name]), name, None), type):
            return super(_PlainUnpickler, self).find_class(module, name)
        if (module, name) in DCP_GLOBALS:
            return super(_PlainUnpickler, self).find_class(module, name)
        if module == "torch" and (name in TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        return super().find_class(module, name)


def check_dcp_metadata(folder: str) -> None:
    """UnsafeFileError (one line) unless `folder`/.metadata, and any rank-local `__<rank>.metadata`
    (which torch falls back to, also unrestricted, when .metadata does not load), unpickles to DCP
    metadata alone and names shards in `folder` only: torch's own load of them then runs nothing."""
    local = [n for n in os.listdir(folder) if n.startswith("__") and n.endswith(".metadata")] \
        if os.path.isdir(folder) else []
    for name in [".metadata", *sorted(local)]:
        _check_dcp_index(os.path.join(folder, name))


def _check_dcp_index(path: str) -> None:
    try:
        with open(path, "rb") as f:
            metadata = _DcpMetadataUnpickler(f, path).load()
        shards = {info.relative_path for info in metadata.storage_data.values()}
    except UnsafeFileError:
        raise
    except OSError as err:
        raise UnsafeFileError(f"{path}: unreadable ({type(err).__name__}: {first_line(err)})") from None
    except Exception as err:  # noqa: BLE001 - any unpickling failure is a damaged file
        raise UnsafeFileError(f"{path}: not a readable checkpoint index ({type(err).__name__}: {first_line(err)})") from None
    outside = sorted(str(name) for name in shards if not isinstance(name, str) or os.path.basename(name) != name
                     or name in ("", ".", ".."))
    if outside:
        raise UnsafeFileError(f"{path}: refused to load: it names shard files outside its folder ({outside[0]!r}); "
                              "nothing was read")


# -- YAML: verl's configs, tool, interaction and agent-loop files ------------------------------------

MAX_YAML_VALUES = 100_000  # verl's whole trainer tree is a few thousand values; aliases may not multiply past this


class YamlBomb(yaml.YAMLError):
    """A YAML document whose aliases expand past MAX_YAML_VALUES values, or refer to themselves."""


def load_yaml(stream):
    """yaml.safe_load, except that the document's size with every alias expanded is counted on the
    node graph first (each node once), so an alias bomb is refused before anything is built."""
    loader = yaml.SafeLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        return loader.construct_document(node)
    except RecursionError:  # PyYAML composes and constructs recursively
        raise YamlBomb("nested too deeply") from None
    finally:
        loader.dispose()


def _check_expansion(root) -> None:
    """YamlBomb unless `root` with its aliases expanded has at most MAX_YAML_VALUES nodes; iterative,
    post-order, each distinct node sized once."""
    def children(node):
        if isinstance(node, yaml.SequenceNode):
            return node.value
        return [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            sizes[id(node)] = 1 + sum(sizes[id(c)] for c in children(node))
            on_path.discard(id(node))
            if sizes[id(node)] > MAX_YAML_VALUES:
                raise YamlBomb(f"its aliases expand to more than {MAX_YAML_VALUES} values (an alias bomb)")
        elif id(node) in on_path:
            raise YamlBomb(f"an alias refers to a node that contains it (line {node.start_mark.line + 1})")
        elif id(node) not in sizes:
            on_path.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in children(node))
