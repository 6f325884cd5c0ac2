"""``method = "iterate"`` (and its secure variant) over a site's OWN network: a small residual
network with GroupNorm, written as a factory file in each site's folder and imported into the
site's own-model store, trained round by round over real daemons on loopback. θ_0 is the
factory's module under torch.manual_seed(init_seed) (never the imported weights), the segments
are charged like a built-in run's, peers with another network are dropped with a reason, and the
fused models live in the site's own store, where they load and score."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import threading

import numpy as np
import pytest
import torch
from peer_harness import make_site, model_arrays, pin_each_other, running
from test_iterate import ARCH, policy

from coordinator_free.iterate import SiteNetwork, load_iterate_config, run_iterate
from coordinator_free.roster import write_roster
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.budget.ledger import Ledger
from peer.net.site import SiteConfig
from peer.nn.imported import import_model, load_factory, load_imported, module_from_arrays, save_imported

NET_PY = '''\
"""A site's own small residual network for 6x6 one-channel inputs."""

import torch.nn.functional as F
from torch import nn


def norm(kind, width):
    if kind == "group":
        return nn.GroupNorm(1, width)
    return nn.BatchNorm2d(width, track_running_stats=kind == "batch")


class Block(nn.Module):
    def __init__(self, width, kind):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm = norm(kind, width)

    def forward(self, x):
        return F.relu(x + self.norm(self.conv(x)))


class OwnNet(nn.Module):
    def __init__(self, width={width}, kind="{kind}"):
        super().__init__()
        self.entry = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.entry_norm = norm(kind, width)
        self.res = Block(width, kind)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(width, 3)

    def forward(self, x):
        x = F.relu(self.entry_norm(self.entry(x)))
        return self.classifier(self.pool(self.res(x)).flatten(1))


def make_model():
    return OwnNet()
