"""Errors that lead with their cause; tracebacks that show the researcher's own frames.

A step_fn mistake reaches the notebook wrapped: AutoGraph re-raises it as "in user code:" plus
a listing of frames, Keras wraps a layer's error in "Exception encountered when calling ...",
and the run loop adds 10-17 frames of its own. The sentence that matters (Keras's "Input 0 ...
is incompatible with the layer", Python's "name 'learning_rat' is not defined") came last.

`readable(error)` finds the innermost error of that chain (each wrapper quotes the error it
wraps, so "the inner message is part of the outer one" tells a wrapper from an unrelated
error raised while handling another), and returns it with a traceback of the researcher's own
frames only (their notebook cell, their file), as Keras filters its own frames. Its message is
then the cause's own sentence, under its own class. IPython shows the same filter over the
frames the error passes on its way out (`_render_traceback_`, which IPython asks any error for).

WORKBENCH_TRACEBACKS=full turns all of this off: every frame and every wrapper, as raised.
"""

from __future__ import annotations

import functools
import linecache
import os
import re
import sys
import sysconfig
import traceback
import types

from workbench._src.core.errors import WorkbenchError
from workbench._src.core.tf_messages import GRAPH_WRAPPER, op_error_sentence

FULL_ENV = "WORKBENCH_TRACEBACKS"
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Libraries whose frames are machinery to a researcher (TensorFlow and Keras filter their own
# the same way); AutoGraph's generated copies of the researcher's functions too: the original
# lines are the ones shown.
_MACHINERY = re.compile(r"[/\\](tensorflow|keras|tf_keras|IPython|ipykernel|tensorboard)[/\\]")
_STDLIB = tuple(
    os.path.abspath(p) + os.sep
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
)


def full_tracebacks() -> bool:
    """Whether WORKBENCH_TRACEBACKS=full asks for every frame and wrapper."""
    return os.environ.get(FULL_ENV, "").strip().lower() == "full"


def plain(text: str) -> str:
    """`text` without terminal escape codes (Keras bolds its sentence with them)."""
    return _ANSI.sub("", text)


def is_user_frame(filename: str) -> bool:
    """Whether a frame in `filename` is the researcher's: not the workbench's, not TensorFlow's,
    Keras's, IPython's or the standard library's (a notebook cell, a script, their own modules)."""
    if not filename or filename.startswith(("<frozen", "<decorator-gen")):
        return False
    path = os.path.abspath(filename) if not filename.startswith("<") else filename
    if path.startswith(_PACKAGE + os.sep) or "__autograph_generated_file" in path:
        return False
    if _MACHINERY.search(path):
        return False
    return not (path.startswith(_STDLIB) and "site-packages" not in path)


def innermost(error: BaseException) -> BaseException:
    """The error a chain of wrappers started from: follows __cause__/__context__ while the inner
    error's message is quoted in the outer one's (AutoGraph's and Keras's wrappers quote it; an
    unrelated error raised while handling another does not)."""
    seen = {id(error)}
    current = error
    while True:
        if _deliberate(current):  # it says what it means to; what it replaced stays out
            return current
        inner = current.__cause__ or current.__context__
        if inner is None or id(inner) in seen or not _quotes(str(current), str(inner)):
            return current
        seen.add(id(inner))
        current = inner


def _deliberate(error: BaseException) -> bool:
    """The workbench's own errors and IPython's UsageError (raised in place of another, with a
    message of their own)."""
    return isinstance(error, WorkbenchError) or type(error).__name__ == "UsageError"


def _quotes(outer: str, inner: str) -> bool:
    """Whether `outer` quotes `inner`: all of it, or (AutoGraph re-indents the error it wraps
    and adds a frame to its listing) its last line, when that line says enough to be told apart."""
    outer, inner = _words(outer), [_words(line) for line in inner.splitlines() if line.strip()]
    if not inner:
        return False
    return " ".join(inner) in outer or (len(inner[-1]) >= 12 and inner[-1] in outer)


def _words(text: str) -> str:
    return " ".join(plain(text).split())


def _chain(error: BaseException) -> list[BaseException]:
    out, current = [error], error
    target = innermost(error)
    while current is not target:
        current = current.__cause__ or current.__context__
        out.append(current)
    return out


def _relink(entries: list[types.TracebackType]) -> types.TracebackType | None:
    """A new traceback of these entries, in order (the frames themselves are shared)."""
    tb = None
    for entry in reversed(entries):
        tb = types.TracebackType(tb, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return tb


def _user_entries(tb) -> list[types.TracebackType]:
    entries = []
    while tb is not None:
        if is_user_frame(tb.tb_frame.f_code.co_filename):
            entries.append(tb)
        tb = tb.tb_next
    return entries


# A frame in AutoGraph's "in user code:" listing: '    File "/tmp/ipykernel_1/2.py", line 7, in step_fn  *'
_AUTOGRAPH_WRAPPER = "in user code:"
_LISTED = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)', re.M)


def user_traceback(error: BaseException) -> types.TracebackType | None:
    """The researcher's frames of `error` and of the errors it wraps, outermost first.

    A wrapper's traceback reaches down to where it caught the inner error; the inner error's
    own traceback may go deeper (into a custom layer of theirs): both are read, each frame once.
    A function AutoGraph converted ran as a generated copy, so no frame of the original exists;
    AutoGraph's listing names the original lines, and each becomes a stand-in frame there.
    """
    entries, seen, at = [], set(), {}

    def add(entry) -> None:
        key = (entry.tb_frame.f_code.co_filename, entry.tb_lineno, entry.tb_frame.f_code.co_name)
        if key in seen:
            return
        seen.add(key)
        if id(entry.tb_frame) in at:  # one frame, met again deeper: the line the cause was raised on
            entries[at[id(entry.tb_frame)]] = entry
        else:
            at[id(entry.tb_frame)] = len(entries)
            entries.append(entry)

    chain = _chain(error)
    for link in chain:
        for entry in _user_entries(link.__traceback__):
            add(entry)
    for link in chain:
        text = plain(str(link))
        if not text.lstrip().startswith((_AUTOGRAPH_WRAPPER, GRAPH_WRAPPER)):
            continue
        for match in _LISTED.finditer(text):
            key = (match["file"], int(match["line"]), match["name"])
            if is_user_frame(key[0]) and key not in seen:
                add(_stand_in(*key))
    return _relink(entries)


class _Marker(Exception):
    pass


def _stand_in(filename: str, lineno: int, name: str) -> types.TracebackType:
    """A traceback entry at `filename`:`lineno` in a function called `name`, for a line that
    ran inside AutoGraph's generated copy: shown (with its source line) as a real frame is."""
    code = compile("\n" * (lineno - 1) + "raise _Marker", filename, "exec")
    code = code.replace(co_name=name, co_qualname=name)
    try:
        exec(code, {"_Marker": _Marker})
    except _Marker as marker:
        return marker.__traceback__.tb_next  # (the first entry is this function's own frame)
    raise AssertionError("unreachable")


def readable(error: BaseException) -> BaseException:
    """The error to show for `error`: its innermost cause, with the researcher's frames only.

    The same object is returned when it is already its own cause; an Exception's wrappers are
    dropped from what is shown (the returned error no longer chains to them). Under
    WORKBENCH_TRACEBACKS=full, or for a BaseException that is not an Exception (KeyboardInterrupt,
    SystemExit), `error` is returned untouched.
    """
    if full_tracebacks() or not isinstance(error, Exception):
        return error
    tb = user_traceback(error)
    shown = innermost(error)
    if shown is not error:
        shown.__cause__ = None
        shown.__suppress_context__ = True  # (wrappers and unrelated errors met on the way)
        for attribute in ("run", "task"):  # what a caller attached to the wrapper travels on
            if getattr(error, attribute, None) is not None and getattr(shown, attribute, None) is None:
                try:
                    setattr(shown, attribute, getattr(error, attribute))
                except AttributeError:
                    pass
    shown = _tensorflow_sentence_first(shown) or shown
    shown = shown.with_traceback(tb)
    if _in_ipython():
        try:  # (only where IPython shows it: a worker's error stays a plain, picklable one)
            shown._render_traceback_ = functools.partial(_ipython_traceback, shown)
        except AttributeError:  # an exception class with __slots__: IPython shows it as it is
            pass
    return shown


# A lost or frozen peer's errors keep their whole text: it names the peer ("unhealthy (stopped
# sending heartbeats): /job:worker/replica:0/task:1"), which the launcher and `workbench run` read.
_PEER_ERRORS = ("UnavailableError", "AbortedError", "DeadlineExceededError", "CancelledError")


def _is_op_error(error: BaseException) -> bool:
    """A TensorFlow OpError (told by its fields: no TensorFlow import here)."""
    return all(hasattr(error, name) for name in ("node_def", "op", "error_code"))


def _tensorflow_sentence_first(error: BaseException) -> BaseException | None:
    """A TensorFlow runtime error of the same class whose message is its sentence (and the node
    TensorFlow detected it at), without the listing of frames before it; None if there is none."""
    if not _is_op_error(error) or type(error).__name__ in _PEER_ERRORS:
        return None
    found = op_error_sentence(plain(str(error)))
    if found is None:
        return None
    sentence, node = found
    where = f"\n(TensorFlow detected it at node {node}.)" if node else ""
    try:
        shown = type(error)(error.node_def, error.op, sentence + where)
    except Exception:  # noqa: BLE001 - a class built otherwise: shown as it is
        return None
    for attribute in ("run", "task"):
        if getattr(error, attribute, None) is not None:
            setattr(shown, attribute, getattr(error, attribute))
    shown.__suppress_context__ = True
    return shown


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


def cause_line(error: BaseException) -> str:
    """'ValueError: Input 0 ... is incompatible ...': the innermost error's class and the first
    line of its own message, without escape codes."""
    inner = error if full_tracebacks() else innermost(error)
    text = plain(str(inner))
    found = op_error_sentence(text) if _is_op_error(inner) and not full_tracebacks() else None
    found = None if type(inner).__name__ in _PEER_ERRORS else found
    lines = [found[0]] if found else [line for line in text.splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0].strip()}" if lines else type(inner).__name__


