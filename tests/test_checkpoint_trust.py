"""A checkpoint is verified before anything in it is believed: a flipped bit in any file, any edit of the
manifest, a missing or extra file is `mpmd.CheckpointError` naming the checkpoint, actor, file and leaf (real
daemons; the saved values are the reference)."""

import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest

import mpmd

SAVED = {"w": np.arange(256 * 64, dtype=np.float32).reshape(256, 64) / 7, "b": np.linspace(-1, 1, 64).astype(np.float32)}


@pytest.fixture(scope="module")
def saved(mesh2, tmp_path_factory):
    """A checkpoint of arrays on both actors (one replicated) and host leaves, a typed key among them."""
    path = tmp_path_factory.mktemp("trusted") / "ckpt"
    tree = {"w": mesh2.actor(0).put(SAVED["w"]), "b": mesh2.put_replicated(SAVED["b"], [0, 1]),
            "v": mesh2.actor(1).put(SAVED["w"][:8] * 3), "step": np.int32(11), "key": jax.random.key(5)}
    ckpt = mpmd.save(str(path), tree)
    return path, os.path.basename(ckpt), tree


@pytest.fixture
def copy(saved, tmp_path):
    path, name, tree = saved
    dst = tmp_path / "ckpt"
    shutil.copytree(path, dst)
    return dst, dst / name, tree


def like(tree):
    return {k: (v if not isinstance(v, mpmd.RemoteArray) else jax.ShapeDtypeStruct(v.shape, v.dtype)) for k, v in tree.items()}


def files_of(ckpt):
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")


def test_an_untouched_checkpoint_restores_the_saved_values_and_loads_without_a_mesh(mesh2, copy):
    path, _, tree = copy
    got = mpmd.restore(str(path), mesh2, like=like(tree))
    np.testing.assert_array_equal(got["w"].to_numpy(), SAVED["w"])
    np.testing.assert_array_equal(got["v"].to_numpy(), SAVED["w"][:8] * 3)
    assert got["b"].actors == [0, 1] and got["w"].actors == [0] and got["v"].actors == [1]
    host = mpmd.load(str(path))
    assert set(host) == {"w", "b", "v", "step", "key"} and int(host["step"]) == 11
    np.testing.assert_array_equal(host["b"], SAVED["b"])
    np.testing.assert_array_equal(jax.random.key_data(host["key"]), jax.random.key_data(tree["key"]))


