"""Downloads (data/download.py) against a local HTTP server: verified, cached, atomic, and failing
with a message that says where to place the file by hand. No test here touches the internet.

    python -m pytest tests/test_download.py -q
"""
from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from fake_mnist import write_fake_mnist

from conftest import build_data, data_options, run_train
from data import mnist, shakespeare
from data.download import fetch
from loop.errors import BadInput

BLOB = np.random.default_rng(0).bytes(2_500_000)  # three read chunks: the streaming path
BLOB_SHA = hashlib.sha256(BLOB).hexdigest()
WRONG_SHA = "0" * 64


class Server:
    """Serves `files` (URL path -> bytes) on 127.0.0.1 at an ephemeral port and counts requests."""

    def __init__(self):
        self.files: dict[str, bytes] = {}
        self.cut: dict[str, int] = {}  # URL path -> bytes sent before hanging up (Content-Length whole)
        self.requests: list[str] = []
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.requests.append(self.path)
                body = server.files.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: server.cut.get(self.path, len(body))])

            def log_message(self, *args):  # keep the test output quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture
def dead_url() -> str:
    """A port nothing listens on: bound for a moment to pick it, then closed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def hint(e: pytest.ExceptionInfo, dest: Path, url: str, sha: str) -> bool:
    msg = str(e.value)
    return f"Download it yourself from {url} and place it at {dest.resolve()} (sha256 {sha})" in msg


# ------------------------------------------------------------------------------- the helper
def test_verified_download_is_cached_and_reused_offline(server, tmp_path, capsys):
    server.files["/blob.bin"] = BLOB
    path = fetch("blob.bin", [f"{server.url}/blob.bin"], BLOB_SHA, tmp_path / "cache")
    assert path == tmp_path / "cache" / "blob.bin" and path.read_bytes() == BLOB
    assert server.requests == ["/blob.bin"] and "downloading" in capsys.readouterr().out
    again = fetch("blob.bin", [f"{server.url}/blob.bin"], BLOB_SHA, tmp_path / "cache")
    assert again == path and server.requests == ["/blob.bin"]  # the server saw no second request
    assert capsys.readouterr().out == ""
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["blob.bin"]  # no temp file left


def test_a_temp_file_of_another_process_is_never_touched(server, tmp_path):
    # Processes in other PID namespaces (containers sharing a cache on network storage) have the
    # same PIDs: a temp name made of the PID alone was truncated by one, then renamed or deleted.
    server.files["/blob.bin"] = BLOB
    cache = tmp_path / "cache"
    cache.mkdir()
    theirs = cache / f".blob.bin.tmp-{os.getpid()}"
    theirs.write_bytes(b"another process's download, under way")
    path = fetch("blob.bin", [f"{server.url}/blob.bin"], BLOB_SHA, cache)
    assert path.read_bytes() == BLOB and theirs.read_bytes() == b"another process's download, under way"


def test_checksum_mismatch_leaves_nothing(server, tmp_path):
    server.files["/blob.bin"] = BLOB
    cache = tmp_path / "cache"
    with pytest.raises(BadInput) as e:
        fetch("blob.bin", [f"{server.url}/blob.bin"], WRONG_SHA, cache)
    assert f"{server.url}/blob.bin (checksum mismatch: got {BLOB_SHA}, expected {WRONG_SHA})" in str(e.value)
    assert hint(e, cache / "blob.bin", f"{server.url}/blob.bin", WRONG_SHA)
    assert list(cache.iterdir()) == []  # neither a temp file nor the final one


def test_a_connection_dropped_mid_file_is_named_as_such(server, tmp_path):
    # Named as a dropped connection, not as a checksum mismatch, as if the mirror served another
    # file.
    server.files["/blob.bin"], server.cut["/blob.bin"] = BLOB, 1_250_000
    with pytest.raises(BadInput) as e:
        fetch("blob.bin", [f"{server.url}/blob.bin"], BLOB_SHA, tmp_path / "cache")
    assert f"{server.url}/blob.bin (the connection closed after 1,250,000 of 2,500,000 bytes)" in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


def test_server_down_and_http_errors_name_each_url(server, dead_url, tmp_path):
    cache = tmp_path / "cache"
    urls = [f"{server.url}/missing.bin", f"{dead_url}/blob.bin"]
    with pytest.raises(BadInput) as e:
        fetch("blob.bin", urls, BLOB_SHA, cache, origin="https://example.org/blob.bin")
    msg = str(e.value)
    assert msg.startswith("data: cannot fetch blob.bin; tried ")
    assert f"{urls[0]} (HTTP 404 Not Found)" in msg and f"{urls[1]} (connection refused)" in msg
    assert hint(e, cache / "blob.bin", "https://example.org/blob.bin", BLOB_SHA)  # origin, not a mirror
    assert list(cache.iterdir()) == []


def test_falls_back_to_the_next_url(server, dead_url, tmp_path):
    server.files["/bad.bin"], server.files["/blob.bin"] = b"not it", BLOB
    urls = [f"{dead_url}/blob.bin", f"{server.url}/bad.bin", f"{server.url}/blob.bin"]
    path = fetch("blob.bin", urls, BLOB_SHA, tmp_path)
    assert path.read_bytes() == BLOB and server.requests == ["/bad.bin", "/blob.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["blob.bin"]


def test_a_full_disk_is_not_blamed_on_the_url(server, tmp_path):
    # A real refused write, in this process: a file-size limit (soft, put back after) below the
    # file's size makes the kernel refuse the write (EFBIG; Python ignores SIGXFSZ), as ENOSPC would.
    # Named as a refused write, not as the URL failing, the next mirror tried, and exit 2 blaming
    # the network.
    import errno
    import resource

    server.files["/a.bin"] = server.files["/b.bin"] = BLOB
    urls = [f"{server.url}/a.bin", f"{server.url}/b.bin"]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (len(BLOB) // 2, hard))
    try:
        with pytest.raises(OSError) as e:
            fetch("blob.bin", urls, BLOB_SHA, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert e.value.errno == errno.EFBIG and e.value.filename == str(tmp_path / "blob.bin")
    assert server.requests == ["/a.bin"], "no other URL is tried"
    assert list(tmp_path.iterdir()) == [], "the part written is removed"


def test_a_corrupt_cached_file_is_replaced(server, tmp_path):
    (tmp_path / "blob.bin").write_bytes(BLOB[:1000])  # e.g. a partial copy placed by hand
    server.files["/blob.bin"] = BLOB
    assert fetch("blob.bin", [f"{server.url}/blob.bin"], BLOB_SHA, tmp_path).read_bytes() == BLOB


def test_the_file_is_synced_before_it_takes_its_name_and_its_directory_after(server, tmp_path, monkeypatch):
    # A power cut after the rename must find the whole file under its name (and the name itself).
    events, fsync, replace = [], os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.fstat(fd).st_ino)), fsync(fd)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", os.stat(a).st_ino)), replace(a, b)))
    server.files["/blob.bin"] = BLOB
    path = fetch("blob.bin", [f"{server.url}/blob.bin"], BLOB_SHA, tmp_path)
    monkeypatch.undo()
    file, folder = path.stat().st_ino, tmp_path.stat().st_ino
    assert events == [("fsync", file), ("replace", file), ("fsync", folder)]


def test_a_stalled_server_and_an_unknown_host_are_named_as_such(tmp_path, monkeypatch):
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):  # as offline, without asking a resolver (none in CI)
        if host == "mirror.invalid":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    with socket.socket() as stalled:  # accepts connections (the backlog) and never answers
        stalled.bind(("127.0.0.1", 0))
        stalled.listen()
        urls = ["http://mirror.invalid/blob.bin", f"http://127.0.0.1:{stalled.getsockname()[1]}/blob.bin"]
        with pytest.raises(BadInput) as e:
            fetch("blob.bin", urls, BLOB_SHA, tmp_path, timeout=0.5)
    assert f"tried {urls[0]} (offline or unknown host: Name or service not known); {urls[1]} (timed out)." \
        in str(e.value)


def test_a_cache_dir_that_cannot_be_made_is_named(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(BadInput) as e:
        fetch("blob.bin", ["http://127.0.0.1:9/blob.bin"], BLOB_SHA, tmp_path / "f" / "cache")
    assert str(e.value) == (f"config key data.cache_dir={tmp_path / 'f' / 'cache'}: {tmp_path / 'f'} is "
                            f"a file; expected a directory, or a path where one can be made.")


def test_a_wrong_file_in_a_cache_that_cannot_be_written_is_named_with_it(tmp_path, monkeypatch):
    # A read-only cache (a shared, prepared one) holding a file placed by hand that does not match:
    # the checksum is the cause to fix, not only the cache's permissions.
    import data.download

    def read_only(name, path, write=True):
        raise BadInput(f"{name}={path}: cannot write in {path}; expected a directory this user can write to.")

    monkeypatch.setattr(data.download, "writable_dir", read_only)
    (tmp_path / "blob.bin").write_bytes(b"wrong")
    with pytest.raises(BadInput) as e:
        fetch("blob.bin", ["http://127.0.0.1:9/blob.bin"], BLOB_SHA, tmp_path)
    assert f"cannot write in {tmp_path}" in str(e.value) and f"the cached {tmp_path / 'blob.bin'} (checksum " \
        f"mismatch: got {hashlib.sha256(b'wrong').hexdigest()}, expected {BLOB_SHA})" in str(e.value)


# ------------------------------------------------------------------------------- the data sets
def test_mnist_download_good_path(server, tmp_path, monkeypatch):
    src = write_fake_mnist(tmp_path / "src", n_train=300, n_val=100, seed=1)
    pins = {n: hashlib.sha256((src / n).read_bytes()).hexdigest() for n in mnist.FILES}
    monkeypatch.setattr(mnist, "FILES", pins)  # the generated files stand in for the real ones
    server.files.update({f"/mirror/{n}": (src / n).read_bytes() for n in pins})
    cfg = data_options("mnist", url=f"{server.url}/mirror/", cache_dir=str(tmp_path / "cache"))
    data = build_data(cfg)
    assert (len(data.train), len(data.val), data.vocab_size, data.seq_len) == (300, 100, 10, 1)
    item = data.val[7]
    assert item["x"].shape == (1, 28, 28) and item["x"].dtype == torch.float32
    assert item["y"].shape == () and item["y"].dtype == torch.int64 and 0 <= int(item["y"]) <= 9
    assert item["idx"] == 7
    cached = tmp_path / "cache" / "mnist"
    assert sorted(p.name for p in cached.iterdir()) == sorted(pins)
    assert all((cached / n).read_bytes() == (src / n).read_bytes() for n in pins)
    assert len(server.requests) == 4
    build_data(cfg)
    assert len(server.requests) == 4  # the second build reads the cache only


def test_shakespeare_download_good_path(server, tmp_path, monkeypatch):
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40
    monkeypatch.setattr(shakespeare, "SHA256", hashlib.sha256(text.encode()).hexdigest())
    server.files["/m/input.txt"] = text.encode()
    data = build_data(data_options("shakespeare", url=f"{server.url}/m", seq_len=8,
                                 cache_dir=str(tmp_path)))
    assert server.requests == ["/m/input.txt"]  # <data.url>/input.txt
    assert data.vocab_size == len(set(text)) and data.decode(data.train[0]["x"].tolist()) == text[:8]
    assert (tmp_path / "shakespeare" / "input.txt").read_text() == text


# ------------------------------------------------------------------------------- through train.py
def test_train_py_mnist_wrong_bytes_exits_2(server, tmp_path):
    server.files.update({f"/{n}": b"not a gzip file" for n in mnist.FILES})
    out, cache = tmp_path / "run", tmp_path / "cache"
    r = run_train(out, "--config", "configs/mnist.yaml", f"data.url={server.url}",
                  f"data.cache_dir={cache}", check=False)
    assert r.returncode == 2, r.stderr
    name = "train-images-idx3-ubyte.gz"
    assert r.stderr.startswith(f"error: data: cannot fetch {name}; tried {server.url}/{name} "
                               f"(checksum mismatch: got {hashlib.sha256(b'not a gzip file').hexdigest()}")
    assert f"Download it yourself from {mnist.BASE_URLS[0]}{name} and place it at " \
           f"{(cache / 'mnist' / name).resolve()} (sha256 {mnist.FILES[name]})" in r.stderr
    assert r.stderr.endswith(f"MNIST needs all four files in {(cache / 'mnist').resolve()}: "
                             f"{', '.join(mnist.FILES)}, from the same place.\n")
    assert "Traceback" not in r.stderr and not out.exists()
    assert list((cache / "mnist").iterdir()) == []


def test_train_py_shakespeare_server_down_exits_2(dead_url, tmp_path):
    out, cache = tmp_path / "run", tmp_path / "cache"
    r = run_train(out, "data.name=shakespeare", f"data.url={dead_url}", f"data.cache_dir={cache}",
                  check=False)
    assert r.returncode == 2, r.stderr
    assert f"{dead_url}/input.txt (connection refused)" in r.stderr
    assert f"Download it yourself from {shakespeare.URLS[0]} and place it at " \
           f"{(cache / 'shakespeare' / 'input.txt').resolve()} (sha256 {shakespeare.SHA256})" in r.stderr
    assert "Traceback" not in r.stderr and not out.exists()
    assert list((cache / "shakespeare").iterdir()) == []
