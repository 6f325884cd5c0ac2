"""The site, the codec and the alignment pipeline without a server (peer.net.site,
peer.net.codec, peer.ldp.pipeline): site.toml errors name file, line and key; the site speaks
plain values and the codec turns them into the wire's; features → match → weights recovers a
permuted copy exactly."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from peer_harness import ARCH, make_site, model_arrays

from peer.base.errors import InvalidArgument
from peer.ldp import pipeline
from peer.ldp.fusion import permute_arrays
from peer.net import codec, site
from peer.net.daemon import open_site
from peer.nn.architectures import model_from_arrays
from peer.nn.graph import extract_graph
from privfusion.v1 import peer_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function bodies included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.parametrize("path", ["peer/net/site.py", "peer/ldp/pipeline.py"])
def test_the_site_and_the_pipeline_import_no_protobuf_and_no_grpc(path):
    wire = {
        m for m in imported_modules(ROOT / path) if m.split(".")[0] in ("privfusion", "grpc", "google", "grpc_status")
    }
    assert wire == set()


# ------------------------------------------------------------------------ site.toml


SITE = """\
[site]
name = "site-a"
listen = "127.0.0.1:0"
identity = "identity"
models = "models"
ledger = "ledger.sqlite"
workers = 8

[site.mechanisms]
activation_clip = [0.0, 4.0]
calibration = "analytic"

