"""Push round trip against a Hub-compatible server on 127.0.0.1, through the real huggingface_hub upload and
transformers from_pretrained code paths (in subprocesses, so HF_ENDPOINT is set before huggingface_hub loads)."""
import os
import subprocess
import sys

import pytest
import torch
from helpers import cli_subprocess
from hub_server import HubServer
from tiny import run_cli, tiny_model

from exporters.export import ExportOptions, export_pruned
from exporters.manifest import MANIFEST
from prune_heads.heads import HeadSet

HEADS = HeadSet.of({0: [0, 3], 1: [1, 4], 2: [2, 5], 3: [0, 3]})


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    export_pruned(tiny_model("llama"), HEADS, d, ExportOptions(progress=False))
    return d


@pytest.fixture()
def hub(tmp_path):
    with HubServer() as server:
        env = {**os.environ, "HF_ENDPOINT": server.url, "HF_TOKEN": server.state.token, "HF_HOME": str(tmp_path / "hf"),
               "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1"}
        yield server, env


RELOAD = """
import sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], revision=sys.argv[2])
ids = torch.tensor([[3, 17, 45, 99, 120, 7, 250, 33, 61]])
torch.save(m(input_ids=ids).logits, sys.argv[3])
"""


@pytest.mark.slow
def test_push_round_trip_files_and_logits(export_dir, hub, tmp_path):
    from transformers import AutoModelForCausalLM

    server, env = hub
    proc = cli_subprocess(["push", export_dir, "--repo-id", "user/pruned-tiny", "--branch", "v1"], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    token = server.state.token
    assert token not in proc.stdout + proc.stderr
    assert all(token not in p.read_text(errors="ignore") for p in export_dir.iterdir() if p.is_file())
    assert f"Bearer {token}" in server.state.auth_headers_seen
    files = server.state.repos["user/pruned-tiny"]["branches"]["v1"]["files"]
    local = {p.name: p.read_bytes() for p in export_dir.iterdir() if p.is_file()}
    assert set(files) == set(local) and all(files[k] == local[k] for k in local)
    assert "heads removed" in server.state.commits[-1]["summary"]

    out = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, "-c", RELOAD, "user/pruned-tiny", "v1", str(out)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    local_model = AutoModelForCausalLM.from_pretrained(export_dir)
    with torch.no_grad():
        expected = local_model(input_ids=torch.tensor([[3, 17, 45, 99, 120, 7, 250, 33, 61]])).logits
    assert torch.equal(torch.load(out), expected)


@pytest.mark.slow
def test_push_refuses_to_overwrite_without_force_and_bad_dirs_and_tokens(export_dir, hub, tmp_path):
    server, env = hub
    assert cli_subprocess(["push", export_dir, "--repo-id", "user/r"], env).returncode == 0
    proc = cli_subprocess(["push", export_dir, "--repo-id", "user/r"], env)
    assert proc.returncode == 2 and "already has files" in proc.stderr and "--force" in proc.stderr
    assert cli_subprocess(["push", export_dir, "--repo-id", "user/r", "--force"], env).returncode == 0

    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "config.json").write_text("{}")
    proc = cli_subprocess(["push", incomplete, "--repo-id", "user/x"], env)
    assert proc.returncode == 2 and f"no {MANIFEST}" in proc.stderr

    proc = cli_subprocess(["push", export_dir, "--repo-id", "user/y"], {**env, "HF_TOKEN": "hf_wrong_token_value"})
    assert proc.returncode == 2 and "HTTP 401" in proc.stderr and "HF_TOKEN" in proc.stderr
    assert "hf_wrong_token_value" not in proc.stderr + proc.stdout
    assert "user/y" not in server.state.repos


@pytest.mark.slow
def test_main_command_push_to(hub, tmp_path):
    from helpers import cais_file

    server, env = hub
    lm = tiny_model("qwen2")
    model = tmp_path / "model"
    lm.model.save_pretrained(model)
    lm.tokenizer.save_pretrained(model)
    mmlu = cais_file(tmp_path, n_subjects=2, per_subject=8)
    proc = cli_subprocess(["--model", model, "--mmlu", mmlu, "--out", tmp_path / "out", "--calibration-size", "4", "--no-progress",
                "--push-to", "user/main-push", "--private"], env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    repo = server.state.repos["user/main-push"]
    assert repo["private"] and MANIFEST in repo["branches"]["main"]["files"]
    assert repo["branches"]["main"]["files"]["model.safetensors"] == (tmp_path / "out" / "model.safetensors").read_bytes()


@pytest.mark.slow
def test_push_makes_an_existing_public_repo_private_when_asked_and_words_bad_ids(export_dir, hub, capsys):
    server, env = hub
    assert cli_subprocess(["push", export_dir, "--repo-id", "user/pub"], env).returncode == 0
    assert server.state.repos["user/pub"]["private"] is False
    proc = cli_subprocess(["push", export_dir, "--repo-id", "user/pub", "--private", "--force"], env)
    assert proc.returncode == 0, proc.stderr
    assert "was public; made it private" in proc.stderr and server.state.repos["user/pub"]["private"] is True
    # Refused before any request: in this process (no Hub endpoint needed; nothing may reach one).
    for repo_id in ("user/na me", "a/b/c", "user/x--y", "-user/x"):
        code, _, err = run_cli(["push", export_dir, "--repo-id", repo_id], capsys)
        assert code == 2 and "is not a Hub repo id" in err and "network" not in err
        assert len(err.strip().splitlines()) == 1
    for branch in ("a..b", "with space", "x.lock", "-x"):
        code, _, err = run_cli(["push", export_dir, "--repo-id", "user/b", "--branch", branch], capsys)
        assert code == 2 and "is not a valid branch name" in err, err
    assert "user/b" not in server.state.repos