def shown_text(error: BaseException) -> str:
    """The traceback text a log or the sidebar shows: the researcher's frames and the cause
    (every frame under WORKBENCH_TRACEBACKS=full), without escape codes."""
    if full_tracebacks():
        return plain("".join(traceback.format_exception(error)))
    inner = innermost(error)
    frames = format_frames(user_traceback(error))
    head = "Traceback (most recent call last):\n" if frames else ""
    tail = "".join(traceback.format_exception_only(inner))
    return plain(head + frames + tail)


def format_frames(tb) -> str:
    """'  File "...", line N, in name' and its source line for each entry, as Python prints
    them; the line of a cell shipped to a worker process comes from `remember_source`."""
    return "".join(_frame_text(f.filename, f.lineno, f.name) + "\n" for f in traceback.extract_tb(tb))


def _frame_text(filename: str, lineno: int, name: str, indent: str = "  ", source: bool = True) -> str:
    """One frame as Python prints it ('File "..."' or 'Cell In[n]', line, function) and, with
    `source`, its line below (from linecache, or a shipped cell's `remember_source`)."""
    text = f"{indent}{_where(filename)}, line {lineno}, in {name}"
    line = (
        (linecache.getline(filename, lineno) or _remembered_line(filename, lineno)).strip() if source else ""
    )
    return f"{text}\n{indent}  {line}" if line else text


