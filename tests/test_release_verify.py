"""Saved releases checked offline from pinned certificates alone (peer.net.client.verify_saved_release,
``privfusion release verify``), and the layer list of GetPeerInfo, against a real daemon."""

import json
import shutil

import numpy as np
import pytest
from peer_harness import ARCH, client, make_site, model_arrays, pin_each_other, running

from peer.base.errors import InvalidArgument, NotFound
from peer.cli import main as cli
from peer.net.client import save_release, verify_saved_release
from peer.net.trust import TrustStore


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A weights release of site-a to site-b, saved by site-b; and site-b's trust directory."""
    root = tmp_path_factory.mktemp("verify")
    a = make_site(root, "site-a", seed=3)
    b = make_site(root, "site-b", models={})
    pin_each_other(a, b)
    with running(a) as (_, address), client(b, address) as c:
        got = c.weights("mlp", epsilon=2.0, delta=1e-5)
        info = c.info()
    tensors, doc = save_release(got, root / "got" / "mlp-a")
    return root, tensors, doc, b.identity_dir / "trusted", got, info


def copy_of(saved, tmp_path):
    _, tensors, doc, *_ = saved
    shutil.copy(tensors, tmp_path / tensors.name)
    shutil.copy(doc, tmp_path / doc.name)
    return tmp_path / tensors.name, tmp_path / doc.name


def test_a_saved_release_verifies_offline_by_function_and_command(saved, capsys):
    root, tensors, doc, trust, got, _ = saved
    report = verify_saved_release(root / "got" / "mlp-a", TrustStore(trust))
    assert (report["signer"], report["counterparty"], report["kind"], report["model"]) == (
        "site-a",
        "site-b",
        "weights",
        "mlp",
    )
    assert report["release_id"] == got.receipt.record.release_id and report["tensors"] == len(got.arrays)
    assert cli(["release", "verify", str(tensors), "--trust", str(trust), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ledger_entry_id"] == got.receipt.ledger_entry_id
    assert cli(["release", "verify", str(doc), "--trust", str(trust)]) == 0
    assert "signature, manifest and tensor checksums verified" in capsys.readouterr().out


def _edit_doc(doc, edit):
    d = json.loads(doc.read_text())
    edit(d)
    doc.write_text(json.dumps(d))


@pytest.mark.parametrize(
    "edit, field",
    [
        # the document's architecture is what peer.nn.store.load_model builds the model from
        (lambda d: d["architecture"].update(hidden=[16, 13]), "architecture"),
        (lambda d: d["metadata"]["release"]["metadata"].update(permuted=True), "metadata.release"),
        # a manifest edited anywhere (metadata text, a shape, a dtype) no longer has the signed digest
        (lambda d: d["metadata"]["manifest"].update(metadata_json='{"permuted": true}'), "manifest"),
        (lambda d: d["metadata"]["manifest"]["tensors"][0].update(shape=[1, 12 * 16]), "manifest"),
        (lambda d: d["metadata"]["manifest"]["tensors"][0].update(dtype="DTYPE_FLOAT64"), "manifest"),
        (lambda d: d["metadata"]["receipt"].update(ledger_entry_id="999"), "receipt.signature"),
        (lambda d: d["metadata"]["receipt"].update(manifest_sha256="00" * 32), "receipt.signature"),
    ],
)
def test_any_edit_of_the_document_is_refused_naming_the_field(saved, tmp_path, edit, field):
    _, doc = copy_of(saved, tmp_path)
    _edit_doc(doc, edit)
    with pytest.raises(InvalidArgument) as e:
        verify_saved_release(doc, TrustStore(saved[3]))
    assert e.value.field == field


def test_edited_tensor_bytes_are_refused_and_the_command_says_why(saved, tmp_path, capsys):
    tensors, doc = copy_of(saved, tmp_path)
    raw = bytearray(tensors.read_bytes())
    raw[-1] ^= 1  # the last byte of the last tensor
    tensors.write_bytes(bytes(raw))
    with pytest.raises(InvalidArgument, match=r"tensor\[.*\]\.sha256"):
        verify_saved_release(doc, TrustStore(saved[3]))
    assert cli(["release", "verify", str(doc), "--trust", str(saved[3])]) == 2
    assert "sha256" in capsys.readouterr().err


def test_a_release_whose_signer_is_not_pinned_is_refused(saved, tmp_path):
    with pytest.raises(NotFound, match="not pinned"):
        verify_saved_release(saved[2], TrustStore(tmp_path))


def test_peer_info_lists_every_layer_with_its_shapes_before_any_charged_call(saved):
    *_, info = saved
    [m] = info.models
    arrays = model_arrays()
    layers = [
        (layer.name, layer.kind, list(layer.weight_shape), list(layer.bias_shape), layer.hidden) for layer in m.layers
    ]
    assert layers == [
        (n, "linear", list(arrays[f"{n}.weight"].shape), list(arrays[f"{n}.bias"].shape), n != "4")
        for n in ("0", "2", "4")
    ]
    assert [layer.weight_shape[0] for layer in m.layers if layer.hidden] == list(m.hidden_sizes) == ARCH["hidden"]
    assert np.sum([np.prod(layer.weight_shape) + np.prod(layer.bias_shape) for layer in m.layers]) == m.parameter_count


def test_a_saved_fused_release_verifies_with_its_upstream_receipts(tmp_path):
    """C asks B to fuse with X: the saved release names X's receipts by digest in B's signed
    manifest; each is verified against X's pin where C has one, and reported unverified where not."""
    probe = np.random.default_rng(5).random((16, 64))
    x = make_site(tmp_path, "site-x", models={"mx": (ARCH, model_arrays(seed=2))}, seed=21)
    with running(x) as (_, x_address):
        b = make_site(
            tmp_path,
            "site-b",
            models={"mb": (ARCH, model_arrays(seed=1))},
            seed=12,
            probe=probe,
            peers={"site-x": x_address},
        )
        c = make_site(tmp_path, "site-c", models={})
        pin_each_other(b, x)
        pin_each_other(b, c)
        with running(b) as (_, b_address), client(c, b_address) as cl:
            got = cl.fuse(
                "mb",
                partner="site-x",
                partner_model="mx",
                alpha=0.5,
                activation_epsilon=4.0,
                weight_epsilon=4.0,
                weights_epsilon=8.0,
                weights_delta=1e-5,
            )
    assert got.upstream
    save_release(got, tmp_path / "got" / "fused")
    trust = c.identity_dir / "trusted"
    report = verify_saved_release(tmp_path / "got" / "fused", TrustStore(trust))
    assert report["kind"] == "fused" and [u["verified"] for u in report["upstream"]] == [False] * len(got.upstream)
    TrustStore(trust).add((x.identity_dir / "site.crt").read_bytes())
    report = verify_saved_release(tmp_path / "got" / "fused", TrustStore(trust))
    assert [u["verified"] for u in report["upstream"]] == [True] * len(got.upstream)
    # upstream receipts other than those B signed (here: one more than it signed) are refused
    doc = tmp_path / "got" / "fused.json"
    d = json.loads(doc.read_text())
    d["metadata"]["upstream"] = d["metadata"]["upstream"] * 2
    doc.write_text(json.dumps(d))
    with pytest.raises(InvalidArgument) as e:
        verify_saved_release(doc, TrustStore(trust))
    assert e.value.field == "upstream"
