"""Image records in rounds: ``iterate`` reads a site's own image folder (or manifest) with the
preprocessing stored with its model, and one-shot rounds (``merged``, ``ldp``) run from a site
whose model was trained on images.

The unit tests call ``coordinator_free.iterate`` on folders the tests write; the end-to-end test
is a hospital IT's command line only: three sites write PNG class folders (scikit-learn's 8x8
digits, classes 0-2), train their models on them through ``privfusion`` as a subprocess
(preprocessing fitted on a shared public folder), serve real daemons with mutual TLS on
loopback, run a ``merged`` and an ``ldp`` round from one site, then an ``iterate`` run at all
three at once, every segment read from the site's image folder and charged to its ledger.

No accuracy threshold: the rounds' fused models draw fresh CSPRNG noise; what is checked is
that the records reach the network prepared exactly as the stored preprocessing says (compared
with ``ImagePreprocessing.transform`` of the same folder), that every release is charged, and
that each fused model scores on held-out images."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
from peer_harness import DaemonProcess, SiteFiles, cli, cli_parallel, digits_images, write_folder

from coordinator_free.iterate import load_iterate_config, load_records
from peer.base.errors import InvalidArgument
from peer.nn.images import prepare_image_records
from peer.nn.store import load_model, save_model

SITES = ("clinic-a", "clinic-b", "clinic-c")


def iterate_round(records: str, *, roster: str = "roster.toml", extra: str = "") -> str:
    return f"""
[round]
roster = "{roster}"
model = "img"
method = "iterate"
out = "iterate"
call_timeout_s = 60.0

