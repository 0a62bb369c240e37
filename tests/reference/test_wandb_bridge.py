"""tools/wandb_bridge.py: pcp events -> wandb calls, with a fake wandb module,
and one real offline run read back with `--dump`."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

SCRIPT = ROOT / "tools" / "wandb_bridge.py"
_spec = importlib.util.spec_from_file_location("wandb_bridge", SCRIPT)
bridge = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bridge)


class FakeRun:
    def __init__(self):
        self.config = FakeConfig()
        self.summary = {}


class FakeConfig(dict):
    def update(self, values, allow_val_change=False):
        assert allow_val_change
        super().update(values)


class FakeWandb:
    """Records what the bridge asks of wandb."""

    def __init__(self):
        self.calls = []
        self.run = None

    def init(self, **kwargs):
        self.calls.append(("init", kwargs))
        self.run = FakeRun()
        return self.run

    def define_metric(self, name, step_metric=None):
        self.calls.append(("define_metric", name, step_metric))

    def log(self, metrics):
        self.calls.append(("log", metrics))

    def finish(self):
        self.calls.append(("finish",))

    def logged(self):
        return [c[1] for c in self.calls if c[0] == "log"]


ROUND = {"event": "round_completed", "round": 1, "contributors": 3, "mean_loss": 2.5, "val_loss": 2.25,
         "seconds": 1.5, "bytes_in": 1000, "bytes_out": 2000, "excluded": ["a"], "params_hash": "ff"}


def feed(lines, init_args=None):
    wandb = FakeWandb()
    b = bridge.Bridge(wandb, init_args or {"project": "p"})
    malformed = bridge.run([json.dumps(x) if isinstance(x, dict) else x for x in lines], b, bridge.Mapper())
    b.finish()
    return wandb, malformed


def test_a_round_becomes_one_log_on_the_round_axis_with_the_counters():
    wandb, malformed = feed([
        {"event": "worker_joined", "peer": "a"},
        {"event": "worker_joined", "peer": "b"},
        {"event": "worker_left", "peer": "a"},
        {"event": "contribution_rejected", "reason": "late"},
        {"event": "contribution_clipped", "norm": 3.0},
        {"event": "peer_connected"},
        ROUND,
    ])
    assert malformed == 0
    assert wandb.calls[0] == ("init", {"project": "p"})
    assert wandb.logged() == [{
        "round": 1, "round_contributors": 3, "round_mean_loss": 2.5, "val_loss": 2.25, "round_seconds": 1.5,
        "round_bytes_in": 1000, "round_bytes_out": 2000, "round_excluded": 1, "contributions_rejected": 1,
        "contributions_clipped": 1, "messages_rejected": 0, "blob_fetched_bytes": 0, "peers": 1, "workers": 1,
    }]
    assert ("define_metric", "val_loss", "round") in wandb.calls
    assert wandb.calls[-1] == ("finish",)


def test_train_steps_and_evals_use_the_step_axis():
    wandb, _ = feed([
        {"event": "step", "step": 1, "loss": 4.2, "lr": 3e-5, "tokens_per_s": 1e4},
        {"event": "eval", "step": 1, "val_loss": 4.1},
        {"event": "checkpoint", "step": 1, "path": "/x"},
    ])
    assert wandb.logged() == [
        {"step": 1, "train_loss": 4.2, "lr": 3e-5, "tokens_per_second": 1e4},
        {"step": 1, "val_loss": 4.1},
    ]
    assert ("define_metric", "train_loss", "step") in wandb.calls


def test_run_events_set_config_and_summary():
    wandb, _ = feed([
        {"event": "run_started", "run": "abc", "model": "nanogpt-small", "rounds": 2, "tau": 5, "resumed_round": 0},
        {"event": "run_finished", "run": "abc", "rounds": 2},  # a worker's, in `sim`
        {"event": "run_finished", "rounds": 2, "val_loss": 3.5, "seconds": 9.0, "params_hash": "ff"},
    ])
    assert dict(wandb.run.config) == {"pcp_run": "abc", "pcp_model": "nanogpt-small", "pcp_rounds": 2,
                                      "pcp_tau": 5, "pcp_resumed_round": 0}
    assert wandb.run.summary == {"rounds_completed": 2, "run_seconds": 9.0, "final_val_loss": 3.5}


def test_nothing_starts_a_run_until_something_is_worth_logging():
    wandb, _ = feed([{"event": "standby", "run": "abc"}, {"event": "peer_connected"}, {"event": "listening"}])
    assert wandb.calls == []


def test_nulls_and_nans_are_left_out():
    wandb, _ = feed([dict(ROUND, mean_loss=None), '{"event": "step", "step": 2, "loss": NaN, "lr": 0.1}'])
    assert "round_mean_loss" not in wandb.logged()[0]
    assert wandb.logged()[1] == {"step": 2, "lr": 0.1}


def test_malformed_lines_are_skipped_with_a_warning(capsys):
    wandb, malformed = feed(["not json", "[1, 2]", "", '{"event": 3}', ROUND, '{"event": "round_completed"'])
    assert malformed == 3
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("wandb_bridge: line ") for line in err), err
    assert [m["round"] for m in wandb.logged()] == [1]


def test_a_failing_log_is_a_warning_and_the_stream_goes_on(capsys):
    wandb = FakeWandb()
    calls = {"n": 0}

    def flaky_log(metrics):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("network down")
        wandb.calls.append(("log", metrics))

    wandb.log = flaky_log
    b = bridge.Bridge(wandb, {})
    bridge.run([json.dumps(dict(ROUND, round=r)) for r in (1, 2)], b, bridge.Mapper())
    assert [m["round"] for m in wandb.logged()] == [2]
    assert "network down" in capsys.readouterr().err


def test_an_offline_run_round_trips_through_dump(tmp_path):
    pytest.importorskip("wandb")
    env = dict(os.environ, WANDB_API_KEY="dummy-key", WANDB_MODE="offline", WANDB_DIR=str(tmp_path),
               WANDB_CONFIG_DIR=str(tmp_path / "config"), WANDB_CACHE_DIR=str(tmp_path / "cache"),
               WANDB_DATA_DIR=str(tmp_path / "data"))
    lines = "\n".join(json.dumps(dict(ROUND, round=r, val_loss=3.0 - r / 4)) for r in (1, 2)) + "\nbad\n"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--project", "pcp-test", "--name", "r", "--job-type", "sim",
         "--config", '{"tau": 5}'],
        input=lines, capture_output=True, text=True, env=env, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    assert "line 3 skipped" in proc.stderr
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    dump = subprocess.run([sys.executable, str(SCRIPT), "--dump", str(run_file)], capture_output=True, text=True,
                          check=True, timeout=60)
    run = json.loads(dump.stdout)
    assert (run["project"], run["name"], run["job_type"], run["config"]) == ("pcp-test", "r", "sim", {"tau": 5})
    assert [(h["round"], h["val_loss"]) for h in run["history"]] == [(1, 2.75), (2, 2.5)]
    assert run["summary"]["round"] == 2 and run["summary"]["val_loss"] == 2.5
