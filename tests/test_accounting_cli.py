"""``privfusion account``: end to end through peer.cli.main, output against the library."""

import json
import re

import pytest

from peer.cli import main
from peer.cli.account import parse_models
from peer.dp.accounting import TrainingRecord, lc_epsilon, rs_epsilon
from peer.dp.accounting.accountant import Accountant

MODELS = {
    "adjacency": "replace",
    "models": [
        {
            "name": "m1",
            "steps": 200,
            "noise_multiplier": 30.0,
            "clip": 1.0,
            "learning_rate": 0.1,
            "sample_rate": 1.0,
            "accuracy": 0.95,
        },
        {
            "name": "m2",
            "steps": 200,
            "noise_multiplier": 60.0,
            "clip": 1.0,
            "learning_rate": 0.1,
            "sample_rate": 1.0,
            "accuracy": 0.9,
        },
        {
            "name": "m3",
            "steps": 100,
            "noise_multiplier": 20.0,
            "clip": 2.0,
            "learning_rate": 0.05,
            "sample_rate": 1.0,
            "accuracy": 0.85,
        },
    ],
}
RECORDS = [
    TrainingRecord.constant("replace-one", 200, 0.1, 1.0, 30.0),
    TrainingRecord.constant("replace-one", 200, 0.1, 1.0, 60.0),
    TrainingRecord.constant("replace-one", 100, 0.05, 2.0, 20.0),
]


def run_cli(tmp_path, capsys, data, *args):
    path = tmp_path / "M.json"
    path.write_text(json.dumps(data))
    code = main(["account", *args[:1], "--models", str(path), *args[1:]])
    out, err = capsys.readouterr()
    return code, out, err


def test_rs_with_weights_json(tmp_path, capsys):
    code, out, _ = run_cli(
        tmp_path, capsys, MODELS, "rs", "--weights", "0.2,0.3,0.5", "--delta", "1e-5", "--json", "--interval", "1e-3"
    )
    assert code == 0
    result = json.loads(out)
    assert result["method"] == "rs" and result["weights"] == [0.2, 0.3, 0.5] and result["delta"] == 1e-5
    expected = rs_epsilon(RECORDS, [0.2, 0.3, 0.5], 1e-5, accountant=Accountant(value_discretization_interval=1e-3))
    assert result["epsilon"]["pld"] == pytest.approx(expected.pld) and result["epsilon"]["rdp"] == pytest.approx(
        expected.rdp
    )
    assert result["expected_accuracy"] == pytest.approx(0.2 * 0.95 + 0.3 * 0.9 + 0.5 * 0.85)


def test_lc_target_json_and_table(tmp_path, capsys):
    code, out, _ = run_cli(
        tmp_path, capsys, MODELS, "lc", "--target-epsilon", "2.5", "--delta", "1e-5", "--json", "--interval", "1e-3"
    )
    assert code == 0
    result = json.loads(out)
    assert result["epsilon"]["pld"] <= 2.5 and "proxy" in result["accuracy_note"]
    assert result["epsilon"]["pld"] == pytest.approx(
        lc_epsilon(RECORDS, result["weights"], 1e-5, accountant=Accountant(value_discretization_interval=1e-3)).pld
    )
    # composition bound + linear proxy: the most accurate model meeting 2.5 alone (m2: μ = 2·sqrt(200)/60)
    assert result["bound"] == "composition" and result["weights"] == [0.0, 1.0, 0.0] and result["accuracy_proxy"] == 0.9
    code, out, _ = run_cli(
        tmp_path, capsys, MODELS, "lc", "--weights", "0.5,0.5,0", "--delta", "1e-5", "--interval", "1e-3"
    )
    assert code == 0 and "closed form" in out and "m3" in out


def test_the_figure_flag_and_its_old_name_choose_by_rdp(tmp_path, capsys):
    args = ("rs", "--target-epsilon", "3", "--delta", "1e-5", "--json", "--interval", "1e-3")
    by_pld = json.loads(run_cli(tmp_path, capsys, MODELS, *args)[1])
    by_figure = json.loads(run_cli(tmp_path, capsys, MODELS, *args, "--figure", "rdp")[1])
    by_old_name = json.loads(run_cli(tmp_path, capsys, MODELS, *args, "--accountant", "rdp")[1])
    assert by_pld["accountant"] == "pld" and by_figure["accountant"] == "rdp"
    assert by_old_name == by_figure
    # met by the RDP figure: RDP at the target; the PLD figure of the same π is the tighter one
    assert by_figure["epsilon"]["rdp"] <= 3 and by_figure["epsilon"]["pld"] <= by_figure["epsilon"]["rdp"]
    assert by_pld["epsilon"]["pld"] <= 3 and by_pld["weights"] != by_figure["weights"]


def test_per_step_lists_are_accepted(tmp_path, capsys):
    data = {
        "adjacency": "add-remove",
        "models": [
            {
                "name": "a",
                "steps": 3,
                "noise_multiplier": [2.0, 2.0, 3.0],
                "clip": 1.0,
                "learning_rate": [0.1, 0.2, 0.2],
                "sample_rate": 1.0,
            }
        ],
    }
    _, _, models, _ = parse_models(data)
    assert [s.noise_multiplier for s in models[0].steps] == [2.0, 2.0, 3.0]
    assert len(models[0].runs) == 3


