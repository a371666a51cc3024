"""Reliability against real redis-server processes: eviction policies, maxmemory, a server
restarted mid-save, dropped connections, ACL users and TLS."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from kvckpt import (
    KVStorageReader,
    KVStorageWriter,
    StoreUnavailableError,
    latest_checkpoint,
    list_checkpoints,
    open_store,
)
from kvckpt.errors import StoreFullError
from kvckpt.keys import data_prefix, meta_key

MIB = 1 << 20


def sd_of(mib: int, value: float = 1.0) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((MIB // 4,), value + i) for i in range(mib)}


def raises_text(fn) -> str:
    with pytest.raises(BaseException) as info:
        fn()
    return str(info.value)


def test_evicting_policy_is_refused_unless_allowed(server) -> None:
    srv = server("--maxmemory-policy", "allkeys-lru", "--maxmemory", "1gb")
    text = raises_text(
        lambda: dcp.save(sd_of(2), storage_writer=KVStorageWriter(srv.url()), checkpoint_id="a")
    )
    assert "allkeys-lru" in text and "noeviction" in text and "allow_eviction" in text
    assert list_checkpoints(srv.url()) == []
    dcp.save(
        sd_of(2), storage_writer=KVStorageWriter(srv.url() + "?allow_eviction=1"), checkpoint_id="a"
    )
    assert latest_checkpoint(srv.url()) == "a"


def test_preflight_refuses_a_save_that_does_not_fit(server) -> None:
    srv = server("--maxmemory", "48mb")
    dcp.save(sd_of(16), storage_writer=KVStorageWriter(srv.url()), checkpoint_id="old")
    text = raises_text(
        lambda: dcp.save(sd_of(40), storage_writer=KVStorageWriter(srv.url()), checkpoint_id="new")
    )
    assert "no room" in text and f"needs {40 * MIB} bytes" in text and "free" in text
    out = {k: torch.zeros_like(v) for k, v in sd_of(16).items()}
    dcp.load(out, storage_reader=KVStorageReader(srv.url()), checkpoint_id="old")
    assert all(torch.equal(out[k], v) for k, v in sd_of(16).items())


def test_maxmemory_reached_mid_save_cleans_up(server) -> None:
    srv = server("--maxmemory", "48mb")
    url = srv.url()
    dcp.save(sd_of(8), storage_writer=KVStorageWriter(url), checkpoint_id="old")
    engine = open_store(url)
    engine.preflight = lambda nbytes: None  # let the save run into the server's limit
    text = raises_text(
        lambda: dcp.save(sd_of(64), storage_writer=KVStorageWriter(engine), checkpoint_id="big")
    )
    assert "ran out of memory" in text and "maxmemory" in text and "used_memory" in text
    assert [i.checkpoint_id for i in list_checkpoints(url)] == ["old"]
    assert list(engine.scan(data_prefix(engine.prefix, "big"))) == []  # partial data removed
    out = {k: torch.zeros_like(v) for k, v in sd_of(8).items()}
    dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id="old")
    assert all(torch.equal(out[k], v) for k, v in sd_of(8).items())


def test_server_restarted_mid_save_is_never_committed(server) -> None:
    srv = server()
    url = srv.url()
    engine = open_store(url)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            dcp.save(sd_of(768), storage_writer=KVStorageWriter(url), checkpoint_id="x")
        except BaseException as e:
            errors.append(e)

    writer = threading.Thread(target=save)
    writer.start()
    deadline = time.monotonic() + 60
    while next(engine.scan(data_prefix(engine.prefix, "x")), None) is None:
        assert time.monotonic() < deadline and writer.is_alive(), "save never started"
        time.sleep(0.01)
    srv.proc.kill()  # the server dies mid-save ...
    srv.proc.wait()
    srv.start()  # ... and comes back empty (no persistence), on the same port
    writer.join(120)
    assert errors, "a save across a server restart must fail"
    text = str(errors[0])
    assert "restarted" in text or "cannot reach Redis" in text
    assert engine.get(meta_key(engine.prefix, "x")) is None
    dcp.save(sd_of(4), storage_writer=KVStorageWriter(url), checkpoint_id="x")
    assert latest_checkpoint(url) == "x"


def test_a_dropped_connection_is_retried(server) -> None:
    srv = server()
    url = srv.url()
    engine = open_store(url)
    sd = sd_of(8)
    dcp.save(sd, storage_writer=KVStorageWriter(engine), checkpoint_id="a")
    # Kill every client connection from the server side; the next load reconnects.
    srv.client().client_kill_filter(_type="normal", skipme=True)
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=KVStorageReader(engine), checkpoint_id="a")
    assert all(torch.equal(out[k], v) for k, v in sd.items())


def make_tls_files(directory: Path) -> dict[str, Path]:
    """A throwaway CA, and a server and a client certificate it signed."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=kvckpt-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
    )
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        run(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            "/CN=localhost",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            f"{name}.crt",
        )
    return {
        n: directory / n for n in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")
    }


def test_tls_with_client_certificates_and_acl_user(server, tmp_path: Path) -> None:
    from kvckpt.testing import free_port

    files = make_tls_files(tmp_path)
    tls_port = free_port()
    srv = server(
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(files["server.crt"]),
        "--tls-key-file",
        str(files["server.key"]),
        "--tls-ca-cert-file",
        str(files["ca.crt"]),
        "--tls-auth-clients",
        "yes",
        "--user",
        "trainer",
        "on",
        ">s3cret-pw",
        "~*",
        "&*",
        "+@all",
    )
    base = f"rediss://trainer:s3cret-pw@localhost:{tls_port}/0"
    certs = (
        f"ssl_ca_certs={files['ca.crt']}&ssl_certfile={files['client.crt']}"
        f"&ssl_keyfile={files['client.key']}"
    )
    url = f"{base}?{certs}"
    sd = sd_of(3)
    dcp.save(sd, storage_writer=KVStorageWriter(url), checkpoint_id="tls")
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    dcp.load(out, storage_reader=KVStorageReader(url), checkpoint_id="tls")
    assert all(torch.equal(out[k], v) for k, v in sd.items())
    assert [i.checkpoint_id for i in list_checkpoints(url)] == ["tls"]

    wrong = f"rediss://trainer:not-the-pw@localhost:{tls_port}/0?{certs}"
    with pytest.raises(StoreUnavailableError) as info:
        KVStorageReader(wrong, checkpoint_id="tls").read_record()
    assert "not-the-pw" not in str(info.value) and "s3cret" not in str(info.value)
    untrusted = f"{base}?ssl_certfile={files['client.crt']}&ssl_keyfile={files['client.key']}"
    with pytest.raises(StoreUnavailableError) as info:
        KVStorageReader(untrusted, checkpoint_id="tls").read_record()
    assert "s3cret" not in str(info.value) and f"localhost:{tls_port}" in str(info.value)
    # A plain-TCP client on the TLS port gets a clear error, not a hang.
    del srv


def test_store_full_error_is_a_kvckpt_error() -> None:
    from kvckpt import KVCheckpointError

    assert issubclass(StoreFullError, KVCheckpointError)
