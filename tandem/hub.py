"""Models from the Hugging Face Hub by reference: `hf://OWNER/REPO/PATH/FILE.gguf`, optionally `@REVISION`.

The file is downloaded once into the Hub's cache (huggingface_hub: resumable, with a progress bar; `HF_HOME` or
`HF_HUB_CACHE` moves it) and checked against the Hub's metadata: its size, and for files in Git LFS (every GGUF) its
SHA-256, hashed once and remembered beside the cache. `HF_ENDPOINT` points at a mirror (the tests use a local one),
`HF_TOKEN` opens gated repositories, `HF_HUB_OFFLINE=1` serves what is cached without asking the Hub; a Hub that
cannot be reached serves what is cached too.

`tandem-fetch REF...` (`python -m tandem.hub`) downloads and checks before a service starts: compose's `fetch-models`
service and the Helm chart's init containers run it, so a multi-GB download happens once, into the models volume.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "hf://"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ModelCheckFailed(RuntimeError):
    """A downloaded file does not match the Hub's size or SHA-256."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    filename: str
    revision: str | None = None

    @classmethod
    def parse(cls, reference: str) -> HubRef:
        """`hf://owner/repo/dir/file.gguf@rev` -> (owner/repo, dir/file.gguf, rev)."""
        body = reference.removeprefix(PREFIX)
        body, _, revision = body.partition("@")
        parts = body.split("/")
        if len(parts) < 3 or not all(parts):
            raise ValueError(f"a Hub reference is hf://OWNER/REPO/PATH/FILE.gguf[@REVISION], not {reference!r}")
        return cls("/".join(parts[:2]), "/".join(parts[2:]), revision or None)


def is_reference(model: str) -> bool:
    return model.startswith(PREFIX)


def fetch(reference: str, cache_dir: str | Path | None = None) -> Path:
    """The local path of a Hub file, downloaded and checked on first use."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    ref = HubRef.parse(reference)
    endpoint = os.environ.get("HF_ENDPOINT") or None  # read now, not at import: a mirror set after start-up works
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    cache_dir = cache_dir or os.environ.get("HF_HUB_CACHE") or None  # read now, as HF_ENDPOINT
    where = {"revision": ref.revision, "cache_dir": str(cache_dir) if cache_dir else None}
    try:
        if offline:
            return Path(hf_hub_download(ref.repo_id, ref.filename, local_files_only=True, **where))
        url = hf_hub_url(ref.repo_id, ref.filename, revision=ref.revision, endpoint=endpoint)
        try:
            meta = get_hf_file_metadata(url, endpoint=endpoint)
        except _unreachable() as exc:
            return _cached(reference, ref, where, exc)
        print(f"tandem: {reference}: {_size(meta.size)} (cached after the first download)", flush=True)
        path = Path(hf_hub_download(ref.repo_id, ref.filename, endpoint=endpoint, **where))
    except GatedRepoError as exc:
        raise PermissionError(f"{reference}: gated: accept its terms on the Hub, then set HF_TOKEN") from exc
    except (EntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
        kind = type(exc).__name__
        hint = "check the repository and path (a private repository needs HF_TOKEN)"
        raise FileNotFoundError(f"{reference}: not on the Hub ({kind}): {hint}") from exc
    check(path, meta.size, meta.etag)
    return path


def _cached(reference: str, ref: HubRef, where: dict, error: BaseException) -> Path:
    """The Hub cannot be reached: what an earlier run downloaded (and checked) serves, as with HF_HUB_OFFLINE=1."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = Path(hf_hub_download(ref.repo_id, ref.filename, local_files_only=True, **where))
    except LocalEntryNotFoundError:
        raise ConnectionError(f"{reference}: the Hub cannot be reached ({error}) and the file is not cached") from error
    print(f"tandem: {reference}: the Hub cannot be reached, serving the cached copy", flush=True)
    return path


def _unreachable() -> tuple[type[BaseException], ...]:
    """The exceptions of a Hub that does not answer (huggingface_hub's HTTP client: httpx2, httpx or requests)."""
    import importlib

    from huggingface_hub.errors import OfflineModeIsEnabled

    errors: list[type[BaseException]] = [OfflineModeIsEnabled]
    for name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            module = importlib.import_module(name)
            errors += [module.ConnectError, module.TimeoutException]
    with contextlib.suppress(ImportError):
        import requests

        errors += [requests.ConnectionError, requests.Timeout]
    return tuple(errors)


def check(path: Path, size: int | None, etag: str | None) -> None:
    """The file's size and, for an LFS file (its etag is the SHA-256), its content, against the Hub's metadata."""
    actual = path.stat().st_size
    if size is not None and actual != size:
        raise ModelCheckFailed(f"{path}: {actual} bytes, the Hub says {size}: delete it and download again")
    digest = (etag or "").strip('"').removeprefix("W/").strip('"')
    if not _SHA256.match(digest):
        return  # a small file kept in git itself: its etag is a git hash, and the size check is what there is
    marker = _verified_dir(path) / digest
    if marker.is_file():
        return
    print(f"tandem: checking the SHA-256 of {path.name} (once)", flush=True)
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    if h.hexdigest() != digest:
        raise ModelCheckFailed(f"{path}: SHA-256 {h.hexdigest()}, the Hub says {digest}: delete it and download again")
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def _verified_dir(path: Path) -> Path:
    """Beside the Hub's cache of this file: `<cache>/.tandem-verified` (a read-only model cache gets none: re-hash)."""
    for parent in path.parents:
        if parent.name.startswith("models--"):
            return parent.parent / ".tandem-verified"
    return path.parent / ".tandem-verified"


def _size(n: int | None) -> str:
    if n is None:
        return "size unknown"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    """tandem-fetch: each model downloaded and checked (a Hub reference) or resolved (a path, a short name)."""
    parser = argparse.ArgumentParser(
        prog="tandem-fetch",
        description="Download and check models before a service starts, and print each one's local path: compose's "
        "fetch-models service and the Helm chart's init containers run it. Exit status 1 if any model failed.",
    )
    parser.add_argument(
        "models",
        nargs="*",
        metavar="MODEL",
        help="hf://OWNER/REPO/PATH/FILE.gguf[@REVISION] (into the Hub cache: HF_HOME, HF_HUB_CACHE), a GGUF path or "
        "a short name (smollm2-135m, gemma3-270m: resolved, the file must exist); an empty MODEL is skipped",
    )
    parser.add_argument(
        "--hub-only",
        action="store_true",
        help="fetch the hf:// references only and leave paths and short names to the service (an image without "
        "the model packages or the model folder)",
    )
    args = parser.parse_args(argv)
    for name in ("HF_ENDPOINT", "HF_TOKEN", "HF_HOME", "HF_HUB_CACHE"):
        if os.environ.get(name) == "":  # compose's ${HF_ENDPOINT:-}: empty means unset, not the endpoint ""
            del os.environ[name]
    failed = 0
    for model in args.models:
        if not model.strip() or (args.hub_only and not is_reference(model)):
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr):  # progress and notes to stderr: stdout is the paths
                path = _local_path(model)
        except Exception as exc:
            failed += 1
            message = " ".join(str(exc).split()) or type(exc).__name__
            print(f"tandem-fetch: error: {message if model in message else f'{model}: {message}'}", file=sys.stderr)
            continue
        print(path, flush=True)
    return 1 if failed else 0


def _local_path(model: str) -> Path:
    from tandem.models import resolve_model

    path = resolve_model(model)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return path


if __name__ == "__main__":
    sys.exit(main())
