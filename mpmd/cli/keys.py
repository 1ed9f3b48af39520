"""`mpmd keys`: make the CURVE key pairs daemons and controllers authenticate with.

    mpmd keys generate ~/.mpmd/keys                 # writes mpmd.key (public) and mpmd.key_secret (mode 600)
    mpmd keys generate ~/.mpmd/keys --name node3    # another pair beside it

One pair used everywhere is the simplest setup: copy the directory to every node, start each daemon with
``--server-key DIR/mpmd.key_secret --authorized-keys DIR`` and connect with ``RemoteMesh.connect(...,
keys=DIR)``. For separate identities, generate a pair per controller, put the controllers' ``*.key`` files
in the daemons' --authorized-keys directory, and pass `transport.auth.ClientKeys.load(...)` as `keys`.
"""
# (The `mpmd` command registers this with `add_subcommand(subparsers)`; `main(argv)` runs it alone.)

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from transport.auth import AuthKeyError, check_safe_path, generate_key_files


def add_subcommand(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``keys`` (with its ``generate`` action) to the `mpmd` command's subparsers."""
    keys = subparsers.add_parser("keys", help="make CURVE key pairs for daemons and controllers",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = keys.add_subparsers(dest="keys_action", metavar="ACTION", required=True)
    gen = actions.add_parser("generate", help="write a new key pair into DIR")
    gen.add_argument("dir", metavar="DIR", type=_directory, help="directory for the key files (created if missing)")
    gen.add_argument("--name", default="mpmd", help="file name of the pair: NAME.key and NAME.key_secret (default: mpmd)")
    gen.add_argument("--force", action="store_true", help="overwrite an existing pair of that name")
    keys.set_defaults(run=run)
    return keys


def _directory(text: str) -> str:
    """A directory name, not an empty one (`keys generate ""` wrote the pair into the working directory; a probe)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("takes a directory name (\".\" for this one), got an empty one")
    return text


def run(args: argparse.Namespace) -> int:
    """Carry out a parsed ``mpmd keys ...`` command; returns the exit status."""
    try:
        # (a daemon refuses keys that other users could have replaced: say so now, of a directory yet to be made too)
        made = Path(args.dir).expanduser().absolute()
        if made.exists() and not made.is_dir():  # (a bare "[Errno 17] File exists"; a probe)
            raise AuthKeyError(f"{args.dir} is a file, not a directory; name the directory the key pair goes in")
        if made.is_dir():
            check_safe_path(made, "key directory")
        else:
            check_safe_path(next(p for p in made.parents if p.is_dir()), f"directory that would hold the key directory {made}")
        public, secret = generate_key_files(args.dir, args.name, overwrite=args.force)
    except AuthKeyError as e:
        print(f"mpmd keys generate: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # (a bare "[Errno 2] No such file or directory" for /proc/keys_here: a probe)
        print(f"mpmd keys generate: cannot write a key pair in {args.dir}: {e.strerror or e}"
              + (f" ({e.filename})" if e.filename and str(e.filename) != str(args.dir) else ""), file=sys.stderr)
        return 1
    print(f"wrote {public} (public: give it to whoever must admit this key)")
    print(f"wrote {secret} (secret, mode 600: keep it on the machines that use this identity)")
    if args.name == "mpmd":
        print(f"start daemons with: mpmd-actor --server-key {secret} --authorized-keys {public.parent} --listen tcp://0.0.0.0:5555")
        print("                    (--listen: the address other nodes reach it at; without it a daemon binds 127.0.0.1 only)")
        print(f"connect with:       mpmd.RemoteMesh.connect([...], keys={str(public.parent)!r})")
    else:  # another identity: a controller's own pair, which daemons admit by its public key
        print(f"admit it: daemons admit the *.key files of their --authorized-keys directory, read at start (when that "
              f"is {public.parent}, {public.name} is there already: restart them)")
        print(f"connect with: mpmd.RemoteMesh.connect([...], keys=transport.auth.ClientKeys.load({str(secret)!r}, "
              "<the daemons' public server key file>))")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpmd")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
