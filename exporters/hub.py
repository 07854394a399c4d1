"""Publish a complete, verified export to the Hugging Face Hub (``huggingface_hub.upload_folder``).

The token comes from ``HF_TOKEN`` or the cached ``hf auth login``; it is never printed or written anywhere.
"""
from __future__ import annotations

from pathlib import Path

from prune_heads.errors import UserError

from .export import MANIFEST, read_manifest


def push_export(directory: str | Path, repo_id: str, private: bool = False, branch: str | None = None,
                commit_message: str | None = None, force: bool = False, log=print) -> str:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    directory = Path(directory)
    meta = read_manifest(directory)  # refuses anything that is not a complete, verified export
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise UserError(f"--push-to {repo_id!r} must look like user/name")
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if branch and branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        existing = set(api.list_repo_files(repo_id, revision=branch)) - {".gitattributes"}
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", "?")
        hint = "check HF_TOKEN or run `hf auth login`" if status in (401, 403) else "check the repo id and your network"
        raise UserError(f"the Hub refused access to {repo_id} (HTTP {status}); {hint}") from None
    except Exception as e:  # noqa: BLE001  (no network, DNS, TLS, offline mode: never a traceback, never the token)
        raise UserError(f"could not reach the Hub at {api.endpoint} ({type(e).__name__}); check your network, "
                        "HF_ENDPOINT and HF_HUB_OFFLINE") from None
    if existing and not force:
        shown = ", ".join(sorted(existing)[:3]) + ("..." if len(existing) > 3 else "")
        raise UserError(f"{repo_id} already has files ({shown}); pass --force to overwrite them, or choose another "
                        "--push-to or --branch")
    files = sorted(meta["files"]) + [MANIFEST]
    message = commit_message or (f"prune-heads: {meta['heads_removed']} attention heads removed from "
                                 f"{meta['source_model'].get('spec')} ({meta['layout']} layout)")
    try:
        info = api.upload_folder(folder_path=str(directory), repo_id=repo_id, repo_type="model", revision=branch,
                                 commit_message=message, allow_patterns=files)
    except HfHubHTTPError as e:
        raise UserError(f"upload to {repo_id} failed (HTTP {getattr(e.response, 'status_code', '?')}); nothing was "
                        "changed if the commit did not complete; try again") from None
    except Exception as e:  # noqa: BLE001
        raise UserError(f"upload to {repo_id} failed ({type(e).__name__}); nothing was changed if the commit did not "
                        "complete; check your network and try again") from None
    url = getattr(info, "commit_url", None) or f"{repo_id}"
    log(f"pushed {len(files)} files to {repo_id}: {url}")
    return url
