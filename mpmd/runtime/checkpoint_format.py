"""A checkpoint on disk, and its manifest — the one file every restore trusts, because it verifies it first.

    path/LATEST                 the committed checkpoint's name, e.g. "ckpt-3" (replaced atomically)
    path/ckpt-3/manifest.json   {"format": "mpmd-checkpoint", "version": 2, "body": {...}, "sha256": <digest of body>}
    path/ckpt-3/actor-0/        a standard orbax-checkpoint directory: {"leaf_00000": array, ...} (what actor 0 held)
    path/ckpt-3/actor-1/        ...
    path/ckpt-3/host/           the same for the tree's host leaves (numpy arrays, scalars), written by the controller

`body` holds, per leaf (in the tree's flattening order): its path (as `jax.tree_util.keystr` writes it, and as
entries a loader can rebuild containers from), its logical shape and dtype (a typed PRNG key's impl), the
part and array name it is stored as, the stored (wire) shape and dtype, the SHA-256 of its bytes, and where
it lived when saved; per part, every file with its size and SHA-256. `sha256` is the digest of the body's
canonical JSON (sorted keys, no spaces), so any edit of the manifest is caught before anything is read.

A checkpoint never depends on the mesh that wrote it: every array is stored whole (all shards gathered), so
it restores onto any number of actors, any stage placement and any device mesh per actor.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from mpmd.compiler.avals import wire_shape_dtype
from mpmd.errors import CheckpointError
from transport.protocol import ALLOWED_DTYPES

FORMAT = "mpmd-checkpoint"
VERSION = 2
MANIFEST = "manifest.json"
HOST_PART = "host"
_NAME = re.compile(r"ckpt-(\d+)")
_PART = re.compile(r"actor-\d+|host")
_HEX = re.compile(r"[0-9a-f]{64}")


def body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def path_entries(path: tuple[Any, ...]) -> list[list[Any]]:
    """A jax tree path as JSON entries: ["key", k] for a dict key, ["index", i] for a sequence position,
    ["attr", name] for a namedtuple/dataclass field, ["flat", i] for a custom node's child."""
    out: list[list[Any]] = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            key = k.key
            out.append(["key", key if isinstance(key, (str, int)) and not isinstance(key, bool) else str(key)])
        elif isinstance(k, jax.tree_util.SequenceKey):
            out.append(["index", int(k.idx)])
        elif isinstance(k, jax.tree_util.GetAttrKey):
            out.append(["attr", str(k.name)])
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            out.append(["flat", int(k.key)])
        else:
            out.append(["key", str(k)])
    return out