@pytest.mark.parametrize(
    "mutate, args, message",
    [
        (lambda d: d, ("rs", "--weights", "0.5,0.6,0", "--delta", "1e-5"), "sum to 1"),
        (lambda d: d, ("rs", "--weights", "1.2,-0.2,0", "--delta", "1e-5"), r"pi\[1\]: must be >= 0"),
        (lambda d: d, ("rs", "--weights", "0.5,0.5", "--delta", "1e-5"), "one weight per model"),
        (lambda d: d, ("rs", "--weights", "1,0,0", "--delta", "1.5"), r"--delta: must be a number in \(0, 1\)"),
        (lambda d: d, ("rs", "--weights", "1,0,0", "--delta", "0"), "--delta"),
        (lambda d: {**d, "adjacency": "swap"}, ("rs", "--weights", "1,0,0", "--delta", "1e-5"), "adjacency: must be"),
        (
            lambda d: {
                **d,
                "models": [
                    {k: v for k, v in m.items() if k != "clip"} if i == 1 else m for i, m in enumerate(d["models"])
                ],
            },
            ("rs", "--weights", "1,0,0", "--delta", "1e-5"),
            r"models\[1\]\.clip: is required",
        ),
        (
            lambda d: {
                **d,
                "models": [{**m, "noise_multiplier": [1.0, 2.0]} if i == 2 else m for i, m in enumerate(d["models"])],
            },
            ("rs", "--weights", "1,0,0", "--delta", "1e-5"),
            r"models\[2\]\.noise_multiplier: has 2 values for 100 steps",
        ),
        (
            lambda d: {**d, "models": [{**m, "learning_rate": -1} if i == 0 else m for i, m in enumerate(d["models"])]},
            ("rs", "--weights", "1,0,0", "--delta", "1e-5"),
            r"models\[0\]\.learning_rate: must be > 0",
        ),
        (
            lambda d: {
                **d,
                "models": [
                    {**m, "state_independent_gradients": "yes"} if i == 0 else m for i, m in enumerate(d["models"])
                ],
            },
            ("lc", "--weights", "1,0,0", "--delta", "1e-5"),
            r"models\[0\]\.state_independent_gradients: must be true or false",
        ),
        (
            lambda d: {**d, "models": [*d["models"][:2], {"name": "old", "epsilon": 1.0, "delta": 1e-06}]},
            ("lc", "--weights", "0.5,0.5,0", "--delta", "1e-5"),
            "No free lunch",
        ),
        (
            lambda d: {
                **d,
                "models": [
                    {k: v for k, v in m.items() if k != "accuracy"} if i == 0 else m for i, m in enumerate(d["models"])
                ],
            },
            ("rs", "--target-epsilon", "3", "--delta", "1e-5"),
            r"models\[0\]\.accuracy: is required with --target-epsilon",
        ),
        (lambda d: d, ("rs", "--target-epsilon", "0.1", "--delta", "1e-5"), "most private reachable is epsilon = "),
        (
            lambda d: {**d, "models": [{**m, "clip_norm": 1.0} if i == 0 else m for i, m in enumerate(d["models"])]},
            ("rs", "--weights", "1,0,0", "--delta", "1e-5"),
            r"models\[0\]: unknown fields \['clip_norm'\]",
        ),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capsys, mutate, args, message):
    code, out, err = run_cli(tmp_path, capsys, mutate(json.loads(json.dumps(MODELS))), *args, "--interval", "1e-3")
    assert code == 2 and out == ""
    assert err.startswith("privfusion account: error: ")

    assert re.search(message, err), err


def test_rs_with_an_epsilon_delta_model(tmp_path, capsys):
    data = {
        **MODELS,
        "models": [*MODELS["models"][:2], {"name": "legacy", "epsilon": 1.0, "delta": 1e-07, "accuracy": 0.99}],
    }
    code, out, _ = run_cli(
        tmp_path, capsys, data, "rs", "--target-epsilon", "2.0", "--delta", "1e-5", "--json", "--interval", "1e-3"
    )
    result = json.loads(out)
    assert code == 0 and result["weights"][2] > 0.5
    assert result["epsilon"]["rdp"] == "inf" and result["epsilon"]["pld"] <= 2.0


def test_missing_file(tmp_path, capsys):
    code = main(["account", "rs", "--models", str(tmp_path / "absent.json"), "--weights", "1", "--delta", "1e-5"])
    assert code == 2 and "no such file" in capsys.readouterr().err


def test_output_into_a_closed_pipe_ends_quietly(tmp_path):
    """``privfusion account … | head`` whose reader has gone: exit 141 (128 + SIGPIPE, as a
    shell reports a tool ended by a closed pipe) and nothing on stderr, no traceback."""
    import os
    import subprocess
    import sys

    path = tmp_path / "M.json"
    path.write_text(json.dumps(MODELS))
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "peer.cli",
                "account",
                "rs",
                "--models",
                str(path),
                "--weights",
                "0.2,0.3,0.5",
                "--delta",
                "1e-5",
            ],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=300,
            check=False,
        )
    finally:
        os.close(write)
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr)