[site.peers.site-b]
address = "127.0.0.1:50052"
"""


def load(tmp_path, text: str) -> site.SiteConfig:
    path = tmp_path / "site.toml"
    path.write_text(text)
    return site.SiteConfig.load(path)


def test_a_good_site_toml_is_read_with_its_paths_resolved(tmp_path):
    cfg = load(tmp_path, SITE)
    assert (cfg.name, cfg.listen, cfg.workers, cfg.activation_clip) == ("site-a", "127.0.0.1:0", 8, (0.0, 4.0))
    assert cfg.identity == (tmp_path / "identity").resolve() and cfg.probe is None
    assert cfg.peers == {"site-b": "127.0.0.1:50052"} and cfg.limits.threads == 8 + 8


@pytest.mark.parametrize(
    "old, new, key, line, rule",
    [
        (
            "activation_clip = [0.0, 4.0]",
            "activation_clip = [4.0, 0.0]",
            "site.mechanisms.activation_clip",
            10,
            "must be [low, high] with low < high",
        ),
        ('calibration = "analytic"', 'calibration = "exact"', "site.mechanisms.calibration", 11, "must be one of"),
        ('calibration = "analytic"', "clip = 3", "site.mechanisms.clip", 11, "unknown key"),
        ("workers = 8", 'workers = "8"', "site.workers", 7, "must be an integer"),
        ("workers = 8", "workers = 0", "site.workers", 7, "must be >= 1"),
        ("workers = 8", "shutdown_grace_s = -1", "site.shutdown_grace_s", 7, "must be >= 0"),
        ("workers = 8", "wokers = 8", "site.wokers", 7, "unknown key"),
        ('name = "site-a"', 'name = "Site A"', "site.name", 2, "must be"),
        ('listen = "127.0.0.1:0"', 'listen = "localhost"', "site.listen", 3, "must be HOST:PORT"),
        ("[site.peers.site-b]", "[site.peers.Site_B]", "site.peers.Site_B", 13, "must be"),
        ('address = "127.0.0.1:50052"', "port = 50052", "site.peers.site-b.port", 14, "unknown key"),
    ],
)
def test_a_bad_value_is_refused_naming_file_line_and_key(tmp_path, old, new, key, line, rule):
    assert old in SITE
    with pytest.raises(InvalidArgument) as e:
        load(tmp_path, SITE.replace(old, new))
    assert f"{key} ({tmp_path / 'site.toml'}, line {line}): " in str(e.value) and rule in str(e.value), str(e.value)


def test_a_file_without_a_site_table_or_key_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match=r"^site \(.*site\.toml\): is required \(a table\)"):
        load(tmp_path, "[policy]\n")
    with pytest.raises(InvalidArgument, match=r"site\.ledger \(.*site\.toml, line 1\): is required"):
        load(tmp_path, SITE.replace('ledger = "ledger.sqlite"\n', ""))


def test_the_probe_set_loader_names_the_problem(tmp_path):
    from safetensors.numpy import save_file

    save_file({"y": np.zeros((2, 3))}, str(tmp_path / "p.safetensors"))
    with pytest.raises(InvalidArgument, match=r"site\.probe: .* must hold the probe inputs as tensor 'x'"):
        site.load_probe(tmp_path / "p.safetensors")
    save_file({"x": np.array([[0.0, np.nan]])}, str(tmp_path / "p.safetensors"))
    with pytest.raises(InvalidArgument, match=r"site\.probe: contains NaN"):
        site.load_probe(tmp_path / "p.safetensors")
    save_file({"x": np.ones((2, 3))}, str(tmp_path / "p.safetensors"))
    assert site.load_probe(tmp_path / "p.safetensors").shape == (2, 3)


# ------------------------------------------------------------------------ the site and the codec


def test_the_site_answers_in_plain_values_and_the_codec_makes_the_message(tmp_path):
    files = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(seed=3))}, seed=5)
    s = open_site(files.config)
    try:
        info = s.peer_info("site-b")
        assert isinstance(info, site.SiteInfo) and not any(
            type(v).__module__.startswith("privfusion") for v in vars(info).values()
        )
        [m] = info.models
        assert m.hidden_sizes == (16, 12) and [layer.hidden for layer in m.layers] == [True, True, False]
        assert m.layers[0].weight_shape == (16, 64) and m.parameter_count == sum(
            a.size for a in model_arrays().values()
        )
        message = codec.peer_info_message(info)
        assert isinstance(message, pb.PeerInfo) and message.name == "site-a" and message.protocol
        assert [list(layer.weight_shape) for layer in message.models[0].layers] == [[16, 64], [12, 16], [10, 12]]
        assert message.mechanisms[-1].startswith("randomness:fixed-seed") and not message.has_probe_set
        # a features release with weights: one record for both parts, tensors in the codec's names
        probe = np.random.default_rng(0).random((20, 64))
        release = s.features(
            s.model("mlp"),
            probe,
            activation_epsilon=1.0,
            weight_epsilon=1.0,
            activation_clip=s.activation_clip(),
            weights=(2.0, 1e-5),
        )
        assert release.record.mechanism == "composite" and release.record.parameters["release"] == "features+weights"
        tensors, meta = codec.features_tensors(release.graph, release.weights)
        arrays = dict(tensors)
        back = codec.graph_from_release(ARCH, meta, arrays)
        assert all(
            np.array_equal(a.activations, b.activations) for a, b in zip(back.hidden, release.graph.hidden, strict=True)
        )
        weights = codec.weights_from_release(ARCH, arrays)
        assert weights.keys() == release.weights.keys() and meta["weights"] == sorted(f"weights.{k}" for k in weights)
        del arrays["weights.2.bias"]
        with pytest.raises(InvalidArgument, match="holds no weights of layer '2'"):
            codec.weights_from_release(ARCH, arrays)
    finally:
        s.close()


# ------------------------------------------------------------------------ features -> match -> weights


def test_the_pipeline_recovers_a_permuted_copy_exactly_and_fuses_it_back_to_itself():
    own = model_arrays(seed=7)
    rng = np.random.default_rng(11)
    q = [rng.permutation(n) for n in ARCH["hidden"]]
    theirs = permute_arrays(ARCH, own, q)  # their node i is our node q[i]: the same function
    probe = np.random.default_rng(2).random((50, 64))
    g_own = extract_graph(ARCH, model_from_arrays(ARCH, own), probe)
    g_theirs = extract_graph(ARCH, model_from_arrays(ARCH, theirs), probe)

    aligned, alignment = pipeline.align(ARCH, g_own, g_theirs, theirs)
    assert [p.dtype for p in alignment.permutations] == [np.int64, np.int64]
    assert all(np.array_equal(p, np.argsort(qq)) for p, qq in zip(alignment.permutations, q, strict=True))
    assert all(np.array_equal(aligned[k], own[k]) for k in own)
    assert alignment.objective == pytest.approx(float(alignment.match.objective))
    # match first, weights later (a round's ldp step): the same alignment
    later = pipeline.align_graphs(g_own, g_theirs)
    assert all(np.array_equal(later.apply(ARCH, theirs)[k], aligned[k]) for k in own)
    fused, _ = pipeline.align_and_fuse(ARCH, g_own, own, g_theirs, theirs, alpha=0.3)
    assert all(np.allclose(fused[k], own[k], atol=1e-6) for k in own)
    with pytest.raises(InvalidArgument, match="alpha"):
        pipeline.align_and_fuse(ARCH, g_own, own, g_theirs, theirs, alpha=1.5)
