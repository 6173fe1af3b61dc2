"""Entry point of the `hindsight` command installed by pip (the logic is Rust)."""

from __future__ import annotations

import sys

from hindsight import _native

# Options of the Rust command that may come before the subcommand, and
# whether they take a value.
_GLOBAL_OPTIONS = {"--home": True, "--store": True, "-s": True}


def _split_global(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """({option: value} given before the subcommand, the subcommand and the rest)."""
    options: dict[str, str] = {}
    i = 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name not in _GLOBAL_OPTIONS:
            break
        if not eq and i + 1 < len(argv):
            value = argv[i + 1]
            i += 1
        options[name] = value
        i += 1
    return options, argv[i:]


def _port(text: str) -> int:
    """`--port N`: a TCP port."""
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"{n} is not a port number (0 to 65535)")
    return n


def _data_dispatcher(argv: list[str]) -> int:
    """`hindsight data dispatcher`: the input service's dispatcher (Rust), here until Ctrl-C or SIGTERM."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="hindsight data dispatcher", description=_data_dispatcher.__doc__)
    p.add_argument("--journal", required=True, help="directory of its journal, on the dispatcher's local disk")
    p.add_argument("--port", type=_port, default=50051)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 for workers on other machines)",
    )
    p.add_argument("--heartbeat-timeout", type=float, default=1.0, help="seconds of silence before a worker is dead")
    a = p.parse_args(argv)

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        _native.run_data_dispatcher(a.journal, bind=f"{a.host}:{a.port}", heartbeat_timeout=a.heartbeat_timeout)
    except (KeyboardInterrupt, SystemExit):
        pass
    return 0


def _data_token(argv: list[str]) -> int:
    """`hindsight data token`: a job token for the trainers of one dataset's
    jobs, derived from the service's token (from --journal's token file, or
    $HINDSIGHT_DATA_TOKEN / $HINDSIGHT_DATA_TOKEN_FILE). With it a trainer
    reads its dataset's jobs and can do nothing else: not register a worker,
    list the service, or touch another dataset's job."""
    import argparse

    p = argparse.ArgumentParser(prog="hindsight data token", description=_data_token.__doc__)
    p.add_argument("--dataset", required=True, help="the dataset factory the jobs name (module.function)")
    p.add_argument("--journal", help="the dispatcher's journal directory (its token file)")
    a = p.parse_args(argv)
    sys.stdout.write(_native.data_job_token(a.dataset, a.journal) + "\n")
    return 0


def _record(argv: list[str]) -> int:
    """`hindsight record [--explain] SCRIPT [ARGS...]`: run a training script
    (the same as `python SCRIPT ARGS`); with --explain, only say what its
    checkpoints would hold and why, recording nothing."""
    import os
    import subprocess
    import tempfile

    explain = bool(argv) and argv[0] == "--explain"
    rest = argv[1:] if explain else argv
    if not rest or rest[0] in ("-h", "--help"):
        sys.stdout.write("usage: hindsight record [--explain] SCRIPT [ARGS...]\n" + (_record.__doc__ or "") + "\n")
        return 0 if rest else 2
    if rest[0].endswith(".ipynb"):
        # Python would run the notebook's JSON; a kernel records it (hindsight._run.jupyter).
        sys.stderr.write(
            f"hindsight record: {rest[0]} is a notebook: run it in Jupyter, where the hs.* calls in its cells "
            "record it (or `jupyter nbconvert --to script` it and record the script)\n"
        )
        return 2
    if not explain:
        return subprocess.call([sys.executable, *rest])
    with tempfile.TemporaryDirectory(prefix="hindsight-explain-") as home:
        from hindsight import _settings

        env = {**os.environ, _settings.EXPLAIN: "1", _settings.HOME: home, _settings.RESUME: "0"}
        return subprocess.call([sys.executable, *rest], env=env)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    options, rest = _split_global(argv)
    if rest and rest[0] == "replay":
        # Replay runs Python workers: it lives in the Python package. It
        # takes --home like every subcommand, before or after its name.
        from hindsight.replay import main as replay_main

        if "--store" in options or "-s" in options:
            sys.stderr.write("hindsight replay: --store is ignored (a run replays from the store it recorded)\n")
        home = ["--home", options["--home"]] if "--home" in options else []
        return replay_main([*rest[1:], *home])
    if rest and rest[0] in ("plot", "export"):
        # matplotlib and TensorBoard's writer are Python libraries.
        from hindsight._export import main as export_main

        return export_main(rest[0], rest[1:], options.get("--home"))
    if rest and rest[0] == "record":
        return _record(rest[1:])
    if rest[:1] == ["data"] and rest[1:2] not in (["worker"], ["dispatcher"], ["token"]):
        sys.stdout.write(
            "usage: hindsight data {dispatcher,worker,token} [ARGS...]\n\n"
            "  dispatcher  the input service's dispatcher (hindsight data dispatcher --help)\n"
            "  worker      serve a dataset for a dispatcher (hindsight data worker --help)\n"
            "  token       a job token for one dataset's trainers (hindsight data token --help)\n"
        )
        return 0 if rest[1:2] in (["-h"], ["--help"]) else 2
    if rest[:2] in (["data", "worker"], ["data", "dispatcher"], ["data", "token"]):
        from hindsight.errors import HindsightError

        try:
            if rest[1] == "worker":
                from hindsight.data._worker import main as worker_main

                return worker_main(rest[2:])
            if rest[1] == "token":
                return _data_token(rest[2:])
            return _data_dispatcher(rest[2:])
        except HindsightError as e:
            # A message naming what is wrong (the address, the journal), not a traceback.
            sys.stderr.write(f"hindsight data {rest[1]}: error: {e}\n")
            return 1
    args = ["hindsight", *argv]
    code, out, err = _native.run_cli(args)
    sys.stdout.write(out)
    sys.stderr.write(err)
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    raise SystemExit(main())
