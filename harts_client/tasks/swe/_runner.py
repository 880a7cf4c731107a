"""The sandboxed side of one tool call: run as `python -I -S _runner.py` in a private copy of the repository.

    stdin:  {"tool": "read_file" | "write_file" | "edit" | "run_tests", "args": {...}, "limits": {...}}
    stdout: ... {"output": text, "files": {changed path: text}, "passed": n, "failed": n, "isolation": ...}

Standard library only. Before any repository code runs: a user and network namespace where the
kernel allows it, hard resource limits, then an audit hook that refuses sockets, processes, ctypes
and writes outside the directory (docs/design/training-loop.md, "Tasks").
"""
import ctypes
import importlib.util
import io
import json
import os
import resource
import sys
import traceback

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
            "ctypes.", "pty.", "os.kill", "os.killpg")
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile")
_MAX_OUTPUT = 4000


def confine(limits: dict, root: str) -> str:
    isolation = "audit-hook"
    try:
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0:
            isolation = "namespace"
    except (OSError, AttributeError):
        pass
    mb = 1 << 20
    for res, value in ((resource.RLIMIT_CPU, int(limits["cpu_s"])), (resource.RLIMIT_AS, int(limits["memory_mb"]) * mb),
                       (resource.RLIMIT_FSIZE, int(limits["file_kb"]) * 1024), (resource.RLIMIT_NOFILE, 64),
                       (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))

    def inside(path) -> bool:
        full = os.path.realpath(os.fsdecode(path))
        return (full + os.sep).startswith(root + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event.startswith(_BLOCKED):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event in _PATH_EVENTS:
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"sandbox: {event} of {os.fsdecode(arg)} outside the repository is not allowed")
            return
        if event != "open" or not isinstance(args[0], (str, bytes)):
            return
        mode, flags = args[1], args[2]
        writing = (any(c in mode for c in "wax+") if isinstance(mode, str)
                   else bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)) if isinstance(flags, int) else False)
        if writing and not inside(args[0]):
            raise PermissionError(f"sandbox: writing {os.path.realpath(os.fsdecode(args[0]))} outside the repository "
                                  "is not allowed")

    sys.addaudithook(hook)
    return isolation


def _inside(path: str, root: str) -> str:
    full = os.path.realpath(os.path.join(root, path))
    if not (full + os.sep).startswith(root + os.sep) or full == root:
        raise ValueError(f"{path}: expected a path inside the repository")
    return full


def _numbered(text: str) -> str:
    return "".join(f"{i:4d} | {line}\n" for i, line in enumerate(text.split("\n")[:-1] if text.endswith("\n")
                                                              else text.split("\n"), 1))


def read_file(root: str, path: str) -> dict:
    full = _inside(path, root)
    if not os.path.isfile(full):
        raise ValueError(f"{path}: no such file")
    with open(full, encoding="utf-8") as f:
        return {"output": f"{path}:\n{_numbered(f.read())}"}


def write_file(root: str, path: str, content: str) -> dict:
    full = _inside(path, root)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    with open(full, "w", encoding="utf-8") as f:
        f.write(content if content.endswith("\n") else content + "\n")
    with open(full, encoding="utf-8") as f:
        text = f.read()
    return {"output": f"wrote {path} ({text.count(chr(10))} lines)", "files": {path: text}}


def edit(root: str, path: str, line: int, text: str) -> dict:
    full = _inside(path, root)
    if not os.path.isfile(full):
        raise ValueError(f"{path}: no such file")
    with open(full, encoding="utf-8") as f:
        lines = f.read().split("\n")
    if not 1 <= line <= len(lines):
        raise ValueError(f"line: expected 1 <= line <= {len(lines)} in {path}, got {line}")
    new = text.rstrip("\n").split("\n")
    lines[line - 1: line] = new
    with open(full, "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    with open(full, encoding="utf-8") as f:
        body = f.read()
    shown = body.split("\n")[max(0, line - 3): line - 1 + len(new) + 2]
    start = max(1, line - 2)
    view = "".join(f"{start + i:4d} | {s}\n" for i, s in enumerate(shown))
    return {"output": f"edited {path} line {line}:\n{view}", "files": {path: body}}


def run_tests(root: str) -> dict:
    sys.path.insert(0, root)
    passed, failed, report = 0, [], []
    tests = sorted(os.path.join("tests", n) for n in os.listdir(os.path.join(root, "tests"))
                   if n.startswith("test_") and n.endswith(".py")) if os.path.isdir(os.path.join(root, "tests")) else []
    for rel in tests:
        name = "harts_test_" + os.path.basename(rel)[:-3]
        try:
            spec = importlib.util.spec_from_file_location(name, os.path.join(root, rel))
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        except BaseException as exc:  # an import error fails every test of the file
            failed.append(f"{rel}")
            report.append(f"ERROR {rel}: {type(exc).__name__}: {exc}")
            continue
        for fname in sorted(n for n in vars(mod) if n.startswith("test_") and callable(vars(mod)[n])):
            try:
                vars(mod)[fname]()
                passed += 1
            except BaseException as exc:
                failed.append(f"{rel}::{fname}")
                frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename.startswith(root)]
                where = f" (line {frames[-1].lineno}: {frames[-1].line})" if frames else ""
                report.append(f"FAILED {rel}::{fname}{where}: {type(exc).__name__} {exc}".rstrip())
    summary = f"{passed} passed, {len(failed)} failed"
    return {"output": "\n".join(report + [summary]), "passed": passed, "failed": len(failed), "failing": failed}


def main() -> None:
    request = json.loads(sys.stdin.read())
    root = os.path.realpath(os.getcwd())
    sys.dont_write_bytecode = True
    isolation = confine(request["limits"], root)
    real_stdout = sys.stdout
    sys.stdout = sys.stderr = io.StringIO()  # what the repository's code prints stays out of the result line
    tool, args = request["tool"], request.get("args", {})
    try:
        if tool == "read_file":
            result = read_file(root, args["path"])
        elif tool == "write_file":
            result = write_file(root, args["path"], args["content"])
        elif tool == "edit":
            result = edit(root, args["path"], int(args["line"]), args["text"])
        elif tool == "run_tests":
            result = run_tests(root)
        else:
            result = {"output": f"error: unknown tool {tool!r}"}
    except (OSError, ValueError, KeyError, UnicodeDecodeError) as exc:
        result = {"output": f"error: {type(exc).__name__}: {exc}"}
    result["output"] = result["output"][:_MAX_OUTPUT]
    result["isolation"] = isolation
    real_stdout.write("\n" + json.dumps(result) + "\n")
    real_stdout.flush()


if __name__ == "__main__":
    main()