'''

#: the site's own loop (peer.dp.own_loop): the built-in step, and a note of the module it got
LOOP_PY = """\
def train(model, records, step):
    with open("{seen}", "a") as f:
        f.write(type(model).__name__ + "\\n")
    for _ in range(step.steps):
        step()
"""

SHAPE = (1, 6, 6)
DECLARED = 20
OWN_SITE = 'own_models = "own_models"'


def records(path, n: int, seed: int, width: int = 36) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = (rng.normal(size=(n, width)) + y[:, None]).astype(np.float32)
    np.savez(path, x=x, y=y)
    return x, y


def own_site(tmp_path, name: str, *, module: str = "own_net", width: int = 4, kind: str = "group", **kw):
    """A site whose own-model store holds "own": the factory file ``module``.py in its folder,
    imported with its (site-trained, here: arbitrary) weights."""
    kw.setdefault("policy", policy(4.0))
    site = make_site(tmp_path, name, models={"mlp": (ARCH, model_arrays(ARCH))}, extra_site=OWN_SITE, **kw)
    (site.root / f"{module}.py").write_text(NET_PY.format(width=width, kind=kind))
    sys.modules.pop(module, None)
    importlib.invalidate_caches()
    factory = load_factory(f"{module}:make_model", [site.root])
    torch.manual_seed(1000 + ord(name[-1]))  # the site's own weights: never θ_0
    net = factory().eval()
    import_model(site.root / "own_models", "own", net, SHAPE, factory=f"{module}:make_model")
    sys.modules.pop(module, None)
    return site


def round_file(site, roster, *, model: str = "own", rounds: int = 2, wait_s: float = 20.0, extra: str = "") -> str:
    records(site.root / f"records-{model}.npz", 24, seed=ord(site.name[-1]), width=6 if model == "mlp" else 36)
    p = site.root / f"iterate-{model}.toml"
    p.write_text(
        f"""
[round]
roster = "{roster}"
model = "{model}"
method = "iterate"
out = "rounds-{model}"
call_timeout_s = 10.0

[round.iterate]
records = "records-{model}.npz"
run = "t1"
rounds = {rounds}
local_steps = 2
learning_rate = 0.5
clip_norm = 1.0
epsilon = 4.0
delta = 1e-5
init_seed = 5
wait_s = {wait_s!r}
declared_records = {DECLARED}
{extra}
"""
    )
    return str(p)


def alone(tmp_path, site) -> str:
    """A roster of this site only (no peers: no daemon needed)."""
    return str(
        write_roster(
            tmp_path / f"roster-{site.name}.toml", [(site.name, "127.0.0.1:1", str(site.identity_dir / "site.crt"))]
        )
    )


#: what differs between a built-in and an own network's segment record: the architecture (and
#: the digest of other tensors), the noise's seed, the start's description, the norm layers' note
DIFFERS = {"architecture", "release_sha256", "randomness", "segment", "norm_layers", "loop"}


def charges(site) -> list:
    with Ledger(site.ledger) as led:
        led.verify()
        return [e for e in led.entries() if e.level == "data"]


def assert_charged_alike(entries, reference) -> None:
    """One charge per segment, each the built-in run's: mechanism, ε, δ, RDP and every record
    parameter but the architecture's."""
    assert len(entries) == len(reference)
    for e, ref in zip(entries, reference, strict=True):
        assert e.mechanism == ref.mechanism == "dpsgd" and e.subject == ref.subject
        assert e.epsilon == ref.epsilon and e.delta == ref.delta
        assert list(e.rdp) == list(ref.rdp)
        ours = {k: v for k, v in e.record.parameters.items() if k not in DIFFERS}
        theirs = {k: v for k, v in ref.record.parameters.items() if k not in DIFFERS}
        assert ours == theirs
        assert e.record.parameters["segment"]["round"] == ref.record.parameters["segment"]["round"]
        assert e.record.parameters["architecture"]["kind"] == "imported"


def fused(site, name: str = "t1-r2") -> dict[str, np.ndarray]:
    return dict(load_imported(site.root / "own_models", name).arrays)


def run_everywhere(tmp_path, sites: dict, run) -> dict:
    """Every site's daemon on loopback (pinned to each other, one roster), then ``run(site,
    roster)`` at every site at once, one thread each; every site's result (no site's exception
    is lost: the test fails naming them all)."""
    pin_each_other(*sites.values())
    results, errors = {}, {}
    with contextlib.ExitStack() as stack:
        addr = {n: stack.enter_context(running(s))[1] for n, s in sites.items()}
        roster = write_roster(
            tmp_path / "roster.toml", [(n, addr[n], str(s.identity_dir / "site.crt")) for n, s in sites.items()]
        )

        def one(site):
            try:
                results[site.name] = run(site, roster)
            except BaseException as e:  # the test reads every site's outcome
                errors[site.name] = e

        threads = [threading.Thread(target=one, args=(s,)) for s in sites.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
    assert not errors, errors
    return results


@pytest.mark.slow
def test_three_own_networks_over_daemons_agree_and_a_fourth_network_is_dropped(tmp_path):
    """a, b, c bring the same own network (their own weights differ), d another width. Every
    segment is charged once, as a built-in run of the plan is; a, b and c end with the same
    average; d's segments are dropped with the reason, and d drops theirs; nothing crashes."""
    sites = {n: own_site(tmp_path, n) for n in ("site-a", "site-b", "site-c")}
    sites["site-d"] = own_site(tmp_path, "site-d", module="other_net", width=6)
    results = run_everywhere(
        tmp_path, sites, lambda site, roster: run_iterate(site.config, load_iterate_config(round_file(site, roster)))
    )
    # the same plan with the built-in mlp, at a site alone: the reference charges
    ref = make_site(tmp_path, "ref-a", models={"mlp": (ARCH, model_arrays(ARCH))}, policy=policy(4.0))
    run_iterate(ref.config, load_iterate_config(round_file(ref, alone(tmp_path, ref), model="mlp")))
    reference = charges(ref)
    for n, s in sites.items():
        assert results[n].status == "finished", results[n].reason
        assert_charged_alike(charges(s), reference)
        for r in results[n].report["rounds"]:
            if n == "site-d":
                assert r["contributors"] == []
                assert {p["state"] for p in r["peers"].values()} == {"dropped"}
            else:
                assert sorted(r["contributors"]) == sorted({"site-a", "site-b", "site-c"} - {n})
                d = r["peers"]["site-d"]
                assert d["state"] == "dropped" and "does not fit our network" in d["reason"]
                assert "not ours" in d["reason"]
    models = {n: fused(sites[n]) for n in ("site-a", "site-b", "site-c")}
    for n in ("site-b", "site-c"):
        for k, v in models["site-a"].items():
            np.testing.assert_allclose(models[n][k], v, rtol=0, atol=1e-6)
    # it loads through the own store (the site's factory) and scores, as `privfusion evaluate` does
    from peer.cli.model_import import own_predict_proba

    a = sites["site-a"]
    x, _ = records(tmp_path / "held.npz", 30, seed=99)
    proba = own_predict_proba(str(a.root), load_imported(a.root / "own_models", "t1-r2"), x)
    assert proba.shape == (30, 3) and np.allclose(proba.sum(axis=1), 1.0, atol=1e-5)
    # never the imported weights: round 1's start is the factory under the seed, the same everywhere
    seg = charges(a)[0].record.parameters["segment"]["start"]
    assert "torch.manual_seed(init_seed)" in seg


def test_an_own_loop_gets_the_own_module_and_is_charged_as_the_built_in_loop(tmp_path):
    """A site alone: its own loop around its own network receives the site's module (its class)
    and is charged exactly as the built-in loop on the same network and as the built-in mlp."""
    a = own_site(tmp_path, "site-a", policy=policy(4.0))
    roster = alone(tmp_path, a)
    seen = a.root / "seen.txt"
    (a.root / "site_loop.py").write_text(LOOP_PY.format(seen=seen))
    builtin = run_iterate(a.config, load_iterate_config(round_file(a, roster, model="mlp")))
    assert builtin.status == "finished"
    reference = charges(a)
    b = own_site(tmp_path, "site-b", policy=policy(4.0))
    (b.root / "site_loop.py").write_text(LOOP_PY.format(seen=seen))
    looped = run_iterate(
        b.config, load_iterate_config(round_file(b, alone(tmp_path, b), extra='train = "site_loop.py:train"'))
    )
    assert looped.status == "finished", looped.reason
    assert seen.read_text().split() == ["OwnNet", "OwnNet"]  # one segment per round, the site's class
    assert_charged_alike(charges(b), reference)
    assert all("loop" in e.record.parameters for e in charges(b))
    c = own_site(tmp_path, "site-c", policy=policy(4.0))
    plain = run_iterate(c.config, load_iterate_config(round_file(c, alone(tmp_path, c))))
    assert plain.status == "finished"
    assert_charged_alike(charges(c), reference)
    assert set(fused(c, "t1-r2")) == set(fused(b, "t1-r2"))


def test_resume_reloads_theta_from_the_own_store(tmp_path):
    """A run stopped after round 1 continues from the own store's t1-r1 (its θ), charging round 2
    only."""
    a = own_site(tmp_path, "site-a", policy=policy(4.0))
    roster = alone(tmp_path, a)
    stop = threading.Event()

    def after_round_one(e):
        if e["event"] == "iterate-fused" and e["round"] == 1:
            stop.set()

    first = run_iterate(a.config, load_iterate_config(round_file(a, roster)), on_event=after_round_one, stop=stop)
    assert first.status == "interrupted" and first.rounds_done == 1
    assert len(charges(a)) == 1
    second = run_iterate(a.config, load_iterate_config(round_file(a, roster)), resume=True)
    assert second.status == "finished" and second.rounds_done == 2
    assert len(charges(a)) == 2
    assert [r["round"] for r in second.report["rounds"]] == [1, 2]
    assert set(fused(a, "t1-r2")) == set(fused(a, "t1-r1"))
    # a new run whose fused models would replace a model of the own store is refused, uncharged
    own = load_imported(a.root / "own_models", "own")
    save_imported(a.root / "own_models", "t9-r2", own.factory, own.structure, own.arrays)
    other = dataclasses.replace(load_iterate_config(round_file(a, roster)), run="t9")
    with pytest.raises(FailedPrecondition, match="already holds 't9-r2'"):
        run_iterate(a.config, other)
    assert len(charges(a)) == 2


def test_a_batchnorm_network_trains_in_eval_mode_and_batch_statistics_are_refused(tmp_path):
    """BatchNorm's running statistics are constants of DP-SGD (eval mode, as a pool's): the fused
    model holds the factory's initial statistics. A BatchNorm without running statistics is refused
    before anything is charged."""
    a = own_site(tmp_path, "site-a", module="bn_net", kind="batch", policy=policy(4.0))
    result = run_iterate(a.config, load_iterate_config(round_file(a, alone(tmp_path, a), rounds=1)))
    assert result.status == "finished"
    model = fused(a, "t1-r1")
    for key in ("entry_norm", "res.norm"):
        assert np.array_equal(model[f"{key}.running_mean"], np.zeros(4, np.float32))
        assert np.array_equal(model[f"{key}.running_var"], np.ones(4, np.float32))
        assert int(model[f"{key}.num_batches_tracked"]) == 0
    assert not np.array_equal(model["entry.weight"], load_imported(a.root / "own_models", "own").arrays["entry.weight"])
    assert all("eval mode" in e.record.parameters["norm_layers"] for e in charges(a))
    b = own_site(tmp_path, "site-b", module="bn_batch_net", kind="none", policy=policy(4.0))
    with pytest.raises(InvalidArgument) as e:
        run_iterate(b.config, load_iterate_config(round_file(b, alone(tmp_path, b), rounds=1)))
    assert "running statistics" in e.value.rule
    assert not b.ledger.exists()  # refused before the ledger was opened: nothing charged


def test_a_segment_that_does_not_fit_is_refused_with_a_reason(tmp_path):
    """check_segment: names, shapes, floating point, finite (built-in and own); an own network's
    architecture digest for digest."""
    a = own_site(tmp_path, "site-a")
    own = SiteNetwork.of_site(SiteConfig.load(a.config), "own")
    module = own.initial_module(5)
    theta = {k: v.detach().numpy() for k, v in module.named_parameters()}
    assert own.check_segment(own.arch, dict(theta), theta, "p") is None
    wrong = {**theta, "classifier.weight": np.zeros((3, 5), np.float32)}
    assert "shape" in own.check_segment(own.arch, wrong, theta, "p")
    assert "ours is an imported network" in own.check_segment(dict(ARCH), dict(theta), theta, "p")
    builtin = SiteNetwork.of_site(SiteConfig.load(a.config), "mlp")
    m = builtin.initial_module(5)
    bt = {k: v.detach().numpy() for k, v in m.named_parameters()}
    first = sorted(bt)[0]
    assert builtin.check_segment(ARCH, dict(bt), bt, "p") is None
    assert "shape" in builtin.check_segment(ARCH, {**bt, first: np.zeros((1, 1), np.float32)}, bt, "p")
    assert "NaN" in builtin.check_segment(ARCH, {**bt, first: np.full_like(bt[first], np.nan)}, bt, "p")
    assert "missing" in builtin.check_segment(ARCH, {first: bt[first]}, bt, "p")
    assert "not floating" in builtin.check_segment(ARCH, {**bt, first: bt[first].astype(np.int64)}, bt, "p")
    # θ_0 is the factory's module under the seed: the same at every call, not the imported weights
    again = {k: v.detach().numpy() for k, v in own.initial_module(5).named_parameters()}
    assert all(np.array_equal(again[k], theta[k]) for k in theta)
    imported = load_imported(a.root / "own_models", "own")
    assert not np.array_equal(imported.arrays["entry.weight"], theta["entry.weight"])
    assert module_from_arrays(own.factory, own.own.structure, own.state(theta)) is not None


SECURE_POLICY = policy(8.0, allow='"segment", "ledger", "secure-sum"')


@pytest.mark.slow
def test_secure_iterate_over_daemons_with_own_networks_ends_with_one_model(tmp_path):
    """secure = true, three sites (coalition 1): one secure sum per step of every site's clipped
    gradients of its own network; every site ends with the same model, saved in its own store."""
    from coordinator_free.secure_iterate import run_secure_iterate

    sites = {n: own_site(tmp_path, n, policy=SECURE_POLICY) for n in ("site-a", "site-b", "site-c")}

    def run(site, roster):
        cfg = load_iterate_config(round_file(site, roster, rounds=1, wait_s=30.0, extra="secure = true\ncoalition = 1"))
        return run_secure_iterate(site.config, cfg)

    results = run_everywhere(tmp_path, sites, run)
    for r in results.values():
        assert r.status == "finished", r.reason
        assert r.models == ["t1-final"] and r.rounds_done == 2  # two steps, one secure sum each
        assert [s["sites"] for s in r.report["steps"]] == [sorted(sites)] * 2
    models = {n: fused(s, "t1-final") for n, s in sites.items()}
    for n in ("site-b", "site-c"):
        for k, v in models["site-a"].items():
            assert np.array_equal(models[n][k], v), k
    start = SiteNetwork.of_site(SiteConfig.load(sites["site-a"].config), "own")
    theta0 = {k: v.detach().numpy() for k, v in start.initial_module(5).named_parameters()}
    assert not np.array_equal(models["site-a"]["entry.weight"], theta0["entry.weight"])  # it trained
