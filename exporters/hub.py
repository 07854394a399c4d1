"""Publish a complete, verified export to the Hugging Face Hub (``huggingface_hub.upload_folder``).

The token comes from ``HF_TOKEN`` or the cached ``hf auth login``; it is never printed or written anywhere.
"""
from __future__ import annotations

import re
from pathlib import Path

from exporters.manifest import MANIFEST, read_manifest
from prune_heads.console import say
from prune_heads.errors import UserError

# A git branch name as the Hub accepts it (git check-ref-format's rules, one component or several).
_BRANCH = re.compile(r"(?!/)(?!.*(?:\.\.|//|@\{|\.lock(?:/|$)|/\.|/$))[^\x00-\x20\x7f~^:?*\[\\]+")


def check_repo_id(repo_id: str) -> None:
    """A Hub model id, user/name, as the Hub's own validator reads it."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    shaped = repo_id.count("/") == 1 and all(repo_id.split("/"))
    try:
        if shaped:
            validate_repo_id(repo_id)
    except HFValidationError:
        shaped = False
    if not shaped:
        raise UserError(f"`push_to` {repo_id!r} is not a Hub repo id; use user/name: letters, digits, '-', '_' and "
                        "'.', no '--' or '..', neither at either end, at most 96 characters")


def check_branch(branch: str) -> None:
    if not _BRANCH.fullmatch(branch) or branch.startswith("-") or branch.endswith("."):
        raise UserError(f"`branch` {branch!r} is not a valid branch name (no spaces, '..', '~', '^', ':', '?', '*', "
                        "'[', '\\' or trailing '/', '.' or '.lock'); choose another name")


def _refused(error, repo_id: str) -> UserError:
    """An HTTP error of the Hub as one line: its status and its own message; a hint for the usual causes."""
    status = getattr(error.response, "status_code", "?")
    said = (getattr(error, "server_message", None) or "").strip().splitlines()
    reason = f": {said[0][:120]}" if said else ""
    hint = {401: "check HF_TOKEN or run `hf auth login`", 403: "check HF_TOKEN's write access to this repo",
            404: "check the repo id and branch"}.get(status, "check the repo id and branch")
    return UserError(f"the Hub refused {repo_id} (HTTP {status}{reason}); {hint}")


def push_export(directory: str | Path, repo_id: str, private: bool = False, branch: str | None = None,
                commit_message: str | None = None, force: bool = False) -> str:
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    directory = Path(directory)
    meta = read_manifest(directory)  # refuses anything that is not a complete, verified export
    check_repo_id(repo_id)
    if branch is not None:
        check_branch(branch)
    api = HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if private and not api.repo_info(repo_id).private:  # an existing public repo: made private, and said
            api.update_repo_settings(repo_id, private=True)
            say(f"{repo_id} existed and was public; made it private as `private` asks", fg="green")
        if branch and branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
        existing = set(api.list_repo_files(repo_id, revision=branch)) - {".gitattributes"}
    except HfHubHTTPError as e:
        raise _refused(e, repo_id) from None
    except Exception as e:  # noqa: BLE001  (no network, DNS, TLS, offline mode: never a traceback, never the token)
        raise UserError(f"could not reach the Hub at {api.endpoint} ({type(e).__name__}); check your network, "
                        "HF_ENDPOINT and HF_HUB_OFFLINE") from None
    if existing and not force:
        shown = ", ".join(sorted(existing)[:3]) + ("..." if len(existing) > 3 else "")
        raise UserError(f"{repo_id} already has files ({shown}); pass `force` to overwrite them, or choose another "
                        "`push_to` or `branch`")
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
    say(f"pushed {len(files)} files to {repo_id}: {url}", fg="green")
    return url
