"""write_atomic and the WriteFile effect, on real files in the test's own directory."""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from asiento import Agent, FinalStep, ModelResponse, Session, SqliteCheckpointer, ToolCall
from asiento.effects import EffectRejected, WriteFile, write_atomic
from asiento.testing import ScriptedGateway


def leftovers(directory: Path, keep: set[str]) -> list[str]:
    """Names in ``directory`` other than ``keep``: temp files a write left behind."""
    return sorted(p.name for p in directory.iterdir() if p.name not in keep)


# -- write_atomic ---------------------------------------------------------------------------


def test_replaces_the_whole_content(tmp_path: Path) -> None:
    """str and bytes both replace the file entirely, shorter content included."""
    target = tmp_path / "a.txt"
    write_atomic(target, "a long first version\n")
    write_atomic(str(target), b"short")
    assert target.read_bytes() == b"short"
    assert leftovers(tmp_path, {"a.txt"}) == []


def test_reader_never_sees_a_partial_file(tmp_path: Path) -> None:
    """While a writer alternates two 1 MiB contents, every read returns one of them whole."""
    target = tmp_path / "big.bin"
    versions = (b"a" * 2**20, b"b" * 2**20)
    write_atomic(target, versions[0])
    done = threading.Event()
    reads: list[bytes] = []

    def reader() -> None:
        while not done.is_set() and len(reads) < 10_000:
            reads.append(target.read_bytes())

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(40):
            write_atomic(target, versions[i % 2])
    finally:
        done.set()
        thread.join(timeout=30)
    assert reads
    assert all(r in versions for r in reads), "a reader saw a partial file"


def test_error_while_writing_removes_the_temp_file(tmp_path: Path) -> None:
    """data that cannot be written: the error propagates, the old file and directory are intact."""
    target = tmp_path / "a.txt"
    target.write_text("old")
    with pytest.raises(TypeError):
        write_atomic(target, 12345)  # type: ignore[arg-type]
    assert target.read_text() == "old"
    assert leftovers(tmp_path, {"a.txt"}) == []


def test_error_in_replace_removes_the_temp_file(tmp_path: Path) -> None:
    """os.replace onto a directory fails: the temp file is removed, the directory untouched."""
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("x")
    with pytest.raises(IsADirectoryError):
        write_atomic(target, "data")
    assert target.is_dir()
    assert (target / "inside").read_text() == "x"
    assert leftovers(tmp_path, {"taken"}) == []


def test_keeps_the_permissions_of_the_file_it_replaces(tmp_path: Path) -> None:
    """A 0600 file stays 0600 and a 0755 one stays 0755; a new file is 0644."""
    private, script, new = tmp_path / "secret", tmp_path / "run.sh", tmp_path / "new"
    for path, mode in ((private, 0o600), (script, 0o755)):
        path.write_text("before")
        path.chmod(mode)
        write_atomic(path, "after")
        assert (path.stat().st_mode & 0o7777, path.read_text()) == (mode, "after")
    write_atomic(new, "x")
    assert new.stat().st_mode & 0o7777 == 0o644


SPY = """
import os, sys
from asiento.effects import write_atomic
events = []
real_fsync = os.fsync
def fsync(fd):
    events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
    return real_fsync(fd)
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        events.append(("open", args[0]))
    elif event == "os.rename":
        events.append(("rename", str(args[0]), str(args[1])))
os.fsync = fsync
sys.addaudithook(hook)
write_atomic(sys.argv[1], "hello")
for e in events:
    print("|".join(e))
"""


