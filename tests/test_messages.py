"""The light calls' answers in both directions (peer.net.messages): a site's plain values become
the ``privfusion.v1`` message and come back to the client as plain values (peer.net.peer_info),
with nothing of protobuf in them; a received answer encodes back to the bytes it came as."""

from __future__ import annotations

import dataclasses

import pytest
from peer_harness import ARCH, make_site, model_arrays

from coordinator_free.runner import choose_model, choose_pool
from peer.base.records import ReleaseRecord
from peer.net import wire
from peer.net.daemon import open_site
from peer.net.messages import ledger_entry_from_message, peer_info_from_message, peer_info_message
from peer.net.peer_info import BudgetInfo, LedgerEntry, PeerInfo, PoolInfo, SiteInfo, UnusableFile
from privfusion.v1 import peer_pb2 as pb

LOGREG = {"kind": "mlp", "input_dim": 4, "hidden": [], "output_dim": 2, "activation": "relu"}


def no_protobuf(value) -> list[str]:
    """The paths of every protobuf value inside ``value`` (dataclasses, tuples, mappings)."""
    if type(value).__module__.startswith(("privfusion", "google")):
        return [type(value).__name__]
    if dataclasses.is_dataclass(value):
        return [f"{f.name}.{p}" for f in dataclasses.fields(value) for p in no_protobuf(getattr(value, f.name))]
    if isinstance(value, tuple | list):
        return [f"[{i}].{p}" for i, v in enumerate(value) for p in no_protobuf(v)]
    if isinstance(value, dict):
        return [f"{k}.{p}" for k, v in value.items() for p in no_protobuf(v)]
    return []


def a_site_answer(tmp_path) -> SiteInfo:
    """A real site's answer (its model as it serves it), with a pool, a budget and an unusable
    file added so that every field of the message is exercised."""
    files = make_site(tmp_path, "site-a", models={"mlp": (ARCH, model_arrays(seed=3))}, seed=5)
    s = open_site(files.config)
    try:
        info = s.peer_info("site-b")
    finally:
        s.close()
    return dataclasses.replace(
        info,
        pools=(PoolInfo("dp", LOGREG, ("m0", "m1"), ("rs", "lc")),),
        budgets=(BudgetInfo("data/record:add-remove", "data level, one training record", 8.0, 1e-5, 1.5, 6.5, 3),),
        unusable=(("models/old.pt", "a pickle is never loaded"),),
    )


def test_a_site_answer_comes_back_to_the_client_as_the_same_plain_values(tmp_path):
    info = a_site_answer(tmp_path)
    sent = peer_info_message(info).SerializeToString()
    got = peer_info_from_message(pb.PeerInfo.FromString(sent))
    assert isinstance(got, PeerInfo) and no_protobuf(got) == []
    assert (got.protocol, got.max_chunk_bytes) == (wire.PROTOCOL, wire.MAX_CHUNK_BYTES)
    # every field the site said, as it said it (architectures parsed back to the same objects)
    for f in dataclasses.fields(SiteInfo):
        assert getattr(got, f.name) == getattr(info, f.name), f.name
    assert got.unusable == (UnusableFile("models/old.pt", "a pickle is never loaded"),)
    assert got.models[0].layers[0].weight_shape == (16, 64) and got.budgets[0].releases == 3
    # and a received answer encodes back to the very bytes it came as (``privfusion peer info``)
    assert peer_info_message(got).SerializeToString() == sent


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"mlp"', ""])
def test_an_offer_whose_architecture_is_not_a_json_object_matches_nothing(text):
    message = pb.PeerInfo(
        name="site-b",
        models=[pb.ModelInfo(name="mlp", architecture_json=text)],
        pools=[pb.PoolInfo(name="dp", architecture_json=text, members=["m0"], methods=["rs"])],
    )
    got = peer_info_from_message(message)
    assert got.models[0].architecture is None and got.pools[0].architecture is None
    # a round asks nothing of it: no model and no pool of our architecture is on offer
    assert choose_model(got, None, ARCH, "mlp") is None and choose_model(got, "mlp", ARCH, "mlp") is None
    assert choose_pool(got, None, ARCH, "rs") is None


def test_a_ledger_entry_comes_back_with_its_record_as_charged():
    record = ReleaseRecord("laplace", "model", "neuron", 1.0, 0.0, 2.0, "l1", {"layer": "0"}, counterparty="site-b")
    message = pb.LedgerEntry(
        entry_id="e1", record_json=record.canonical_json(), counterparty="site-b", created_at=record.created_at
    )
    entry = ledger_entry_from_message(pb.LedgerEntry.FromString(message.SerializeToString()))
    assert entry == LedgerEntry("e1", record, record.created_at) and no_protobuf(entry) == []
    entry_id, got, at = entry  # unpacks as the (entry id, record, created at) it always was
    assert (entry_id, got.canonical_json(), at) == ("e1", record.canonical_json(), record.created_at)