@dataclass(frozen=True)
class Leaf:
    """One array of a checkpoint, as the verified manifest describes it."""

    index: int
    path: str  # keystr: "[0]['w']"
    entries: list[list[Any]]
    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, or "key<fry>" for typed keys
    key_impl: str | None
    part: str  # "actor-<writer>" or "host"
    name: str  # the array's name inside the part: "leaf_00003"
    stored_shape: tuple[int, ...]
    stored_dtype: str
    sha256: str
    saved_actors: tuple[int, ...]  # where it lived (empty for a host leaf)
    saved_layout: list[Any] | None  # its PartitionSpec over the saving actors' devices (wire form), if any

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "entries": self.entries, "shape": list(self.shape), "dtype": self.dtype,
                "key_impl": self.key_impl, "part": self.part, "name": self.name, "stored_shape": list(self.stored_shape),
                "stored_dtype": self.stored_dtype, "sha256": self.sha256, "saved_actors": list(self.saved_actors),
                "saved_layout": self.saved_layout}

    @property
    def jax_dtype(self) -> Any:
        if self.key_impl:
            return jax.random.key(0, impl=self.key_impl).dtype
        return np.dtype(self.dtype)

    def expect(self) -> dict[str, Any]:
        """What an actor must find for this leaf: its stored dtype and shape, and the digest of its bytes."""
        return {"shape": list(self.stored_shape), "dtype": self.stored_dtype, "sha256": self.sha256}


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's verified manifest: its leaves, and every part's files."""

    directory: str
    leaves: list[Leaf]
    parts: dict[str, dict[str, dict[str, Any]]]  # part -> file -> {size, sha256}
    saved_by: dict[str, Any]

    def body(self) -> dict[str, Any]:
        return {"leaves": [leaf.to_json() for leaf in self.leaves], "parts": self.parts, "saved_by": self.saved_by}

    def write(self, directory: str) -> None:
        body = self.body()
        doc = {"format": FORMAT, "version": VERSION, "body": body, "sha256": body_digest(body)}
        with open(os.path.join(directory, MANIFEST), "w") as f:
            json.dump(doc, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def _bad(ckpt: str, why: str, *, file: str | None = MANIFEST, leaf: str | None = None) -> CheckpointError:
    return CheckpointError(f"checkpoint {ckpt}: {file}: {why}", checkpoint=ckpt, file=file, leaf=leaf)


def read_manifest(ckpt: str) -> Manifest:
    """Read and verify `ckpt/manifest.json`: its digest, then every field's type. Raises CheckpointError."""
    where = os.path.join(ckpt, MANIFEST)
    if os.path.islink(where):
        raise _bad(ckpt, "a symbolic link where mpmd.save wrote a file: a checkpoint is read only inside its directory")
    if not os.path.isfile(where):
        if os.path.isfile(os.path.join(ckpt, "meta.json")):
            raise _bad(ckpt, "missing; this checkpoint was written by an older mpmd (format 1, meta.json, no digests) and "
                       "cannot be verified: restore it with that version and save it again")
        raise _bad(ckpt, "missing: this is not a complete mpmd checkpoint (or its manifest was removed)")
    try:
        with open(where, "rb") as f:
            doc = json.loads(f.read())
    except (ValueError, OSError, RecursionError) as e:  # (nesting deeper than Python's stack: RecursionError)
        raise _bad(ckpt, f"unreadable or not JSON ({type(e).__name__}: {str(e)[:200]}); the file was damaged or edited") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(ckpt, f"not an mpmd checkpoint manifest (format {doc.get('format') if isinstance(doc, dict) else None!r})")
    if doc.get("version") != VERSION:
        raise _bad(ckpt, f"format version {doc.get('version')!r}; this mpmd reads version {VERSION}")
    body = doc.get("body")
    if not isinstance(body, dict) or not isinstance(doc.get("sha256"), str) or body_digest(body) != doc["sha256"]:
        raise _bad(ckpt, "its contents do not match its own digest: the manifest was edited or damaged after the save, so "
                   "nothing in this checkpoint can be trusted (restore an earlier checkpoint)")
    try:
        return _parse(ckpt, body)
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise _bad(ckpt, f"malformed ({type(e).__name__}: {str(e)[:300]})") from None


def _parse(ckpt: str, body: dict[str, Any]) -> Manifest:
    parts = body["parts"]
    if not isinstance(parts, dict):
        raise TypeError("'parts' must be a map")
    for part, files in parts.items():
        if not _PART.fullmatch(part) or not isinstance(files, dict):
            raise ValueError(f"bad part {part!r}")
        for rel, info in files.items():
            if not isinstance(rel, str) or rel.startswith("/") or ".." in rel.split("/") or not isinstance(info, dict):
                raise ValueError(f"bad file name {rel!r} in part {part}")
            if not isinstance(info.get("size"), int) or not _HEX.fullmatch(str(info.get("sha256"))):
                raise ValueError(f"bad size or digest of {part}/{rel}")
    leaves = []
    for i, m in enumerate(body["leaves"]):
        leaf = Leaf(i, str(m["path"]), list(m["entries"]), tuple(int(d) for d in m["shape"]), str(m["dtype"]), m["key_impl"],
                    str(m["part"]), str(m["name"]), tuple(int(d) for d in m["stored_shape"]), str(m["stored_dtype"]),
                    str(m["sha256"]), tuple(int(a) for a in m["saved_actors"]), m["saved_layout"])
        if leaf.part not in parts or not leaf.name.isidentifier() or not _HEX.fullmatch(leaf.sha256):
            raise ValueError(f"leaf {leaf.path}: bad part, name or digest")
        if leaf.stored_dtype not in ALLOWED_DTYPES:  # (numbers only: np.dtype('object') read an empty leaf of objects; a probe)
            raise ValueError(f"leaf {leaf.path}: stored dtype {leaf.stored_dtype[:40]!r} is not one mpmd writes")
        stored_dtype = np.dtype(leaf.stored_dtype)
        for shape in (leaf.shape, leaf.stored_shape):  # (an array numpy can make; a zero-size one is read from here alone)
            if len(shape) > 32 or not all(0 <= d < 1 << 48 for d in shape):
                raise ValueError(f"leaf {leaf.path}: shape {list(shape)[:8]} is not one an array can have")
        if leaf.key_impl is not None:
            if not isinstance(leaf.key_impl, str):
                raise ValueError(f"leaf {leaf.path}: bad key_impl {leaf.key_impl!r}")
            jax.random.key(0, impl=leaf.key_impl)  # a PRNG implementation this jax knows, or ValueError
        want_shape, want_dtype = wire_shape_dtype(leaf.shape, leaf.jax_dtype)
        if tuple(want_shape) != leaf.stored_shape or want_dtype.name != stored_dtype.name:
            raise ValueError(f"leaf {leaf.path}: stored as {leaf.stored_dtype}{list(leaf.stored_shape)}, but a {leaf.dtype}"
                             f"{list(leaf.shape)} array is stored as {want_dtype.name}{list(want_shape)}")
        if leaf.part == HOST_PART and leaf.saved_actors:
            raise ValueError(f"leaf {leaf.path}: a host leaf names actors {list(leaf.saved_actors)}")
        if leaf.part != HOST_PART and (not leaf.saved_actors or min(leaf.saved_actors) < 0
                                       or len(set(leaf.saved_actors)) != len(leaf.saved_actors)):
            raise ValueError(f"leaf {leaf.path}: saved_actors {list(leaf.saved_actors)} must name distinct actors >= 0")
        leaves.append(leaf)
    _check_entries(leaves)
    saved_by = body["saved_by"]
    if not isinstance(saved_by, dict):
        raise TypeError("'saved_by' must be a map")
    return Manifest(ckpt, leaves, parts, saved_by)