_DUMPED = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')


def _dumped_threads(dump: str) -> list[tuple[str, list]]:
    """The threads of a faulthandler dump: each block's text and its frames (matches of
    _DUMPED), innermost first."""
    blocks = [b for b in re.split(r"\n\s*\n", dump) if "most recent call first" in b]
    return [(b, list(filter(None, map(_DUMPED.match, b.splitlines())))) for b in blocks]


def work_stack(dump: str, frames: int = 12) -> str:
    """Where a member process's work is, from faulthandler's dump of its threads (asked of a
    silent member before it is ended): the thread in the workbench's serve loop (else the first),
    as a traceback's lines, innermost first, from the innermost frame to where the workbench
    called into the code that runs (below that, the workbench's own frames are every run's).
    '' when the dump has no thread."""
    threads = _dumped_threads(dump)
    if not threads:
        return ""
    serving = (t for t in threads if re.search(r'launch[/\\]member\.py", line \d+ in serve', t[0]))
    _, work = next(serving, threads[0])
    out, outside = [], False
    for match in work:
        lineno, name = int(match["line"]), match["name"]
        filename = _origin(match["file"], lineno, name)
        ours = filename.startswith(_PACKAGE + os.sep)
        if (ours and outside) or len(out) == frames:
            break
        outside = outside or not ours
        out.append(_frame_text(filename, lineno, name))
    return "\n".join(out)


