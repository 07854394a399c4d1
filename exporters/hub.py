"""Publish a complete, verified export to the Hugging Face Hub (``huggingface_hub.upload_folder``).

The token comes from ``HF_TOKEN`` or the cached ``hf auth login``; it is never printed or written anywhere.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from exporters.manifest import MANIFEST, read_manifest, source_name
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


@dataclass(frozen=True)
class _Landing:
    """Where a push lands, read before anything changes: whether the repo exists, whether it is private, and the
    files already on the revision the push commits to (a branch not made yet starts from main, with main's files)."""

    exists: bool
    private: bool
    files: frozenset[str]


def _landing(api, repo_id: str, branch: str | None) -> _Landing:
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = api.repo_info(repo_id, revision=branch)
    except RepositoryNotFoundError:
        return _Landing(False, False, frozenset())
    except RevisionNotFoundError:
        info = api.repo_info(repo_id)
    files = frozenset(s.rfilename for s in info.siblings or []) - {".gitattributes"}
    return _Landing(True, bool(info.private), files)


@contextmanager
def _hub_errors(api, repo_id: str):
    """Any failure talking to the Hub as one line: its refusal, or that it could not be reached."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except HfHubHTTPError as e:
        raise _refused(e, repo_id) from None
    except Exception as e:  # noqa: BLE001  (no network, DNS, TLS, offline mode: never a traceback, never the token)
        raise UserError(f"could not reach the Hub at {api.endpoint} ({type(e).__name__}); check your network, "
                        "HF_ENDPOINT and HF_HUB_OFFLINE") from None


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
    with _hub_errors(api, repo_id):
        landing = _landing(api, repo_id, branch)
    if landing.files and not force:  # every refusal before anything on the Hub changes
        shown = ", ".join(sorted(landing.files)[:3]) + ("..." if len(landing.files) > 3 else "")
        raise UserError(f"{repo_id} already has files ({shown}); pass `force` to overwrite them, or choose another "
                        "`push_to` or `branch`")
    with _hub_errors(api, repo_id):
        if not landing.exists:
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        elif private and not landing.private:  # an existing public repo: made private, and said
            api.update_repo_settings(repo_id, private=True)
            say(f"{repo_id} existed and was public; made it private as `private` asks", fg="green")
        if branch and branch != "main":
            api.create_branch(repo_id, branch=branch, exist_ok=True)
    files = sorted(meta["files"]) + [MANIFEST]
    message = commit_message or (f"prune-heads: {meta['heads_removed']} attention heads removed from "
                                 f"{source_name(meta)} ({meta['layout']} layout)")
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