def test_a_flipped_bit_in_any_file_of_any_part_is_a_checkpoint_error_naming_the_file(mesh2, copy):
    path, ckpt, tree = copy
    files = files_of(ckpt)
    assert any(f.startswith("actor-0/") for f in files) and any(f.startswith("host/") for f in files)
    for rel in files:
        p = ckpt / rel
        data = bytearray(p.read_bytes())
        if not data:
            continue
        original = bytes(data)
        data[len(data) // 2] ^= 0x10
        p.write_bytes(bytes(data))
        with pytest.raises(mpmd.CheckpointError) as e:
            mpmd.restore(str(path), mesh2, like=like(tree))
        assert e.value.file == rel, (rel, str(e.value))
        assert e.value.checkpoint == str(ckpt) and str(ckpt) in str(e.value)
        if rel.startswith("actor-"):
            assert e.value.actor in (0, 1) and f"actor {e.value.actor}" in str(e.value)
            assert e.value.leaf is not None or "holds" in str(e.value)
        with pytest.raises(mpmd.CheckpointError):
            mpmd.load(str(path))
        p.write_bytes(original)
    mpmd.restore(str(path), mesh2, like=like(tree))  # all restored: it reads again


def _edit(ckpt, change, redigest=False):
    doc = json.loads((ckpt / "manifest.json").read_text())
    change(doc)
    if redigest:  # a forger who also recomputes the manifest's own digest: the actors' checks still catch it
        doc["sha256"] = hashlib.sha256(json.dumps(doc["body"], sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (ckpt / "manifest.json").write_text(json.dumps(doc))


def _leaf(doc, path):
    return next(x for x in doc["body"]["leaves"] if x["path"] == path)


EDITS = {
    "dtype": lambda d: _leaf(d, "['w']").update(dtype="int32", stored_dtype="int32"),
    "shape": lambda d: _leaf(d, "['w']").update(shape=[128, 128], stored_shape=[128, 128]),
    "leaf_digest": lambda d: _leaf(d, "['v']").update(sha256="0" * 64),
    "file_digest": lambda d: next(iter(d["body"]["parts"]["actor-1"].values())).update(sha256="f" * 64),
    "file_size": lambda d: next(iter(d["body"]["parts"]["actor-0"].values())).update(size=1),
    "leaf_part": lambda d: _leaf(d, "['w']").update(part="actor-1"),
    "dropped_leaf": lambda d: d["body"]["leaves"].pop(),
    "path": lambda d: _leaf(d, "['w']").update(path="['z']"),
}


@pytest.mark.parametrize("redigest", [False, True], ids=["plain_edit", "digest_recomputed"])
def test_each_edit_of_the_manifest_is_a_checkpoint_error(mesh2, copy, redigest):
    path, ckpt, tree = copy
    original = (ckpt / "manifest.json").read_text()
    for name, change in EDITS.items():
        if redigest and name == "leaf_digest":  # self-consistent, and the bytes are the saved ones: nothing to refuse
            continue
        _edit(ckpt, change, redigest)
        with pytest.raises(mpmd.CheckpointError) as e:
            got = mpmd.restore(str(path), mesh2, like=like(tree))
            got["w"].to_numpy()  # (never reached: nothing is handed over unverified)
        assert str(ckpt) in str(e.value), (name, str(e.value))
        if not redigest:
            assert e.value.file == "manifest.json" and "digest" in str(e.value), (name, str(e.value))
        if not redigest or name not in ("path", "dropped_leaf"):  # a consistent forged manifest that only renames or
            with pytest.raises(mpmd.CheckpointError):           # drops a leaf is caught by `like`, not by the bytes
                mpmd.load(str(path))
        (ckpt / "manifest.json").write_text(original)
    (ckpt / "manifest.json").write_text("{not json")
    with pytest.raises(mpmd.CheckpointError, match="manifest.json"):
        mpmd.restore(str(path), mesh2, like=like(tree))


def test_a_missing_or_extra_file_part_or_checkpoint_is_a_checkpoint_error(mesh2, copy):
    path, ckpt, tree = copy
    victim = next(f for f in files_of(ckpt) if f.startswith("actor-1/"))
    data = (ckpt / victim).read_bytes()
    (ckpt / victim).unlink()
    with pytest.raises(mpmd.CheckpointError, match="missing") as e:
        mpmd.restore(str(path), mesh2, like=like(tree))
    assert e.value.file == victim and "['v']" in str(e.value)
    (ckpt / victim).write_bytes(data)
    (ckpt / "actor-0" / "extra.bin").write_bytes(b"x")
    with pytest.raises(mpmd.CheckpointError, match="extra") as e:
        mpmd.restore(str(path), mesh2, like=like(tree))
    assert e.value.file == "actor-0/extra.bin"
    (ckpt / "actor-0" / "extra.bin").unlink()
    shutil.rmtree(ckpt / "host")
    with pytest.raises(mpmd.CheckpointError, match="host"):
        mpmd.restore(str(path), mesh2, like=like(tree))
    shutil.rmtree(ckpt)
    with pytest.raises(mpmd.CheckpointError, match="LATEST names") as e:
        mpmd.restore(str(path), mesh2, like=like(tree))
    (path / "LATEST").write_text("../../etc")
    with pytest.raises(mpmd.CheckpointError, match="not a checkpoint"):
        mpmd.load(str(path))


def test_a_like_tree_of_another_dtype_is_an_error_not_a_silent_cast(mesh2, copy):
    path, _, tree = copy
    wrong = like(tree)
    wrong["w"] = np.zeros((256, 64), np.float16)
    with pytest.raises(mpmd.CheckpointError, match=r"\['w'\] was saved as float32, `like` has float16"):
        mpmd.restore(str(path), mesh2, like=wrong)
    with pytest.raises(mpmd.CheckpointError, match="float16"):
        mpmd.load(str(path), like=wrong)


def test_a_disk_too_full_for_latest_commits_nothing_and_latest_keeps_naming_the_previous_checkpoint(tmp_path, monkeypatch):
    """The checkpoint was renamed into place before LATEST's new contents were written: a disk with room for the
    checkpoint but not for them left it committed, LATEST naming the one before, and a restore of the path read that
    older state without a word (a probe, on a 400 KiB tmpfs). Now LATEST's contents are written first: a failure to
    write them commits nothing, and the path reads as before. (The full disk is a failing fsync of LATEST.tmp here:
    mounting a small file system needs root.)"""
    import errno

    path = str(tmp_path / "c")
    mpmd.save(path, {"w": np.zeros(4, np.float32)}, keep=1)
    real = os.fsync

    def full(fd):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("LATEST.tmp"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd)

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(mpmd.CheckpointError, match=r"could not write here .*No space left on device.*nothing was committed"):
        mpmd.save(path, {"w": np.ones(4, np.float32)}, keep=1)
    assert sorted(os.listdir(path)) == ["LATEST", "ckpt-1"]
    np.testing.assert_array_equal(mpmd.load(path)["w"], np.zeros(4, np.float32))
    monkeypatch.setattr(os, "fsync", real)
    where = mpmd.save(path, {"w": np.full(4, 2, np.float32)}, keep=1)
    assert sorted(os.listdir(path)) == ["LATEST", os.path.basename(where)]
    np.testing.assert_array_equal(mpmd.load(path)["w"], np.full(4, 2, np.float32))


def test_a_plain_orbax_checkpoint_is_named_as_one_with_what_to_do(tmp_path):
    """A StandardCheckpointer directory or a CheckpointManager's got the generic 'was mpmd.save called there?' (a
    probe): it is said to be orbax's own, to be read with orbax."""
    import orbax.checkpoint as ocp

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(str(tmp_path / "plain"), {"w": np.ones(3, np.float32)})
    ckpt.wait_until_finished()
    manager = ocp.CheckpointManager(str(tmp_path / "managed"))
    manager.save(3, args=ocp.args.StandardSave({"w": np.ones(3, np.float32)}))
    manager.wait_until_finished()
    for where in ("plain", "managed", "managed/3"):
        with pytest.raises(mpmd.CheckpointError, match=r"is a plain orbax-checkpoint directory.*StandardCheckpointer"):
            mpmd.load(str(tmp_path / where))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(mpmd.CheckpointError, match="was mpmd.save called there"):
        mpmd.load(str(tmp_path / "empty"))


def test_an_interrupted_saves_temporary_directory_is_removed_by_the_next_save(mesh2, tmp_path):
    path = tmp_path / "ckpt"
    mpmd.save(str(path), {"a": mesh2.actor(0).put(np.ones(3, np.float32))})
    (path / "ckpt-2.tmp" / "actor-0").mkdir(parents=True)  # what a save killed midway leaves
    (path / "ckpt-2.tmp" / "actor-0" / "half").write_bytes(b"\0" * 10)
    committed = mpmd.save(str(path), {"a": mesh2.actor(1).put(np.full(3, 2.0, np.float32))})
    assert sorted(os.listdir(path)) == ["LATEST", os.path.basename(committed)]
    np.testing.assert_array_equal(mpmd.load(str(path))["a"], np.full(3, 2.0))


def test_a_number_handed_to_an_abandoned_save_is_not_handed_out_again(mesh2, tmp_path):
    """A save the controller abandoned (its actor stopped by SIGSTOP, the save failed, the .tmp removed) may still
    be written by that actor once it is resumed: the next save took the same number and failed, "Destination
    .../ckpt-2.tmp/actor-1 already exists" (a probe). Numbers are never reused within a process."""
    from mpmd.runtime import checkpoint

    path = tmp_path / "ckpt"
    mpmd.save(str(path), {"a": mesh2.actor(0).put(np.ones(3, np.float32))})
    name, tmp = checkpoint._start(str(path))  # a save that starts, and is abandoned: its .tmp goes
    assert name == "ckpt-2"
    checkpoint._done_saving(tmp)
    shutil.rmtree(tmp)
    committed = mpmd.save(str(path), {"a": mesh2.actor(1).put(np.full(3, 2.0, np.float32))})
    assert os.path.basename(committed) == "ckpt-3"
    np.testing.assert_array_equal(mpmd.load(str(path))["a"], np.full(3, 2.0))


FORGED = {  # each with the manifest's digest recomputed: the manifest's own checks refuse it before any file is read
    "negative_actor": lambda d: _leaf(d, "['w']").update(saved_actors=[-1]),
    "no_actor": lambda d: _leaf(d, "['w']").update(saved_actors=[]),
    "host_leaf_on_an_actor": lambda d: _leaf(d, "['step']").update(saved_actors=[0]),
    "unknown_key_impl": lambda d: _leaf(d, "['key']").update(key_impl="bogus"),
    "entry_not_a_pair": lambda d: _leaf(d, "['w']").update(entries=[["key"]]),
    "entry_kind": lambda d: _leaf(d, "['w']").update(entries=[["nope", "w"]]),
    "leaf_at_the_root": lambda d: _leaf(d, "['w']").update(entries=[]),
    "two_leaves_one_path": lambda d: _leaf(d, "['w']").update(entries=[["key", "b"]]),
    "leaf_inside_a_leaf": lambda d: _leaf(d, "['w']").update(entries=[["key", "b"], ["index", 0]]),
    # shapes no array can have, or a stored shape unlike the shape (a zero-size one is read from the manifest alone)
    "negative_dimension": lambda d: _leaf(d, "['w']").update(shape=[0, -5], stored_shape=[0, -5]),
    "65_dimensions": lambda d: _leaf(d, "['w']").update(shape=[0] + [1] * 64, stored_shape=[0] + [1] * 64),
    "huge_dimension": lambda d: _leaf(d, "['w']").update(shape=[0, 2**63], stored_shape=[0, 2**63]),
    "stored_unlike_shape": lambda d: _leaf(d, "['w']").update(stored_shape=[0]),
    "stored_unlike_dtype": lambda d: _leaf(d, "['w']").update(stored_dtype="int32"),
    # numpy knows 'object', and an empty leaf of it was read from the manifest alone (a probe)
    "object_dtype": lambda d: _leaf(d, "['w']").update(shape=[0, 3], stored_shape=[0, 3], dtype="object", stored_dtype="object"),
    # a tree 5000 levels deep: rebuilding it raised RecursionError (a probe)
    "nested_5000_deep": lambda d: _leaf(d, "['w']").update(entries=[["key", "a"]] * 5000),
}


@pytest.mark.parametrize("name", list(FORGED))
def test_a_forged_manifest_with_its_digest_recomputed_is_a_checkpoint_error_not_a_crash(mesh2, copy, name):
    path, ckpt, tree = copy
    _edit(ckpt, FORGED[name], redigest=True)
    with pytest.raises(mpmd.CheckpointError, match="manifest.json: malformed"):
        mpmd.load(str(path))
    with pytest.raises(mpmd.CheckpointError, match="manifest.json: malformed"):
        mpmd.restore(str(path), mesh2, like=like(tree))


@pytest.mark.parametrize("value, kind", [(np.array(["run", "7"]), "str"), (np.array([{"a": 1}], dtype=object), "object")],
                         ids=["array of strings", "object array"])
def test_a_non_numeric_array_leaf_is_refused_naming_it_before_anything_is_written(tmp_path, value, kind):
    """An array of strings or objects has no numbers to write (a plain `str` leaf is static, as in a step: not saved)."""
    with pytest.raises(mpmd.CheckpointError, match=rf"leaf \['meta'\] is a ndarray \({kind}|<U.*arrays and numbers"):
        mpmd.save(str(tmp_path / "c"), {"w": np.ones(3, np.float32), "meta": value})
    assert not (tmp_path / "c").exists() or not any(p.name.startswith("ckpt") for p in (tmp_path / "c").iterdir())


def test_list_positions_a_forged_manifest_makes_up_cost_no_memory_when_loading_without_like(copy):
    """Leaf paths naming list positions near 2**20 made `load` without `like` build lists of a million slots per
    leaf (8 MB each, from a few bytes of manifest): past a budget proportional to the arrays it is an error."""
    path, ckpt, tree = copy
    _edit(ckpt, lambda d: [leaf.update(entries=[["key", leaf["path"][2:-2]], ["index", 10**9]]) for leaf in d["body"]["leaves"]],
          redigest=True)
    with pytest.raises(mpmd.CheckpointError, match="list positions up to 1000000000 for 5 arrays; load it with like="):
        mpmd.load(str(path))


def test_special_files_links_and_deep_json_in_a_checkpoint_are_refused_never_followed_or_waited_on(mesh2, copy, tmp_path):
    """A crafted checkpoint directory (a probe): a FIFO listed as a part's file, or as LATEST, made load wait
    forever; LATEST linked to /dev/zero grew without end; a checkpoint, part or manifest linked to a directory
    elsewhere was read from there; a manifest nested deeper than Python's stack, a LATEST not UTF-8 or a directory
    raised raw Python errors. Each is a CheckpointError naming it, at once."""
    path, ckpt, tree = copy
    outside = tmp_path / "outside"
    shutil.copytree(ckpt, outside)

    def fresh():
        shutil.rmtree(path)
        shutil.copytree(tmp_path / "pristine", path)

    shutil.copytree(path, tmp_path / "pristine")
    cases = {
        "LATEST is a FIFO": (lambda: (os.remove(path / "LATEST"), os.mkfifo(path / "LATEST")), r"LATEST cannot be read"),
        "LATEST links to /dev/zero": (lambda: (os.remove(path / "LATEST"), os.symlink("/dev/zero", path / "LATEST")),
                                      r"LATEST cannot be read"),
        "LATEST is a directory": (lambda: (os.remove(path / "LATEST"), os.mkdir(path / "LATEST")), r"LATEST cannot be read"),
        "LATEST is not UTF-8": (lambda: (path / "LATEST").write_bytes(ckpt.name.encode() + b"\xff"), r"LATEST cannot be read"),
        "the checkpoint links outside": (lambda: (shutil.rmtree(ckpt), os.symlink(outside, ckpt)), r"is a symbolic link"),
        "a part links outside": (lambda: (shutil.rmtree(ckpt / "host"), os.symlink(outside / "host", ckpt / "host")),
                                 r"host.*a symbolic link where the checkpoint wrote a directory"),
        "the manifest links outside": (lambda: (os.remove(ckpt / "manifest.json"),
                                                os.symlink(outside / "manifest.json", ckpt / "manifest.json")),
                                       r"manifest.json: a symbolic link"),
        "the manifest nests too deep": (lambda: (ckpt / "manifest.json").write_text("[" * 200_000 + "]" * 200_000),
                                        r"manifest.json: unreadable or not JSON \(RecursionError"),
    }
    for name, (damage, said) in cases.items():
        fresh()
        damage()
        for read in (lambda: mpmd.load(str(path)), lambda: mpmd.restore(str(path), mesh2, like=like(tree))):
            with pytest.raises(mpmd.CheckpointError, match=said):
                read()
    # a FIFO among a part's files, listed in a manifest whose digest is recomputed: refused by its kind, not opened
    fresh()
    first = next(p for p in (ckpt / "host").rglob("*") if p.is_file())
    os.remove(first)
    os.mkfifo(first)
    rel = str(first.relative_to(ckpt / "host"))
    _edit(ckpt, lambda d: d["body"]["parts"]["host"][rel].update(size=0, sha256=hashlib.sha256(b"").hexdigest()), redigest=True)
    with pytest.raises(mpmd.CheckpointError, match=r"not a regular file \(a FIFO"):
        mpmd.load(str(path))


def test_a_damaged_parts_leaves_are_named_whole_then_counted():
    """The message listing a damaged part's leaves was cut at 200 characters, mid-path ("... [1][1][2].co)"; a probe):
    whole paths, then how many more."""
    from mpmd.runtime.checkpoint import _some

    paths = [f"[{i}][1][2].count" for i in range(40)]
    said = _some(paths)
    listed, more = said.split(" ... ")
    assert listed.split(", ") == paths[: len(listed.split(", "))] and more == f"({40 - len(listed.split(', '))} more)"
    assert len(listed) <= 200 and _some(["a", "b"]) == "a, b" and _some(["x" * 300]) == "x" * 300
