"""Entry point of the `hindsight` command installed by pip (the logic is Rust)."""

from __future__ import annotations

import sys

from hindsight import _native


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "replay":
        # Replay runs Python workers: it lives in the Python package.
        from hindsight.replay import main as replay_main

        return replay_main(argv[1:])
    args = ["hindsight", *argv]
    code, out, err = _native.run_cli(args)
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
