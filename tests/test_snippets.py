"""Every ```python block of README.md and docs/ runs as written, against a real redis-server and
LMDB in a temporary directory, unless its first line marks it as a fragment (a comment that
starts with ``# Fragment``, saying what it leaves out). ``examples/demo.py`` runs too.

A runnable block uses ``redis://localhost:6379`` and ``lmdb:///dev/shm/...`` as a reader would;
the test points them at the test's redis-server and at a temporary directory. A block that calls
``tiers.restore`` is a whole training script: it runs twice, the second time as on a replaced
node (its node-local LMDB gone), and must restore the first run's model and optimizer
bit-exact. Blocks run in this process (a fresh namespace each, torch already imported), with
the environment torchrun gives a world of one process.
"""

from __future__ import annotations

import contextlib
import io
import re
import runpy
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from kvckpt.engines.lmdb import close_idle_environments
from kvckpt.testing import RedisServer, free_port

ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]  # docs/reference/ too
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
FRAGMENT = re.compile(r"#\s*Fragment\b", re.I)


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def fragment(self) -> bool:
        first = next((line for line in self.code.splitlines() if line.strip()), "")
        return FRAGMENT.match(first.strip()) is not None


def snippets() -> list[Snippet]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            found.append(Snippet(path, line, textwrap.dedent(m.group("body"))))
    return found


ALL = snippets()
RUNNABLE = [s for s in ALL if not s.fragment]


def test_the_docs_have_runnable_blocks_and_marked_fragments() -> None:
    """The extraction finds what it should: the README's quick start, the tutorial's steps and
    training script (every block of the tutorial runs, its export to safetensors too), the
    TIERS.md script, and fragments that say what they leave out."""
    runnable = {s.id for s in RUNNABLE}
    assert any(i.startswith("README.md:") for i in runnable), runnable
    assert any(
        s.id.startswith("docs/TUTORIAL.md:") and "tiers.restore(" in s.code for s in RUNNABLE
    ), runnable
    tutorial = [s for s in ALL if s.id.startswith("docs/TUTORIAL.md:")]
    assert tutorial and not [s.id for s in tutorial if s.fragment]  # "every block runs"
    assert any("export_safetensors(" in s.code for s in tutorial), runnable  # step 5
    assert any(i.startswith("docs/TIERS.md:") for i in runnable), runnable
    assert any(i.startswith("docs/index.md:") for i in runnable), runnable
    for s in ALL:
        if s.fragment:
            first = s.code.strip().splitlines()[0]
            assert len(first) > len("# Fragment: ") + 10, f"{s.id}: say what it leaves out"


@pytest.mark.parametrize("snippet", ALL, ids=[s.id for s in ALL])
def test_snippet_is_formatted(snippet: Snippet) -> None:
    """Blocks read like the code they sit beside: ruff-formatted, fragments too."""
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (the [test] extra)")
    result = subprocess.run(
        [ruff, "format", "--diff", "--stdin-filename", "snippet.py", "-"],
        input=snippet.code,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def localise(code: str, redis: RedisServer, tmp: Path) -> str:
    redis_base, lmdb_base = f"redis://127.0.0.1:{redis.port}", f"lmdb://{tmp}/shm/"
    code = code.replace("redis://localhost:6379", redis_base)
    code = code.replace("lmdb:///dev/shm/", lmdb_base)
    for url in re.findall(r"[a-z+]+://[^\s\"']*", code):  # no other server, no other path
        assert url.startswith((redis_base, lmdb_base)), f"{url} in {code}"
    return code


@contextlib.contextmanager
def one_process_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What torchrun sets for a world of one process; the process group goes away after."""
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(name, value)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(snippet: Snippet, code: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    with one_process_world(monkeypatch), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, snippet.id, "exec"), namespace)
    return namespace


def assert_same_training_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    ma, mb = a["model"].state_dict(), b["model"].state_dict()
    assert ma.keys() == mb.keys()
    for name in ma:
        assert torch.equal(ma[name], mb[name]), name
    oa, ob = a["optimizer"].state_dict(), b["optimizer"].state_dict()
    assert oa["state"] and oa["state"].keys() == ob["state"].keys()
    for index, values in oa["state"].items():
        for key, value in values.items():
            assert torch.equal(value, ob["state"][index][key]), (index, key)
    assert oa["param_groups"] == ob["param_groups"]


@pytest.mark.parametrize("snippet", RUNNABLE, ids=[s.id for s in RUNNABLE])
def test_snippet_runs(
    snippet: Snippet,
    redis_url: str,  # a flushed database
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    code = localise(snippet.code, redis_server, tmp_path)
    monkeypatch.chdir(tmp_path)
    first = run(snippet, code, monkeypatch)
    if "tiers.restore(" not in code:
        return
    assert first["restored"] is None  # a fresh start
    for tiers in (first["tiers"],):
        tiers.close()
        for engine in tiers.engines:
            engine.close()
    close_idle_environments()
    shutil.rmtree(tmp_path / "shm")  # a replaced node: its node-local store is gone
    second = run(snippet, code, monkeypatch)
    restored = second["restored"]
    assert restored is not None and restored.checkpoint_id == "step-100", restored
    assert restored.tier == 0, restored  # prefetched from Redis into the new node-local store
    assert_same_training_state(first, second)
    second["tiers"].close()


def test_the_demo_checks_model_and_optimizer(tmp_path: Path, redis_server: RedisServer) -> None:
    """examples/demo.py on LMDB (its default) and on Redis, in a namespace of its own."""
    demo = ROOT / "examples" / "demo.py"
    for args in ([], [redis_server.url()]):
        out = io.StringIO()
        argv = sys.argv
        sys.argv = [str(demo), *args]
        try:
            with contextlib.redirect_stdout(out):
                runpy.run_path(str(demo), run_name="__main__")
        finally:
            sys.argv = argv
        text = out.getvalue()
        assert "prefix=kvckpt-demo" in text, text
        assert "AdamW state (12 tensors: exp_avg, exp_avg_sq, step of 4 parameters)" in text, text
        assert "bit-exact, OK" in text, text


def test_the_demos_check_fails_for_a_plain_optimizer_state_dict(lmdb_url: str) -> None:
    """What the demo checks catches the mistake it warns about: ``optimizer.state_dict()``
    saved and loaded as it is leaves a fresh optimizer with no state at all."""
    import torch.distributed.checkpoint as dcp

    from kvckpt import KVStorageReader, KVStorageWriter

    demo = runpy.run_path(str(ROOT / "examples" / "demo.py"))
    model, opt = demo["make_model"]()
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    fresh_model, fresh_opt = demo["make_model"]()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        dcp.save(state, storage_writer=KVStorageWriter(lmdb_url), checkpoint_id="plain")
        restored = {"model": fresh_model.state_dict(), "optim": fresh_opt.state_dict()}
        dcp.load(restored, storage_reader=KVStorageReader(lmdb_url), checkpoint_id="plain")
    fresh_model.load_state_dict(restored["model"])
    fresh_opt.load_state_dict(restored["optim"])
    assert fresh_opt.state_dict()["state"] == {}  # nothing restored
    with pytest.raises(AssertionError, match="the optimizer state was not restored"):
        demo["check_identical"](model, opt, fresh_model, fresh_opt)