_ENTRY_KINDS = {"key": (str, int), "index": (int,), "attr": (str,), "flat": (int,)}


MAX_DEPTH = 200  # levels of a saved pytree (a crafted manifest of 5000 made load raise RecursionError; a probe)


def _check_entries(leaves: list[Leaf]) -> None:
    """Every leaf's path entries are `path_entries` pairs, no two leaves at one path and none inside another's
    (a tree `load` can rebuild): only a lone leaf sits at the root."""
    seen: set[tuple[Any, ...]] = set()
    for leaf in leaves:
        if len(leaf.entries) > MAX_DEPTH:  # (rebuilding the tree recurses per level: Python's stack, a RecursionError)
            raise ValueError(f"leaf {str(leaf.path)[:80]} sits {len(leaf.entries)} levels deep, more than the {MAX_DEPTH} a "
                             "checkpoint's tree may have")
        for e in leaf.entries:
            if not (isinstance(e, list) and len(e) == 2 and e[0] in _ENTRY_KINDS and isinstance(e[1], _ENTRY_KINDS[e[0]])
                    and not isinstance(e[1], bool)):
                raise ValueError(f"leaf {leaf.path}: bad path entry {e!r}")
        seen.add(tuple(tuple(e) for e in leaf.entries))
    if len(seen) != len(leaves):
        raise ValueError("two leaves at one tree path")
    for path in seen:
        for k in range(len(path)):
            if path[:k] in seen:
                raise ValueError(f"a leaf at {list(path[:k])} holds another leaf at {list(path)}")


def _small_text(path: str, limit: int = 4096) -> str:
    """The text of a small regular file, read without following a link or waiting on a FIFO (OSError), and
    ValueError when it is over `limit` bytes or not UTF-8."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        raw = f.read(limit + 1)
    if len(raw) > limit:
        raise ValueError(f"more than {limit} bytes")
    return raw.decode("utf-8").strip()  # (UnicodeDecodeError is a ValueError)


def _orbax_made(path: str) -> bool:
    """Whether `path` looks written by orbax itself: its metadata files, or a CheckpointManager's numbered steps."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    marks = {"_CHECKPOINT_METADATA", "_METADATA", "_sharding", "manifest.ocdbt"}
    return bool(marks & set(names)) or any(n.isdigit() and os.path.isfile(os.path.join(path, n, "_CHECKPOINT_METADATA"))
                                           for n in names[:1000])


