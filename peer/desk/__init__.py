"""The release desk: every release a site makes goes one way (``peer.desk.desk``).

``requests`` (what is asked, typed per kind) → ``desk`` (policy → make → record → charge, or
serve again, or cancel → sign; the only caller of ``Ledger.charge``) → ``kinds`` (what is handed
to the transport), with ``make`` (the core's mechanisms and merges with a site's public
defaults) and ``store`` (the data-level releases kept so that each is charged once). No gRPC, no
protobuf: the transport (``peer.net``) binds the caller, validates, calls the desk and streams.
"""