def heartbeat_stack(dump: str, frames: int = 6) -> str:
    """Where a silent member's heartbeat thread (`beat`) was, from the same dump, when it was
    held anywhere but its sleep between beats (a lock, a send that does not return): a member
    that sat idle while its heartbeats stopped then says what held them. '' when it rests."""
    held = []
    for _, found in _dumped_threads(dump):
        if not found or "beat" not in [match["name"] for match in found]:
            continue
        innermost = found[0]
        if innermost["name"] in ("get", "wait") or "sleep(" in linecache.getline(
            innermost["file"], int(innermost["line"])
        ):
            continue  # (asleep between beats, or waiting on a queue: at rest)
        held.append("\n".join(_frame_text(m["file"], int(m["line"]), m["name"]) for m in found[:frames]))
    return "\n".join(held)


_FORMATTED = re.compile(r'^(?P<indent>\s*)File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>.+)$')


def frames_named(text: str) -> str:
    """A traceback formatted in a worker process, its frames named as this process names them:
    a function sent by value (cloudpickle's "<dynamic-code>") by the file it came from, a frame
    in a notebook cell as IPython names the cell ("Cell In[3]"), with the line, which only this
    process (the notebook's kernel) may have."""
    lines, out = text.splitlines(), []
    for i, line in enumerate(lines):
        found = _FORMATTED.match(line)
        if not found:
            out.append(line)
            continue
        indent, lineno = found["indent"], int(found["line"])
        filename = _origin(found["file"], lineno, found["name"])
        if filename == found["file"] and _where(filename).startswith("File "):
            out.append(line)
            continue
        listed = (  # (its source line is there already: a file the worker could read)
            i + 1 < len(lines)
            and lines[i + 1].startswith(indent + "  ")
            and not _FORMATTED.match(lines[i + 1])
        )
        out.append(_frame_text(filename, lineno, found["name"], indent, source=not listed))
    return "\n".join(out)


DYNAMIC_CODE = "<dynamic-code>"  # cloudpickle's file name for a function's code sent by value
_shipped: dict[tuple[str, str, int], int] = {}  # (file, function, first line) -> last line


def remember_shipped_code(code: types.CodeType) -> None:
    """Where a function sent to the workers by value (and those defined in it) came from."""
    stack = [code]
    while stack:
        code = stack.pop()
        last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
        key = (code.co_filename, code.co_name, code.co_firstlineno)
        _shipped.pop(key, None)  # (sent again: now the newest)
        _shipped[key] = last
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def _origin(filename: str, lineno: int, name: str) -> str:
    """The file of a worker's frame: a "<dynamic-code>" frame's, from the functions this process
    sent (the innermost one of that name around the line; the newest sent when several match)."""
    if filename != DYNAMIC_CODE:
        return filename
    around = [
        (first, order, file)
        for order, ((file, fn, first), last) in enumerate(_shipped.items())
        if fn == name and first <= lineno <= last
    ]
    return max(around)[2] if around else filename


def _where(filename: str) -> str:
    """'Cell In[3]' for a notebook cell (as IPython names it), else 'File "path"'."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    named = getattr(getattr(shell, "compile", None), "format_code_name", lambda _: None)(filename)
    return f"{named[0]} {named[1]}" if named else f'File "{filename}"'


_sources: dict[str, list[str]] = {}  # "<%%replicate cell>" -> its lines, in a worker process


def remember_source(filename: str, source: str) -> None:
    """Keeps the lines of source run under a name that is no file (a cell shipped to a worker),
    for the lines its tracebacks show. (Not in linecache: AutoGraph would then convert the
    cell's functions, which the worker processes do not do today.)"""
    if filename.startswith("<"):
        _sources[filename] = source.splitlines()


def _remembered_line(filename: str, lineno: int) -> str:
    lines = _sources.get(filename, [])
    return lines[lineno - 1] if 0 < lineno <= len(lines) else ""


def _ipython_traceback(error: BaseException) -> list[str]:
    """What IPython shows for `error`: its structured traceback over the researcher's frames of
    the way out (the cell, and any of their functions between it and the workbench)."""
    from IPython import get_ipython

    shell = get_ipython()
    tb = _relink(_user_entries(error.__traceback__))
    if shell is None:
        return traceback.format_exception(type(error), error, tb)
    return shell.InteractiveTB.structured_traceback(type(error), error, tb, tb_offset=0)


def user_facing(fn):
    """Decorates a public entry point (repl.train, repl.run, the magic): an error leaving it is
    `readable(error)`, its cause with the researcher's frames (as Keras's `filter_traceback`)."""

    @functools.wraps(fn)
    def entry_point(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the same error, shown by its cause
            shown = readable(error)
            if shown is error:
                raise
            raise shown from None

    return entry_point