[round.iterate]
records = "{records}"
run = "img-iterate"
rounds = 3
local_steps = 2
learning_rate = 0.5
clip_norm = 1.0
epsilon = 4.0
delta = 1e-5
declared_records = 100
init_seed = 5
wait_s = 60.0
{extra}
"""


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("iterate-images")
    x, y = digits_images(150, seed=21)
    return {
        "dir": d,
        "train": write_folder(d / "train", x[:100], y[:100], jpeg_every=9),
        "public": write_folder(d / "public", x[100:], y[100:]),
    }


def stored_image_model(folders, directory: Path):
    """A CNN stored with the image preprocessing fitted on the public folder."""
    from peer.nn.architectures import build_model, state_arrays

    prep = prepare_image_records(folders["public"], validation_fraction=0.2).preprocessing
    arch = {"kind": "cnn", "input_shape": [1, 8, 8], "channels": [4], "hidden": [8], "output_dim": 3}
    save_model(directory, "img", arch, state_arrays(build_model(arch, seed=0)), preprocessing=prep)
    return load_model(directory, "img"), prep


def test_iterate_reads_an_image_folder_with_the_stored_preprocessing(tmp_path, folders):
    stored, prep = stored_image_model(folders, tmp_path / "models")
    x, y = load_records(folders["train"], stored)
    want_x, want_y = prep.transform(prep.read(folders["train"]))
    assert x.shape == (100, 64) and np.array_equal(x, want_x) and np.array_equal(y, want_y)
    # the statistics are the stored ones (the public folder's), not refitted on these records
    refitted = prepare_image_records(folders["train"], validation_fraction=0.2).preprocessing
    assert refitted.mean != prep.mean
    # a manifest of the same files (paths relative to it) gives the same records
    manifest = folders["dir"] / "manifest.csv"
    rows = sorted(p for p in folders["train"].rglob("*") if p.is_file())
    manifest.write_text("path,folder\n" + "".join(f"{p.relative_to(folders['dir'])},{p.parent.name}\n" for p in rows))
    mx, my = load_records(manifest, stored)
    order = np.argsort([str(p) for p in prep.read(folders["train"]).paths])
    assert np.array_equal(mx, want_x[order]) and np.array_equal(my, want_y[order])


def test_the_round_file_takes_a_folder_and_refuses_what_does_not_exist(tmp_path, folders):
    p = tmp_path / "iterate.toml"
    p.write_text(iterate_round(str(folders["train"])))
    assert load_iterate_config(p).records == folders["train"].resolve()
    p.write_text(iterate_round("no-such-folder"))
    with pytest.raises(InvalidArgument) as e:
        load_iterate_config(p)
    assert e.value.field.startswith("round.iterate.records") and "no-such-folder" in e.value.rule


def test_images_for_a_table_model_and_bad_files_are_refused_by_field_and_path(tmp_path, folders):
    from peer.nn.tables import prepare_records

    stored, _ = stored_image_model(folders, tmp_path / "models")
    # a table for an image model
    table = tmp_path / "t.csv"
    table.write_text("a,b,label\n1,2,0\n3,4,1\n5,6,0\n7,8,1\n9,1,0\n")
    with pytest.raises(InvalidArgument) as e:
        load_records(table, stored)
    assert e.value.field == "round.iterate.records" and "reads images" in e.value.rule
    # images for a table model
    tprep = prepare_records(table, label="label", validation_fraction=0.2).preprocessing
    arch = {"kind": "mlp", "input_dim": 2, "hidden": [3], "output_dim": 2}
    from peer.nn.architectures import build_model, state_arrays

    save_model(tmp_path / "models", "tab", arch, state_arrays(build_model(arch, seed=0)), preprocessing=tprep)
    with pytest.raises(InvalidArgument) as e:
        load_records(folders["train"], load_model(tmp_path / "models", "tab"))
    assert e.value.field == "round.iterate.records" and "folder of images" in e.value.rule
    assert "reads tables" in e.value.rule
    # a corrupt file: refused naming the field and the file, before any step
    bad = tmp_path / "bad"
    x, y = digits_images(12, seed=5)
    write_folder(bad, x, y)
    victim = sorted((bad / "1").glob("*.png"))[0]
    victim.write_bytes(victim.read_bytes()[:40])
    with pytest.raises(InvalidArgument) as e:
        load_records(bad, stored)
    assert e.value.field == "round.iterate.records" and str(victim) in e.value.rule
    # another size than the model's preprocessing takes (it resizes none)
    big = tmp_path / "big"
    from PIL import Image

    write_folder(big, x, y)
    one = sorted((big / "0").glob("*.png"))[0]
    Image.open(one).resize((12, 12)).save(one)
    with pytest.raises(InvalidArgument) as e:
        load_records(big, stored)
    assert e.value.field == "round.iterate.records" and str(one) in e.value.rule and "8x8" in e.value.rule


# ------------------------------------------------------------------------------ end to end


def report_of(directory: Path) -> dict:
    (path,) = sorted(directory.glob("round-*.json"))
    return json.loads(path.read_text())


@pytest.mark.slow
def test_image_sites_run_merged_ldp_and_iterate_over_real_daemons(tmp_path):
    started = time.monotonic()
    x, y = digits_images(420, seed=8)
    data = tmp_path / "data"
    for i, s in enumerate(SITES):
        write_folder(data / s, x[90 * i : 90 * (i + 1)], y[90 * i : 90 * (i + 1)])
    write_folder(data / "public", x[270:330], y[270:330])  # e.g. published images: may be shown to anyone
    write_folder(data / "held", x[330:], y[330:])  # clinic-a's own held-out images
    root = tmp_path / "sites"
    cli_parallel(
        *[
            ("site", "new", "--name", s, "--dir", str(root / s), "--listen", "127.0.0.1:0", "--address", "127.0.0.1")
            for s in SITES
        ]
    )
    for s in SITES:
        toml = (root / s / "site.toml").read_text()
        # a merge at each peer and then an iterate run: more than the default data budget
        marker = "epsilon = 4.0                     # all data-level"
        assert marker in toml
        (root / s / "site.toml").write_text(toml.replace(marker, "epsilon = 20.0                    # all data-level"))

    def each(*args: str) -> list[tuple[str, ...]]:
        """The same command at every site: "SITE" becomes the site's directory, "DATA" its images."""
        return [tuple({"SITE": str(root / s), "DATA": str(data / s)}.get(a, a) for a in args) for s in SITES]

    public = str(data / "public")
    trained = cli_parallel(
        *each("model", "train", "--site", "SITE", "--data", "DATA", "--public", public, "--preset", "cnn",
              "--hidden", "16", "--name", "img", "--epochs", "15", "--json")
    )  # fmt: skip
    arch = json.loads(trained[0])["architecture"]
    assert arch["kind"] == "cnn" and arch["input_shape"] == [1, 8, 8]
    # the same architecture's DP-SGD pool, for the peers' merges
    cli_parallel(
        *each("pool", "train", "--site", "SITE", "--data", "DATA", "--public", public, "--architecture",
              json.dumps(arch), "--steps", "10",
              "--model", "name=p1,noise=16,clip=1", "--model", "name=p2,noise=24,clip=1")
    )  # fmt: skip
    cli_parallel(
        *each("probe", "make", "--site", "SITE", "--data", public, "--model", "img", "--rows", "40"),
        *each("probe", "make", "--site", "SITE", "--data", public, "--pool", "dpsgd", "--label", "folder"),
    )  # fmt: skip
    for s in SITES:
        for o in SITES:
            if o != s:
                cli(
                    "peer", "trust", "add", str(root / o / "identity" / "site.crt"), "--dir", str(root / s / "identity")
                )
    print(f"[{time.monotonic() - started:6.1f}s] models, pools and probes made", flush=True)

    daemons = {s: DaemonProcess(SiteFiles(s, root / s, root / s / "site.toml", root / s / "identity")) for s in SITES}
    try:
        addresses = {s: d.wait_ready() for s, d in daemons.items()}
        roster = []
        for s in SITES:
            roster += [f"[sites.{s}]", f'address = "{addresses[s]}"', f'certificate = "{s}/identity/site.crt"', ""]
        (root / "roster.toml").write_text("\n".join(roster))
        a = root / "clinic-a"
        # 1. one-shot rounds from clinic-a: a merge of each peer's pool, then LDP features + weights
        for method, extra in (
            ("merged", '[round.merge]\nmethod = "rs"\nepsilon = 2.0\ndelta = 1e-5\n'),
            # ε 2 per neuron: the weights release is predicted constant (docs/mechanisms.md); the
            # test runs the exchange's mechanics anyway, as a site may ask it to
            (
                "ldp",
                "[round.features]\nactivation_epsilon = 2.0\nweight_epsilon = 2.0\n"
                "[round.weights]\ngo_on_without_signal = true\n",
            ),
        ):
            (a / f"{method}.toml").write_text(
                f'[round]\nroster = "../roster.toml"\nmodel = "img"\nalpha = 0.5\nquorum = 3\nmethod = "{method}"\n'
                f'out = "rounds-{method}"\ncall_timeout_s = 120\n{extra}'
            )
            proc = cli("round", "--config", str(a / "site.toml"), "--round", str(a / f"{method}.toml"), check=False)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            report = report_of(a / f"rounds-{method}")
            assert report["status"] == "fused", report["events"]
            assert sorted(report["contributors"]) == ["clinic-b", "clinic-c"]
            steps = {"merged": {"merged"}, "ldp": {"features", "weights"}}[method]
            assert {c["peer"] for c in report["charges"]} == {"clinic-b", "clinic-c"}
            assert {c["step"] for c in report["charges"]} == steps, report["charges"]
            fused = a / f"rounds-{method}" / "models" / report["fused_model"]
            scored = json.loads(
                cli("evaluate", "--site", str(a), "--model", str(fused), "--data", str(data / "held"), "--json").stdout
            )
            assert scored["records"] == 90 and 0.0 <= scored["accuracy"] <= 1.0
            print(f"[{time.monotonic() - started:6.1f}s] {method} round: {scored['accuracy']:.3f}", flush=True)

        # 2. iterate at every site at once, each reading its own image folder
        for s in SITES:
            (root / s / "iterate.toml").write_text(iterate_round(f"../../data/{s}", roster="../roster.toml"))
        outs = cli_parallel(
            *[
                ("round", "--config", str(root / s / "site.toml"), "--round", str(root / s / "iterate.toml"))
                for s in SITES
            ]
        )
        assert all("finished" in o for o in outs), outs
        for s in SITES:
            report = json.loads((root / s / "iterate" / "img-iterate.json").read_text())
            assert report["status"] == "finished" and len(report["rounds"]) == 3
            assert report["dataset_size"] == 100 and report["dataset_size_source"] == "declared"
            assert {p for r in report["rounds"] for p in r["contributors"]} == set(SITES) - {s}
            shown = json.loads(
                cli("ledger", "show", "--db", str(root / s / "ledger.sqlite"), "--json", "--no-pld").stdout
            )
            segments = [e for e in shown["entries"] if e["mechanism"] == "dpsgd"]
            assert len(segments) == 3 and {e["unit"] for e in segments} == {"record:add-remove"}
        last = root / "clinic-a" / "iterate" / "models" / "img-iterate-r3"
        manifest = json.loads(last.with_suffix(".json").read_text())
        assert manifest["preprocessing"]["kind"] == "images"
        assert manifest["preprocessing"]["fitted_on"]["split"] == "public"
        scored = json.loads(cli("evaluate", "--model", str(last), "--data", str(data / "held"), "--json").stdout)
        assert scored["records"] == 90 and 0.0 <= scored["accuracy"] <= 1.0
        print(f"[{time.monotonic() - started:6.1f}s] iterate: {scored['accuracy']:.3f}", flush=True)
    finally:
        for d in daemons.values():
            d.close()