def committed(path: str) -> str:
    """The directory of the checkpoint `path/LATEST` names, or `path` itself when it is one committed checkpoint
    (`path/ckpt-<n>`, what mpmd.save returned: an older one kept by `keep=`). Raises CheckpointError when there
    is none."""
    latest = os.path.join(path, "LATEST")
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is a file, not a checkpoint directory (give the directory mpmd.save wrote)", checkpoint=path)
    if _NAME.fullmatch(os.path.basename(os.path.normpath(path))) and not os.path.lexists(latest):
        if os.path.islink(os.path.normpath(path)):  # (as one that LATEST names: read only where it is)
            raise CheckpointError(f"{path!r} is a symbolic link; give the checkpoint's own directory", checkpoint=path)
        if os.path.isfile(os.path.join(path, MANIFEST)):  # (committed: a save renames ckpt-<n>.tmp once all is written)
            return os.path.normpath(path)
    try:
        name = _small_text(latest)
    except FileNotFoundError:
        if _orbax_made(path):  # (said as the generic "was mpmd.save called there?": a probe)
            raise CheckpointError(f"{path!r} is a plain orbax-checkpoint directory, not one mpmd.save wrote (no LATEST, no "
                                  f"{MANIFEST} with the digests mpmd checks): read it with orbax (e.g. "
                                  "ocp.StandardCheckpointer().restore(path)) and pass the arrays to the step, or mpmd.save "
                                  "them once", checkpoint=path, file="LATEST") from None
        raise CheckpointError(f"no committed checkpoint in {path!r} (no LATEST file, no {MANIFEST}); was mpmd.save called there? "
                              "Give the directory passed to mpmd.save, or one of its ckpt-<n>", checkpoint=path, file="LATEST") from None
    except (OSError, ValueError) as e:  # (a FIFO waited forever, /dev/zero grew without end, a directory, not text)
        raise CheckpointError(f"{latest} cannot be read as the small text file mpmd.save writes ({e}); the directory was "
                              "damaged or edited", checkpoint=path, file="LATEST") from None
    if not _NAME.fullmatch(name):
        raise CheckpointError(f"{latest} names {name[:80]!r}, not a checkpoint (ckpt-<n>); the file was damaged or edited",
                              checkpoint=path, file="LATEST")
    ckpt = os.path.join(path, name)
    if os.path.islink(ckpt):  # (a checkpoint is read only inside the directory it was given: a link leads outside)
        raise CheckpointError(f"{ckpt} is a symbolic link; mpmd.save writes each checkpoint as a directory of its own, and "
                              f"one is read only inside {path!r}", checkpoint=ckpt, file="LATEST")
    if not os.path.isdir(ckpt):
        raise CheckpointError(f"{latest} names {name!r}, but {ckpt} is missing; restore an older one by giving its own "
                              "directory (path/ckpt-<n>, as mpmd.save returned it), or save again", checkpoint=ckpt, file="LATEST")
    return ckpt


def check_parts(m: Manifest) -> None:
    """Refuse a checkpoint whose directory holds a part or file the manifest does not list, or lacks one (names
    and sizes; the bytes are verified by whoever reads them)."""
    from transport.checkpoint_parts import check_listing

    for entry in sorted(os.listdir(m.directory)):
        if entry != MANIFEST and entry not in m.parts:
            raise _bad(m.directory, "an extra file or directory that the manifest does not list", file=entry)
    for part, files in sorted(m.parts.items()):
        bad = check_listing(os.path.join(m.directory, part), files)
        if bad is not None:
            held = [x.path for x in m.leaves if x.part == part]
            writer = int(part.split("-")[1]) if part != HOST_PART else None
            who = f"written by actor {writer}" if writer is not None else "the host leaves"
            err = _bad(m.directory, f"{bad[1]} (part {part}, {who}, holding leaves {', '.join(held)[:300]})",
                       file=f"{part}/{bad[0]}" if bad[0] != "." else part, leaf=held[0] if held else None)
            err.actor = writer
            raise err


def checkpoint_number(name: str) -> int | None:
    """n for "ckpt-<n>" or "ckpt-<n>.tmp"; None for anything else."""
    match = _NAME.fullmatch(name.removesuffix(".tmp"))
    return int(match.group(1)) if match else None


__all__ = ["HOST_PART", "MANIFEST", "Leaf", "Manifest", "check_parts", "checkpoint_number", "committed", "path_entries",
           "read_manifest"]