def test_temp_in_same_directory_fsynced_then_directory_fsynced(tmp_path: Path) -> None:
    """Temp file opened in the target's directory, fsynced, renamed; then the directory fsynced."""
    target = tmp_path / "out.txt"
    proc = subprocess.run(
        [sys.executable, "-c", SPY, str(target)], capture_output=True, text=True, check=True
    )
    events = [tuple(line.split("|")) for line in proc.stdout.splitlines()]
    opened, fsync_tmp, renamed, fsync_dir = events[0], events[1], events[2], events[-1]
    tmp = Path(opened[1])
    assert tmp.parent == tmp_path
    assert fsync_tmp == ("fsync", str(tmp))
    assert renamed == ("rename", str(tmp), str(target))
    assert fsync_dir == ("fsync", str(tmp_path))
    assert target.read_text() == "hello"
    assert leftovers(tmp_path, {"out.txt"}) == []


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed")
def test_directory_fsync_seen_by_strace(tmp_path: Path) -> None:
    """At the system-call level: rename, then open the directory, then fsync that descriptor."""
    target = tmp_path / "out.txt"
    code = "import sys; from asiento.effects import write_atomic; write_atomic(sys.argv[1], 'x')"
    trace = ["strace", "-f", "-e", "trace=openat,fsync,rename,renameat,renameat2"]
    proc = subprocess.run(
        [*trace, sys.executable, "-c", code, str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0 and "ptrace" in proc.stderr.lower():
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if str(tmp_path) in x or "fsync(" in x]
    renamed = next(i for i, x in enumerate(lines) if "rename" in x and str(target) in x)
    opened = lines[renamed + 1]
    assert f'"{tmp_path}"' in opened
    assert "O_DIRECTORY" in opened
    fd = re.search(r"= (\d+)$", opened)
    assert fd is not None
    assert re.match(rf"(\[pid\s+\d+\] )?fsync\({fd.group(1)}\)\s+= 0", lines[renamed + 2])


# -- WriteFile ------------------------------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> Path:
    allowed = tmp_path / "root"
    (allowed / "docs").mkdir(parents=True)
    return allowed


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_prepare_freezes_path_content_and_hash(root: Path) -> None:
    """prepare resolves the path inside the root and freezes the content's sha256."""
    payload = WriteFile(root).prepare("docs/../docs/a.md", "# A\n")
    assert payload == {
        "path": str(root / "docs" / "a.md"),
        "content": "# A\n",
        "sha256": sha("# A\n"),
    }
    assert not (root / "docs" / "a.md").exists(), "prepare must not touch the destination"


@pytest.mark.parametrize("path", ["../outside.txt", "docs/../../x", "/etc/passwd", "escape/x"])
def test_prepare_refuses_paths_outside_the_root(root: Path, tmp_path: Path, path: str) -> None:
    """A path that leaves the root, by .., by being absolute or through a symlink, is refused."""
    (root / "escape").symlink_to(tmp_path)
    with pytest.raises(EffectRejected, match="outside"):
        WriteFile(root).prepare(path, "x")


async def write_through_agent(root: Path, db: Path, path: str) -> tuple[list[Any], str]:
    """One pass where the model asks to write ``path``; the steps and what the model read."""
    call = ToolCall(name="write_file", arguments={"path": path, "content": "x"})
    gateway = ScriptedGateway([ModelResponse(tool_calls=[call]), ModelResponse(text="ok")])
    store = SqliteCheckpointer(db)
    agent = Agent(tools=[WriteFile(root).as_tool()])
    try:
        steps = [s async for s in agent.run("write", session=Session("r", gateway, store))]
    finally:
        await store.close()
    return steps, gateway.calls[-1][0].messages[-1].content


async def test_refused_path_is_the_steps_outcome(root: Path, tmp_path: Path) -> None:
    """Through the agent, a refused path is a recorded error fed to the model; nothing written."""
    steps, told = await write_through_agent(root, tmp_path / "runs.db", "../evil.txt")
    assert isinstance(steps[-1], FinalStep)
    assert told.startswith("error: refused while preparing")
    assert not (tmp_path / "evil.txt").exists()


async def test_directory_target_is_a_recorded_failure(root: Path, tmp_path: Path) -> None:
    """A path naming a directory can never be written: an error for the model, not a stuck run."""
    steps, told = await write_through_agent(root, tmp_path / "runs.db", "docs")
    assert isinstance(steps[-1], FinalStep)
    assert told.startswith("error:")
    assert (root / "docs").is_dir()


async def test_missing_directory_is_written_or_a_recorded_failure(
    root: Path, tmp_path: Path
) -> None:
    """A path into a missing directory ends as a written file or an error, never a stuck run."""
    steps, told = await write_through_agent(root, tmp_path / "runs.db", "new/a.txt")
    assert isinstance(steps[-1], FinalStep)
    written = (root / "new" / "a.txt").exists()
    assert written or told.startswith("error:")


async def test_publish_then_lookup_finds_the_file(root: Path) -> None:
    """After publish the file is there with that content, and lookup says so with the same id."""
    effect = WriteFile(root)
    payload = effect.prepare("docs/a.md", "contenido ñ\n")
    assert await effect.lookup(payload) is None
    published = await effect.publish(payload, "r:m1.t1:abcdef")
    assert (root / "docs" / "a.md").read_text() == "contenido ñ\n"
    assert await effect.lookup(payload) == published
    assert published.remote_id == f"{payload['path']}#sha256:{payload['sha256'][:16]}"


@pytest.mark.parametrize("current", ["other content\n", b"\xff\xfe not utf-8"])
async def test_lookup_does_not_find_other_content(root: Path, current: Any) -> None:
    """A file at the path with other content (or not even text) is not the effect."""
    effect = WriteFile(root)
    payload = effect.prepare("docs/a.md", "expected\n")
    target = root / "docs" / "a.md"
    if isinstance(current, bytes):
        target.write_bytes(current)
    else:
        target.write_text(current)
    assert await effect.lookup(payload) is None


async def test_whole_file_replaced_by_publish(root: Path) -> None:
    """Publishing over an existing file replaces it whole, through write_atomic."""
    target = root / "docs" / "a.md"
    target.write_text("a much longer previous version of the file\n")
    effect = WriteFile(root)
    await effect.publish(effect.prepare("docs/a.md", "new\n"), "k")
    assert target.read_text() == "new\n"
    assert leftovers(root / "docs", {"a.md"}) == []
