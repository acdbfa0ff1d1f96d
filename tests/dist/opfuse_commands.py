"""Several ``python -m opfuse ARGS`` commands from one interpreter start (tests/dist/test_cli.py).

Most of a quick command's time (``--version``, an argument error, ``bench NAME`` on a host without
GPUs) is the interpreter importing opfuse, and torch with it: about 3.5 s on 2 CPU cores. This script
does what ``python -m opfuse`` does first, once: puts the working directory first on ``sys.path`` and
imports the package (what that prints is recorded). Then, for each command, it forks a child that runs
``opfuse/__main__.py`` as ``__main__`` the way ``-m`` does (``runpy``, ``sys.argv[1:]`` the command's
arguments), its stdout and stderr at the file-descriptor level in files of its own, and turns how it
ends into an exit status as the interpreter does (``SystemExit``'s code; a traceback on stderr and 1
for any other exception). A command's result is its exit status, and the import's output followed by
its own, as from its own interpreter.

Usage: ``python tests/dist/opfuse_commands.py REQUESTS.json RESULTS.json FOLDER``: REQUESTS a list of
argument lists, RESULTS the list of ``{"returncode", "stdout", "stderr"}`` in the same order.
"""

import json
import os
import runpy
import sys


def _redirect(folder: str, name: str) -> None:
    """This process's stdout and stderr (file descriptors 1 and 2) into FOLDER/NAME.out and .err."""
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, suffix in ((1, "out"), (2, "err")):
        target = os.open(os.path.join(folder, f"{name}.{suffix}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)


def _read(folder: str, name: str) -> tuple[str, str]:
    texts = []
    for suffix in ("out", "err"):
        with open(os.path.join(folder, f"{name}.{suffix}")) as handle:  # as subprocess.run(text=True) reads
            texts.append(handle.read())
    return texts[0], texts[1]


def _status(code) -> int:
    """The exit status the interpreter gives ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_main(args: list[str]) -> int:
    """``python -m opfuse ARGS`` after the import: opfuse/__main__.py as ``__main__``."""
    sys.argv = [sys.argv[0], *args]  # runpy puts the module's path first, as -m does
    try:
        runpy.run_module("opfuse", run_name="__main__", alter_sys=True)
        status = 0
    except SystemExit as done:
        status = _status(done.code)
    except BaseException:  # noqa: BLE001 - printed as the interpreter prints an uncaught exception
        sys.excepthook(*sys.exc_info())
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    return status


def main() -> None:
    requests_path, results_path, folder = sys.argv[1:4]
    with open(requests_path) as handle:
        requests = json.load(handle)
    sys.path[0] = os.getcwd()  # python -m puts the working directory first, not this script's folder
    own = os.dup(1), os.dup(2)
    _redirect(folder, "import")
    try:
        import opfuse  # noqa: F401 - what python -m opfuse imports before running opfuse/__main__.py
        imported = True
    except BaseException:  # noqa: BLE001 - every command then fails as its interpreter would
        sys.excepthook(*sys.exc_info())
        imported = False
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(own[0], 1)
    os.dup2(own[1], 2)
    head_out, head_err = _read(folder, "import")
    results = []
    for index, args in enumerate(requests):
        if not imported:
            results.append({"returncode": 1, "stdout": head_out, "stderr": head_err})
            continue
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                _redirect(folder, str(index))
                status = _run_main(args)
            finally:
                os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        out, err = _read(folder, str(index))
        results.append({"returncode": os.waitstatus_to_exitcode(wait_status), "stdout": head_out + out,
                        "stderr": head_err + err})
    with open(results_path, "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
