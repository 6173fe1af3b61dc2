"""Entry point of the `hindsight` command installed by pip (the logic is Rust)."""

from __future__ import annotations

import sys

from hindsight import _native


def _data_dispatcher(a: _native.DispatcherArgs) -> int:
    """`hindsight data dispatcher`: the input service's dispatcher (Rust), here until Ctrl-C or SIGTERM."""
    import signal

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        _native.run_data_dispatcher(a.journal, bind=f"{a.host}:{a.port}", heartbeat_timeout=a.heartbeat_timeout)
    except (KeyboardInterrupt, SystemExit):
        pass
    return 0


def _data_token(a: _native.TokenArgs) -> int:
    """`hindsight data token`: a job token for the trainers of one dataset's jobs."""
    sys.stdout.write(_native.data_job_token(a.dataset, a.journal) + "\n")
    return 0


def _record(a: _native.RecordArgs) -> int:
    """`hindsight record [--explain] SCRIPT [ARGS...]`: run a training script
    (the same as `python SCRIPT ARGS`); with --explain, only say what its
    checkpoints would hold and why, recording nothing."""
    import os
    import subprocess
    import tempfile

    explain, rest = a.explain, a.command
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
    """The `hindsight` command: parsed by the engine's one grammar (clap),
    which runs its own commands; the Python package's come back parsed."""
    argv = sys.argv[1:] if argv is None else argv
    call = _native.parse_cli(["hindsight", *argv])
    sys.stdout.write(call.out)
    sys.stderr.write(call.err)
    sys.stdout.flush()
    a = call.args
    if a is None:
        return call.code
    if isinstance(a, _native.ReplayArgs):
        # Replay runs Python workers: it lives in the Python package.
        from hindsight.replay import main as replay_main

        if call.store_given:
            sys.stderr.write("hindsight replay: --store is ignored (a run replays from the store it recorded)\n")
        return replay_main(a)
    if isinstance(a, _native.SeriesArgs):
        # matplotlib and TensorBoard's writer are Python libraries.
        from hindsight._export import main as export_main

        return export_main(a)
    if isinstance(a, _native.RecordArgs):
        return _record(a)
    from hindsight.errors import HindsightError

    name = {_native.DispatcherArgs: "dispatcher", _native.WorkerArgs: "worker", _native.TokenArgs: "token"}[type(a)]
    try:
        if isinstance(a, _native.WorkerArgs):
            from hindsight.data._worker import main as worker_main

            return worker_main(a)
        if isinstance(a, _native.TokenArgs):
            return _data_token(a)
        return _data_dispatcher(a)
    except HindsightError as e:
        # A message naming what is wrong (the address, the journal), not a traceback.
        sys.stderr.write(f"hindsight data {name}: error: {e}\n")
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
