"""The shell between sites: identity, pinned trust, receipts, wire codec, gRPC service, client, daemon."""
